"""Thin, checked access to the CUDA driver and runtime through cuda-python.

Every helper here raises :class:`CudaError` (a ``RuntimeError``) with the error's name
instead of returning a status tuple, and none of them is imported before it is needed: a
machine without a CUDA driver can import :mod:`tilescale_host` and use its CPU helpers.
Device arguments are CUDA ordinals as the process sees them (after CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import functools


class CudaError(RuntimeError):
    """A CUDA driver or runtime call failed (or no driver could be loaded)."""


@functools.cache
def driver():
    """Return the ``cuda.bindings.driver`` module (``cuda.cuda`` on older cuda-python)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:  # cuda-python < 12.8 layout
        try:
            from cuda import cuda as drv
        except ImportError as exc:
            raise CudaError(
                "cuda-python is required for this TileScale host helper; "
                "install it with `pip install cuda-python`"
            ) from exc
    return drv


@functools.cache
def runtime():
    """Return the ``cuda.bindings.runtime`` module (``cuda.cudart`` on older cuda-python)."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt
        except ImportError as exc:
            raise CudaError("cuda-python is required for this TileScale host helper") from exc
    return rt


def check(result, what: str):
    """Unpack a cuda-python result tuple ``(status, *values)``; raise CudaError on failure.

    Returns None, the single value, or a tuple of values.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CudaError(f"{what} failed: {_error_name(status)} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _error_name(status) -> str:
    name = getattr(status, "name", None)
    return name if name else str(status)


@functools.cache
def _init_driver() -> None:
    try:
        result = driver().cuInit(0)
    except Exception as exc:  # the driver library itself could not be loaded
        raise CudaError(f"the CUDA driver is not available: {exc}") from exc
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
