"""``tune(...)``: pick one config of a search space, the same on every rank, cached on disk.

Rank consistency, by construction. Every rank returns the config the root (group rank 0)
sent it in the last exchange, never one it chose itself, and every control decision on the
way (agree on the key and mode, cache hit or miss, skip a candidate, error) is taken either
by the root and sent, or by each rank from the same gathered list. So the ranks cannot
diverge: they all return the same config, or all raise the same error. The steps:

1. Agreement: every rank sends its key, mode and policy; the root adds its cache entry (only
   the root reads the cache). Ranks that disagree (other shapes, another GPU model, another
   ``TILESCALE_AUTOTUNE``) all raise :class:`AutotuneError` naming the fields.
2. ``mode="off"``: the space's first candidate, untimed, nothing cached. A cache hit: the
   cached winner, with no compile and no timer call. ``mode="cache_only"`` and a miss: every
   rank raises :class:`AutotuneCacheMiss` naming the key and the file.
3. Tuning. ``policy="root"``: the root compiles, checks and times every candidate while the
   others wait in the next exchange (for rank-local kernels such as a GEMM; the other ranks
   then compile the winner themselves). ``policy="slowest"``: every rank compiles, checks and
   times every candidate in lockstep, and a candidate's time is the slowest rank's (for
   kernels that communicate, whose launch must be collective, and for ranks whose GPUs
   differ in speed); a candidate failing on any rank is skipped on all.
4. The root picks the fastest (ties: the earlier candidate), writes the cache (only the root
   writes; a failed write is a warning, not a divergence) and sends the winner, or the error
   when no candidate survived (:class:`NoValidCandidate`, listing every skip).

Argument errors are raised before the first exchange; pass the same arguments on every rank.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tilescale_core.interface import check_choice

from .cache import TuneCache, current_environment, key_hash, make_key
from .protocol import Comm, guarded
from .space import SearchSpace
from .trials import Outcome, default_timer, make_verifier, run_lockstep, run_root, slowest_outcome

__all__ = ["ENV_VAR", "MODES", "POLICIES", "AutotuneCacheMiss", "AutotuneError", "NoValidCandidate", "TuneResult",
           "resolve_mode", "tune"]

#: The environment variable that sets the mode when ``mode`` is not passed.
ENV_VAR = "TILESCALE_AUTOTUNE"
#: ``"on"``: use the cache, tune on a miss; ``"cache_only"``: use the cache, raise on a miss;
#: ``"off"``: no tuning and no cache, the space's first candidate.
MODES = ("on", "cache_only", "off")
#: ``"root"``: the root times alone; ``"slowest"``: every rank times, the slowest decides.
POLICIES = ("root", "slowest")


class AutotuneError(RuntimeError):
    """The tuning failed on every rank alike (the ranks disagree, or the root failed)."""


class AutotuneCacheMiss(AutotuneError, LookupError):
    """``mode="cache_only"`` found no entry. ``key`` is the key asked for, ``path`` the file."""

    def __init__(self, key: dict, path: Path):
        super().__init__(f"autotune cache_only ({ENV_VAR} or mode=): no entry for key {key} "
                         f"(hash {key_hash(key)}) in {path}; tune once with mode='on' to fill it")
        self.key, self.path = key, path

    def __reduce__(self):
        return type(self), (self.key, self.path)


class NoValidCandidate(AutotuneError):
    """No candidate compiled, passed its check and was timed; ``skipped`` lists why each one fell."""

    def __init__(self, name: str, skipped: list):
        lines = "\n".join(f"  {s.stage}: {s.config}: {s.error.splitlines()[0] if s.error else ''}" for s in skipped)
        super().__init__(f"autotune {name!r}: none of the {len(skipped)} candidates survived:\n{lines}")
        self.name, self.skipped = name, skipped

    def __reduce__(self):
        return type(self), (self.name, self.skipped)


@dataclass(frozen=True)
class TuneResult:
    """The chosen config and how it was found.

    Attributes:
        config: the winner (axis name -> value), the same on every rank.
        source: ``"tuned"`` (measured now), ``"cache"`` (read from the disk cache, nothing
            timed) or ``"off"`` (the space's first candidate, ``mode="off"``).
        time_ms: the winner's time in milliseconds (the slowest rank's under ``"slowest"``);
            None for ``"off"``.
        key: the cache key (see :mod:`tilescale_lang.autotune.cache`); ``key_hash`` its hash.
        path: the cache file of this key.
        timings: ``[(config, ms), ...]`` of every timed candidate, in candidate order.
        skipped: the :class:`~tilescale_lang.autotune.trials.Skipped` candidates.
    """

    config: dict
    source: str
    time_ms: float | None
    key: dict
    key_hash: str
    path: Path
    timings: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def resolve_mode(mode: str | None) -> str:
    """``mode`` if given, else ``$TILESCALE_AUTOTUNE`` (any case, blanks ignored; unset or
    empty: ``"on"``): the one place the environment variable is read. ``ValueError`` naming
    ``mode`` or the variable for anything but :data:`MODES`."""
    if mode is None:
        return check_choice(ENV_VAR, os.environ.get(ENV_VAR, "on").strip().lower() or "on", MODES)
    return check_choice("mode", mode, MODES)


def _check_callables(build: Any, reference: Any, check: Any, timer: Any) -> None:
    if not callable(build):
        raise TypeError(f"build must be a callable config -> launch, got {build!r}")
    if (reference is None) == (check is None):
        raise ValueError("pass exactly one of reference (the expected output) and check (output -> bool): every "
                         "candidate is checked before it is timed")
    if check is not None and not callable(check):
        raise TypeError(f"check must be a callable output -> bool, got {check!r}")
    if timer is not None and not callable(timer):
        raise TypeError(f"timer must be a callable launch -> milliseconds, or None, got {timer!r}")


def _disagreement(hello: list) -> str | None:
    """Which fields the ranks' ``(key, mode, policy)`` differ in, or None."""
    first = hello[0]
    for rank, other in enumerate(hello[1:], 1):
        if other[:3] != first[:3]:
            key0, key = first[0], other[0]
            fields = sorted(f for f in set(key0) | set(key) if key0.get(f) != key.get(f))
            fields += [n for n, i in (("mode", 1), ("policy", 2)) if other[i] != first[i]]
            return (f"rank {rank} differs from rank 0 in {fields}: "
                    + "; ".join(f"{f}: {_field(first, f)!r} vs {_field(other, f)!r}" for f in fields))
    return None


