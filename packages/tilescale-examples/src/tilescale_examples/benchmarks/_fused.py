"""What the benchmarks of a fused op against its unfused sequence share (``decode``,
``gemm_allreduce``): building an op on N emulated peers in one process, timing every emulated
rank's calls, and one measurement from build to close."""

from __future__ import annotations

import statistics

from tilescale_examples.benchmarks import _timing

__all__ = ["build", "time_ranks", "measure"]


def build(cls, n: int, args: tuple, device, **kwargs) -> tuple:
    """``(peers, ops)``: :class:`~tilescale_examples.testing.emulated.EmulatedPeers` of ``n``
    ranks, each region sized by ``cls.heap_bytes(*args, world_size=n, device=device,
    **kwargs)``, and ``cls(rank, *args, **kwargs)`` on each of them, in rank order (``args``:
    the constructor's positional arguments after the allocator)."""
    from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers

    region = cls.heap_bytes(*args, world_size=n, device=device, **kwargs) + ALIGNMENT
    peers = EmulatedPeers(n, region, device)
    return peers, [cls(peers.rank(r), *args, **kwargs) for r in range(n)]


def time_ranks(ops, launch, iters: int, device, preset=None) -> float:
    """Milliseconds of GPU time per call of ``launch(op)``, the mean over the emulated ranks:
    for each rank, flags preset (``preset(ops)``, default
    :func:`~tilescale_examples.benchmarks.emulated.preset_flags`) and its table bound,
    ``iters`` calls behind a stream hold."""
    from tilescale_examples.benchmarks.emulated import preset_flags

    preset = preset or preset_flags
    per_rank = []
    for op in ops:
        preset(ops)
        op.bind_table()
        per_rank.append(_timing.held_ms_per_launch(lambda: launch(op), iters, device))
    return statistics.fmean(per_rank)


def measure(cls, n: int, args: tuple, device, launch, iters: int, check=None, preset=None, **kwargs) -> tuple:
    """``(ms per call, failures)``: ``cls`` built on ``n`` emulated peers (:func:`build`),
    ``check(ops)`` (failure messages; none when ``check`` is None), :func:`time_ranks` of
    ``launch`` (flags preset by ``preset``), then every op and the peers closed, also on error."""
    peers, ops = build(cls, n, args, device, **kwargs)
    try:
        failures = [] if check is None else check(ops)
        return time_ranks(ops, launch, iters, device, preset), failures
    finally:
        for op in ops:
            op.close()
        peers.close()
