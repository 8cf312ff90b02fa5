"""Sustained runs with the GPU's SM clock and board power sampled alongside (NVML): what a
benchmark prints when it asks whether two kernels of like speed per cycle differ only by the
clock the power budget leaves them.

:func:`sustained` runs one call back to back for about ``seconds`` while a thread samples
the SM clock (MHz) and the board power (W) every ``period`` seconds; the first quarter of the
samples (the clock settling) is dropped and the median of the rest reported.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Sustained", "sustained", "steady_median", "nvml_sampler"]


@dataclass(frozen=True)
class Sustained:
    """One sustained run: ``ms`` GPU milliseconds per call (the whole run's GPU time over its
    calls), ``calls``, and the medians of the steady samples: ``sm_mhz`` (SM clock,
    MHz) and ``watts`` (board power, W); NaN where no sample was taken."""

    ms: float
    calls: int
    sm_mhz: float
    watts: float


def steady_median(samples: list) -> tuple:
    """``(median SM MHz, median W)`` of ``samples`` (``(mhz, watts)`` pairs in time order)
    without their first quarter (the clock settling after the run starts); NaNs if none."""
    steady = samples[len(samples) // 4:]
    if not steady:
        return float("nan"), float("nan")
    return statistics.median(s[0] for s in steady), statistics.median(s[1] for s in steady)


def nvml_sampler(device_index: int) -> Callable[[], tuple]:
    """A function returning ``(SM clock MHz, board power W)`` of CUDA device
    ``device_index`` now (NVML: the clock through
    :func:`tilescale_host.utils.get_current_gpu_clock_rate_in_khz`, the power through
    :func:`tilescale_host.topology.nvml_handle`'s handle)."""
    import pynvml
    from tilescale_host.topology import nvml_handle
    from tilescale_host.utils import get_current_gpu_clock_rate_in_khz

    handle = nvml_handle(device_index)  # initialises NVML

    def sample() -> tuple:
        return (get_current_gpu_clock_rate_in_khz(device_index) / 1000.0,
                pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)

    return sample


def sustained(fn: Callable[[], object], seconds: float = 1.0, sample: Optional[Callable[[], tuple]] = None,
              period: float = 0.02) -> Sustained:
    """Run ``fn()`` back to back for about ``seconds`` (the call count from one timed call,
    at least 3; timed by :func:`tilescale_host.bench.perf_fn` on this rank alone) on the
    current stream, sampling ``sample()`` (default :func:`nvml_sampler` of the current device)
    every ``period`` seconds meanwhile; returns the :class:`Sustained`."""
    import torch
    from tilescale_host.bench import perf_fn

    if not (seconds > 0 and period > 0):
        raise ValueError(f"seconds and period must be > 0, got {seconds}, {period}")
    sample = sample or nvml_sampler(torch.cuda.current_device())
    _, one = perf_fn(fn, warmup=1, rep=1, group="local", aggregate="none")
    calls = max(3, int(seconds * 1e3 / max(one, 1e-3)))
    samples: list = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            samples.append(sample())
            time.sleep(period)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, ms = perf_fn(fn, warmup=0, rep=calls, group="local", aggregate="none")
    finally:
        stop.set()
        watcher.join()
    mhz, watts = steady_median(samples)
    return Sustained(ms, calls, mhz, watts)
