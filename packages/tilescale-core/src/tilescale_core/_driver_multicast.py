"""Every NVLink multicast driver call of TileScale, and nothing else.

Isolated so that unit tests can replace these functions and so that a reader can check
that nothing else ever calls ``cuMulticastCreate``.  The allocator reaches this module only
after :func:`tilescale_core.probes.probe_multicast` passed; on the lent machines it never
does.  Multicast handles are shared as fabric handles (64 bytes).  Handles cross as ``int``.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import _driver, _vmm

__all__ = [
    "add_device",
    "aligned_size",
    "bind_mem",
    "create",
    "export_handle",
    "import_handle",
    "map",
    "release_handle",
    "unbind",
    "unmap",
]

_FABRIC_BYTES = 64


def _prop(size: int, num_devices: int):
    drv = _driver.driver_module()
    prop = drv.CUmulticastObjectProp()
    prop.numDevices = num_devices
    prop.size = size
    prop.handleTypes = int(drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
    return prop


def _granularity(size: int, num_devices: int) -> int:
    drv = _driver.driver_module()
    flag = drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
    return int(_driver.call("cuMulticastGetGranularity", _prop(size, num_devices), flag))


def aligned_size(size: int, num_devices: int) -> int:
    """``size`` rounded up to the multicast granularity for ``num_devices`` devices (bytes)."""
    gran = _granularity(size, num_devices)
    return (size + gran - 1) // gran * gran


def create(size: int, num_devices: int) -> int:
    """Create a multicast object of ``size`` bytes (aligned) for ``num_devices``; return its handle."""
    handle = _driver.call("cuMulticastCreate", _prop(aligned_size(size, num_devices), num_devices))
    return int(handle)


def _handle(handle: int):
    return _driver.driver_module().CUmemGenericAllocationHandle(handle)


def export_handle(handle: int) -> bytes:
    """Export a multicast object as 64 fabric-handle bytes."""
    drv = _driver.driver_module()
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    fabric = _driver.call("cuMemExportToShareableHandle", _handle(handle), kind, 0)
    return _driver.bytes_of(fabric, _FABRIC_BYTES)


def import_handle(handle_bytes: bytes) -> int:
    """Import a multicast object exported by :func:`export_handle`; return the local handle."""
    if len(handle_bytes) != _FABRIC_BYTES:
        raise ValueError(f"a multicast fabric handle is {_FABRIC_BYTES} bytes, got {len(handle_bytes)}")
    drv = _driver.driver_module()
    fabric = _driver.fill_struct(drv.CUmemFabricHandle(), bytes(handle_bytes))
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    return int(_driver.call("cuMemImportFromShareableHandle", fabric, kind))


def add_device(handle: int, device_id: int) -> None:
    """Add CUDA device ``device_id`` to the multicast object (before any binding)."""
    _driver.call("cuMulticastAddDevice", _handle(handle), _driver.call("cuDeviceGet", device_id))


def bind_mem(handle: int, ptr: int, size: int) -> None:
    """Bind ``size`` bytes of this rank's mapped VMM memory at ``ptr`` to the object's offset 0."""
    _driver.call("cuMulticastBindAddr", _handle(handle), 0, ptr, size, 0)


def unbind(handle: int, device_id: int, size: int) -> None:
    """Unbind device ``device_id``'s memory (offset 0, ``size`` bytes) from the object."""
    _driver.call("cuMulticastUnbind", _handle(handle), _driver.call("cuDeviceGet", device_id), 0, size)


def map(handle: int, size: int, devices: Sequence[int]) -> int:  # noqa: A001 - the FFI's name
    """Map the multicast object into this process, accessible from ``devices``; return the address."""
    return _vmm.map_handle(_handle(handle), size, _granularity(size, len(devices)), list(devices))


def unmap(ptr: int, size: int) -> None:
    """Unmap a multicast mapping made by :func:`map`."""
    _vmm.unmap(ptr, size)


def release_handle(handle: int) -> None:
    """Release this process's reference to the multicast object."""
    _driver.call("cuMemRelease", _handle(handle))
