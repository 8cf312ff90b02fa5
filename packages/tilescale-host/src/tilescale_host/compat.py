"""Upstream TileScale's host helpers under their upstream names, built on TileScale's own.

Programs written for upstream TileScale import these from ``tilelang.distributed.utils`` (and
``tilelang.distributed``); the rest of that module's names are TileScale's existing helpers
(``init_dist``, ``perf_fn``, ``has_fullmesh_nvlink``, ...).  See docs/host.md, "Upstream
TileScale's module paths".

* :func:`CUDA_CHECK`: raise :class:`tilescale_core.CudaError` for a failed cuda-python status.
* :data:`dtype_map`: upstream's dtype names (``"bfloat16"``, ``"s8"``, ...) to torch dtypes.
* :func:`init_distributed`: join the process group from torchrun's variables, over
  :func:`~tilescale_host.dist_init.init_dist`.
* :func:`create_mapped_tensor`: host memory mapped into the device
  (``tilelang.distributed.shared_memory.create_host_device_tensor``).

Importing this module imports torch; cuda-python loads on the first :func:`CUDA_CHECK`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import torch

__all__ = ["CUDA_CHECK", "create_mapped_tensor", "dtype_map", "init_distributed"]


def CUDA_CHECK(err: Any) -> Any:  # noqa: N802 - upstream's name
    """Check the status of a cuda-python call (upstream TileScale's ``CUDA_CHECK``).

    Args:
        err: a driver ``CUresult`` or a runtime ``cudaError_t`` (``(err,) = cuda.cuXxx(...)``;
            ``CUDA_CHECK(err)``), or the whole result tuple ``(status, *values)``.

    Returns:
        None for a bare status; for a result tuple, its values (none: None, one: that value,
        several: a tuple), as :func:`tilescale_core.driver.check` returns them.

    Raises:
        tilescale_core.CudaError: the status is not success; a ``RuntimeError`` (as upstream's)
            whose ``code`` and ``name`` are the status's and whose message adds CUDA's own
            description of the error.
        TypeError: ``err`` is neither a driver nor a runtime status.
    """
    from tilescale_core.driver import CudaError, driver_module, runtime_module

    values: tuple = ()
    if isinstance(err, tuple):
        if not err:
            raise TypeError("CUDA_CHECK got an empty tuple; pass a cuda-python status or result tuple")
        err, values = err[0], err[1:]
    drv, rt = driver_module(), runtime_module()
    if isinstance(err, drv.CUresult):
        success, describe = drv.CUresult.CUDA_SUCCESS, drv.cuGetErrorString
    elif isinstance(err, rt.cudaError_t):
        success, describe = rt.cudaError_t.cudaSuccess, rt.cudaGetErrorString
    else:
        raise TypeError(f"CUDA_CHECK takes a CUresult or cudaError_t (or a cuda-python result tuple), "
                        f"got {type(err).__name__} {err!r}")
    if err != success:
        raise CudaError("CUDA_CHECK", int(err), err.name, _description(describe, err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _description(describe, status) -> str:
    """CUDA's text for ``status`` (``cuGetErrorString`` / ``cudaGetErrorString``); empty when
    it cannot be had (no driver on this machine)."""
    try:
        result = describe(status)
    except Exception:
        return ""
    text = result[-1] if isinstance(result, tuple) else result
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text or ""


#: Upstream TileScale's dtype names (the spellings its examples take on the command line) to
#: torch dtypes: ``bfloat16``, ``float16``, ``float8_e4m3fn``, ``float8_e5m2``, ``s8``
#: (``torch.int8``), ``s32`` (``torch.int32``), ``float32``.
dtype_map: dict = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "s8": torch.int8,
    "s32": torch.int32,
    "float32": torch.float32,
}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def init_distributed(return_tp_group: bool = False, init_nvshmem: bool = True, return_lc_group: bool = False):
    """Join the process group from torchrun's variables (upstream TileScale's ``init_distributed``).

    Reads ``WORLD_SIZE`` (default 1), ``RANK`` (default 0) and ``LOCAL_RANK`` (default 0), then
    calls :func:`~tilescale_host.dist_init.init_dist` with ``(LOCAL_RANK, WORLD_SIZE)``: the
    same single-node checks, device choice (``TILESCALE_SHARE_GPUS=1`` runs several ranks on
    one GPU), rendezvous and timeout as every TileScale program.

    Args:
        return_tp_group: also return the group of all ranks.
        init_nvshmem: when a ``pynvshmem`` module can be imported, call its
            ``init_nvshmem_by_uniqueid(group)``: a real one (NVSHMEM's bindings) or
            tilescale-host's own (:mod:`tilescale_host.pynvshmem`, which records the group
            for its heap); when none can be imported this is skipped.
        return_lc_group: also return the group of the ranks on this node (and the group of all
            ranks before it).  TileScale runs on one node, so both are the same group.

    Returns:
        ``(WORLD_SIZE, RANK, LOCAL_RANK)``; with ``return_tp_group``
        ``(WORLD_SIZE, RANK, LOCAL_RANK, group)``; with ``return_lc_group``
        ``(WORLD_SIZE, RANK, LOCAL_RANK, group, local_group)``.

    Raises:
        ValueError: a variable that is not an integer, ``RANK`` differing from ``LOCAL_RANK``
            (a multi-node launch), or anything :func:`~tilescale_host.dist_init.init_dist`
            refuses.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if rank != local_rank:
        raise ValueError(f"RANK={rank} differs from LOCAL_RANK={local_rank}: a multi-node launch; "
                         "TileScale supports a single node only")
    from .dist_init import init_dist

    rank, world_size, group = init_dist(local_rank, world_size)
    if init_nvshmem and (sys.modules.get("pynvshmem") or importlib.util.find_spec("pynvshmem")) is not None:
        import pynvshmem  # installed: its own import errors are the caller's to see

        pynvshmem.init_nvshmem_by_uniqueid(group)
    if return_lc_group:
        return world_size, rank, local_rank, group, group
    if return_tp_group:
        return world_size, rank, local_rank, group
    return world_size, rank, local_rank


def create_mapped_tensor(shape, dtype):
    """Host memory mapped into the current device as ``(host_tensor, device_tensor)``
    (upstream TileScale's ``create_mapped_tensor``): the same function as
    ``tilelang.distributed.shared_memory.create_host_device_tensor``."""
    from tilescale_core.shared_memory import create_host_device_tensor

    return create_host_device_tensor(shape, dtype)
