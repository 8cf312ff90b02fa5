"""Run one Python function on N local ranks, each in its own process, and never hang.

This is the harness under every multi-rank test and under ``tilescale-run``'s in-process
mode: the ranks are started with the ``spawn`` method, optionally joined into a
``torch.distributed`` process group, and watched by the parent.  When one rank raises, the
others are stopped within seconds and :class:`RankFailure` carries the failing rank's
traceback; when the deadline passes, every rank still running first dumps the Python stack
of all its threads to stderr (so the report says where each rank was waiting), then is
killed, and :class:`RankTimeout` names the ranks that did not finish.

Example::

    def body(rank, world_size, n):
        import torch.distributed as dist
        t = torch.full((n,), rank)
        dist.all_reduce(t)
        return t.tolist()

    results = run_ranks(body, 4, args=(3,), backend="gloo", timeout=60)
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .validate import check_positive_int, check_seconds

__all__ = ["RankExitWarning", "RankFailure", "RankTimeout", "auto_backend", "find_free_port", "rank_device", "run_ranks"]

#: Environment variable that makes ranks share GPUs (as in tilescale-host's ``init_dist``).
SHARE_GPUS_ENV = "TILESCALE_SHARE_GPUS"


class RankFailure(RuntimeError):
    """A rank raised (or died). ``rank`` is the first failing rank, ``details`` its traceback."""

    def __init__(self, rank: int, details: str):
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details


class RankExitWarning(RuntimeWarning):
    """A rank reported its result, then ended badly: it crashed during interpreter shutdown
    (for example ``std::terminate`` in a library's thread: SIGABRT) or did not exit within
    10 s and was terminated.  The results are returned; the rank's stderr holds the Python
    stack of every thread at the crash (``faulthandler`` is enabled in each rank)."""


class RankTimeout(TimeoutError):
    """Ranks did not finish within the deadline. ``ranks`` lists the unfinished ranks."""

    def __init__(self, ranks: Sequence[int], timeout: float):
        super().__init__(
            f"ranks {list(ranks)} did not finish within {timeout:.0f} s; their Python stacks "
            "were dumped to stderr just before they were killed"
        )
        self.ranks = list(ranks)
        self.timeout = timeout


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch or no driver: no GPU
        return 0


def rank_device(rank: int, device_count: int | None = None) -> str:
    """The CUDA device of ``rank``: ``cuda:{rank % device_count}`` (its own GPU when there
    are at least as many GPUs as ranks, shared round-robin otherwise). ``device_count``
    defaults to the GPUs torch sees; with none, ``"cpu"``."""
    count = _visible_gpus() if device_count is None else device_count
    return f"cuda:{rank % count}" if count > 0 else "cpu"


def auto_backend(world_size: int, device_count: int | None = None, share: bool | None = None,
                 env: Mapping[str, str] | None = None) -> str:
    """``"nccl"`` when every rank can have its own GPU and GPUs are not shared, else
    ``"gloo"`` (NCCL refuses two ranks on one GPU). ``share`` None reads
    ``TILESCALE_SHARE_GPUS`` from ``env`` (default ``os.environ``) with
    :func:`tilescale_core.env.flag`: ``1``/``true``/``yes``/``on`` share.

    Raises:
        ValueError: ``TILESCALE_SHARE_GPUS`` is neither an on nor an off spelling.
    """
    if share is None:
        from .env import flag

        share = flag(SHARE_GPUS_ENV, False, env)
    count = _visible_gpus() if device_count is None else device_count
    return "nccl" if count >= world_size and not share else "gloo"


def _child(fn, rank, world_size, args, env, backend, port, group_timeout, results, parent):
    # Dump every thread's stack if the parent sends SIGUSR1 (it does so before a kill), and
    # on a fatal signal (SIGABRT from std::terminate, SIGSEGV), so a crash says where it was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)
    # Not a daemon (so that a body may start processes of its own), hence die with the
    # harness even when it is SIGKILLed.
    from ._parent_death import die_with_parent

    die_with_parent(parent)
    os.environ.update(env)
    try:
        if backend is not None:
            import datetime

            import torch.distributed as dist

            if backend == "nccl":  # NCCL needs the rank's own device before the group forms
                import torch

                torch.cuda.set_device(rank_device(rank))
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=group_timeout),
            )
        value = fn(rank, world_size, *args)
        try:  # pickled here, not in the queue's feeder thread, which would drop it silently
            from multiprocessing.reduction import ForkingPickler

            ForkingPickler.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"the return value of fn on rank {rank} ({type(value).__name__}) cannot be sent to the "
                f"parent: it does not pickle ({type(exc).__name__}: {exc})"
            ) from exc
        results.put((rank, True, value))
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
        # os._exit skips the queue's feeder thread: flush the report into the pipe first,
        # or the parent sees "exited before reporting" instead of the traceback.
        results.close()
        results.join_thread()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if backend is not None:
            try:
                import gc

                import torch.distributed as dist

                # Free reference cycles first (a caught exception's frames can hold objects that
                # hold the group): a group left for the interpreter's finalization aborts it with
                # "terminate called without an active exception" (its C++ threads still joinable).
                gc.collect()
                if dist.is_initialized():
                    dist.destroy_process_group()
                gc.collect()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    grace: float = 5.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Args:
        fn: a picklable (module-level) function; its return values must pickle too.
        world_size: number of ranks, an int >= 1 (not a bool).
        args: extra positional arguments, picklable.
        timeout: seconds for the whole run (a finite number > 0); ranks still running then
            are killed.
        backend: ``torch.distributed`` backend to initialise before ``fn`` runs
            (``"gloo"`` or ``"nccl"``; ``"auto"``: :func:`auto_backend`, NCCL with one GPU
            per rank, gloo when ranks share GPUs), or None to leave the group to ``fn``.
            With NCCL each rank's current device is :func:`rank_device` before ``fn`` runs.
        env: environment variables for every rank, or one mapping per rank.
        grace: seconds (a finite number >= 0) the other ranks get to exit after one fails
            before they are killed.

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        ValueError: a bad ``world_size``, ``timeout``, ``grace`` or ``env``.
        RankFailure: a rank raised or exited without a result.  When a rank died without
            reporting (killed, or ``os._exit``), it is the one named, with its exit code,
            even if the others failed first because of it (their tracebacks follow).
        RankTimeout: the deadline passed.
    """
    world_size = check_positive_int("world_size", world_size)
    timeout = check_seconds("timeout", timeout)
    grace = check_seconds("grace", grace, positive=False)
    if backend == "auto":
        backend = auto_backend(world_size)
    if env is None or isinstance(env, Mapping):
        envs = [dict(env or {})] * world_size
    else:
        envs = [dict(e) for e in env]
        if len(envs) != world_size:
            raise ValueError(f"env has {len(envs)} mappings for {world_size} ranks")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, tuple(args), envs[r], backend, port, timeout, results, os.getpid()),
            name=f"tilescale-rank{r}",
            # Not daemonic: a rank body may start processes (multiprocessing forbids that in
            # daemons).  The finally below stops every rank, and each rank dies with this
            # process (PR_SET_PDEATHSIG) if it is killed.
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}  # tracebacks, in the order they arrived
    failure: RankFailure | None = None
    timed_out = False
    succeeded = False

    def record(rank: int, ok: bool, payload: Any) -> None:
        if ok:
            values[rank] = payload
        else:
            failures.setdefault(rank, payload)

    def unreported() -> list[int]:
        """Ranks whose process ended without a report (a reporting rank flushes it first)."""
        return [r for r, p in enumerate(procs) if r not in values and r not in failures and not p.is_alive()]

    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = [r for r in range(world_size) if r not in values]
                _dump_stacks([procs[r] for r in pending])
                timed_out = True
                raise RankTimeout(pending, timeout)
            try:
                record(*results.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                pass
            if failures or unreported():
                failure = _first_failure(procs, results, record, unreported, failures)
                if failure is not None:
                    raise failure
        succeeded = True
        return [values[r] for r in range(world_size)]
    finally:
        # Hung or failed ranks get ``grace`` seconds; ranks that all reported get 10 s to exit.
        _stop(procs, grace if failure is not None or timed_out else 10.0)
        results.close()
        if succeeded:
            _warn_bad_exits(procs)


def _warn_bad_exits(procs) -> None:
    """Warn (:class:`RankExitWarning`) about ranks that reported a result and then did not exit 0."""
    import warnings

    for rank, p in enumerate(procs):
        if p.exitcode != 0:
            how = (f"did not exit within 10 s and was stopped ({_exit_text(p.exitcode)})"
                   if p.exitcode in (-signal.SIGTERM, -signal.SIGKILL) else _exit_text(p.exitcode))
            warnings.warn(f"rank {rank} returned its result, then {how} while shutting down; its stderr "
                          f"above shows every thread's Python stack at the crash", RankExitWarning, stacklevel=3)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _first_failure(procs, results, record, unreported, failures) -> RankFailure | None:
    """The failure to report once a rank failed or ended, or None (it ended after reporting
    a result that was still in the queue).  A rank that died without reporting is the likely
    cause of the others' errors, so it is named first; reports still in the queue, and
    deaths that follow a reported failure within a moment, are collected first."""
    settle = time.monotonic() + 0.5
    while True:
        try:
            record(*results.get(timeout=0.05))
            continue
        except queue.Empty:
            pass
        dead = unreported()
        if dead or not failures or time.monotonic() >= settle:
            break
    if not dead and not failures:
        return None
    others = "".join(f"\n\nrank {r} failed too (possibly because of it):\n{tb}" for r, tb in failures.items())
    if dead:
        rank = dead[0]
        return RankFailure(rank, f"process {_exit_text(procs[rank].exitcode)} before reporting{others}")
    rank = next(iter(failures))
    rest = "".join(f"\n\nrank {r} failed too:\n{tb}" for r, tb in failures.items() if r != rank)
    return RankFailure(rank, failures[rank] + rest)


def _dump_stacks(procs) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)


def _stop(procs, grace: float) -> None:
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
