"""Load an AOT bundle and launch its kernels with the CUDA driver: no nvcc, no TileLang passes.

``bundle = tilescale_lang.aot.load(path)`` checks the manifest (:mod:`.manifest`); then
``kernel = bundle.kernel("ring_put", n=4096)`` selects the entry whose arguments are these
(the factory's defaults filled in) and returns an :class:`AotKernel`:
``kernel.initialize(allocator=...)`` binds the heap table as ``JITKernel.initialize`` does,
``kernel(src, dst)`` launches it on the current torch stream (or ``stream=``). A kernel the
bundle lacks is compiled with TileLang (one log line) unless the bundle was loaded with
``strict=True``, which raises :class:`KernelNotInBundleError` instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from . import manifest as manifest_mod
from . import spec as spec_mod
from .packing import ArgPacker, PackedLaunch

__all__ = ["AotKernel", "Bundle", "KernelNotInBundleError", "load"]

log = logging.getLogger("tilescale_lang.aot")

#: Dynamic shared memory above this needs ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``.
DEFAULT_SMEM_LIMIT = 48 * 1024


class KernelNotInBundleError(LookupError):
    """A kernel (name and arguments) is not in a bundle loaded with ``strict=True``."""


def _device_arch() -> str | None:
    """``sm_XY`` of the current CUDA device, None without a usable driver or GPU."""
    from tilescale_core import driver

    try:
        driver.init()
        device = _current_device()
        major = driver.device_attribute("COMPUTE_CAPABILITY_MAJOR", device)
        minor = driver.device_attribute("COMPUTE_CAPABILITY_MINOR", device)
    except driver.CudaError:
        return None
    return f"sm_{major}{minor}"


def _driver_version() -> int | None:
    from tilescale_core import driver

    try:
        return driver.driver_version()
    except driver.CudaError:
        return None


def _current_device() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except ImportError:
        pass
    return 0


class AotKernel:
    """One bundle entry for one arch, loaded into the current device's primary context at the
    first call (``cuModuleLoadData`` of the cubin).

    Attributes:
        entry: the manifest entry (``params``, ``table``, ``archs``...).
        arch: the arch whose cubin this kernel runs.
        packer: the :class:`~tilescale_lang.aot.packing.ArgPacker` of its arguments.
    """

    def __init__(self, bundle_dir: Path, entry: dict[str, Any], arch: str):
        self.entry, self.arch = entry, arch
        self.packer = ArgPacker(entry, arch)
        self._path = bundle_dir / entry["archs"][arch]["cubin"]
        self._module: Any = None
        self._functions: dict[str, Any] = {}
        self._image: Any = None
        self._keep: dict = {}
        self._table: tuple[list[int], int] | None = None

    @property
    def name(self) -> str:
        """The entry's id, ``<kernel>_<hash of its arguments>``."""
        return self.entry["id"]

    def image(self) -> bytes:
        """The cubin's bytes, checked against the manifest's SHA-256.

        Raises:
            manifest.BundleFormatError: the file is missing or differs from the manifest.
        """
        if not self._path.is_file():
            raise manifest_mod.BundleFormatError(f"{self.name}: cubin {str(self._path)!r} is missing")
        data = self._path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.entry["archs"][self.arch]["sha256"]:
            raise manifest_mod.BundleFormatError(f"{self.name}: cubin {str(self._path)!r} does not match the manifest's "
                                                 "sha256 (a partial copy or another build)")
        return data

    def load(self) -> AotKernel:
        """Load the module and its functions into the current device's context (once)."""
        if self._module is not None:
            return self
        from tilescale_core import driver

        driver.init()
        driver.ensure_context(_current_device())
        self._image = ctypes.create_string_buffer(self.image())
        module = driver.call("cuModuleLoadData", ctypes.addressof(self._image))
        drv = driver.driver_module()
        for launch in self.packer.launches:
            fn = driver.call("cuModuleGetFunction", module, launch["symbol"].encode())
            if launch["dynamic_smem"] > DEFAULT_SMEM_LIMIT:
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.call("cuFuncSetAttribute", fn, attr, launch["dynamic_smem"])
            self._functions[launch["symbol"]] = fn
        self._module = module
        if self._table is not None:
            self._apply_table(*self._table)
        return self

    def _apply_table(self, values: list[int], stream: int) -> None:
        from .. import metadata

        metadata.apply_to_module(int(self._module), values, stream, self._keep)

    def initialize(self, allocator: Any = None, stream: int | None = None) -> AotKernel:
        """Copy ``allocator.table`` into the module's ``meta_data`` (as ``JITKernel.initialize``).

        Args:
            allocator: the distributed allocator (a CPU uint64 ``table`` ``[local_rank,
                num_ranks, base_0, ...]``, at most 1024 entries).
            stream: raw CUDA stream handle for the copy; None means 0.

        Returns:
            this kernel.
        """
        from .. import metadata

        values = metadata.table_from_allocator(allocator)
        stream = metadata.check_stream(stream)
        self._table = (values, stream)
        if self._module is not None:
            self._apply_table(values, stream)
        return self

    def pack(self, *args: Any) -> list[PackedLaunch]:
        """Check and pack ``args`` (no CUDA call): the launches one call makes."""
        return self.packer.pack(*args)

    def __call__(self, *args: Any, stream: int | None = None) -> None:
        """Launch with ``args`` (the PrimFunc's parameters in order) on ``stream`` (a raw CUDA
        stream handle; default the current torch stream).

        Raises:
            tilescale_lang.metadata.KernelNotInitializedError: the kernel reads the heap table
                and :meth:`initialize` has not run.
            TypeError / ValueError: an argument that does not fit, naming it.
            tilescale_core.CudaError: a CUDA call failed.
        """
        from tilescale_core import driver

        from .. import metadata

        if self.entry["table"]["needed"] and self._table is None:
            raise metadata.KernelNotInitializedError(
                f"AOT kernel {self.name!r} uses {', '.join(self.entry['table']['readers'])} (the rank/peer "
                "metadata table); call kernel.initialize(allocator=...) before launching it")
        self.packer.check_device(args)
        launches = self.pack(*args)
        self.load()
        if stream is None:
            import torch

            stream = torch.cuda.current_stream().cuda_stream
        handle = driver.driver_module().CUstream(metadata.check_stream(stream))
        for launch in launches:
            self._launch(driver, launch, handle)

    def _launch(self, driver: Any, launch: PackedLaunch, stream: Any) -> None:
        fn = self._functions[launch.symbol]
        if launch.cluster is not None:
            raise NotImplementedError(f"{self.name}: {launch.symbol} needs a cluster launch {launch.cluster}, "
                                      "which the Python AOT launcher does not make yet (the C export does)")
        call = "cuLaunchCooperativeKernel" if launch.cooperative else "cuLaunchKernel"
        extra = () if launch.cooperative else (0,)
        driver.call(call, fn, *launch.grid, *launch.block, launch.dynamic_smem, stream, launch.address, *extra)


