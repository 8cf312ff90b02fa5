"""``tilescale-run``: start N local ranks of a script, stop them all when one fails.

Usage::

    tilescale-run -n 4 [--timeout S] [--share-gpus] [--master-port P] script.py [args...]
    tilescale-run -n 4 -m package.module [args...]
    python -m tilescale_host.launcher -n 4 script.py [args...]

Each rank is a subprocess with the single-node torchrun variables (LOCAL_RANK, RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so ``init_dist(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))``
works unchanged.  Every output line is echoed prefixed with ``[rank N]``.  When a rank exits
with a nonzero status every rank's process group (the failed rank's own children included)
gets SIGTERM, then SIGKILL after ``--grace`` seconds, and the failing rank's last output (its
traceback) is printed again; the exit status is that rank's.  ``--timeout`` bounds the whole
run: ranks still running then dump their Python stacks and are killed, and the exit status is
124.

The signals torchrun forwards (SIGINT, SIGTERM, SIGHUP, SIGQUIT) are forwarded to every
rank's process group, followed by SIGKILL after ``--grace`` seconds; the exit status is then
128 + the signal.  Ranks die with the launcher even when it is killed with SIGKILL (each asks
the kernel for a parent-death signal).  Ports and ``--grace`` are validated up front: a bad
``MASTER_PORT`` is a one-line error, not a traceback (exit status 2).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from tilescale_core.interface import PARENT_PID_ENV

__all__ = ["EXIT_TIMEOUT", "FORWARDED_SIGNALS", "Interrupted", "LaunchResult", "check_grace", "check_port", "build_rank_env", "launch", "main", "parse_args"]

#: Exit status of the launcher when the overall timeout expires (as coreutils' timeout).
EXIT_TIMEOUT = 124
#: Signals that are forwarded to the ranks (the ones torchrun forwards).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: Lines of each rank's output kept for the failure summary.
TAIL_LINES = 60
_POLL_S = 0.05


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


def build_rank_env(
    rank: int,
    nranks: int,
    master_port: int,
    *,
    share_gpus: bool = False,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment of rank ``rank`` of ``nranks``: ``base`` plus torchrun's single-node variables."""
    env = dict(os.environ if base is None else base)
    env.update(
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(nranks),
        LOCAL_WORLD_SIZE=str(nranks),
        ROLE_WORLD_SIZE=str(nranks),
        MASTER_ADDR=env.get("MASTER_ADDR") or "127.0.0.1",
        MASTER_PORT=str(master_port),
        TILESCALE_MASTER_PORT=str(master_port),
        PYTHONUNBUFFERED="1",
    )
    env[PARENT_PID_ENV] = str(os.getpid())  # the rank dies with this process
    if share_gpus:
        env["TILESCALE_SHARE_GPUS"] = "1"
    return env


class Interrupted(BaseException):
    """The launcher received one of :data:`FORWARDED_SIGNALS`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def check_port(name: str, value) -> int:
    """``value`` as a TCP port (1..65535); ValueError naming ``name`` and the value."""
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer port") from None
    if not 0 < port < 65536:
        raise ValueError(f"{name}={value!r} is not a TCP port (1..65535)")
    return port


def check_grace(grace) -> float:
    """``grace`` as a non-negative, finite number of seconds; ValueError otherwise."""
    import math

    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (grace >= 0 and math.isfinite(grace)):
        raise ValueError(f"grace must be a non-negative, finite number of seconds, got {grace!r}")
    return float(grace)


def _default_port(base: Mapping[str, str]) -> int:
    """TILESCALE_MASTER_PORT, MASTER_PORT (validated), else a free port."""
    for name in ("TILESCALE_MASTER_PORT", "MASTER_PORT"):
        if base.get(name):
            return check_port(name, base[name])
    from tilescale_core.multiprocess import find_free_port

    return find_free_port()


def _echo(rank: _Rank, out: TextIO, lock: threading.Lock) -> None:
    """Copy the rank's output to ``out`` line by line, prefixed, keeping the tail."""
    for raw in iter(rank.proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        rank.tail.append(line)
        with lock:
            out.write(f"[rank {rank.rank}] {line}\n")
            out.flush()
    rank.proc.stdout.close()


def _start(command: Sequence[str], nranks: int, port: int, share_gpus: bool, out: TextIO) -> list[_Rank]:
    lock = threading.Lock()
    ranks = []
    for r in range(nranks):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tilescale_host._rank_main", *command],
            env=build_rank_env(r, nranks, port, share_gpus=share_gpus),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it stops its children
        )
        rank = _Rank(r, proc)
        rank.reader = threading.Thread(target=_echo, args=(rank, out, lock), daemon=True)
        rank.reader.start()
        ranks.append(rank)
    return ranks


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


