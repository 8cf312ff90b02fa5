"""GPU time per launch of back-to-back launches, without the host's launch cost.

An event pair around one launch measures the host too: the start event completes at once on
an idle stream, and the kernel starts only when the host has finished enqueueing it (tens of
microseconds of Python and driver work for a small kernel). :func:`gpu_ms_per_launch` instead
*holds* the stream with a spinning kernel (``torch.cuda._sleep``) long enough for the host to
enqueue a start event, ``launches`` back-to-back launches and an end event behind it; the GPU
then runs the launches one after the other with no idle gap, and the events' difference
divided by ``launches`` is the GPU time per launch (the launches' own start-up on the GPU
included, the host's not). If the hold ran out before the end event was enqueued (the start
event already completed then), the measurement is repeated with a hold twice as long.

Repeated launches on the same buffers find them in L2 when they fit (H200: 50 MB): a
baseline measured with this function on buffers of the same size sees the same effect.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["gpu_ms_per_launch", "sleep_cycles_per_ms"]

_CYCLES_PER_MS: dict = {}


def sleep_cycles_per_ms(device) -> float:
    """``torch.cuda._sleep`` cycles per millisecond on ``device`` (measured once per process)."""
    import torch

    key = str(device)
    if key not in _CYCLES_PER_MS:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # warm-up
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        _CYCLES_PER_MS[key] = cycles / max(s.elapsed_time(e), 1e-3)
    return _CYCLES_PER_MS[key]


def gpu_ms_per_launch(launch: Callable[[], object], launches: int, device, tries: int = 4) -> float:
    """Milliseconds of GPU time per call of ``launch`` (which enqueues work on the current
    stream of ``device``), from ``launches`` back-to-back calls behind a stream hold (see the
    module docstring). Call ``launch`` once before to warm it up (compile, caches)."""
    import torch

    if launches < 1:
        raise ValueError(f"launches must be >= 1, got {launches}")
    # host cost of one launch, to size the hold (4x the measured enqueue time, at least 1 ms)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    launch()
    host_ms = (time.perf_counter() - t0) * 1e3
    hold_ms = max(1.0, 4 * host_ms * (launches + 2))
    per_ms = sleep_cycles_per_ms(device)
    for attempt in range(tries):
        torch.cuda.synchronize(device)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(hold_ms * per_ms))
        s.record()
        for _ in range(launches):
            launch()
        e.record()
        held = not s.query()  # the start event still waits behind the hold: no idle gap
        e.synchronize()
        if held or attempt == tries - 1:
            return s.elapsed_time(e) / launches
        hold_ms *= 2
    raise AssertionError("unreachable")
