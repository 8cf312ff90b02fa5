"""TileScale lang: kernel-side communication intrinsics for stock TileLang.

Installed, it extends ``tilelang`` at import time (through tilescale-core's hook):
``T.get_rank``, ``T.put_warp`` / ``T.get_warp`` / ``T.put_block`` / ``T.get_block``,
``T.copy`` / ``T.tma_copy`` with ``src_pe=`` / ``dst_pe=``, ``T.ld`` / ``T.st`` / ``T.atom_add``,
remote ``T.atomic_add`` / ``T.atomic_addx2``, ``T.atomic_cas``, fences, ``T.wait_*``, put with
signal, ``T.quiet`` / ``T.fence``, teams, GPU and cross-rank barriers, ``T.notify``, the
``T.multimem_*`` operations, ``JITKernel.initialize(allocator=..., stream=None)`` and the
``compile_once`` / ``compile_root`` options of ``tilelang.compile`` and ``@tilelang.jit``.  Device code ships as CUDA headers in
``tilescale_lang/include/tilescale``; see :mod:`tilescale_lang.headers`.
"""

__version__ = "0.1.0"

from tilescale_lang.core_check import check_core  # noqa: E402

check_core()  # a tilescale-core with another metadata table layout: a clear ImportError

# Import stock tilelang first, whichever tilescale_lang module is imported first: tilelang's
# import runs the TileScale extensions (this package's among them) and puts TileLang's bundled
# ``tvm`` on sys.path, which the intrinsic modules need.  Importing it here, before any
# sub-module body runs, keeps that re-entry from meeting a half-imported sub-module.
import tilelang  # noqa: E402,F401
