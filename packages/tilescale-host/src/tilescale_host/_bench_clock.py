"""The clocks behind :mod:`tilescale_host.bench`, and the waits and rank collectives around them.

* :func:`make_wait`: a function that waits until the GPU is idle (a stream, or the device),
  optionally with a timeout that turns a lost signal into a ``TimeoutError``.
* :func:`gpu_calls`: CUDA events around back-to-back calls; :func:`held_calls` the same
  behind a spin kernel that holds the stream, so that the host's launch cost is hidden.
* :func:`host_calls`: ``time.perf_counter`` around back-to-back calls.
* :func:`resolve_group`, :func:`barrier`, :func:`gather`, :func:`all_ranks`: the process group.

Every time is in milliseconds.  torch is imported on use.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

#: Attempts of a held timing: each one after the first doubles a hold that ran out.
HOLD_TRIES = 4
#: Shortest hold, and longest first hold, that ``hold=True`` sizes (milliseconds).
MIN_HOLD_MS, MAX_FIRST_HOLD_MS = 1.0, 1000.0
#: The value of ``group`` that times this rank alone.
LOCAL = "local"

_CYCLES_PER_MS: dict[str, float] = {}


def _cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (without initialising it, or importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def current_stream(stream):
    """``stream``, or the current CUDA stream when it is None."""
    import torch

    return stream if stream is not None else torch.cuda.current_stream()


def on(stream):
    """A context that makes ``stream`` current (nothing when it is None)."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def make_wait(stream, timeout: float | None) -> Callable[[], None]:
    """A function that waits for the GPU: until ``stream`` is idle, polled, for at most
    ``timeout`` seconds (TimeoutError after; :func:`tilescale_host.signals.synchronize_streams`),
    or with ``timeout`` None, ``torch.cuda.synchronize`` of its device (``stream`` None: the
    current stream's).  Without a ``stream`` it does nothing while CUDA is not initialised:
    no GPU work can be pending then, and a CPU-only process never needs CUDA."""

    def wait() -> None:
        if stream is None and not _cuda_in_use():
            return
        import torch

        target = current_stream(stream)
        if timeout is None:
            torch.cuda.synchronize(target.device)
            return
        from .signals import synchronize_streams

        synchronize_streams([target], timeout=timeout)

    return wait


def host_calls(fn: Callable[[], Any], rep: int, wait: Callable[[], None]) -> tuple[Any, float]:
    """``(fn's last output, ms per call)``: host wall time of ``rep`` back-to-back calls, from
    an idle GPU (``wait()`` first) to the end of their GPU work (``wait()`` inside the interval)."""
    wait()
    output = None
    start = time.perf_counter()
    for _ in range(rep):
        output = fn()
    wait()
    return output, (time.perf_counter() - start) * 1e3 / rep


def enqueue_calls(fn: Callable[[], Any], rep: int, wait: Callable[[], None]) -> tuple[Any, float]:
    """``(fn's last output, ms per call)``: the mean host wall time of ``rep`` calls, each made
    from an idle GPU (``wait()`` before it, outside the interval) and timed until it returns,
    its GPU work not waited for: the host's cost of making the call, whatever the GPU's."""
    output, total = None, 0.0
    for _ in range(rep):
        wait()
        start = time.perf_counter()
        output = fn()
        total += time.perf_counter() - start
    wait()
    return output, total * 1e3 / rep


def host_ms_of_one_call(fn: Callable[[], Any], wait: Callable[[], None]) -> float:
    """Host milliseconds to make one call of ``fn`` from an idle GPU (its enqueue cost)."""
    wait()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def hold_for(host_ms: float, rep: int) -> float:
    """Hold (ms) long enough to enqueue ``rep`` calls of ``host_ms`` each and two events: four
    times their host cost, at least :data:`MIN_HOLD_MS`, at most :data:`MAX_FIRST_HOLD_MS`
    (a hold that runs out is doubled and the timing repeated)."""
    return min(MAX_FIRST_HOLD_MS, max(MIN_HOLD_MS, 4 * host_ms * (rep + 2)))


