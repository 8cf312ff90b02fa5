"""``tilescale-run``: start N local ranks of a script, stop them all when one fails.

Usage::

    tilescale-run -n 4 [--timeout S] [--share-gpus] [--master-port P] [--verbose] script.py [args...]
    tilescale-run -n 4 -m package.module [args...]
    python -m tilescale_host.launcher -n 4 script.py [args...]

Each rank is a subprocess with the single-node torchrun variables (LOCAL_RANK, RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and a job id of its own (TILESCALE_JOB_ID, checked at rendezvous), so
``init_dist(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))`` works
unchanged.  Every output line is echoed prefixed with ``[rank N]``; text without a newline yet
(a progress bar) is echoed as it comes, read in bounded chunks.  When a rank exits
with a nonzero status every rank's process group (the failed rank's own children included)
gets SIGTERM, then SIGKILL after ``--grace`` seconds; the exit status is that rank's.  An
exception a rank raised is reported in one line per distinct message, naming the ranks that
raised it (``ranks 0, 1 failed: ValueError: no CUDA device is visible ...``); with
``--verbose`` the ranks print their tracebacks instead and the failing rank's last output is
printed again, as it is when a rank exits without an exception.  ``--timeout`` bounds the whole
run: ranks still running then dump their Python stacks and are killed, and the exit status is
124.

The signals torchrun forwards (SIGINT, SIGTERM, SIGHUP, SIGQUIT) are forwarded to every
rank's process group, followed by SIGKILL after ``--grace`` seconds; the exit status is then
128 + the signal -- also when it comes while the ranks are being started, and a second signal
during the grace period does not cut the ranks' grace short.  A signal that was ignored when the
launcher started (SIGHUP under ``nohup``) stays ignored.  Ranks die with the launcher even when
it is killed with SIGKILL (each asks the kernel for a parent-death signal).  Ports,
MASTER_ADDR, ``--timeout``, ``--grace`` and ``-n`` (against the file-descriptor limit) are
validated up front: a bad value is a one-line error, not a traceback (exit status 2).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO


from ._rank_main import ERROR_FILE_ENV
from .dist_init import check_timeout, master_addr
from .launcher_env import build_rank_env, check_fd_budget, check_grace, check_port, check_port_free, default_port
from .rank_output import TAIL_LINES, RankSink, cut_line, echo

__all__ = ["EXIT_TIMEOUT", "FORWARDED_SIGNALS", "Interrupted", "LaunchResult", "check_fd_budget", "check_grace",
           "check_port", "check_port_free", "build_rank_env", "launch", "main", "parse_args"]

#: Exit status of the launcher when the overall timeout expires (as coreutils' timeout).
EXIT_TIMEOUT = 124
#: Signals that are forwarded to the ranks (the ones torchrun forwards).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_POLL_S = 0.05
#: Forwarded signals received by :func:`main`'s handler, in order.  The handler only records
#: them (it never raises), so a signal during start-up or during the grace period cannot end
#: the launcher half-way; :func:`launch` polls this list.
_received: list[int] = []


@dataclass
class _Rank:
    """One running rank: its process, the thread echoing its output and its last lines."""

    rank: int
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None


@dataclass
class LaunchResult:
    """Outcome of :func:`launch`: exit ``status``, ``failed_rank`` (or None), ``timed_out``."""

    status: int
    failed_rank: int | None = None
    timed_out: bool = False


class Interrupted(BaseException):
    """The launcher received one of :data:`FORWARDED_SIGNALS` (raised by callers' handlers;
    :func:`main`'s handler records the signal instead, see :data:`_received`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _start(command: Sequence[str], nranks: int, port: int, share_gpus: bool, sink: RankSink, ranks: list[_Rank],
           errors: str | None) -> None:
    """Start the ranks, appending each to ``ranks``; stop starting when a signal arrived.
    ``errors``: the directory where each rank writes the one-line summary of an exception."""
    for r in range(nranks):
        if _received:
            return
        env = build_rank_env(r, nranks, port, share_gpus=share_gpus)
        if errors is not None:
            env[ERROR_FILE_ENV] = os.path.join(errors, f"rank-{r}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tilescale_host._rank_main", *command],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it stops its children
        )
        rank = _Rank(r, proc)
        ranks.append(rank)
        rank.reader = threading.Thread(target=echo, args=(rank, sink), daemon=True)
        rank.reader.start()


