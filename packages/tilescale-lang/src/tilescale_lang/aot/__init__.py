"""Ahead-of-time kernel bundles: compile once with nvcc, load and launch without a compiler.

* :func:`build` (``python -m tilescale_lang.aot build SPEC -o DIR``): lower every kernel a
  JSON spec declares (:mod:`.spec`) with stock TileLang, compile a cubin per architecture with
  the CUDA toolkit, and write a versioned bundle (:mod:`.builder`): the cubins, the CUDA
  sources and ``manifest.json`` (:mod:`.manifest`) with each kernel's launch metadata
  (:mod:`.launch_info`) and what the loader must bind (the TileScale heap table).
* :func:`load` (:mod:`.loader`): check the manifest against this machine
  (:class:`BundleMismatchError` names the field and both values), select a kernel by its
  arguments, bind the heap table (``kernel.initialize(allocator=...)``) and launch it with
  ``cuLaunchKernel`` (:mod:`.packing` checks and packs the arguments). A missing kernel
  compiles with TileLang (one log line), or raises with ``strict=True``.
* :func:`dump_c` (``python -m tilescale_lang.aot dump-c DIR -o OUT``): a C header and source
  that embed the cubins and launch every kernel with typed arguments (:mod:`.cexport`).

See ``docs/aot.md``.
"""

from .builder import build
from .cexport import dump_c
from .launch_info import UnsupportedKernelError
from .loader import AotKernel, Bundle, KernelNotInBundleError, load
from .manifest import FORMAT_VERSION, BundleFormatError, BundleMismatchError, read_manifest

__all__ = ["FORMAT_VERSION", "AotKernel", "Bundle", "BundleFormatError", "BundleMismatchError",
           "KernelNotInBundleError", "UnsupportedKernelError", "build", "dump_c", "load", "read_manifest"]
