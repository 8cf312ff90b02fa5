"""Zero-copy torch tensors over raw addresses, on a device chosen by the caller.

torch's ``__cuda_array_interface__`` import asks the driver which device owns a pointer; a
peer mapping would then be reported on the peer's GPU.  Every view must be on the
current device (docs/core.md), so views are built from a hand-made DLPack capsule whose device field is
set explicitly.  The tensor does not own the memory: its deleter only drops the capsule's
bookkeeping.
"""

from __future__ import annotations

import ctypes
import threading

import torch

__all__ = ["byte_view"]

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_LIVE: dict[int, tuple] = {}
_LOCK = threading.Lock()


@_DELETER
def _release(managed) -> None:
    with _LOCK:
        _LIVE.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _dl_device(device: torch.device) -> _DLDevice:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _DLDevice(_KDL_CUDA, index)
    if device.type == "cpu":
        return _DLDevice(_KDL_CPU, 0)
    raise ValueError(f"unsupported device {device} for a pointer view (cuda or cpu)")


def byte_view(ptr: int, nbytes: int, device: torch.device, owner: object = None) -> torch.Tensor:
    """Return a 1-D ``torch.uint8`` tensor of ``nbytes`` bytes at address ``ptr`` on ``device``.

    The tensor aliases the memory without owning it; reinterpret it with
    ``.view(dtype).view(shape)``.  ``owner``, when given, is kept alive until torch frees the
    tensor's storage (every view of it gone): an object whose finaliser frees the memory
    makes the tensor own it.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        data=ptr,
        device=_dl_device(device),
        ndim=1,
        dtype=_DLDataType(_KDL_UINT, 8, 1),
        shape=shape,
        strides=None,
        byte_offset=0,
    )
    managed.manager_ctx = None
    managed.deleter = _release
    with _LOCK:
        _LIVE[ctypes.addressof(managed)] = (managed, shape, owner)
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
