"""CUDA IPC memory: ``cudaMalloc`` bases and ``cudaIpc*`` handles (64 bytes each).

Functions run on the runtime's current device; the caller selects it.
"""

from __future__ import annotations

from . import _driver

__all__ = ["HANDLE_BYTES", "check_handle", "close_handle", "free", "get_handle", "malloc", "open_handle"]

#: Size of a ``cudaIpcMemHandle_t`` in bytes.
HANDLE_BYTES = 64


def malloc(size: int) -> int:
    """Allocate ``size`` bytes with ``cudaMalloc`` (not torch's caching allocator); return the address."""
    return int(_driver.rt_call("cudaMalloc", size))


def free(ptr: int) -> None:
    """Free an address returned by :func:`malloc`."""
    _driver.rt_call("cudaFree", ptr)


def get_handle(ptr: int) -> bytes:
    """Return the 64-byte IPC handle of the allocation at ``ptr``."""
    handle = _driver.rt_call("cudaIpcGetMemHandle", ptr)
    return _driver.bytes_of(handle, HANDLE_BYTES)


def check_handle(handle: bytes) -> None:
    """Raise ValueError unless ``handle`` is a 64-byte ``bytes`` value."""
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != HANDLE_BYTES:
        raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)!r}")


def open_handle(handle: bytes) -> int:
    """Map a peer's IPC handle with lazy peer access; return the address in this process."""
    check_handle(handle)
    rt = _driver.runtime_module()
    h = _driver.fill_struct(rt.cudaIpcMemHandle_t(), bytes(handle))
    return int(_driver.rt_call("cudaIpcOpenMemHandle", h, rt.cudaIpcMemLazyEnablePeerAccess))


def close_handle(ptr: int) -> None:
    """Unmap an address returned by :func:`open_handle`."""
    _driver.rt_call("cudaIpcCloseMemHandle", ptr)
