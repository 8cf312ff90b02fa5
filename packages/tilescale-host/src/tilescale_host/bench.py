"""Benchmark timing: ``do_bench``, ``perf_fn`` and ``perf_rounds``; every time in milliseconds per call.

``do_bench`` times each repetition of ``fn`` with its own pair of CUDA events after a
warm-up, optionally flushing the L2 cache before each repetition by writing a buffer larger
than L2, and reports the median (or another statistic).  ``perf_fn`` is the
Triton-distributed style helper: it times a run of ``rep`` back-to-back calls with one event
pair and also returns ``fn``'s last output.  ``perf_rounds`` compares several functions under
the same conditions: rounds in which each one is timed in turn (A, B, A, B, ...), so that a
drift of the clocks or the temperature during the measurement reaches them all alike, and
per function the median (or another statistic) of its rounds.

Ranks: when a ``torch.distributed`` process group is initialised (or ``group`` is given), the
ranks start each phase together (barrier) and every rank's times are gathered with
``all_gather``; each repetition's (round's) time is then the slowest rank's (``"max"``, the
default: a collective's time) or the mean over ranks, so every rank returns the same number.
``aggregate="none"`` keeps this rank's times (the barriers still happen); ``group="local"``
(:data:`LOCAL`) times this rank alone, with no barrier and no collective at all.
:func:`gather_rank_times` and :func:`slowest_rank` expose the gathering.

Clocks (``clock=``):

* ``"gpu"`` (default): CUDA events on ``stream`` (default the current stream): GPU time.
  With ``hold`` (``perf_fn``, ``perf_rounds``), a spin kernel first holds the stream while the
  host enqueues the start event, the calls and the end event, so the GPU runs the calls with
  no idle gap and the host's launch cost is hidden: the time is the GPU's alone.  ``hold=True``
  sizes the hold from the host time of the last warm-up call (four times the enqueue cost of
  the run, 1 ms .. 1 s); a number is the hold in milliseconds.  A hold that ran out before
  the end event was enqueued is doubled and the timing repeated (on every rank together),
  up to four attempts.
* ``"host"``: ``time.perf_counter`` from an idle GPU to the end of the calls' GPU work (the
  GPU is synchronised before and inside the interval; nothing is waited for while CUDA is not
  initialised, so a CPU-only function is timed as it is).
* ``"enqueue"``: ``time.perf_counter`` around each call alone, made from an idle GPU (the GPU
  synchronised before it, outside the interval), its GPU work not waited for: the host's cost
  of making the call. ``"host"`` times back-to-back calls, which the GPU paces once its work
  per call takes longer than the host's; ``"enqueue"`` stays the host's cost.

``timeout`` (seconds): every wait for the GPU polls ``stream`` (default the current stream)
and raises ``TimeoutError`` after that long (a lost signal fails the run instead of hanging
it); None waits with ``torch.cuda.synchronize`` on the stream's device.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tilescale_core.interface import check_choice, check_non_negative_int, check_positive_int, check_seconds

from . import _bench_clock as _clock
from ._bench_clock import LOCAL, sleep_cycles_per_ms

__all__ = [
    "LOCAL",
    "aggregate_rank_times",
    "do_bench",
    "gather_rank_times",
    "perf_fn",
    "perf_rounds",
    "sleep_cycles_per_ms",
    "slowest_rank",
    "summarize",
]

_AGGREGATES = ("max", "mean", "none")
_RETURN_MODES = ("median", "mean", "min", "max", "all")
_CLOCKS = ("gpu", "host", "enqueue")
#: The clocks that time on the host (``perf_counter``), with their timer of ``rep`` calls.
_HOST_CLOCKS = {"host": _clock.host_calls, "enqueue": _clock.enqueue_calls}
#: Default L2 flush size when the device's L2 size is unknown (bytes).
DEFAULT_FLUSH_BYTES = 256 * 1024 * 1024


# ------------------------------------------------------------------------------ pure logic
def _finite(values) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def aggregate_rank_times(per_rank: Sequence[Sequence[float]], how: str) -> list[float]:
    """Combine ``per_rank[r][i]`` (rank ``r``, repetition ``i``, ms) into one time per repetition.

    ``how`` is ``"max"`` (the slowest rank: the collective's time), ``"mean"``, or
    ``"none"`` (this is then only valid for one rank's list and returns it unchanged).  A
    NaN (a rank that did not run that repetition) is left out; NaN when no rank ran it.
    """
    check_choice("aggregate", how, _AGGREGATES)
    if how == "none" or len(per_rank) == 1:
        return list(per_rank[0])
    out = []
    for column in zip(*per_rank, strict=True):
        ran = _finite(column)
        out.append(math.nan if not ran else max(ran) if how == "max" else sum(ran) / len(ran))
    return out


def summarize(times: Sequence[float], return_mode: str):
    """Reduce repetition times (ms) to the statistic ``return_mode`` (``"all"``: the list).

    NaN times (not run) are left out of a statistic; NaN when every time is NaN.
    """
    check_choice("return_mode", return_mode, _RETURN_MODES)
    if return_mode == "all":
        return list(times)
    ran = _finite(times)
    if not ran:
        return math.nan
    reduce = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max}
    return float(reduce[return_mode](ran))


def _round_order(names: Sequence[Any], rounds: int, alternate: bool) -> list[Any]:
    """The order in which :func:`perf_rounds` times its functions: ``names`` once per round,
    reversed in every second round when ``alternate`` (A B, B A, A B, ...)."""
    order = []
    for r in range(rounds):
        order += list(reversed(names)) if alternate and r % 2 else list(names)
    return order


# ------------------------------------------------------------------------------ arguments
def _check_counts(warmup: int, rep: int) -> tuple[int, int]:
    return check_non_negative_int("warmup", warmup), check_positive_int("rep", rep)


def _check_hold(hold) -> bool | float:
    """``hold`` as False, True or a positive, finite number of milliseconds."""
    if isinstance(hold, bool):
        return hold
    if not isinstance(hold, numbers.Real) or not 0 < float(hold) < math.inf:
        raise ValueError(f"hold must be True, False or a positive, finite number of milliseconds, got {hold!r}")
    return float(hold)


def _check_clock(clock: str, hold, timeout) -> tuple[str, bool | float, float | None]:
    check_choice("clock", clock, _CLOCKS)
    hold = _check_hold(hold)
    if hold and clock != "gpu":
        raise ValueError(f"hold needs clock='gpu' (it hides the host's launch cost from CUDA events), got clock={clock!r}")
    return clock, hold, None if timeout is None else check_seconds("timeout", timeout)


def _check_callable(name: str, value, optional: bool = False) -> None:
    if not callable(value) and not (optional and value is None):
        raise TypeError(f"{name} must be callable{' or None' if optional else ''}, got {type(value).__name__} {value!r}")


def _warm_up(fn: Callable[[], Any], warmup: int, rep: int, hold: bool | float, wait) -> float | None:
    """Make ``warmup`` untimed calls; return the hold in ms for a run of ``rep`` calls (None:
    no hold).  ``hold=True`` times the last warm-up call on the host to size it (one extra
    call when ``warmup`` is 0)."""
    if hold is True:
        for _ in range(warmup - 1):
            fn()
        return _clock.hold_for(_clock.host_ms_of_one_call(fn, wait), rep)
    for _ in range(warmup):
        fn()
    return float(hold) if hold else None


def _device(clock: str, stream):
    """Where the NCCL gathers of the GPU clock put their tensors (None: the current device)."""
    return _clock.current_stream(stream).device if clock == "gpu" and stream is not None else None


# ------------------------------------------------------------------------------ ranks
def gather_rank_times(local: Sequence[float], group=None) -> list[list[float]]:
    """Every rank's ``local`` times (ms, or any float), as a list in rank order.

    Collective over ``group`` (default the WORLD group when ``torch.distributed`` is
    initialised): every rank calls it with as many values.  Without a process group, or with
    ``group="local"``, it returns ``[list(local)]``.
    """
    return _clock.gather([float(t) for t in local], _clock.resolve_group(group))


def slowest_rank(value: float, group=None) -> float:
    """The largest ``value`` over the ranks of ``group`` (a collective's time is its slowest
    rank's); NaN values (ranks that did not run) are left out.  Collective, as
    :func:`gather_rank_times`; ``value`` itself without a process group."""
    return aggregate_rank_times(gather_rank_times([value], group), "max")[0]


def _combine(local: list[float], group, aggregate: str, device) -> list[float]:
    per_rank = _clock.gather(local, group, device) if aggregate != "none" else [local]
    return aggregate_rank_times(per_rank, aggregate)


# ------------------------------------------------------------------------------ timers
def _flush_buffer(flush_l2: bool, flush_bytes: int | None):
    """An int8 CUDA buffer larger than L2 (twice its size), or None when not flushing."""
    if not flush_l2:
        return None
    import torch

    if flush_bytes is None:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        flush_bytes = 2 * l2 if l2 else DEFAULT_FLUSH_BYTES
    return torch.empty(check_positive_int("l2_flush_bytes", flush_bytes), dtype=torch.int8, device="cuda")


def do_bench(
    fn: Callable[[], Any],
    warmup: int = 10,
    rep: int = 50,
    *,
    flush_l2: bool | None = None,
    l2_flush_bytes: int | None = None,
    group=None,
    aggregate: str = "max",
    return_mode: str = "median",
    before: Callable[[], Any] | None = None,
    clock: str = "gpu",
    stream=None,
    timeout: float | None = None,
):
    """Time each of ``rep`` calls of ``fn()`` on its own; return milliseconds per call.

    Args:
        fn: the work to time; it enqueues CUDA work on the current stream (``stream`` is made
            current around it).
        warmup: untimed calls before timing (>= 0).
        rep: timed calls (>= 1), each between its own pair of CUDA events (GPU clock; all
            enqueued, then one wait) or its own ``perf_counter`` interval (host clock).
        flush_l2: before each timed call, overwrite a buffer of ``l2_flush_bytes`` (default
            twice the device's L2 size) so that ``fn`` starts with a cold L2 cache, outside
            the timed interval.  Default: True on the GPU clock, False on the host clock (where
            True is an error).
        l2_flush_bytes: size of the flush buffer in bytes.
        group: process group to synchronise and aggregate over; default the WORLD group when
            ``torch.distributed`` is initialised, none otherwise; ``"local"``: this rank alone.
        aggregate: ``"max"`` or ``"mean"`` over ranks of each repetition's time, or ``"none"``
            to keep this rank's times (collectives are still entered by every rank).
        return_mode: ``"median"``, ``"mean"``, ``"min"``, ``"max"`` or ``"all"`` (the list of
            ``rep`` times).
        before: called before every call of ``fn`` (warm-up included), outside the timed
            interval: a reset of state ``fn`` consumes, or ``torch.cuda.synchronize`` to start
            every repetition on an idle GPU.
        clock: ``"gpu"`` (CUDA events), ``"host"`` or ``"enqueue"`` (see the module docstring).
        stream: the stream the events are recorded on and waited for (default: current).
        timeout: seconds a wait for the GPU may take (None: no limit; module docstring).

    Returns:
        A float in milliseconds, or a list of ``rep`` floats for ``return_mode="all"``.
    """
    warmup, rep = _check_counts(warmup, rep)
    check_choice("aggregate", aggregate, _AGGREGATES)
    check_choice("return_mode", return_mode, _RETURN_MODES)
    clock, _, timeout = _check_clock(clock, False, timeout)
    _check_callable("before", before, optional=True)
    flush_l2 = (clock == "gpu") if flush_l2 is None else flush_l2
    if flush_l2 and clock != "gpu":
        raise ValueError("flush_l2 needs clock='gpu' (the flush is timed apart on the GPU)")
    group = _clock.resolve_group(group)
    wait = _clock.make_wait(stream, timeout)
    flush = _flush_buffer(flush_l2, l2_flush_bytes)
    prepare = before or (lambda: None)
    with _clock.on(stream):
        _clock.barrier(group, wait)
        for _ in range(warmup):
            prepare()
            fn()
        _clock.barrier(group, wait)
        if clock in _HOST_CLOCKS:
            local = []
            for _ in range(rep):
                prepare()
                local.append(_HOST_CLOCKS[clock](fn, 1, wait)[1])
        else:
            local = _gpu_each(fn, rep, prepare, flush, _clock.current_stream(stream), wait)
    return summarize(_combine(local, group, aggregate, _device(clock, stream)), return_mode)


def _gpu_each(fn, rep: int, prepare, flush, stream, wait) -> list[float]:
    """Milliseconds of each of ``rep`` calls, each between its own event pair on ``stream``."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    with torch.cuda.stream(stream):
        for start, end in events:
            prepare()
            if flush is not None:
                flush.zero_()
            start.record(stream)
            fn()
            end.record(stream)
    wait()
    return [start.elapsed_time(end) for start, end in events]


def perf_fn(
    fn: Callable[[], Any],
    warmup: int = 10,
    rep: int = 50,
    *,
    group=None,
    aggregate: str = "max",
    clock: str = "gpu",
    hold: bool | float = False,
    stream=None,
    timeout: float | None = None,
):
    """Run ``fn`` ``warmup`` times, then time ``rep`` back-to-back calls as one run.

    Args:
        fn: the work to time (made with ``stream`` current).
        warmup: untimed calls first (>= 0).
        rep: timed calls (>= 1), between one pair of CUDA events (GPU clock) or one
            ``perf_counter`` interval (host clock).
        group: as :func:`do_bench` (``"local"``: this rank alone).
        aggregate: ``"max"`` (slowest rank), ``"mean"`` or ``"none"`` (this rank's time).
        clock: ``"gpu"``, ``"host"`` or ``"enqueue"`` (module docstring).
        hold: GPU clock only: hold the stream behind a spin kernel while the run is enqueued,
            so the host's launch cost is hidden (True: sized from the last warm-up call; a
            number: the hold in milliseconds).  See the module docstring.  ``fn`` must then
            not wait for the GPU (``synchronize``, ``.item()``): the hold would run out.
        stream: the stream timed and waited for (default: the current stream).
        timeout: seconds a wait for the GPU may take (None: no limit).

    Returns:
        ``(output, ms)``: ``fn``'s last return value and the mean time per call in
        milliseconds (the max or mean over ranks when a process group is initialised, see
        :func:`do_bench`; ``aggregate="none"`` keeps this rank's time).
    """
    warmup, rep = _check_counts(warmup, rep)
    check_choice("aggregate", aggregate, _AGGREGATES)
    clock, hold, timeout = _check_clock(clock, hold, timeout)
    group = _clock.resolve_group(group)
    wait = _clock.make_wait(stream, timeout)
    device = _device(clock, stream)
    with _clock.on(stream):
        _clock.barrier(group, wait)
        hold_ms = _warm_up(fn, warmup, rep, hold, wait)
        _clock.barrier(group, wait)
        if clock in _HOST_CLOCKS:
            output, ms = _HOST_CLOCKS[clock](fn, rep, wait)
        else:
            output, ms = _clock.timed_gpu(fn, rep, _clock.current_stream(stream), hold_ms, wait, group, device)
    return output, _combine([ms], group, aggregate, device)[0]


def perf_rounds(
    fns: Mapping[Any, Callable[[], Any] | None],
    rounds: int = 5,
    *,
    warmup: int = 1,
    rep: int = 20,
    clock: str = "gpu",
    hold: bool | float = False,
    stream=None,
    timeout: float | None = None,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    group=None,
    aggregate: str = "max",
    return_mode: str = "median",
    alternate: bool = False,
) -> dict:
    """Compare functions under the same conditions: ``rounds`` rounds that time each in turn.

    First every function is warmed up (``warmup`` calls each, in turn); then each round times
    every function once, in the order of ``fns`` (reversed in every second round with
    ``alternate``), each timing preceded by a barrier of the ranks, and each timing a run of
    ``rep`` back-to-back calls (as :func:`perf_fn`) or ``timer(fn)``.

    Args:
        fns: name -> function.  A function may be None on some ranks: this rank does not run
            it (its times are NaN) but joins its barriers and agreements; every rank passes
            the same names in the same order.
        rounds: rounds (>= 1).
        warmup: untimed calls of each function before the first round (>= 0).
        rep: calls per timing (>= 1).
        clock, hold, stream, timeout: as :func:`perf_fn` (``hold=True`` is sized once per
            function, from its last warm-up call).
        timer: ``timer(fn) -> ms per call`` on this rank, replacing the built-in clock (then
            ``clock``, ``hold`` and ``stream`` must keep their defaults and ``rep`` is unused),
            e.g. ``lambda fn: do_bench(fn, 1, 20, flush_l2=False, group="local")``.
        group: as :func:`do_bench` (``"local"``: no barriers, this rank's times).
        aggregate: per round, ``"max"`` (slowest rank) or ``"mean"`` over the ranks that ran
            the function, or ``"none"`` (this rank's).
        return_mode: the statistic over the rounds (``"median"``, ``"mean"``, ``"min"``,
            ``"max"``, or ``"all"``: every round's time).
        alternate: reverse the order in every second round (A B, B A, ...), so no function
            always follows the same one.

    Returns:
        ``{name: milliseconds per call}`` in the order of ``fns`` (lists with ``"all"``); NaN
        for a function that no rank (``aggregate="none"``: this rank) ran.
    """
    if not isinstance(fns, Mapping) or not fns:
        raise ValueError(f"fns must be a non-empty mapping of name -> function, got {fns!r}")
    for name, fn in fns.items():
        _check_callable(f"fns[{name!r}]", fn, optional=True)
    names = list(fns)
    rounds = check_positive_int("rounds", rounds)
    warmup, rep = _check_counts(warmup, rep)
    check_choice("aggregate", aggregate, _AGGREGATES)
    check_choice("return_mode", return_mode, _RETURN_MODES)
    if timer is not None:
        _check_callable("timer", timer)
        if hold is not False or stream is not None or clock != "gpu":
            raise ValueError("timer replaces the built-in clock: leave clock, hold and stream at their defaults")
    clock, hold, timeout = _check_clock(clock, hold, timeout)
    group = _clock.resolve_group(group)
    wait = _clock.make_wait(stream, timeout)
    device = _device(clock, stream)
    if timer is None and clock in _HOST_CLOCKS:
        timer = lambda fn: _HOST_CLOCKS[clock](fn, rep, wait)[1]  # noqa: E731
    times: dict = {name: [] for name in names}
    with _clock.on(stream):
        _clock.barrier(group, wait)
        holds = {name: _warm_up(fn, warmup, rep, hold, wait) if fn is not None
                 else (_clock.MIN_HOLD_MS if hold else None) for name, fn in fns.items()}
        for name in _round_order(names, rounds, alternate):
            _clock.barrier(group, wait)
            fn = fns[name]
            if timer is not None:
                times[name].append(math.nan if fn is None else float(timer(fn)))
            else:
                stream_now = _clock.current_stream(stream)
                times[name].append(_clock.timed_gpu(fn, rep, stream_now, holds[name], wait, group, device)[1])
    flat = [t for name in names for t in times[name]]
    ranks = _clock.gather(flat, group, device) if aggregate != "none" else [flat]
    return {name: summarize(aggregate_rank_times([r[i * rounds:(i + 1) * rounds] for r in ranks], aggregate),
                            return_mode)
            for i, name in enumerate(names)}
