"""Running the candidates: compile, check against a reference, time; on the root alone
(``policy="root"``) or on every rank in lockstep (``policy="slowest"``).

A candidate goes through three stages, each of which can fail it without stopping the tuning:
``"compile"`` (``build(config)`` raises or returns no callable), ``"check"`` (its output
differs from the reference, or the user's ``check`` says so), ``"time"`` (the timer raises or
returns no positive finite number of milliseconds). A failed candidate is reported as a
:class:`Skipped` and never timed.

In lockstep every rank enters one exchange after each stage of each candidate (the exchange
is also what starts the ranks together before a collective kernel runs); a candidate that
failed on any rank is skipped on all, so a multi-rank kernel is never launched on some ranks
and not on others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .protocol import Comm

__all__ = ["STAGES", "Outcome", "Skipped", "cuda_event_timer", "default_timer", "make_verifier", "run_lockstep",
           "run_root", "slowest_outcome"]

#: The stages a candidate can fail at, in order.
STAGES = ("compile", "check", "time")
#: Characters of an error message kept in a report.
_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Skipped:
    """A candidate that did not survive.

    Attributes:
        config: the candidate.
        stage: ``"compile"``, ``"check"`` or ``"time"``.
        error: what went wrong (``"ExceptionType: message"``, at most 2000 characters),
            prefixed with ``"rank r: "`` when another rank than the root failed it.
    """

    config: dict
    stage: str
    error: str

    def to_json(self) -> dict:
        """The cache file's form: ``{"config", "stage", "error"}``."""
        return {"config": self.config, "stage": self.stage, "error": self.error}


@dataclass
class Outcome:
    """What a tuning run measured: ``timings`` as ``(candidate index, milliseconds)`` of the
    candidates that passed every stage (under ``"slowest"`` the slowest rank's time), and
    ``skipped`` the others, both in candidate order."""

    timings: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + " [...]"


def make_verifier(reference: Any, check: Callable[[Any], bool] | None, rtol: float | None,
                  atol: float | None) -> Callable[[Any], None]:
    """``verify(output)``, raising ``AssertionError`` when ``output`` is wrong.

    With ``check``: ``check(output)`` must return True. Otherwise the output must match
    ``reference`` (a tensor, a sequence of them, or a zero-argument callable computing them,
    called once on first use) under ``torch.testing.assert_close(output, reference, rtol=rtol,
    atol=atol)`` (both None: torch's defaults for the dtype).
    """
    expected: list = []

    def by_reference(output: Any) -> None:
        import torch

        if output is None:
            raise AssertionError("the launch returned None: build(config) must return a callable that runs the "
                                 "kernel and returns its output")
        if not expected:
            expected.append(reference() if callable(reference) else reference)
        torch.testing.assert_close(output, expected[0], rtol=rtol, atol=atol)

    def by_check(output: Any) -> None:
        verdict = check(output)
        if verdict is not True:
            raise AssertionError(f"check(output) returned {verdict!r}, not True")

    return by_reference if check is None else by_check


def _time(timer: Callable[[Callable[[], Any]], float], launch: Callable[[], Any]) -> float:
    ms = timer(launch)
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"timer returned {ms!r}: it must return the milliseconds of one call, a positive "
                         "finite number")
    return float(ms)


def _stage(stage: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, description)`` when ``fn`` raises an Exception."""
    try:
        return True, fn()
    except Exception as exc:  # the candidate is skipped and reported, the tuning goes on
        return False, _describe(exc)


def _compile(build: Callable[[dict], Any], config: dict) -> Callable[[], Any]:
    launch = build(dict(config))
    if not callable(launch):
        raise TypeError(f"build(config) must return a callable that runs the kernel, got {type(launch).__name__}")
    return launch


def run_root(candidates: Sequence[dict], build: Callable[[dict], Any], verify: Callable[[Any], None],
             timer: Callable[[Callable[[], Any]], float]) -> Outcome:
    """Every candidate through compile, check and time on this process alone."""
    out = Outcome()
    for index, config in enumerate(candidates):
        ok, launch = _stage("compile", lambda: _compile(build, config))
        stage = "compile"
        if ok:
            stage = "check"
            ok, value = _stage(stage, lambda: verify(launch()))
        if ok:
            stage = "time"
            ok, value = _stage(stage, lambda: _time(timer, launch))
        if ok:
            out.timings.append((index, value))
        else:
            out.skipped.append(Skipped(dict(config), stage, launch if stage == "compile" else value))
    return out


def _agree(comm: Comm, ok: bool, error: Any) -> str | None:
    """One exchange: every rank's stage result; the first failure, ``"rank r: error"``, or None."""
    states = comm.gather(None if ok else str(error))
    for rank, state in enumerate(states):
        if state is not None:
            return state if comm.size == 1 else f"rank {rank}: {state}"
    return None


def run_lockstep(comm: Comm, candidates: Sequence[dict], build: Callable[[dict], Any],
                 verify: Callable[[Any], None], timer: Callable[[Callable[[], Any]], float]) -> tuple[list, list]:
    """Every candidate through compile, check and time on every rank of ``comm`` together.

    Returns ``(skipped, every)`` on every rank: the candidates skipped at compile or check (on
    some rank), and each rank's ``[(index, ok, ms or error), ...]`` of the candidates it
    timed (the same indices on every rank); :func:`slowest_outcome` makes them an Outcome.
    """
    skipped: list[Skipped] = []
    local: list[tuple[int, bool, Any]] = []
    for index, config in enumerate(candidates):
        ok, launch = _stage("compile", lambda: _compile(build, config))
        failure = _agree(comm, ok, launch)
        if failure is None:
            ok, value = _stage("check", lambda: verify(launch()))
            failure, stage = _agree(comm, ok, value), "check"
        else:
            stage = "compile"
        if failure is not None:
            skipped.append(Skipped(dict(config), stage, failure))
            continue
        ok, value = _stage("time", lambda: _time(timer, launch))
        local.append((index, ok, value))
    return skipped, comm.gather(local)


def slowest_outcome(candidates: Sequence[dict], skipped: list, every: list) -> Outcome:
    """The :class:`Outcome` of a lockstep run: a candidate's time is the slowest rank's; one
    whose timing failed on any rank is skipped at ``"time"``."""
    out = Outcome(skipped=list(skipped))
    for column in zip(*every):  # one timed candidate, every rank's result
        index = column[0][0]
        errors = [f"rank {r}: {v}" if len(every) > 1 else str(v) for r, (_, ok, v) in enumerate(column) if not ok]
        if errors:
            out.skipped.append(Skipped(dict(candidates[index]), "time", "; ".join(errors)))
        else:
            out.timings.append((index, max(v for _, _, v in column)))
    out.skipped.sort(key=lambda s: _position(candidates, s.config))
    return out


def _position(candidates: Sequence[dict], config: dict) -> int:
    return next(i for i, c in enumerate(candidates) if c == config)


def cuda_event_timer(fn: Callable[[], Any], warmup: int = 5, rep: int = 20) -> float:
    """Median milliseconds of one call of ``fn`` over ``rep`` calls after ``warmup``, each
    between its own pair of CUDA events on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in pairs)
    return times[len(times) // 2]


def default_timer(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` on this rank alone: tilescale-host's
    ``do_bench(fn, warmup=5, rep=20, group="local")`` (median, cold L2) when tilescale-host is
    installed, else :func:`cuda_event_timer` (tilescale-lang does not require tilescale-host)."""
    try:
        from tilescale_host.bench import do_bench
    except ImportError:
        return cuda_event_timer(fn)
    return float(do_bench(fn, warmup=5, rep=20, group="local"))
