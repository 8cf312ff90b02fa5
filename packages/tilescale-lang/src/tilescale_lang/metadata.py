"""``kernel.initialize(allocator=..., stream=None)``: copy the allocator's table into a module.

Every compiled module that includes the TileScale headers owns one
``extern "C" __constant__ unsigned long long meta_data[1024]`` holding
``[local_rank, num_ranks, base_0, ..., base_{n-1}]``.  :func:`initialize` copies the
allocator's table into it, before or after the module is loaded (the layout, its capacity
and its validation are :mod:`tilescale_core.table`'s):

* ``tvm_ffi`` (default backend): TVM loads the cubin lazily at the first launch and then
  calls the global function ``runtime.nvshmem.cumodule_init`` with the ``CUmodule``
  (looked up once per process, so :func:`install_module_hook` registers it when the
  extension loads, before any launch).  Every kernel's first launch (a stock kernel's too,
  for the lean launcher) runs under a one-shot wrapper that tells the hook which kernel the
  module belongs to; the hook records the module and applies a pending table.
  ``initialize`` on an already loaded module copies directly (``cuModuleGetGlobal`` +
  ``cuMemcpyHtoDAsync`` on ``stream``).
* ``nvrtc``: the adapter's ``CUlibrary`` (``cuLibraryGetGlobal``).
* ``cython``: the generated library exports ``tilescale_set_meta_data`` (see
  ``include/tilescale/host.cuh``), called with the table and the stream.

The table is the same binary layout on every rank; only the values differ, so one compiled
kernel (and the disk cache) serves every rank.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

from tilescale_core import driver as _cuda
from tilescale_core import table as _table

from .state import STATE

#: Capacity of ``meta_data`` in uint64 entries (:data:`tilescale_core.table.MAX_TABLE_ENTRIES`).
MAX_TABLE_ENTRIES = _table.MAX_TABLE_ENTRIES
SYMBOL = b"meta_data"
HOOK_NAME = "runtime.nvshmem.cumodule_init"

# Process-wide state lives in tilescale_lang.state (one object, one lifetime); these names
# are views of it.
_local = STATE.launching
_lock = STATE.lock


# ------------------------------------------------------------------------------ validation
# The table's layout, capacity and validation belong to tilescale_core.table; these names are
# kept for callers of tilescale_lang.metadata.
table_from_allocator = _table.table_from_allocator


def check_stream(stream: Any) -> int:
    """Validate ``stream``: a raw non-negative CUDA stream handle, None meaning 0."""
    if stream is None:
        return 0
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(
            f"stream must be a raw CUDA stream handle (non-negative int) or None, got "
            f"{type(stream).__name__}; pass e.g. torch.cuda.current_stream().cuda_stream"
        )
    if stream < 0:
        raise ValueError(f"stream must be a non-negative CUDA stream handle, got {stream}")
    return stream


# ------------------------------------------------------------------------------ CUDA calls
# tilescale-core's one CUDA layer: a failed call raises tilescale_core.CudaError.
_driver = _cuda.driver_module
_check = _cuda.check


def _host_buffer(values: list[int]):
    return (ctypes.c_uint64 * len(values))(*values)


def _copy_to_global(dptr, nbytes_symbol: int, values: list[int], stream: int, keep: dict) -> None:
    nbytes = 8 * len(values)
    if nbytes > nbytes_symbol:
        raise ValueError(f"table of {len(values)} entries exceeds meta_data ({nbytes_symbol} bytes)")
    buf = _host_buffer(values)
    # Keep the host buffer of the latest copy into this symbol alive: one per target, so
    # repeated initialize calls do not grow the kernel's state.  (A copy from pageable host
    # memory has staged its source by the time cuMemcpyHtoDAsync returns, so replacing an
    # older buffer is safe.)
    keep[int(dptr)] = buf
    driver = _driver()
    _check(
        driver.cuMemcpyHtoDAsync(dptr, ctypes.addressof(buf), nbytes, driver.CUstream(stream)),
        "cuMemcpyHtoDAsync(meta_data)",
    )


def _ensure_context() -> None:
    """Make torch's current device's context current on this thread, if CUDA works at all.

    A failure here is not raised: the CUDA call that follows reports a missing context as a
    :class:`tilescale_core.CudaError`.
    """
    import torch

    try:
        if torch.cuda.is_available():
            _cuda.runtime_module().cudaSetDevice(torch.cuda.current_device())
    except RuntimeError:  # torch's CUDA errors and tilescale_core.CudaError
        pass


#: ``CUDA_ERROR_NOT_FOUND``: the module has no ``meta_data`` symbol.
CUDA_ERROR_NOT_FOUND = 500


def _table_symbol(result: Any, call_name: str) -> tuple | None:
    """``(device pointer, size in bytes)`` of ``meta_data`` from a ``cuModuleGetGlobal`` or
    ``cuLibraryGetGlobal`` result, or None when the module has none: its kernels read no rank
    table (a kernel without TileScale intrinsics, compiled by stock TileLang's path), so there
    is nothing to bind. Any other failure raises :class:`tilescale_core.CudaError`."""
    if isinstance(result, tuple) and result and int(result[0]) == CUDA_ERROR_NOT_FOUND:
        return None
    return _check(result, call_name)


def apply_to_module(module_handle: int, values: list[int], stream: int, keep: dict) -> None:
    """Copy ``values`` into ``meta_data`` of the loaded ``CUmodule`` ``module_handle`` (nothing
    when the module has no table)."""
    driver = _driver()
    found = _table_symbol(driver.cuModuleGetGlobal(driver.CUmodule(module_handle), SYMBOL),
                          "cuModuleGetGlobal(meta_data)")
    if found is not None:
        _copy_to_global(found[0], int(found[1]), values, stream, keep)


def apply_to_library(culib: Any, values: list[int], stream: int, keep: dict) -> None:
    """Copy ``values`` into ``meta_data`` of an NVRTC-backend ``CUlibrary`` (nothing when the
    library has no table)."""
    driver = _driver()
    found = _table_symbol(driver.cuLibraryGetGlobal(culib, SYMBOL), "cuLibraryGetGlobal(meta_data)")
    if found is not None:
        _copy_to_global(found[0], int(found[1]), values, stream, keep)


# ------------------------------------------------------------------------------ module hook
def _handle_to_int(handle: Any) -> int:
    if isinstance(handle, int):
        return handle
    value = getattr(handle, "value", None)  # ctypes.c_void_p
    if value is not None or isinstance(handle, ctypes.c_void_p):
        return int(value or 0)
    return int(handle)


def _state(kernel: Any) -> dict:
    st = kernel.__dict__.get("_tilescale_state")
    if st is None:
        st = {"modules": [], "pending": None, "keep": {}, "capturing": False}
        kernel.__dict__["_tilescale_state"] = st
    return st


def on_module_load(handle: Any) -> None:
    """``runtime.nvshmem.cumodule_init``: record the module, apply a pending table."""
    module = _handle_to_int(handle)
    kernel_ref = getattr(_local, "kernel", None)
    kernel = kernel_ref() if kernel_ref is not None else None
    with _lock:
        if kernel is None:
            STATE.unclaimed_modules += 1  # a stock kernel's module: nothing to do
            return
        st = _state(kernel)
        if module not in st["modules"]:
            st["modules"].append(module)
        pending = st["pending"]
    if pending is not None:
        values, stream = pending
        apply_to_module(module, values, stream, st["keep"])


def install_module_hook() -> None:
    """Register ``runtime.nvshmem.cumodule_init`` (TVM looks it up once, at the first load).

    Does not override a hook someone else registered (it is then chained: it still runs).
    """
    if STATE.hooks.get("module_init"):
        return
    import tvm_ffi

    previous = tvm_ffi.get_global_func(HOOK_NAME, allow_missing=True)

    def hook(handle):
        if previous is not None:
            previous(handle)
        on_module_load(handle)

    tvm_ffi.register_global_func(HOOK_NAME, f=hook, override=True)
    STATE.hooks["module_init"] = True


def track_kernel(kernel: Any) -> None:
    """Arrange for a tvm_ffi kernel's first launch to report its module to the hook."""
    if getattr(kernel, "execution_backend", None) != "tvm_ffi":
        return
    with _lock:
        st = _state(kernel)
        if st["modules"] or st["capturing"]:
            return
        original = kernel.torch_function
        if original is None:
            return
        st["capturing"] = True
    ref = weakref.ref(kernel)

    def first_launch(*args, **kwargs):
        previous = getattr(_local, "kernel", None)
        _local.kernel = ref
        try:
            return original(*args, **kwargs)
        finally:
            _local.kernel = previous
            k = ref()
            if k is not None:
                kst = _state(k)
                if kst["modules"]:
                    kst["capturing"] = False
                    # Back to the untouched launch path: no per-call overhead from here on.
                    _set_launch(k, original)

    _set_launch(kernel, first_launch)


def _set_launch(kernel: Any, fn: Any) -> None:
    """Route both launch paths of ``kernel`` through ``fn``: ``kernel(...)`` (its
    ``torch_function``) and ``kernel.adapter(...)`` (the adapter's ``func``, which stock
    TileLang's profiler calls: ``kernel.get_profiler().run_once()``)."""
    kernel.__dict__["torch_function"] = fn
    adapter = getattr(kernel, "adapter", None)
    if adapter is not None and callable(getattr(adapter, "func", None)):
        adapter.func = fn


# ------------------------------------------------------------------------------ launch guard
class KernelNotInitializedError(RuntimeError):
    """A kernel that uses peer intrinsics was launched before ``kernel.initialize``."""


def table_readers(func: Any) -> list[str]:
    """Names of the TileScale helpers in PrimFunc ``func`` that read the metadata table
    (rank queries and intrinsics aimed at a peer), sorted; empty for local-only kernels."""
    from tvm import tirx

    from . import validation

    body = getattr(func, "body", None)
    if body is None:
        return []
    found: set[str] = set()

    def visit(node):
        if isinstance(node, tirx.Call):
            name = validation.reads_table(node)
            if name is not None:
                found.add(name)

    tirx.stmt_functor.post_order_visit(body, visit)
    return sorted(found)


def _kernel_name(kernel: Any) -> str:
    func = getattr(kernel, "prim_func", None)
    attrs = getattr(func, "attrs", None)
    if attrs is not None and "global_symbol" in attrs:
        return str(attrs["global_symbol"])
    return type(kernel).__name__


def guard_launch(kernel: Any, readers: list[str]) -> None:
    """Make ``kernel`` refuse to launch until :func:`initialize` ran, when it reads the table.

    An uninitialised table is all zeros: every peer address would silently be the local
    one.  The guard replaces the kernel's launch function; :func:`initialize` puts the
    original back, so an initialised kernel launches with no extra cost.  When the process
    has a default heap (``tilescale_core.interface.default_allocator()``, set by
    ``pynvshmem``'s initialisation: NVSHMEM programs never bind kernels), the first launch
    initialises the kernel with it instead of refusing.
    """
    if not readers:
        return
    with _lock:
        st = _state(kernel)
        if st.get("initialized") or "unguarded" in st:
            return
        inner = kernel.torch_function
        if inner is None:
            return
        name = _kernel_name(kernel)
        ref = weakref.ref(kernel)

        def refuse(*args, **kwargs):
            from tilescale_core.interface import default_allocator

            heap, k = default_allocator(), ref()
            if heap is not None and k is not None:
                initialize(k, allocator=heap)  # puts the launch function back
                return k.torch_function(*args, **kwargs)
            raise KernelNotInitializedError(
                f"kernel {name!r} uses {', '.join(readers)} (the rank/peer metadata table) and was "
                "launched before kernel.initialize(allocator=...); an empty table would make every "
                "peer address the local one. Call kernel.initialize(allocator=<the distributed "
                "allocator>) once after compiling it."
            )

        st["unguarded"] = inner
        _set_launch(kernel, refuse)


def _unguard(kernel: Any) -> None:
    with _lock:
        st = _state(kernel)
        st["initialized"] = True
        inner = st.pop("unguarded", None)
        if inner is not None:
            _set_launch(kernel, inner)


# ------------------------------------------------------------------------------ initialize
def initialize(kernel: Any, allocator: Any = None, stream: int | None = None) -> Any:
    """Copy ``allocator.table`` into the kernel module's ``meta_data``.

    Args:
        kernel: a compiled ``tilelang.JITKernel``.
        allocator: the distributed allocator (anything with a CPU uint64 ``table``
            ``[local_rank, num_ranks, base_0, ..., base_{n-1}]``, at most 1024 entries).
        stream: raw CUDA stream handle (non-negative int) for the copy; None means 0.

    Returns:
        the kernel, so that ``kernel = tilelang.compile(f).initialize(allocator=a)`` works.

    Raises:
        TypeError: allocator missing or without a table; stream not an int.
        ValueError: stream negative; table too large or inconsistent.
        NotImplementedError: an execution backend without a way to set the table.
        tilescale_core.CudaError: a CUDA call of the copy failed (call, code and name attached).

    Until it has run, a kernel that reads the table (rank queries, peer intrinsics) refuses
    to launch with :class:`KernelNotInitializedError` (see :func:`guard_launch`). A kernel
    whose module has no table (one without TileScale intrinsics) is returned unchanged: the
    same code may initialize every kernel it launches, whichever it is.
    """
    values = table_from_allocator(allocator)
    stream = check_stream(stream)
    backend = getattr(kernel, "execution_backend", None)
    adapter = getattr(kernel, "adapter", None)
    st = _state(kernel)
    _unguard(kernel)
    if backend == "tvm_ffi":
        install_module_hook()
        with _lock:
            st["pending"] = (values, stream)
            modules = list(st["modules"])
        if modules:
            _ensure_context()
            for module in modules:
                apply_to_module(module, values, stream, st["keep"])
        else:
            track_kernel(kernel)
        return kernel
    if backend == "nvrtc":
        culib = getattr(getattr(adapter, "lib_generator", None), "culib", None)
        if culib is None:
            raise RuntimeError("nvrtc kernel has no loaded CUlibrary (adapter.lib_generator.culib)")
        _ensure_context()
        apply_to_library(culib, values, stream, st["keep"])
        return kernel
    if backend == "cython":
        lib = getattr(adapter, "lib", None)
        setter = getattr(lib, "tilescale_set_meta_data", None) if lib is not None else None
        if setter is None:
            raise NotImplementedError(
                "kernel.initialize on the cython backend needs the tilescale_set_meta_data host "
                "setter in the kernel library; this kernel was built without it (use the "
                "default tvm_ffi backend or nvrtc)"
            )
        buf = _host_buffer(values)
        st["keep"]["cython"] = buf  # the latest table only (see _copy_to_global)
        setter.restype = ctypes.c_int
        setter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        err = setter(ctypes.addressof(buf), len(values), ctypes.c_void_p(stream))
        if err != 0:
            raise _cuda.CudaError("tilescale_set_meta_data", err, f"cudaError {err}")
        return kernel
    raise NotImplementedError(
        f"kernel.initialize supports the tvm_ffi, nvrtc and cython execution backends, not {backend!r}"
    )


# ------------------------------------------------------------------------------ graph capture
def modules(kernel: Any) -> list[int]:
    """The ``CUmodule`` handles (ints) of ``kernel``'s code that TileScale has seen loaded:
    a ``tvm_ffi`` kernel's module once its first launch ran under tracking (after
    :func:`initialize` or :func:`track_kernel`), one per CUDA context; empty otherwise."""
    with _lock:
        return list(_state(kernel)["modules"])


def loaded(kernel: Any) -> bool:
    """Whether ``kernel``'s module is loaded (it has been launched once, or it is not a
    ``tvm_ffi`` kernel, whose modules load when the kernel is compiled)."""
    if getattr(kernel, "execution_backend", None) != "tvm_ffi":
        return True
    return bool(modules(kernel))


def bind_from_device(kernel: Any, table: Any, stream: int | None = None) -> None:
    """Copy ``table`` (a device tensor holding the uint64 table, any 8-byte dtype) into the
    ``meta_data`` of ``kernel``'s module(s) with ``cuMemcpyDtoDAsync`` on ``stream``.

    Unlike :func:`initialize` (a copy from host memory), this copy can be captured in a CUDA
    graph: every replay then binds the table the tensor holds at replay time, so a kernel
    shared by several allocators launches with the right one in each graph. A module without
    a table (a kernel without TileScale intrinsics) is skipped.

    Raises:
        RuntimeError: the module is not loaded yet (a ``tvm_ffi`` kernel loads it at its first
            launch: launch it once outside the capture first, as a warm-up).
        ValueError: ``table`` is not a contiguous device tensor of 8-byte elements, or it is
            larger than ``meta_data``.
        NotImplementedError: the ``cython`` backend (its table is set through the host setter).
    """
    stream = check_stream(stream)
    if getattr(table, "element_size", lambda: 0)() != 8 or not table.is_contiguous() or table.device.type != "cuda":
        raise ValueError("table must be a contiguous CUDA tensor of 8-byte elements (the uint64 table)")
    nbytes = 8 * table.numel()
    backend = getattr(kernel, "execution_backend", None)
    driver = _driver()
    if backend == "tvm_ffi":
        handles = modules(kernel)
        if not handles:
            raise RuntimeError(
                f"kernel {_kernel_name(kernel)!r} has not been launched yet, so its module (and table) is not "
                "loaded; call it once outside the CUDA graph capture first (a warm-up), then capture")
        targets = [_table_symbol(driver.cuModuleGetGlobal(driver.CUmodule(m), SYMBOL), "cuModuleGetGlobal(meta_data)")
                   for m in handles]
    elif backend == "nvrtc":
        culib = getattr(getattr(getattr(kernel, "adapter", None), "lib_generator", None), "culib", None)
        if culib is None:
            raise RuntimeError("nvrtc kernel has no loaded CUlibrary (adapter.lib_generator.culib)")
        targets = [_table_symbol(driver.cuLibraryGetGlobal(culib, SYMBOL), "cuLibraryGetGlobal(meta_data)")]
    else:
        raise NotImplementedError(f"bind_from_device supports the tvm_ffi and nvrtc backends, not {backend!r}")
    for dptr, size in filter(None, targets):  # a module without a table has nothing to bind
        if nbytes > int(size):
            raise ValueError(f"table of {table.numel()} entries exceeds meta_data ({int(size)} bytes)")
        _check(driver.cuMemcpyDtoDAsync(dptr, table.data_ptr(), nbytes, driver.CUstream(stream)),
               "cuMemcpyDtoDAsync(meta_data)")
