"""Small helpers adopted from ``triton_dist.utils`` for TileLang users.

Printing from selected ranks (:func:`dist_print`), random test data (:func:`rand_tensor`,
:func:`init_seed`), typed environment variables (:func:`get_bool_env`, :func:`get_int_env`)
and device queries (NUMA node, SM clock rates, opt-in shared memory, TMA support).  Device
arguments are CUDA ordinals as this process sees them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence

from . import _cuda
from .topology import NvidiaSmiUtil, nvml_handle

__all__ = [
    "dist_print",
    "get_bool_env",
    "get_current_gpu_clock_rate_in_khz",
    "get_device_max_shared_memory_size",
    "get_int_env",
    "get_max_gpu_clock_rate_in_khz",
    "get_numa_node",
    "has_tma",
    "init_seed",
    "rand_tensor",
]

# --------------------------------------------------------------------------- environment


def get_bool_env(env: str, default_value: bool = False) -> bool:
    """Boolean value of environment variable ``env``; ``default_value`` when unset or empty.

    Read as every TileScale switch is (:func:`tilescale_core.env.flag`): 1/true/yes/on and
    0/false/no/off, any case; anything else raises ValueError naming the variable and its value.
    """
    from tilescale_core.env import flag

    return flag(env, default_value)


def get_int_env(env: str, default_value: int = 0) -> int:
    """Integer value of environment variable ``env``; ``default_value`` when unset or empty.

    Raises ValueError naming the variable and its value when it is not an integer.
    """
    value = os.environ.get(env)
    if value is None or not value.strip():
        return int(default_value)
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{env}={value!r} is not an integer") from None


# --------------------------------------------------------------------------- ranks and printing


def _rank_and_size() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else RANK / WORLD_SIZE."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return get_int_env("RANK", 0), get_int_env("WORLD_SIZE", 1)


def dist_print(
    *args,
    allowed_ranks: Iterable[int] | str = [0],  # noqa: B006 - the documented default, never mutated
    prefix: bool = False,
    need_sync: bool = False,
    **kwargs,
) -> None:
    """``print(*args, **kwargs)`` on the ranks in ``allowed_ranks`` only.

    Args:
        allowed_ranks: ranks that print (default ``[0]``), or ``"all"``.
        prefix: start the line with ``[rank:<r>]``.
        need_sync: print rank by rank in ``allowed_ranks`` order, with a
            ``torch.distributed.barrier()`` before each turn (every rank must call).
        kwargs: passed to ``print`` (``sep``, ``end``, ``file``, ``flush``).

    The rank is ``torch.distributed.get_rank()`` when a group is initialised, otherwise the
    RANK environment variable (default 0).
    """
    rank, world_size = _rank_and_size()
    if isinstance(allowed_ranks, str):
        if allowed_ranks != "all":
            raise ValueError(f"allowed_ranks must be a list of ranks or 'all', got {allowed_ranks!r}")
        allowed = list(range(world_size))
    else:
        allowed = list(allowed_ranks)
    head = (f"[rank:{rank}]",) if prefix else ()
    if not need_sync:
        if rank in allowed:
            print(*head, *args, **kwargs)
        return
    import torch.distributed as dist

    for turn in allowed:
        dist.barrier()
        if rank == turn:
            print(*head, *args, **{"flush": True, **kwargs})


# --------------------------------------------------------------------------- random data


def init_seed(seed: int = 0) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (CPU and every CUDA device).

    Nothing else is changed (no deterministic-algorithm or TF32 switches).
    """
    import torch

    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device lazily


def rand_tensor(shape: Sequence[int] | int, dtype, device="cuda"):
    """Random tensor of ``shape`` and ``dtype`` on ``device``.

    Floating types (fp8 included) are uniform in ``[-1, 1)``; signed integers are uniform
    in ``[-128, 128)`` clipped to the type's range; unsigned integers in ``[0, 256)``
    clipped likewise; bool is a fair coin.
    """
    import torch

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype.is_floating_point:
        gen = torch.float32 if dtype.itemsize == 1 else dtype  # fp8: draw in fp32, then cast
        return (torch.rand(shape, dtype=gen, device=device) * 2 - 1).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device).bool()
    if dtype.is_complex:
        raise TypeError(f"rand_tensor does not support complex dtype {dtype}")
    info = torch.iinfo(dtype)
    low, high = max(info.min, -128 if info.min < 0 else 0), min(info.max + 1, 128 if info.min < 0 else 256)
    return torch.randint(low, high, shape, dtype=torch.int64, device=device).to(dtype)


# --------------------------------------------------------------------------- device queries


def get_numa_node(device_id: int = 0) -> int:
    """NUMA node of CUDA device ``device_id`` (-1: none reported); see NvidiaSmiUtil.get_gpu_numa_node."""
    return NvidiaSmiUtil.get_gpu_numa_node(device_id)


def _sm_clock_khz(device_id: int, query: str) -> int:
    import pynvml

    handle = nvml_handle(device_id)
    mhz = getattr(pynvml, query)(handle, pynvml.NVML_CLOCK_SM)
    return int(mhz) * 1000


def get_max_gpu_clock_rate_in_khz(device_id: int = 0) -> int:
    """Maximum SM clock of CUDA device ``device_id`` in kHz (NVML)."""
    return _sm_clock_khz(device_id, "nvmlDeviceGetMaxClockInfo")


def get_current_gpu_clock_rate_in_khz(device_id: int = 0) -> int:
    """Current SM clock of CUDA device ``device_id`` in kHz (NVML)."""
    return _sm_clock_khz(device_id, "nvmlDeviceGetClockInfo")


def get_device_max_shared_memory_size(device_id: int = 0) -> int:
    """Largest shared memory one block can opt into on ``device_id``, in bytes."""
    return _cuda.device_attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", device_id)


def has_tma(device_id: int | None = None) -> bool:
    """True when ``device_id`` (default: the current device, else 0) is SM90+ (has TMA).

    False when no CUDA device is visible.
    """
    if _cuda.device_count() == 0:
        return False
    if device_id is None:
        device_id = _current_device()
    return _cuda.device_attribute("COMPUTE_CAPABILITY_MAJOR", device_id) >= 9


def _current_device() -> int:
    try:
        import torch

        return torch.cuda.current_device()
    except Exception:
        return 0
