"""Thin, checked access to the CUDA driver and runtime, through tilescale-core's CUDA layer.

Every helper here raises :class:`tilescale_core.CudaError` (a ``RuntimeError``; the same class
as :class:`CudaError` here) with the error's name instead of returning a status tuple, and none
of them is imported before it is needed: a machine without a CUDA driver can import
:mod:`tilescale_host` and use its CPU helpers.  Device arguments are CUDA ordinals as the
process sees them (after CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import functools

from tilescale_core.driver import CudaError, CudaUnavailableError, check
from tilescale_core.driver import driver_module as driver
from tilescale_core.driver import runtime_module as runtime

__all__ = ["CudaError", "CudaUnavailableError", "check", "device", "device_attribute", "device_count",
           "driver", "normalize_bus_id", "pci_bus_id", "runtime"]


@functools.cache
def _init_driver() -> None:
    try:
        result = driver().cuInit(0)
    except CudaError:
        raise
    except Exception as exc:  # the driver library itself could not be loaded
        raise CudaUnavailableError(f"the CUDA driver is not available: {exc}", "cuInit") from exc
    check(result, "cuInit")


def device(ordinal: int):
    """Return the driver's ``CUdevice`` for CUDA ordinal ``ordinal`` (initialising the driver)."""
    _init_driver()
    return check(driver().cuDeviceGet(int(ordinal)), f"cuDeviceGet({ordinal})")


def device_count() -> int:
    """Number of CUDA devices visible to this process; 0 when no driver can be loaded."""
    try:
        _init_driver()
        return int(check(driver().cuDeviceGetCount(), "cuDeviceGetCount"))
    except CudaError:
        return 0


def device_attribute(name: str, ordinal: int) -> int:
    """Integer value of ``CU_DEVICE_ATTRIBUTE_<name>`` for device ``ordinal``."""
    drv = driver()
    attr = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(check(drv.cuDeviceGetAttribute(attr, device(ordinal)), f"cuDeviceGetAttribute({name})"))


def pci_bus_id(ordinal: int) -> str:
    """PCI bus id of device ``ordinal``, normalised to ``dddd:bb:dd.f`` in lower case."""
    raw = check(driver().cuDeviceGetPCIBusId(64, device(ordinal)), "cuDeviceGetPCIBusId")
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return normalize_bus_id(text.split("\x00", 1)[0])  # a C string in a fixed-size buffer


def normalize_bus_id(bus_id: str) -> str:
    """Normalise a PCI bus id (``00000000:18:00.0`` or ``0000:18:00.0``) to ``0000:18:00.0``."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:  # no domain given
        parts.insert(0, "0")
    if len(parts) != 3:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, slot = parts
    return f"{int(domain, 16):04x}:{bus}:{slot}"
