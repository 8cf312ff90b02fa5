"""Checked CUDA driver queries for host code (public face of :mod:`tilescale_host._cuda`).

Every helper raises :class:`tilescale_core.CudaError` (the same class as :class:`CudaError`
here) naming the failed call instead of returning a status tuple; nothing touches the driver
before the first call, so a machine without CUDA can import this module.  Device arguments are
CUDA ordinals as this process sees them (after ``CUDA_VISIBLE_DEVICES``).

* :func:`device_attribute`: the int ``CU_DEVICE_ATTRIBUTE_<name>`` of a device, e.g.
  ``device_attribute("CAN_USE_64_BIT_STREAM_MEM_OPS", 0)``.
* :func:`device_count`: visible devices; 0 (no error) when no driver can be loaded.
* :func:`device`: the driver's ``CUdevice`` of an ordinal.
* :func:`pci_bus_id` / :func:`normalize_bus_id`: a device's PCI bus id as ``dddd:bb:dd.f``.
* :func:`driver` / :func:`runtime`: cuda-python's driver / runtime binding modules (the same
  functions as :func:`tilescale_core.driver.driver_module` / ``runtime_module``).
* :func:`check`: check a result tuple ``(status, *values)`` already in hand, return the values
  (:func:`tilescale_core.driver.check`).
* :class:`CudaError`, :class:`CudaUnavailableError`: tilescale-core's CUDA errors.
"""

from __future__ import annotations

from . import _cuda
from ._cuda import *  # noqa: F401,F403 - this module is _cuda's public face

__all__ = list(_cuda.__all__)