def _field(hello: tuple, name: str) -> Any:
    return {"mode": hello[1], "policy": hello[2]}.get(name, hello[0].get(name))


def _cached(space: SearchSpace, entry: Any) -> dict | None:
    """The cached entry's config if it is a candidate of ``space``; else None with a warning."""
    if entry is None:
        return None
    if entry["config"] not in space:
        warnings.warn(f"autotune cache entry's config {entry['config']} is not a candidate of {space!r}; "
                      "tuning again", RuntimeWarning, stacklevel=3)
        return None
    return entry


def _decide(outcome: Outcome) -> tuple:
    """The root's decision: ``("ok", index, ms, outcome)`` or ``("none", skipped)``."""
    if not outcome.timings:
        return ("none", outcome.skipped)
    index, ms = min(outcome.timings, key=lambda t: (t[1], t[0]))
    return ("ok", index, ms, outcome)


def _store(cache: TuneCache, key: dict, candidates: list, policy: str, decision: tuple) -> None:
    _, index, ms, outcome = decision
    entry = {"config": candidates[index], "time_ms": ms, "policy": policy,
             "timings": [{"config": candidates[i], "time_ms": t} for i, t in outcome.timings],
             "skipped": [s.to_json() for s in outcome.skipped]}
    try:
        cache.store(key, entry)
    except (OSError, TimeoutError, ValueError) as exc:  # the peers already have the winner
        warnings.warn(f"autotune: could not write the cache {cache.path(key['name'])}: {exc}", RuntimeWarning,
                      stacklevel=3)


