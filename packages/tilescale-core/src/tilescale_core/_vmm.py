"""CUDA virtual memory management (VMM): physical allocations, mappings and shareable handles.

An allocation is ``cuMemCreate`` (size rounded up to the recommended granularity) +
``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess`` for the mapping device.  It is
shared either as a *fabric* handle (64 opaque bytes, valid in any process that can reach
the same IMEX channel) or as a *POSIX file descriptor* (moved between processes with
:mod:`tilescale_core._fd_exchange`).  This module remembers every mapping it made, keyed by
its address, so that one address is enough to export, unmap or free it.

Serialised handles (what ``_create_vmm_handle`` returns) are
``b"TSVM" | u8 kind | 3 pad | u64 size`` followed by the 64-byte fabric handle, or by
``i64 pid | i64 fd`` for a descriptor that lives in process ``pid``.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

from . import _driver

__all__ = [
    "FABRIC",
    "POSIX_FD",
    "Mapping",
    "create",
    "decode_handle",
    "encode_handle",
    "export_fd",
    "export_handle",
    "granularity",
    "import_fd",
    "import_handle",
    "lookup",
    "release",
]

#: Handle kind: fabric handles (IMEX).
FABRIC = "fabric"
#: Handle kind: POSIX file descriptors.
POSIX_FD = "fd"

_KIND_CODE = {FABRIC: 1, POSIX_FD: 2}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}
_HEADER = struct.Struct("<4sB3xQ")
_FD_PAYLOAD = struct.Struct("<qq")
_MAGIC = b"TSVM"
_FABRIC_BYTES = 64


@dataclass
class Mapping:
    """One VMM mapping made by this process.

    Attributes:
        ptr: mapped address (bytes). size: mapped bytes. handle: ``CUmemGenericAllocationHandle``.
        kind: :data:`FABRIC` or :data:`POSIX_FD`. device: mapping device ordinal.
        owner: True for memory created here, False for an imported peer allocation.
    """

    ptr: int
    size: int
    handle: object
    kind: str
    device: int
    owner: bool


_MAPPINGS: dict[int, Mapping] = {}
_LOCK = threading.Lock()


def _handle_type(kind: str):
    drv = _driver.driver_module()
    types = drv.CUmemAllocationHandleType
    if kind == FABRIC:
        return types.CU_MEM_HANDLE_TYPE_FABRIC
    if kind == POSIX_FD:
        return types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    raise ValueError(f"unknown VMM handle kind {kind!r} (expected {FABRIC!r} or {POSIX_FD!r})")


def _prop(device: int, kind: str):
    drv = _driver.driver_module()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = _handle_type(kind)
    return prop


def granularity(device: int, kind: str) -> int:
    """Recommended VMM granularity (bytes) for ``device`` and handle ``kind``."""
    drv = _driver.driver_module()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_driver.call("cuMemGetAllocationGranularity", _prop(device, kind), flag))


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _access_desc(device: int):
    drv = _driver.driver_module()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def map_handle(handle, size: int, alignment: int, devices: list[int]) -> int:
    """Reserve ``size`` bytes of address space, map ``handle`` there, allow ``devices``; return it."""
    ptr = int(_driver.call("cuMemAddressReserve", size, alignment, 0, 0))
    try:
        _driver.call("cuMemMap", ptr, size, 0, handle, 0)
        try:
            descs = [_access_desc(d) for d in devices]
            _driver.call("cuMemSetAccess", ptr, size, descs, len(descs))
        except BaseException:
            _driver.call("cuMemUnmap", ptr, size)
            raise
    except BaseException:
        _driver.call("cuMemAddressFree", ptr, size)
        raise
    return ptr


def unmap(ptr: int, size: int) -> None:
    """Undo :func:`map_handle`: unmap and free the address range."""
    _driver.call("cuMemUnmap", ptr, size)
    _driver.call("cuMemAddressFree", ptr, size)


def _register(mapping: Mapping) -> int:
    with _LOCK:
        _MAPPINGS[mapping.ptr] = mapping
    return mapping.ptr


def _map_new(handle, size: int, kind: str, device: int, owner: bool) -> int:
    try:
        ptr = map_handle(handle, size, granularity(device, kind), [device])
    except BaseException:
        _driver.call("cuMemRelease", handle)
        raise
    return _register(Mapping(ptr, size, handle, kind, device, owner))


def create(size: int, device: int, kind: str) -> int:
    """Create and map ``size`` bytes (rounded up) on ``device``, shareable as ``kind``; return the address."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    size = _round_up(size, granularity(device, kind))
    handle = _driver.call("cuMemCreate", size, _prop(device, kind), 0)
    return _map_new(handle, size, kind, device, owner=True)


