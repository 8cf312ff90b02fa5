"""The shared-memory FFI: ``tl.shared_memory.*`` globals, their ``_``-prefixed bindings, the probes.

Importing this module registers every function of the FFI tables in docs/core.md as a tvm-ffi global
named ``tl.shared_memory.<name>`` (idempotent).  Each registered function checks its
arguments against :data:`SIGNATURES` (``int64`` = a Python int in the signed 64-bit range,
``Bytes`` = ``bytes``) before any CUDA work, and the Python bindings below call through the
FFI.  These are internal APIs: the allocator is the supported interface.

Addresses and sizes are in bytes; handles are ``bytes`` (IPC: 64 bytes; VMM: see
:mod:`tilescale_core._vmm`) or ``int`` (multicast objects).  Functions that map or allocate
work on the CUDA runtime's current device.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

import tvm_ffi

from . import _driver, _driver_multicast, _ipc, _vmm, probes
from .host_device import create_host_device_tensor
from .probes import probe_cuda_ipc, probe_multicast, probe_vmm_fabric, probe_vmm_fd

__all__ = [
    "FFI_PREFIX",
    "SIGNATURES",
    "_close_ipc_handle",
    "_close_vmm_handle",
    "_create_ipc_handle",
    "_create_vmm_handle",
    "_mc_add_device",
    "_mc_bind_mem",
    "_mc_create",
    "_mc_export_handle",
    "_mc_get_aligned_size",
    "_mc_import_handle",
    "_mc_map",
    "_mc_release_handle",
    "_mc_unmap",
    "_open_ipc_handle",
    "_open_vmm_handle",
    "_supports_multicast",
    "_supports_vmm_fabric",
    "_sync_ipc_handles",
    "_sync_vmm_handles",
    "_vmm_free",
    "_vmm_malloc",
    "create_host_device_tensor",
    "pack_handles",
    "probe_cuda_ipc",
    "probe_multicast",
    "probe_vmm_fabric",
    "probe_vmm_fd",
    "register",
    "unpack_handles",
]

#: Prefix of every registered FFI name.
FFI_PREFIX = "tl.shared_memory."

_I64 = "int64"
_BYTES = "Bytes"

#: ``name -> ((argument name, type), ...), return type`` for every registered FFI function.
SIGNATURES: dict[str, tuple[tuple[tuple[str, str], ...], str]] = {
    "create_ipc_handle": ((("ptr", _I64),), _BYTES),
    "open_ipc_handle": ((("handle", _BYTES),), _I64),
    "close_ipc_handle": ((("ptr", _I64),), "void"),
    "sync_ipc_handles": (
        (("rank", _I64), ("num_ranks", _I64), ("buffer_ptrs_gpu_addr", _I64), ("packed_handles", _BYTES)),
        "void",
    ),
    "vmm_malloc": ((("size", _I64),), _I64),
    "vmm_free": ((("ptr", _I64),), "void"),
    "create_vmm_handle": ((("ptr", _I64),), _BYTES),
    "open_vmm_handle": ((("handle", _BYTES),), _I64),
    "close_vmm_handle": ((("ptr", _I64),), "void"),
    "sync_vmm_handles": (
        (("rank", _I64), ("num_ranks", _I64), ("buffer_ptrs_gpu_addr", _I64), ("packed_handles", _BYTES)),
        "void",
    ),
    "supports_vmm_fabric": ((), "bool"),
    "supports_multicast": ((), "bool"),
    "mc_create": ((("size", _I64), ("num_devices", _I64)), _I64),
    "mc_export_handle": ((("handle", _I64),), _BYTES),
    "mc_import_handle": ((("handle_bytes", _BYTES),), _I64),
    "mc_add_device": ((("handle", _I64), ("device_id", _I64)), "void"),
    "mc_bind_mem": ((("handle", _I64), ("ptr", _I64), ("size", _I64)), "void"),
    "mc_map": ((("handle", _I64), ("size", _I64), ("num_devices", _I64)), _I64),
    "mc_release_handle": ((("handle", _I64),), "void"),
    "mc_unmap": ((("ptr", _I64), ("size", _I64), ("num_devices", _I64)), "void"),
    "mc_get_aligned_size": ((("size", _I64), ("num_devices", _I64)), _I64),
}

_LEN = struct.Struct("<I")


def pack_handles(handles: Sequence[bytes]) -> bytes:
    """Pack one handle per rank into one ``Bytes`` value (u32 length + bytes, per rank)."""
    out = bytearray()
    for h in handles:
        if not isinstance(h, (bytes, bytearray)):
            raise TypeError(f"handles must be bytes, got {type(h).__name__}")
        out += _LEN.pack(len(h)) + bytes(h)
    return bytes(out)


def unpack_handles(packed: bytes, num_ranks: int) -> list[bytes]:
    """Inverse of :func:`pack_handles`; raise ValueError unless exactly ``num_ranks`` handles."""
    handles, pos = [], 0
    while pos < len(packed):
        if pos + _LEN.size > len(packed):
            raise ValueError("packed handles are truncated")
        (n,) = _LEN.unpack_from(packed, pos)
        pos += _LEN.size
        if pos + n > len(packed):
            raise ValueError("packed handles are truncated")
        handles.append(bytes(packed[pos : pos + n]))
        pos += n
    if len(handles) != num_ranks:
        raise ValueError(f"packed_handles holds {len(handles)} handles for num_ranks={num_ranks}")
    return handles


# --- implementations (called through the FFI) -------------------------------------------


def _current_device() -> int:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"CUDA is unavailable: {probes.probe_driver().reason}")
    device = torch.cuda.current_device()
    _driver.ensure_context(device)
    return device


def _write_table_slot(table_addr: int, index: int, value: int) -> None:
    word = ctypes.c_uint64(value)
    _driver.call("cuMemcpyHtoD", table_addr + 8 * index, ctypes.addressof(word), 8)


def _sync(open_fn: Callable[[bytes], int], rank: int, num_ranks: int, table_addr: int, packed: bytes) -> None:
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside [0, {num_ranks})")
    if table_addr == 0:
        raise ValueError("buffer_ptrs_gpu_addr is a null pointer")
    for peer, handle in enumerate(unpack_handles(packed, num_ranks)):
        if peer != rank:
            _write_table_slot(table_addr, peer, open_fn(handle))


def _impl_open_ipc_handle(handle: bytes) -> int:
    _ipc.check_handle(handle)
    _current_device()
    return _ipc.open_handle(handle)


def _impl_vmm_malloc(size: int) -> int:
    kind = _vmm.FABRIC if probe_vmm_fabric().ok else _vmm.POSIX_FD
    return _vmm.create(size, _current_device(), kind)


def _impl_open_vmm_handle(handle: bytes) -> int:
    return _vmm.import_handle(handle, _current_device())


_IMPLS: dict[str, Callable[..., Any]] = {
    "create_ipc_handle": _ipc.get_handle,
    "open_ipc_handle": _impl_open_ipc_handle,
    "close_ipc_handle": _ipc.close_handle,
    "sync_ipc_handles": lambda r, n, t, p: _sync(_impl_open_ipc_handle, r, n, t, p),
    "vmm_malloc": _impl_vmm_malloc,
    "vmm_free": lambda ptr: _vmm.release(ptr, owner=True),
    "create_vmm_handle": _vmm.export_handle,
    "open_vmm_handle": _impl_open_vmm_handle,
    "close_vmm_handle": lambda ptr: _vmm.release(ptr, owner=False),
    "sync_vmm_handles": lambda r, n, t, p: _sync(_impl_open_vmm_handle, r, n, t, p),
    "supports_vmm_fabric": lambda: probes.probe_vmm_fabric().ok,
    "supports_multicast": lambda: probes.probe_multicast().ok,
    "mc_create": lambda size, n: _driver_multicast.create(size, n),
    "mc_export_handle": lambda h: _driver_multicast.export_handle(h),
    "mc_import_handle": lambda b: _driver_multicast.import_handle(b),
    "mc_add_device": lambda h, d: _driver_multicast.add_device(h, d),
    "mc_bind_mem": lambda h, p, s: _driver_multicast.bind_mem(h, p, s),
    "mc_map": lambda h, s, n: _driver_multicast.map(h, s, range(n)),
    "mc_release_handle": lambda h: _driver_multicast.release_handle(h),
    "mc_unmap": lambda p, s, n: _driver_multicast.unmap(p, s),
    "mc_get_aligned_size": lambda s, n: _driver_multicast.aligned_size(s, n),
}


def _check_value(where: str, value: Any, kind: str) -> None:
    if kind == _I64:
        if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
            raise TypeError(f"{where} must be an int64, got {value!r}")
    elif kind == _BYTES:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"{where} must be bytes, got {type(value).__name__}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be a bool, got {value!r}")
    elif kind == "void" and value is not None:
        raise TypeError(f"{where} must be None, got {value!r}")


def _typed(name: str) -> Callable[..., Any]:
    params, ret = SIGNATURES[name]
    impl = _IMPLS[name]
    full = FFI_PREFIX + name

    def ffi_function(*args):
        if len(args) != len(params):
            raise TypeError(f"{full} takes {len(params)} arguments, got {len(args)}")
        for value, (pname, kind) in zip(args, params):
            _check_value(f"{full}: argument {pname!r}", value, kind)
        result = impl(*(bytes(a) if isinstance(a, bytearray) else a for a in args))
        if ret == _BYTES and isinstance(result, bytearray):
            result = bytes(result)
        _check_value(f"{full}: return value", result, ret)
        return result

    ffi_function.__name__ = name
    return ffi_function


_registered = False


def register() -> None:
    """Register every ``tl.shared_memory.*`` FFI global (idempotent; runs on import)."""
    global _registered
    if _registered:
        return
    for name in SIGNATURES:
        tvm_ffi.register_global_func(FFI_PREFIX + name, _typed(name), override=True)
    _registered = True


def _ffi(name: str) -> Callable[..., Any]:
    return tvm_ffi.get_global_func(FFI_PREFIX + name)


# --- Python bindings (docs/core.md's names) --------------------------------------------------


def _create_ipc_handle(ptr: int) -> bytes:
    """Return the 64-byte CUDA IPC handle of the ``cudaMalloc`` allocation at ``ptr``."""
    return bytes(_ffi("create_ipc_handle")(ptr))


def _open_ipc_handle(handle: bytes) -> int:
    """Map a peer's IPC handle (lazy peer access) on the current device; return its address."""
    return _ffi("open_ipc_handle")(handle)