def _compile_jit(entry: str, args: dict[str, Any], target: Any) -> Any:
    """The JIT fallback: compile ``entry`` with ``args`` through ``tilelang.compile`` for
    ``target`` (``"auto"``: this GPU)."""
    import tilelang

    obj = spec_mod.resolve_entry(entry)
    func, options = spec_mod.prim_func_of(obj, args, entry)
    return tilelang.compile(func, target=target, pass_configs=options.get("pass_configs") or None,
                            compile_flags=options.get("compile_flags"))


class Bundle:
    """A loaded, checked bundle (:func:`load`).

    Attributes:
        path: the bundle directory.
        manifest: the parsed ``manifest.json``.
        arch: the arch whose cubins are used (this GPU's, or the one given to :func:`load`;
            None before a GPU is known: the first matching entry's arch is then used).
        strict: whether a missing kernel raises instead of compiling.

    ``jit_target`` is the target of a fallback compile: ``load``'s ``arch``, else ``"auto"``.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], arch: str | None, strict: bool,
                 jit_target: Any = "auto"):
        self.path, self.manifest, self.arch, self.strict = path, manifest, arch, strict
        self._jit_target = jit_target
        self._kernels: dict[str, Any] = {}

    def entries(self, name: str | None = None) -> list[dict[str, Any]]:
        """The manifest entries (of kernel ``name`` only, when given)."""
        return [e for e in self.manifest["kernels"] if name is None or e["name"] == name]

    def find(self, name: str, **args: Any) -> dict[str, Any] | None:
        """The entry of kernel ``name`` built with keyword ``args`` (factory defaults filled in),
        or None; tuples and lists compare equal."""
        for entry in self.entries(name):
            wanted = dict(entry.get("defaults", {}))
            wanted.update(args)
            if spec_mod.canonical(wanted) == spec_mod.canonical(entry["bound"]):
                return entry
        return None

    def _arch_of(self, entry: dict[str, Any]) -> str | None:
        if self.arch is None:
            return next(iter(entry["archs"]), None)
        return next((a for a in entry["archs"] if manifest_mod.arch_matches(a, self.arch)), None)

    def kernel(self, name: str, **args: Any) -> Any:
        """The kernel ``name`` for keyword ``args``: an :class:`AotKernel` from the bundle, else
        (``strict=False``) a ``JITKernel`` compiled now, with one log line.

        Raises:
            KernelNotInBundleError: not in the bundle (or not for this arch) and ``strict``.
        """
        entry = self.find(name, **args)
        arch = self._arch_of(entry) if entry is not None else None
        key = entry["id"] if arch is not None else f"{name} {spec_mod.canonical(args)}"  # one kernel per entry
        if key in self._kernels:
            return self._kernels[key]
        if arch is not None:
            kernel = AotKernel(self.path, entry, arch)
        else:
            why = "no such entry" if entry is None else f"no cubin for {self.arch}"
            known = sorted({e["name"] for e in self.entries()})
            if self.strict:
                raise KernelNotInBundleError(f"kernel {name!r} with {spec_mod.canonical(args)} is not in AOT bundle "
                                             f"{str(self.path)!r} ({why}; kernels: {known})")
            entries = self.entries(name)
            if not entries:
                raise KernelNotInBundleError(f"kernel {name!r} is not in AOT bundle {str(self.path)!r} (kernels: "
                                             f"{known}), so there is no entry to compile it from")
            log.warning("aot: %s not in bundle %s (%s); compiling it with TileLang", key, self.path, why)
            kernel = _compile_jit(entries[0]["entry"], args, self._jit_target)
        self._kernels[key] = kernel
        return kernel


def load(path: str | os.PathLike, *, strict: bool = False, arch: str | None = None,
         toolkit: str | None = None) -> Bundle:
    """Load and check the AOT bundle in directory ``path``.

    Args:
        path: the bundle directory (holding ``manifest.json``).
        strict: raise :class:`KernelNotInBundleError` for a kernel the bundle lacks, instead of
            compiling it with TileLang (one log line).
        arch: the GPU architecture to run (``"sm_90a"``); default: the current device's, when
            a CUDA driver and GPU are present (else the arch is not checked).
        toolkit: ``"major.minor"`` the bundle must have been built with (default: any toolkit
            the CUDA driver supports, when a driver is present).

    Raises:
        manifest.BundleMismatchError: format, tilescale-lang, table, arch or toolkit differ
            (a ``ValueError`` naming the field and both values).
        manifest.BundleFormatError: no or malformed manifest.
    """
    bundle_dir = Path(path)
    manifest = manifest_mod.read_manifest(bundle_dir)
    jit_target = {"kind": "cuda", "arch": arch} if arch is not None else "auto"  # the fallback's target
    if arch is None:
        arch = _device_arch()
    manifest_mod.check_key(manifest, arch=arch, toolkit=toolkit, driver_version=_driver_version())
    return Bundle(bundle_dir, manifest, arch, strict, jit_target)