def lookup(ptr: int) -> Mapping:
    """Return the :class:`Mapping` at address ``ptr``; raise ValueError for unknown addresses."""
    with _LOCK:
        mapping = _MAPPINGS.get(ptr)
    if mapping is None:
        raise ValueError(f"0x{ptr:x} is not a VMM mapping made by this process")
    return mapping


def export_fd(ptr: int) -> int:
    """Export the allocation at ``ptr`` as a new POSIX descriptor (the caller closes it)."""
    mapping = lookup(ptr)
    if mapping.kind != POSIX_FD:
        raise ValueError(f"0x{ptr:x} was created for {mapping.kind} handles, not POSIX fds")
    return int(_driver.call("cuMemExportToShareableHandle", mapping.handle, _handle_type(POSIX_FD), 0))


def _export_fabric(ptr: int) -> bytes:
    mapping = lookup(ptr)
    if mapping.kind != FABRIC:
        raise ValueError(f"0x{ptr:x} was created for {mapping.kind} handles, not fabric handles")
    handle = _driver.call("cuMemExportToShareableHandle", mapping.handle, _handle_type(FABRIC), 0)
    return _driver.bytes_of(handle, _FABRIC_BYTES)


def encode_handle(kind: str, size: int, payload: bytes) -> bytes:
    """Serialise a handle (see the module docstring)."""
    return _HEADER.pack(_MAGIC, _KIND_CODE[kind], size) + payload


def decode_handle(data: bytes) -> tuple[str, int, bytes]:
    """Parse a serialised handle into ``(kind, size, payload)``; raise ValueError if malformed."""
    if not isinstance(data, (bytes, bytearray)) or len(data) < _HEADER.size:
        raise ValueError("not a TileScale VMM handle (too short)")
    magic, code, size = _HEADER.unpack_from(data)
    if magic != _MAGIC or code not in _CODE_KIND:
        raise ValueError("not a TileScale VMM handle (bad magic or kind)")
    kind = _CODE_KIND[code]
    payload = bytes(data[_HEADER.size :])
    expected = _FABRIC_BYTES if kind == FABRIC else _FD_PAYLOAD.size
    if len(payload) != expected:
        raise ValueError(f"a {kind} VMM handle carries {expected} payload bytes, got {len(payload)}")
    return kind, size, payload


def export_handle(ptr: int) -> bytes:
    """Serialise the handle of the allocation at ``ptr``.

    Fabric handles work in any process; an fd handle names a new descriptor of THIS process
    (the receiver must get the descriptor itself via :mod:`tilescale_core._fd_exchange`).
    """
    mapping = lookup(ptr)
    if mapping.kind == FABRIC:
        return encode_handle(FABRIC, mapping.size, _export_fabric(ptr))
    fd = export_fd(ptr)
    return encode_handle(POSIX_FD, mapping.size, _FD_PAYLOAD.pack(os.getpid(), fd))


def _import(os_handle, kind: str, size: int, device: int) -> int:
    handle = _driver.call("cuMemImportFromShareableHandle", os_handle, _handle_type(kind))
    return _map_new(handle, size, kind, device, owner=False)


def import_fd(fd: int, size: int, device: int) -> int:
    """Import and map a peer's POSIX descriptor of ``size`` bytes on ``device``; return the address."""
    return _import(fd, POSIX_FD, size, device)


def import_handle(data: bytes, device: int) -> int:
    """Import and map a serialised handle on ``device``; return the address in this process."""
    kind, size, payload = decode_handle(data)
    if kind == FABRIC:
        drv = _driver.driver_module()
        return _import(_driver.fill_struct(drv.CUmemFabricHandle(), payload), FABRIC, size, device)
    pid, fd = _FD_PAYLOAD.unpack(payload)
    if pid != os.getpid():
        raise ValueError(
            f"this POSIX-fd VMM handle names descriptor {fd} of process {pid}; descriptors "
            "cannot travel as bytes: move them with tilescale_core._fd_exchange"
        )
    return import_fd(fd, size, device)


def release(ptr: int, owner: bool) -> None:
    """Unmap the mapping at ``ptr`` and drop its handle; ``owner`` must match how it was made."""
    mapping = lookup(ptr)
    if mapping.owner != owner:
        made = "created by vmm_malloc" if mapping.owner else "imported from a peer handle"
        raise ValueError(f"0x{ptr:x} was {made}; use the matching free/close call")
    unmap(ptr, mapping.size)
    _driver.call("cuMemRelease", mapping.handle)
    with _LOCK:
        _MAPPINGS.pop(ptr, None)