def _close_ipc_handle(ptr: int) -> None:
    """Unmap an address returned by :func:`_open_ipc_handle`."""
    _ffi("close_ipc_handle")(ptr)


def _sync_ipc_handles(
    rank: int,
    device_ids: Sequence[int],
    buffer_ptrs_gpu_addr: int,
    handles: Sequence[bytes],
    root_unique_id_opt: Any = None,
) -> None:
    """Open every peer's IPC handle and write its address into a CUDA uint64 table.

    ``num_ranks`` is ``len(device_ids)``; entry ``i`` of the table at device address
    ``buffer_ptrs_gpu_addr`` receives peer ``i``'s address (this rank's entry is left as
    is).  Close the opened addresses with :func:`_close_ipc_handle`.
    ``root_unique_id_opt`` is ignored.
    """
    _ffi("sync_ipc_handles")(rank, len(device_ids), buffer_ptrs_gpu_addr, pack_handles(handles))


def _vmm_malloc(size: int) -> int:
    """Allocate and map ``size`` bytes (rounded up to the VMM granularity) on the current device.

    The memory is shareable as a fabric handle when the fabric probe passes, else as a POSIX
    file descriptor.  Returns the address.
    """
    return _ffi("vmm_malloc")(size)


def _vmm_free(ptr: int) -> None:
    """Unmap and release memory returned by :func:`_vmm_malloc`."""
    _ffi("vmm_free")(ptr)


