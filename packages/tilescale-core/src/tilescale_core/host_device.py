"""``create_host_device_tensor(shape, dtype)``: pinned host memory mapped into the device.

Returns ``(host_tensor, device_tensor)``: two views of one ``cudaHostAlloc(...,
cudaHostAllocMapped | cudaHostAllocPortable)`` allocation, a CPU tensor and a CUDA tensor on
the current device (its address from ``cudaHostGetDevicePointer``).  A kernel reading the
device tensor reads host memory over PCIe/C2C; writes by either side are visible to the
other after the usual synchronisation (a stream sync, or system-scope fences/atomics from a
kernel).  The memory is freed (``cudaFreeHost``) when both tensors -- and every view of them
-- are gone.  Upstream TileScale's ``tilelang.distributed.shared_memory.create_host_device_tensor``.
"""

from __future__ import annotations

import threading

import torch

from . import _driver
from ._dlpack import byte_view
from .tensors import Shape, _shape_tuple, numel_of, resolve_dtype

__all__ = ["create_host_device_tensor", "live_host_device_allocations"]

_live = 0
_lock = threading.Lock()


class _PinnedMapped:
    """One mapped pinned allocation; freed when the last tensor over it is freed."""

    def __init__(self, nbytes: int):
        global _live
        rt = _driver.runtime_module()
        flags = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable
        self.host_ptr = int(_driver.rt_call("cudaHostAlloc", max(nbytes, 1), flags))
        try:
            self.device_ptr = int(_driver.rt_call("cudaHostGetDevicePointer", self.host_ptr, 0))
        except BaseException:
            _driver.rt_call("cudaFreeHost", self.host_ptr)
            raise
        with _lock:
            _live += 1

    def __del__(self):
        global _live
        try:
            _driver.rt_call("cudaFreeHost", self.host_ptr)
        except Exception:  # interpreter shutdown or a dead context: nothing left to free
            pass
        with _lock:
            _live -= 1


def live_host_device_allocations() -> int:
    """Allocations made by :func:`create_host_device_tensor` not freed yet (for tests)."""
    return _live


def create_host_device_tensor(shape: Shape, dtype: str | torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate pinned host memory mapped into the current CUDA device.

    Args:
        shape: tensor shape: positive dimensions (ints, numpy integers or 0-dim integer
            tensors).
        dtype: a ``torch.dtype`` or a dtype string (``"float32"``, ``"uint64"``, ...).

    Returns:
        ``(host_tensor, device_tensor)``: the same memory as a CPU tensor and as a CUDA
        tensor on the current device; freed when both (and their views) are gone.

    Raises:
        ValueError: a dimension that is not positive (``"shape dimensions must be positive
            ..."``) or not an integer, or an unknown dtype string -- before anything is
            allocated.
        TypeError: ``dtype`` is neither a string nor a ``torch.dtype``.
        RuntimeError: no CUDA device.
    """
    dims = _shape_tuple(shape, positive=True)
    dt = resolve_dtype(dtype)
    if not torch.cuda.is_available():
        raise RuntimeError("create_host_device_tensor needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = numel_of(dims) * dt.itemsize
    owner = _PinnedMapped(nbytes)
    host = byte_view(owner.host_ptr, nbytes, torch.device("cpu"), owner).view(dt).view(dims)
    dev = byte_view(owner.device_ptr, nbytes, device, owner).view(dt).view(dims)
    return host, dev
