"""CUDA IPC memory (public): plain ``cudaMalloc`` allocations and their 64-byte IPC handles.

The allocator's CUDA IPC path is built on these; benchmarks and tools use them for a
``cudaMalloc`` baseline or a buffer outside torch's caching allocator.  Every function runs
on the runtime's *current* device (select it first, e.g. with
:func:`tilescale_core.driver.ensure_context`) and raises :class:`tilescale_core.CudaError` on
failure.  Addresses are plain Python ``int`` (bytes); importing this module needs neither a GPU
nor cuda-python.

* :func:`malloc` / :func:`free`: ``cudaMalloc`` ``size`` bytes / ``cudaFree`` the address.
* :func:`get_handle` / :func:`open_handle` / :func:`close_handle`: export an allocation as a
  ``HANDLE_BYTES``-byte handle, map a peer's handle in this process, unmap it.
* :func:`check_handle`: ValueError unless a value is a ``HANDLE_BYTES``-byte ``bytes``.
* :data:`HANDLE_BYTES`: size of a ``cudaIpcMemHandle_t`` (64 bytes).
"""

from __future__ import annotations

from . import _ipc
from ._ipc import *  # noqa: F401,F403 - this module is _ipc's public face

__all__ = list(_ipc.__all__)