def _create_vmm_handle(ptr: int) -> bytes:
    """Serialise the shareable handle of :func:`_vmm_malloc` memory at ``ptr``."""
    return bytes(_ffi("create_vmm_handle")(ptr))


def _open_vmm_handle(handle: bytes) -> int:
    """Import and map a serialised VMM handle on the current device; return its address."""
    return _ffi("open_vmm_handle")(handle)


def _close_vmm_handle(ptr: int) -> None:
    """Unmap an address returned by :func:`_open_vmm_handle`."""
    _ffi("close_vmm_handle")(ptr)


def _sync_vmm_handles(rank: int, device_ids: Sequence[int], buffer_ptrs_gpu_addr: int, handles: Sequence[bytes]) -> None:
    """Like :func:`_sync_ipc_handles`, for VMM handles (close with :func:`_close_vmm_handle`)."""
    _ffi("sync_vmm_handles")(rank, len(device_ids), buffer_ptrs_gpu_addr, pack_handles(handles))


def _supports_vmm_fabric() -> bool:
    """Runtime probe: VMM fabric handles usable on every visible GPU (see :func:`probe_vmm_fabric`)."""
    return bool(_ffi("supports_vmm_fabric")())


def _supports_multicast() -> bool:
    """Runtime probe: multicast usable and allowed (see :func:`probe_multicast`)."""
    return bool(_ffi("supports_multicast")())


def _mc_create(size: int, num_devices: int) -> int:
    """Create a multicast object of ``size`` bytes (aligned up) for ``num_devices``; return its handle."""
    return _ffi("mc_create")(size, num_devices)


def _mc_export_handle(handle: int) -> bytes:
    """Export a multicast object as 64 fabric-handle bytes."""
    return bytes(_ffi("mc_export_handle")(handle))


def _mc_import_handle(handle_bytes: bytes) -> int:
    """Import a multicast object from :func:`_mc_export_handle` bytes; return the handle."""
    return _ffi("mc_import_handle")(handle_bytes)


def _mc_add_device(handle: int, device_id: int) -> None:
    """Add CUDA device ``device_id`` to the multicast object."""
    _ffi("mc_add_device")(handle, device_id)


def _mc_bind_mem(handle: int, ptr: int, size: int) -> None:
    """Bind ``size`` bytes of mapped VMM memory at ``ptr`` to the object (offset 0)."""
    _ffi("mc_bind_mem")(handle, ptr, size)


def _mc_map(handle: int, size: int, num_devices: int) -> int:
    """Map the multicast object, accessible from devices ``0..num_devices-1``; return the address."""
    return _ffi("mc_map")(handle, size, num_devices)


def _mc_release_handle(handle: int) -> None:
    """Release this process's reference to a multicast object."""
    _ffi("mc_release_handle")(handle)


def _mc_unmap(ptr: int, size: int, num_devices: int) -> None:
    """Unmap a multicast mapping made by :func:`_mc_map`."""
    _ffi("mc_unmap")(ptr, size, num_devices)


def _mc_get_aligned_size(size: int, num_devices: int) -> int:
    """``size`` rounded up to the multicast granularity (bytes)."""
    return _ffi("mc_get_aligned_size")(size, num_devices)


register()
