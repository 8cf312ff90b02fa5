"""CUDA-event benchmarking: ``do_bench`` and ``perf_fn``.

``do_bench`` times each repetition of ``fn`` with a pair of CUDA events on the current
stream after a warm-up, optionally flushing the L2 cache before each repetition by writing a
buffer larger than L2, and reports the median (or another statistic) in milliseconds.  When a
``torch.distributed`` process group is initialised, the ranks start each phase together
(barrier) and the per-repetition times of all ranks are gathered with ``all_gather``; each
repetition's time is then the maximum (default) or mean over ranks, so every rank returns the
same number.  ``perf_fn`` is the Triton-distributed style helper: it times a run of ``rep``
calls with one event pair and also returns ``fn``'s last output.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["aggregate_rank_times", "do_bench", "perf_fn", "summarize"]

_AGGREGATES = ("max", "mean", "none")
_RETURN_MODES = ("median", "mean", "min", "max", "all")
#: Default L2 flush size when the device's L2 size is unknown (bytes).
DEFAULT_FLUSH_BYTES = 256 * 1024 * 1024


def aggregate_rank_times(per_rank: Sequence[Sequence[float]], how: str) -> list[float]:
    """Combine ``per_rank[r][i]`` (rank ``r``, repetition ``i``) into one time per repetition.

    ``how`` is ``"max"`` (the slowest rank: the collective's time), ``"mean"``, or
    ``"none"`` (this is then only valid for one rank's list and returns it unchanged).
    """
    if how not in _AGGREGATES:
        raise ValueError(f"aggregate must be one of {_AGGREGATES}, got {how!r}")
    if how == "none" or len(per_rank) == 1:
        return list(per_rank[0])
    columns = list(zip(*per_rank, strict=True))
    if how == "max":
        return [max(c) for c in columns]
    return [sum(c) / len(c) for c in columns]


def summarize(times: Sequence[float], return_mode: str):
    """Reduce repetition times (ms) to the statistic ``return_mode`` (``"all"``: the list)."""
    if return_mode not in _RETURN_MODES:
        raise ValueError(f"return_mode must be one of {_RETURN_MODES}, got {return_mode!r}")
    if return_mode == "all":
        return list(times)
    reduce = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max}
    return float(reduce[return_mode](times))


def _group(group):
    """The process group to aggregate over, or None when torch.distributed is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return group if group is not None else dist.group.WORLD


def _barrier(group) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group)


def _gather_times(local: list[float], group) -> list[list[float]]:
    """All ranks' repetition times, via all_gather (CUDA tensors on NCCL, CPU otherwise)."""
    import torch
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return [local]
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor(local, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.cpu().tolist() for p in parts]


def _flush_buffer(flush_l2: bool, flush_bytes: int | None):
    """An int8 CUDA buffer larger than L2 (twice its size), or None when not flushing."""
    import torch

    if not flush_l2:
        return None
    if flush_bytes is None:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        flush_bytes = 2 * l2 if l2 else DEFAULT_FLUSH_BYTES
    if flush_bytes <= 0:
        raise ValueError(f"l2_flush_bytes must be positive, got {flush_bytes}")
    return torch.empty(int(flush_bytes), dtype=torch.int8, device="cuda")


def _check_counts(warmup: int, rep: int) -> None:
    if rep < 1:
        raise ValueError(f"rep must be at least 1, got {rep}")
    if warmup < 0:
        raise ValueError(f"warmup must be non-negative, got {warmup}")


def do_bench(
    fn: Callable[[], Any],
    warmup: int = 10,
    rep: int = 50,
    *,
    flush_l2: bool = True,
    l2_flush_bytes: int | None = None,
    group=None,
    aggregate: str = "max",
    return_mode: str = "median",
):
    """Time ``fn()`` with CUDA events; return milliseconds.

    Args:
        fn: the work to time; it enqueues CUDA work on the current stream.
        warmup: untimed calls before timing.
        rep: timed calls, each between its own pair of CUDA events.
        flush_l2: before each timed call, overwrite a buffer of ``l2_flush_bytes`` (default
            twice the device's L2 size) so that ``fn`` starts with a cold L2 cache. The write
            is outside the timed interval.
        l2_flush_bytes: size of the flush buffer in bytes.
        group: process group to aggregate over; default the WORLD group when
            ``torch.distributed`` is initialised, no aggregation otherwise.
        aggregate: ``"max"`` or ``"mean"`` over ranks of each repetition's time, or ``"none"``
            to keep this rank's times (collectives are still entered by every rank).
        return_mode: ``"median"``, ``"mean"``, ``"min"``, ``"max"`` or ``"all"`` (the list of
            ``rep`` times).

    Returns:
        A float in milliseconds, or a list of ``rep`` floats for ``return_mode="all"``.
    """
    import torch

    _check_counts(warmup, rep)
    if aggregate not in _AGGREGATES:
        raise ValueError(f"aggregate must be one of {_AGGREGATES}, got {aggregate!r}")
    summarize([0.0], return_mode)  # validates return_mode before any GPU work
    group = _group(group)
    flush = _flush_buffer(flush_l2, l2_flush_bytes)
    _barrier(group)
    for _ in range(warmup):
        fn()
    _barrier(group)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    local = [start.elapsed_time(end) for start, end in events]
    per_rank = _gather_times(local, group) if aggregate != "none" else [local]
    return summarize(aggregate_rank_times(per_rank, aggregate), return_mode)


def perf_fn(fn: Callable[[], Any], warmup: int = 10, rep: int = 50, *, group=None, aggregate: str = "max"):
    """Run ``fn`` ``warmup`` times, then time ``rep`` back-to-back calls with one event pair.

    Returns:
        ``(output, ms)``: ``fn``'s last return value and the mean time per call in
        milliseconds (the max or mean over ranks when a process group is initialised, see
        :func:`do_bench`; ``aggregate="none"`` keeps this rank's time).
    """
    import torch

    _check_counts(warmup, rep)
    group = _group(group)
    _barrier(group)
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _barrier(group)
    start.record()
    output = None
    for _ in range(rep):
        output = fn()
    end.record()
    torch.cuda.synchronize()
    local = [start.elapsed_time(end) / rep]
    per_rank = _gather_times(local, group) if aggregate != "none" else [local]
    return output, aggregate_rank_times(per_rank, aggregate)[0]