def tune(space: SearchSpace, build: Callable[[dict], Callable[[], Any]], *, name: str, dtype: Any, shapes: Any,
         reference: Any = None, check: Callable[[Any], bool] | None = None, rtol: float | None = None,
         atol: float | None = None, group: Any = None, policy: str = "root", mode: str | None = None,
         timer: Callable[[Callable[[], Any]], float] | None = None, cache_dir: str | os.PathLike | None = None,
         extra: Mapping[str, Any] | None = None, environment: Mapping[str, Any] | None = None,
         prepare: Callable[[list], None] | None = None) -> TuneResult:
    """Choose the fastest correct candidate of ``space``, the same one on every rank of ``group``.

    A collective over ``group``: every rank calls it with the same arguments. Every rank
    returns the config the root (group rank 0) sent it in the last exchange, never one it
    picked itself, so a rank-dependent choice (which would deadlock a fused multi-rank plan)
    cannot happen; ranks that disagree on the key, mode or policy all raise instead (the
    module docstring has the steps).

    Args:
        space: the candidates (:class:`~tilescale_lang.autotune.space.SearchSpace`).
        build: ``build(config) -> launch``: compiles the candidate and returns a zero-argument
            callable that runs it on the problem's inputs and returns its output.
        name: the tuned kernel's name (the cache file's, and part of the key).
        dtype: the problem's dtype (``torch.dtype`` or its name); part of the key.
        shapes: the problem's sizes (a mapping such as ``{"m": 4096, "n": 3584, "k": 8192}``,
            or a sequence of shapes); part of the key.
        reference: the expected output (tensor, sequence of tensors, or a zero-argument
            callable computing them once), compared with ``torch.testing.assert_close`` under
            ``rtol`` / ``atol`` (None: torch's defaults for the dtype).
        check: instead of ``reference``, ``check(output) -> bool`` (True passes).
        group: the ``torch.distributed`` group (default: the world group when initialised,
            else this process alone).
        policy: ``"root"`` (the root times alone; rank-local kernels) or ``"slowest"`` (every
            rank times in lockstep, the slowest rank's time decides; needed for kernels that
            communicate).
        mode: ``"on"``, ``"cache_only"`` or ``"off"`` (:data:`MODES`); None reads
            ``$TILESCALE_AUTOTUNE`` (default ``"on"``).
        timer: ``timer(launch) -> milliseconds`` of one call (default
            :func:`~tilescale_lang.autotune.trials.default_timer`).
        cache_dir: the cache directory (default TileLang's ``TILELANG_CACHE_DIR``).
        extra: further JSON-able key fields the winner depends on.
        environment: the hardware/software key fields (default
            :func:`~tilescale_lang.autotune.cache.current_environment`).
        prepare: ``prepare(candidates)``, called on the root once it is going to tune (not
            on a cache hit), with every candidate config, before the first ``build``: e.g. to
            compile them all in parallel into a disk cache that ``build`` then hits. A
            failure is a warning (``build`` compiles what is missing).

    Returns:
        A :class:`TuneResult`.

    Raises:
        TypeError / ValueError: a bad argument, naming it (raised before any exchange).
        AutotuneCacheMiss: ``mode="cache_only"`` and no entry (on every rank).
        NoValidCandidate: every candidate failed (on every rank).
        AutotuneError: the ranks disagree on the key, mode or policy, or the root failed.
    """
    mode = resolve_mode(mode)
    check_choice("policy", policy, POLICIES)
    _check_callables(build, reference, check, timer)
    if prepare is not None and not callable(prepare):
        raise TypeError(f"prepare must be a callable candidates -> None, or None, got {prepare!r}")
    comm = Comm.of(group)
    environment = current_environment() if environment is None else environment
    key = make_key(name, space, dtype, shapes, comm.size, environment, extra)
    cache = TuneCache(cache_dir)
    entry = None
    if comm.is_root and mode != "off":
        entry = guarded(lambda: cache.load(key))  # a failed read is sent, not raised alone
    hello = comm.gather((key, mode, policy, entry))
    problem = _disagreement(hello)
    if problem:
        raise AutotuneError(f"autotune {name!r}: the ranks disagree ({problem}); every rank must pass the same "
                            "arguments and environment")
    result = dict(key=key, key_hash=key_hash(key), path=cache.path(name))
    if mode == "off":
        return TuneResult(space.default(), "off", None, **result)
    ok, entry = hello[0][3]
    if not ok:
        warnings.warn(f"autotune: could not read the cache {cache.path(name)}:\n{entry}", RuntimeWarning, stacklevel=2)
        entry = None
    entry = _cached(space, entry)
    if entry is not None:
        return TuneResult(dict(entry["config"]), "cache", entry.get("time_ms"), **result)
    if mode == "cache_only":
        raise AutotuneCacheMiss(key, cache.path(name))
    return _tune_now(space, build, comm, key, cache, policy, make_verifier(reference, check, rtol, atol),
                     timer or default_timer, result, prepare)


def _tune_now(space: SearchSpace, build, comm: Comm, key: dict, cache: TuneCache, policy: str, verify, timer,
              result: dict, prepare=None) -> TuneResult:
    """Steps 3 and 4 of the module docstring."""
    candidates = space.candidates()
    name = key["name"]
    if prepare is not None and comm.is_root:
        ok, error = guarded(lambda: prepare([dict(c) for c in candidates]))
        if not ok:
            warnings.warn(f"autotune {name!r}: prepare failed (each candidate compiles in build):\n{error}",
                          RuntimeWarning, stacklevel=3)
    if policy == "slowest":
        skipped, every = run_lockstep(comm, candidates, build, verify, timer)
        decision = guarded(lambda: _decide(slowest_outcome(candidates, skipped, every))) if comm.is_root else None
    else:
        decision = guarded(lambda: _decide(run_root(candidates, build, verify, timer))) if comm.is_root else None
    ok, decision = comm.from_root(decision)  # every rank adopts the root's decision
    if not ok:
        raise AutotuneError(f"autotune {name!r}: the root rank failed while tuning:\n{decision}")
    if decision[0] == "none":
        raise NoValidCandidate(name, decision[1])
    if comm.is_root:  # after the peers have the winner: they do not wait for the disk
        _store(cache, key, candidates, policy, decision)
    _, index, ms, outcome = decision
    return TuneResult(dict(candidates[index]), "tuned", ms,
                      timings=[(dict(candidates[i]), t) for i, t in outcome.timings],
                      skipped=list(outcome.skipped), **result)