def gpu_calls(fn: Callable[[], Any], rep: int, stream, wait: Callable[[], None]) -> tuple[Any, float]:
    """``(fn's last output, ms per call)``: one CUDA event pair on ``stream`` around ``rep``
    back-to-back calls made with ``stream`` current."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    output = None
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(rep):
            output = fn()
        end.record(stream)
    wait()
    return output, start.elapsed_time(end) / rep


def sleep_cycles_per_ms(device=None) -> float:
    """``torch.cuda._sleep`` cycles per millisecond on ``device`` (default: the current
    device), measured with CUDA events once per process and device."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    key = str(device)
    if key not in _CYCLES_PER_MS:
        cycles = 2_000_000
        with torch.cuda.device(device):
            torch.cuda._sleep(cycles)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
        _CYCLES_PER_MS[key] = cycles / max(start.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[key]


def held_calls(fn: Callable[[], Any], rep: int, stream, hold_ms: float,
               wait: Callable[[], None]) -> tuple[Any, float, bool]:
    """``(fn's last output, ms per call, held)``: from an idle ``stream``, a spin kernel of
    ``hold_ms`` milliseconds, then :func:`gpu_calls`' event pair and calls behind it, all
    enqueued while the spin runs; ``held`` is False when the start event had already
    completed once the end event was enqueued (the hold ran out: the time may include host
    gaps)."""
    import torch

    wait()
    cycles = max(1, int(hold_ms * sleep_cycles_per_ms(stream.device)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    output = None
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        start.record(stream)
        for _ in range(rep):
            output = fn()
        end.record(stream)
    held = not start.query()
    wait()
    return output, start.elapsed_time(end) / rep, held


def resolve_group(group):
    """The process group to synchronise and aggregate over, or None: ``group`` is
    :data:`LOCAL`, or ``torch.distributed`` is not initialised.  None means the WORLD group."""
    if isinstance(group, str):
        if group != LOCAL:
            raise ValueError(f"group must be a process group, None or {LOCAL!r}, got {group!r}")
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return group if group is not None else dist.group.WORLD


def barrier(group, wait: Callable[[], None]) -> None:
    """Wait for the GPU, then for every rank of ``group`` (None: this rank alone)."""
    wait()
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def gather(local: list[float], group, device=None) -> list[list[float]]:
    """Every rank's ``local`` list, in rank order (all_gather of float64: CUDA tensors on
    ``device``, default the current one, over NCCL; CPU tensors otherwise).  Collective: every
    rank passes a list of the same length.  ``[local]`` without a group or with one rank."""
    import torch
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return [list(local)]
    where = (device if device is not None else "cuda") if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor(local, dtype=torch.float64, device=where)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.cpu().tolist() for p in parts]


def all_ranks(flag: bool, group, device=None) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (collective; this rank's alone without one)."""
    if group is None:
        return flag
    return all(v[0] == 1.0 for v in gather([1.0 if flag else 0.0], group, device))


def timed_gpu(fn: Callable[[], Any] | None, rep: int, stream, hold_ms: float | None,
              wait: Callable[[], None], group, device=None) -> tuple[Any, float]:
    """``(last output, ms per call)`` on the GPU clock: :func:`gpu_calls`, or with ``hold_ms``
    :func:`held_calls`, repeated with a doubled hold while the hold ran out on some rank of
    ``group`` (every rank repeats together, so a collective ``fn`` stays matched), at most
    :data:`HOLD_TRIES` times, the last attempt counting whatever happened (with a
    ``RuntimeWarning`` when its hold ran out too).  ``fn`` None: this rank times nothing (NaN)
    but joins the group's agreements."""
    if hold_ms is None:
        return (None, math.nan) if fn is None else gpu_calls(fn, rep, stream, wait)
    for attempt in range(HOLD_TRIES):
        output, ms, held = (None, math.nan, True) if fn is None else held_calls(fn, rep, stream, hold_ms, wait)
        if attempt == HOLD_TRIES - 1:
            if not held:
                import warnings

                warnings.warn(f"the stream hold ran out {HOLD_TRIES} times (last {hold_ms:g} ms) before the timed "
                              "calls were enqueued: the time includes host gaps (does fn wait for the GPU?)",
                              RuntimeWarning, stacklevel=4)
            return output, ms
        if all_ranks(held, group, device):
            return output, ms
        hold_ms *= 2
    raise AssertionError("unreachable")
