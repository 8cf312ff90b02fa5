"""TileScale's one CUDA layer (public): checked driver/runtime calls and one error type.

tilescale-core, tilescale-host and tilescale-lang make their CUDA calls through these names,
so ``except tilescale_core.CudaError`` catches a CUDA failure from any of them.  Importing
this module needs neither a GPU nor cuda-python (they are loaded on the first call).

* :class:`CudaError` (``call``, ``code``, ``name``): a call returned an error.
* :class:`CudaUnavailableError`: a :class:`CudaError` raised when no CUDA driver or no
  cuda-python can be loaded.
* :func:`call` / :func:`rt_call`: call a driver / runtime function by name, checked.
* :func:`check`: check a result tuple ``(status, *values)`` already in hand.
* :func:`driver_module` / :func:`runtime_module`: cuda-python's binding modules (with the
  cuda-python < 12.8 fallback).
* :func:`init`: ``cuInit(0)``, once per process.
* :func:`ensure_context`: make a device's primary context current (``cudaSetDevice`` +
  ``cudaFree(0)``); this also changes the runtime's current device.
* :func:`driver_version`, :func:`device_count`, :func:`device_attribute` (an int
  ``CU_DEVICE_ATTRIBUTE_<name>``), :func:`mem_get_info` (``(free, total)`` bytes).
* :func:`bytes_of` / :func:`fill_struct`: the raw bytes of a cuda-python struct (handles).

CUDA IPC allocations (``cudaMalloc`` and IPC handles) are :mod:`tilescale_core.ipc`'s.
"""

from __future__ import annotations

from . import _driver
from ._driver import *  # noqa: F401,F403 - this module is _driver's public face

__all__ = list(_driver.__all__)