def _report_failure(rank: _Rank, others: Sequence[int], err: TextIO) -> None:
    code = rank.proc.returncode
    how = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
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
    """Wait until all ranks succeed, one fails, or the deadline passes: (failed, timed_out)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        failed = _first_failure(ranks)
        if failed is not None:
            return failed, False
        if all(r.proc.poll() == 0 for r in ranks):
            return None, False
        if deadline is not None and time.monotonic() > deadline:
            return None, True
        time.sleep(_POLL_S)


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
) -> LaunchResult:
    """Run ``python -m tilescale_host._rank_main *command`` as ``nranks`` ranks.

    Args:
        command: ``[script, *args]`` or ``["-m", module, *args]``.
        nranks: number of local ranks, >= 1.
        timeout: seconds for the whole run (None: no limit).
        share_gpus: set TILESCALE_SHARE_GPUS=1 in every rank (several ranks per GPU).
        master_port: rendezvous port (default TILESCALE_MASTER_PORT, MASTER_PORT, a free port).
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        out, err: streams for the ranks' prefixed output and the launcher's messages.
    """
    if nranks < 1:
        raise ValueError(f"the number of ranks must be at least 1, got {nranks}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    grace = check_grace(grace)
    out, err = out or sys.stdout, err or sys.stderr
    port = check_port("master_port", master_port) if master_port is not None else _default_port(os.environ)
    ranks = _start(command, nranks, port, share_gpus, out)
    try:
        failed, timed_out = _wait(ranks, timeout)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
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
        _report_failure(failed, running, err)
        return LaunchResult(_status_of(failed.proc.returncode), failed_rank=failed.rank)
    return LaunchResult(0)


def _finish(ranks: Sequence[_Rank], grace: float, sig: int = signal.SIGTERM) -> None:
    """Stop what still runs (every rank's process group) and drain the output threads."""
    _stop(ranks, grace, sig)
    for r in ranks:
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
    parser.add_argument("--timeout", type=float, default=None, help="overall limit in seconds (exit status 124)")
    parser.add_argument("--share-gpus", action="store_true",
                        help="several ranks per GPU (sets TILESCALE_SHARE_GPUS=1 in every rank)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (default TILESCALE_MASTER_PORT, MASTER_PORT, else a free port)")
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", help="script path, or module name with -m")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if args.nranks < 1:
        parser.error(f"-n must be at least 1, got {args.nranks}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    try:
        check_grace(args.grace)
        if args.master_port is not None:
            check_port("--master-port", args.master_port)
    except ValueError as exc:
        parser.error(str(exc).replace("grace must", "--grace must"))
    return args


def _raise_interrupt(signum, frame):
    raise Interrupted(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``tilescale-run``; returns the exit status."""
    args = parse_args(argv)
    for sig in FORWARDED_SIGNALS:  # forwarded to the ranks, as torchrun does
        signal.signal(sig, _raise_interrupt)
    command = (["-m"] if args.module else []) + [args.target, *args.args]
    try:
        result = launch(
            command,
            args.nranks,
            timeout=args.timeout,
            share_gpus=args.share_gpus,
            master_port=args.master_port,
            grace=args.grace,
        )
    except ValueError as exc:  # a bad port variable: one line, not a traceback
        sys.stderr.write(f"tilescale-run: error: {exc}\n")
        return 2
    return result.status


if __name__ == "__main__":
    sys.exit(main())
