"""Thin, checked wrappers over cuda-python's driver and runtime bindings.

Every CUDA call made by TileScale goes through :func:`call` (driver API), :func:`rt_call`
(runtime API) or :func:`check` (a result tuple already in hand): the call's status is checked
and a failure raises :class:`CudaError` naming the call and its ``CUresult`` /
``cudaError_t``.  tilescale-host and tilescale-lang use this layer through the public
:mod:`tilescale_core.driver`, so one ``except tilescale_core.CudaError`` catches every CUDA
failure of every TileScale package (:class:`CudaUnavailableError`, no driver or no
cuda-python, is a :class:`CudaError` too).  cuda-python is
imported on first use, so importing this module needs neither a GPU nor a driver; on a
machine without ``libcuda`` the first call raises :class:`CudaUnavailableError`.

Pointers and handles cross this module as plain Python ``int`` (device addresses in bytes).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = [
    "CudaError",
    "CudaUnavailableError",
    "bytes_of",
    "call",
    "check",
    "device_attribute",
    "device_count",
    "driver_module",
    "driver_version",
    "ensure_context",
    "fill_struct",
    "init",
    "mem_get_info",
    "rt_call",
    "runtime_module",
]


class CudaError(RuntimeError):
    """A CUDA driver or runtime call returned an error (or CUDA cannot be used at all).

    Attributes:
        call: the function name, e.g. ``"cuMemCreate"`` (may carry its arguments,
            ``"cuDeviceGet(0)"``).
        code: the numeric ``CUresult`` / ``cudaError_t``; None for :class:`CudaUnavailableError`.
        name: the symbolic error name, e.g. ``"CUDA_ERROR_NOT_PERMITTED"``.
    """

    def __init__(self, call: str, code: int | None, name: str, detail: str = ""):
        self.call = call
        self.code = code
        self.name = name
        self.detail = detail
        message = f"{call} failed: {name} ({code})"
        if detail:
            message += f": {detail}"
        super().__init__(message)

    def __reduce__(self):  # picklable across rank processes
        return type(self), (self.call, self.code, self.name, self.detail)


class CudaUnavailableError(CudaError):
    """The CUDA driver library (or cuda-python) cannot be loaded or initialised on this machine.

    ``code`` is None and ``name`` is ``"CUDA_UNAVAILABLE"``.
    """

    def __init__(self, message: str, call: str = ""):
        self.call = call
        self.code = None
        self.name = "CUDA_UNAVAILABLE"
        self.detail = message
        RuntimeError.__init__(self, message)

    def __reduce__(self):
        return type(self), (self.detail, self.call)


_NO_CUDA_PYTHON = "cuda-python is required for TileScale's CUDA calls; install it with `pip install cuda-python`"


@functools.cache
def driver_module():
    """Return ``cuda.bindings.driver`` (imported on first use; ``cuda.cuda`` on cuda-python < 12.8).

    Raises:
        CudaUnavailableError: cuda-python is not installed.
    """
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.8 layout
        try:
            from cuda import cuda as driver
        except ImportError as exc:
            raise CudaUnavailableError(_NO_CUDA_PYTHON) from exc
    return driver


@functools.cache
def runtime_module():
    """Return ``cuda.bindings.runtime`` (imported on first use; ``cuda.cudart`` on cuda-python < 12.8).

    Raises:
        CudaUnavailableError: cuda-python is not installed.
    """
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError as exc:
            raise CudaUnavailableError(_NO_CUDA_PYTHON) from exc
    return runtime


def _unpack(call_name: str, result: Any, success: Any, describe) -> Any:
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if status != success:
        code = int(status)
        name = getattr(status, "name", str(status))
        raise CudaError(call_name, code, name, describe(status))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def check(result: Any, call_name: str) -> Any:
    """Unpack a cuda-python result ``(status, *values)`` of driver or runtime call ``call_name``.

    Returns None, the single value, or a tuple of values (as :func:`call`).

    Raises:
        CudaError: the status is not success (0); its ``call`` is ``call_name``.
    """
    status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if int(status) != 0:
        raise CudaError(call_name, int(status), getattr(status, "name", None) or str(status))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _describe_driver_error(status) -> str:
    try:
        err, text = driver_module().cuGetErrorString(status)
    except Exception:
        return ""
    if err != 0 or text is None:
        return ""
    return text.decode() if isinstance(text, bytes) else str(text)


def _describe_runtime_error(status) -> str:
    try:
        err, text = runtime_module().cudaGetErrorString(status)
    except Exception:
        return ""
    return text.decode() if isinstance(text, bytes) else str(text)


def _load_error(call_name: str, exc: Exception) -> CudaUnavailableError:
    return CudaUnavailableError(
        f"{call_name}: the CUDA driver library could not be loaded ({type(exc).__name__}: {exc})"
    )


def call(name: str, *args) -> Any:
    """Call driver function ``name`` with ``args``; return its value(s) or raise :class:`CudaError`.

    Single return values come back bare, several as a tuple, none as ``None``.
    """
    drv = driver_module()
    fn = getattr(drv, name)
    try:
        result = fn(*args)
    except (OSError, RuntimeError) as exc:  # DynamicLibNotFoundError and friends
        raise _load_error(name, exc) from exc
    return _unpack(name, result, drv.CUresult.CUDA_SUCCESS, _describe_driver_error)


def rt_call(name: str, *args) -> Any:
    """Like :func:`call`, for runtime API function ``name`` (``cudaMalloc``, ...)."""
    rt = runtime_module()
    fn = getattr(rt, name)
    try:
        result = fn(*args)
    except (OSError, RuntimeError) as exc:
        raise _load_error(name, exc) from exc
    return _unpack(name, result, rt.cudaError_t.cudaSuccess, _describe_runtime_error)


@functools.cache
def _init() -> None:
    call("cuInit", 0)


def init() -> None:
    """Initialise the driver API once per process (``cuInit(0)``); raise if impossible."""
    _init()


def driver_version() -> int:
    """Return the driver API version as an int, e.g. ``12040`` for CUDA 12.4."""
    init()
    return int(call("cuDriverGetVersion"))


def device_count() -> int:
    """Return the number of CUDA-visible devices."""
    init()
    return int(call("cuDeviceGetCount"))


def device_attribute(attribute: str, ordinal: int) -> int:
    """Return ``CU_DEVICE_ATTRIBUTE_<attribute>`` of device ``ordinal`` (e.g. ``"MULTICAST_SUPPORTED"``)."""
    init()
    drv = driver_module()
    attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + attribute)
    dev = call("cuDeviceGet", ordinal)
    return int(call("cuDeviceGetAttribute", attr, dev))


def can_access_peer(a: int, b: int) -> bool:
    """Return whether device ``a`` can map memory of device ``b``."""
    init()
    return bool(call("cuDeviceCanAccessPeer", call("cuDeviceGet", a), call("cuDeviceGet", b)))


def ensure_context(device: int) -> None:
    """Make device ``device``'s primary context current on this thread (as the runtime does).

    Changes the runtime's current device to ``device``; callers that must not change it
    wrap the call in ``torch.cuda.device(...)``.
    """
    rt_call("cudaSetDevice", device)
    rt_call("cudaFree", 0)


def mem_get_info(device: int) -> tuple[int, int]:
    """Return ``(free, total)`` device memory in bytes of ``device`` (``cudaMemGetInfo``)."""
    ensure_context(device)
    free, total = rt_call("cudaMemGetInfo")
    return int(free), int(total)


def bytes_of(struct: Any, size: int) -> bytes:
    """Return the ``size`` raw bytes of a cuda-python struct (handles have no other accessor)."""
    return ctypes.string_at(struct.getPtr(), size)


def fill_struct(struct: Any, data: bytes) -> Any:
    """Copy ``data`` into the raw storage of a cuda-python struct and return the struct."""
    ctypes.memmove(struct.getPtr(), data, len(data))
    return struct
