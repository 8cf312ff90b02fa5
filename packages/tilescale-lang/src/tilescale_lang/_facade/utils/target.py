"""``tilelang.utils.target``: upstream TileScale's module of target helpers, as aliases of
stock TileLang's.

Stock TileLang 0.1.15 has no ``tilelang/utils/target.py``: its target helpers live in
``tilelang.backend.target`` (``determine_target``), ``tilelang.cuda.target``
(``target_is_hopper``, ``target_has_bulk_copy``, ...), ``tilelang.rocm.target`` and
``tilelang.metal.target``.  The names below are those functions themselves (never copies), so
``from tilelang.utils.target import determine_target, target_is_hopper`` behaves exactly as the
stock functions do.  Two helpers upstream has and stock does not are written here:
:func:`target_get_warp_size` (any target kind) and :func:`parse_device`.

tilescale-lang appends this file's directory to ``tilelang.utils.__path__`` (after stock's own
directory), so a stock ``tilelang/utils/target.py``, should a release add one, is the module
found and this one is never imported.
"""

from __future__ import annotations

from tilelang.backend.target import determine_target
from tilelang.cuda.target import (
    check_cuda_availability,
    normalize_cutedsl_target,
    target_has_async_copy,
    target_has_bulk_copy,
    target_has_ldmatrix,
    target_has_stmatrix,
    target_is_ampere,
    target_is_cuda,
    target_is_hopper,
    target_is_sm120,
    target_is_turing,
    target_is_volta,
)
from tilelang.metal.target import check_metal_availability, target_is_metal
from tilelang.rocm.target import check_hip_availability, target_is_cdna, target_is_hip

__all__ = [
    "check_cuda_availability",
    "check_hip_availability",
    "check_metal_availability",
    "determine_target",
    "normalize_cutedsl_target",
    "parse_device",
    "target_get_warp_size",
    "target_has_async_copy",
    "target_has_bulk_copy",
    "target_has_ldmatrix",
    "target_has_stmatrix",
    "target_is_ampere",
    "target_is_cdna",
    "target_is_cuda",
    "target_is_hip",
    "target_is_hopper",
    "target_is_metal",
    "target_is_sm120",
    "target_is_turing",
    "target_is_volta",
]


def target_get_warp_size(target) -> int:
    """Threads per warp (wavefront) of ``target``: stock TileLang's per-backend query for CUDA,
    ROCm and Metal targets, else the target's ``thread_warp_size`` attribute."""
    from tilelang import _ffi_api
    from tvm.target import Target

    target = target if isinstance(target, Target) else Target(target)
    if target_is_cuda(target):
        return int(_ffi_api.TargetCudaGetWarpSize(target))
    if target_is_hip(target):
        return int(_ffi_api.TargetRocmGetWarpSize(target))
    if target_is_metal(target):
        return int(_ffi_api.TargetMetalGetWarpSize(target))
    return int(target.attrs.get("thread_warp_size", 1))


def parse_device(device) -> int:
    """The CUDA device index ``device`` names.

    Args:
        device: None or ``"cuda"`` / ``"gpu"`` (the current device; 0 without CUDA), an int,
            a CUDA ``torch.device`` (``cuda`` alone: 0), or a string ``"cuda:N"`` / ``"N"``.

    Raises:
        ValueError: a device that is not CUDA, a string that names no index, or another type.
    """
    import torch

    if isinstance(device, bool):
        raise ValueError(f"Invalid device specification: {device!r}")
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    if isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Only CUDA devices are supported, got {device.type}")
        return 0 if device.index is None else device.index
    if isinstance(device, str):
        text = device.strip().lower()
        if text in ("cuda", "gpu"):
            return parse_device(None)
        index = text[len("cuda:"):] if text.startswith("cuda:") else text
        try:
            return int(index)
        except ValueError:
            raise ValueError(f"Invalid device specification: {device}") from None
    raise ValueError(f"Invalid device type: {type(device)}")
