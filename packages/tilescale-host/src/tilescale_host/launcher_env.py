"""``tilescale-run``'s ranks' environment and its argument checks (:mod:`tilescale_host.launcher`):
torchrun's single-node variables for each rank, the master port (given and free, or a free
one), the grace period and the file descriptors ``-n`` ranks need."""

from __future__ import annotations

import os
from collections.abc import Mapping

from tilescale_core.interface import PARENT_PID_ENV, check_seconds

from .dist_init import JOB_ID_ENV, _start_ticks, master_addr

__all__ = ["FDS_PER_RANK", "FDS_SPARE", "build_rank_env", "check_fd_budget", "check_grace", "check_port",
           "check_port_free", "default_port"]

#: File descriptors the launcher holds per rank (the read end of its output pipe) and spares
#: for everything else (standard streams, the pipes of the Popen under way, Python's own).
FDS_PER_RANK = 1
FDS_SPARE = 16


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
        MASTER_ADDR=master_addr(env),
        MASTER_PORT=str(master_port),
        TILESCALE_MASTER_PORT=str(master_port),
        PYTHONUNBUFFERED="1",
    )
    env[PARENT_PID_ENV] = str(os.getpid())  # the rank dies with this process
    # This launch's own job id: one inherited from a job further up must not name this one.
    env[JOB_ID_ENV] = f"tilescale-run pid {os.getpid()} started at tick {_start_ticks(os.getpid())}"
    if share_gpus:
        env["TILESCALE_SHARE_GPUS"] = "1"
    return env


def check_port(name: str, value) -> int:
    """``value`` as a TCP port (1..65535); ValueError naming ``name`` and the value."""
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer port") from None
    if not 0 < port < 65536:
        raise ValueError(f"{name}={value!r} is not a TCP port (1..65535)")
    return port


def check_port_free(name: str, port: int, addr: str) -> None:
    """ValueError naming ``name`` when ``port`` is already bound on this machine (rank 0 hosts
    the rendezvous there; its ranks would otherwise fail one by one with a socket error).
    Only checked when ``addr`` is this machine (a loopback address or this host's name)."""
    import errno
    import socket

    if addr not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return
            raise ValueError(f"{name}={port} is in use on this machine (another job, or one still shutting "
                             f"down): pick another port, or leave it unset for a free one") from None


def check_grace(grace) -> float:
    """``grace`` as a non-negative, finite number of seconds; ValueError otherwise."""
    return check_seconds("grace", grace, positive=False)


def check_fd_budget(nranks: int) -> None:
    """ValueError naming ``-n`` and ``ulimit -n`` when ``nranks`` ranks would exhaust this
    process's file-descriptor limit (each rank holds :data:`FDS_PER_RANK` while it runs)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # less the descriptor listdir used
    except OSError:
        in_use = 3
    need = in_use + nranks * FDS_PER_RANK + FDS_SPARE
    if need > soft:
        most = max(0, (soft - in_use - FDS_SPARE) // FDS_PER_RANK)
        raise ValueError(
            f"-n {nranks} needs about {need} file descriptors but this process may open {soft} "
            f"(ulimit -n); raise the limit or start at most {most} ranks"
        )


def default_port(base: Mapping[str, str]) -> int:
    """TILESCALE_MASTER_PORT, MASTER_PORT (validated), else a free port."""
    for name in ("TILESCALE_MASTER_PORT", "MASTER_PORT"):
        if base.get(name):
            port = check_port(name, base[name])
            check_port_free(name, port, master_addr(base))
            return port
    from tilescale_core.multiprocess import find_free_port

    return find_free_port()