def _signal_group(rank: _Rank, sig: int) -> None:
    try:
        os.killpg(rank.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(ranks: Sequence[_Rank], grace: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to every rank's process group -- also the groups of ranks that already
    exited, whose children may still run -- then SIGKILL every group after ``grace`` s (at
    once for groups whose leader is gone and whose output pipe is already closed)."""
    for r in ranks:
        _signal_group(r, sig)
    deadline = time.monotonic() + grace
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # Children of a rank may outlive it and hold its output pipe: wait for the pipes too.
    for r in ranks:
        if r.reader is not None:
            r.reader.join(timeout=max(0.0, deadline - time.monotonic()))
    for r in ranks:
        _signal_group(r, signal.SIGKILL)
        r.proc.wait()


def _first_failure(ranks: Sequence[_Rank]) -> _Rank | None:
    failed = [r for r in ranks if r.proc.poll() not in (None, 0)]
    return failed[0] if failed else None


def _status_of(returncode: int) -> int:
    return returncode if returncode > 0 else 128 + (-returncode)


def _raised(ranks: Sequence[_Rank], errors: str | None) -> dict[str, list[int]]:
    """``{one-line exception: ranks that raised it}`` from the ranks' error files."""
    raised: dict[str, list[int]] = {}
    for r in ranks if errors is not None else ():
        try:
            with open(os.path.join(errors, f"rank-{r.rank}"), encoding="utf-8", errors="replace") as f:
                line = cut_line(f.readline().strip())
        except OSError:
            continue
        raised.setdefault(line, []).append(r.rank)
    return raised


def _report_failure(rank: _Rank, others: Sequence[int], err: TextIO, raised: Mapping[str, list[int]]) -> None:
    code = rank.proc.returncode
    how = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
    mine = [line for line, who in raised.items() if rank.rank in who]
    if mine:  # an exception: one line per message, the failing rank's first; no traceback
        stopped = [r for r in others if not any(r in who for who in raised.values())]
        note = f"stopped ranks {stopped}; " if stopped else ""
        for i, line in enumerate(sorted(raised, key=lambda m: m != mine[0])):
            who = raised[line]
            names = f"rank {who[0]}" if len(who) == 1 else "ranks " + ", ".join(map(str, who))
            plural = "s" if len(raised) + len(who) > 2 else ""
            tail = f" ({note}--verbose shows the traceback{plural})" if i == 0 else ""
            err.write(f"tilescale-run: {names} failed: {line}{tail}\n")
        err.flush()
        return
    err.write(
        f"tilescale-run: rank {rank.rank} failed ({how}); stopped ranks {list(others)}.\n"
        f"tilescale-run: last output of rank {rank.rank}:\n"
    )
    err.writelines(f"[rank {rank.rank}] {line}\n" for line in rank.tail)
    err.flush()


def _report_timeout(pending: Sequence[int], timeout: float, err: TextIO) -> None:
    err.write(
        f"tilescale-run: timed out after {timeout:g} s; ranks {list(pending)} were still running "
        "(their Python stacks are above) and were killed.\n"
    )
    err.flush()


def _wait(ranks: Sequence[_Rank], timeout: float | None) -> tuple[_Rank | None, bool]:
    """Wait until all ranks succeed, one fails, the deadline passes or a signal arrives:
    (failed, timed_out)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not _received:
        failed = _first_failure(ranks)
        if failed is not None:
            return failed, False
        if all(r.proc.poll() == 0 for r in ranks):
            return None, False
        if deadline is not None and time.monotonic() > deadline:
            return None, True
        time.sleep(_POLL_S)
    return None, False


def launch(
    command: Sequence[str],
    nranks: int,
    *,
    timeout: float | None = None,
    share_gpus: bool = False,
    master_port: int | None = None,
    grace: float = 3.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
    verbose: bool = False,
) -> LaunchResult:
    """Run ``python -m tilescale_host._rank_main *command`` as ``nranks`` ranks.

    Args:
        command: ``[script, *args]`` or ``["-m", module, *args]``.
        nranks: number of local ranks, >= 1 (and within the file-descriptor limit).
        timeout: seconds for the whole run, positive and finite (None: no limit).
        share_gpus: set TILESCALE_SHARE_GPUS=1 in every rank (several ranks per GPU).
        master_port: rendezvous port (default TILESCALE_MASTER_PORT, MASTER_PORT, a free port).
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        out, err: streams for the ranks' prefixed output and the launcher's messages.
        verbose: the ranks print the tracebacks of exceptions (otherwise each distinct
            exception is one line of the launcher's).

    Raises:
        ValueError: a bad argument or variable (ports, MASTER_ADDR), or more ranks than
            file descriptors allow, before anything starts.
        OSError: a rank could not be started (the ranks already started are stopped first).
    """
    if nranks < 1:
        raise ValueError(f"the number of ranks must be at least 1, got {nranks}")
    if timeout is not None:
        timeout = check_timeout(timeout)
    grace = check_grace(grace)
    check_fd_budget(nranks)
    out, err = out or sys.stdout, err or sys.stderr
    addr = master_addr(os.environ)
    if master_port is not None:
        port = check_port("master_port", master_port)
        check_port_free("master_port", port, addr)
    else:
        port = default_port(os.environ)
    errors = None if verbose else tempfile.mkdtemp(prefix="tilescale-run-")
    try:
        return _launch(command, nranks, timeout, share_gpus, port, grace, out, err, errors)
    finally:
        if errors is not None:
            shutil.rmtree(errors, ignore_errors=True)


def _launch(command: Sequence[str], nranks: int, timeout: float | None, share_gpus: bool, port: int, grace: float,
            out: TextIO, err: TextIO, errors: str | None) -> LaunchResult:
    ranks: list[_Rank] = []
    signum = None
    try:
        _start(command, nranks, port, share_gpus, RankSink(out), ranks, errors)
        failed, timed_out = _wait(ranks, timeout)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    except OSError:
        _finish(ranks, grace)
        raise
    if signum is None and _received:
        signum = _received[0]
    if signum is not None:
        err.write(f"tilescale-run: got {signal.Signals(signum).name}; forwarding it to every rank\n")
        err.flush()
        _finish(ranks, grace, signum)
        return LaunchResult(128 + signum)
    running = [r.rank for r in ranks if r.proc.poll() is None]
    if timed_out:
        for r in ranks:
            _signal_group(r, signal.SIGUSR1)  # faulthandler in _rank_main dumps the stacks
        time.sleep(1.0)
    _finish(ranks, grace)
    if timed_out:
        _report_timeout(running, timeout, err)
        return LaunchResult(EXIT_TIMEOUT, timed_out=True)
    if failed is not None:
        _report_failure(failed, running, err, _raised(ranks, errors))
        return LaunchResult(_status_of(failed.proc.returncode), failed_rank=failed.rank)
    return LaunchResult(0)


def _finish(ranks: Sequence[_Rank], grace: float, sig: int = signal.SIGTERM) -> None:
    """Stop what still runs (every rank's process group) and drain the output threads."""
    _stop(ranks, grace, sig)
    for r in ranks:
        if r.reader is not None:
            r.reader.join(timeout=5.0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``tilescale-run`` arguments (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="tilescale-run",
        description="Start N local ranks of a Python script with torchrun-compatible variables; "
        "stop all of them as soon as one fails.",
    )
    parser.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nranks", type=int, required=True,
                        help="number of local ranks")
    parser.add_argument("--timeout", type=float, default=None,
                        help="overall limit in seconds, positive and finite (exit status 124)")
    parser.add_argument("--share-gpus", action="store_true",
                        help="several ranks per GPU (sets TILESCALE_SHARE_GPUS=1 in every rank)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (default TILESCALE_MASTER_PORT, MASTER_PORT, else a free port)")
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="the ranks print the tracebacks of exceptions (default: one line per distinct exception)")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", help="script path, or module name with -m")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if args.nranks < 1:
        parser.error(f"-n must be at least 1, got {args.nranks}")
    try:
        if args.timeout is not None:
            check_timeout(args.timeout, "--timeout")
        check_grace(args.grace)
        if args.master_port is not None:
            check_port("--master-port", args.master_port)
    except ValueError as exc:
        parser.error(str(exc).replace("grace must", "--grace must"))
    return args


def _note_signal(signum, frame):
    _received.append(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``tilescale-run``; returns the exit status."""
    args = parse_args(argv)
    _received.clear()
    for sig in FORWARDED_SIGNALS:  # forwarded to the ranks, as torchrun does
        if signal.getsignal(sig) is not signal.SIG_IGN:  # SIGHUP under nohup stays ignored
            signal.signal(sig, _note_signal)
    command = (["-m"] if args.module else []) + [args.target, *args.args]
    try:
        result = launch(
            command,
            args.nranks,
            timeout=args.timeout,
            share_gpus=args.share_gpus,
            master_port=args.master_port,
            grace=args.grace,
            verbose=args.verbose,
        )
    except ValueError as exc:  # a bad port, address, -n, ...: one line, not a traceback
        sys.stderr.write(f"tilescale-run: error: {exc}\n")
        return 2
    except OSError as exc:  # a rank could not be started (the others were stopped)
        sys.stderr.write(f"tilescale-run: error: could not start the ranks: {exc}\n")
        return 1
    finally:
        _received.clear()  # this run's signals must not stop a later launch() in this process
    return result.status


if __name__ == "__main__":
    sys.exit(main())
