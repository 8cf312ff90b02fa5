"""``init_dist``: join the single-node process group that TileScale's allocator expects.

The work is split in two so that every rule can be tested without a GPU:

* :func:`resolve_launch` is pure: from the arguments, an environment mapping and the number
  of visible CUDA devices it computes a :class:`LaunchPlan` (rank, device, backend,
  rendezvous address and port, defaults to apply) or raises a :class:`ValueError` that names
  the offending variable and its value.
* :func:`init_dist` applies the plan: it sets the environment defaults that are unset, makes
  ``cuda:<device>`` current and creates the process group.

Launch modes (docs/host.md, "Joining the process group"):

* spawn-style: no torchrun rank variables; the arguments define rank and world size;
* single-node torchrun, recognised by ``LOCAL_WORLD_SIZE``: ``LOCAL_WORLD_SIZE``,
  ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` must agree with the arguments.

Several ranks on one GPU (docs/host.md, "Several ranks on one GPU"): with ``TILESCALE_SHARE_GPUS=1`` or
``share_gpus=True`` (the argument wins when given), rank ``r`` uses device
``r % device_count`` and, when two ranks do share a device, the host group uses gloo because
NCCL refuses two ranks on one GPU ("Duplicate GPU detected").

One job per rendezvous: every rank of a job shares a job id
(:func:`job_id`: ``TILESCALE_JOB_ID`` when set, else the process that started the ranks --
``tilescale-run``, torchrun's agent or the spawning script -- by pid and start time).  Rank 0
publishes it in the rendezvous store and every other rank compares it before it joins, so a
rank of another job that reaches the same port (two jobs left on the default port) is refused
with an error naming both jobs instead of silently joining and mixing the data; the process
group's keys live under the job id, out of reach of any other job's ranks.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tilescale_core.interface import check_seconds

__all__ = [
    "DEFAULT_ENV",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TIMEOUT_S",
    "JOB_ID_ENV",
    "SHARE_GPUS_ENV",
    "LaunchPlan",
    "apply_env_defaults",
    "check_timeout",
    "init_dist",
    "job_id",
    "master_addr",
    "resolve_launch",
    "resolve_master_port",
    "share_gpus_requested",
]

#: Rendezvous address used when MASTER_ADDR is unset.
DEFAULT_MASTER_ADDR = "127.0.0.1"
#: Rendezvous port used when neither the argument nor a port variable is given.
DEFAULT_MASTER_PORT = 8361
#: Environment switch for several ranks per GPU (``1`` on, ``0`` off).
SHARE_GPUS_ENV = "TILESCALE_SHARE_GPUS"
#: Variables that ``init_dist`` sets only when the caller has not set them.
DEFAULT_ENV: Mapping[str, str] = {
    "MASTER_ADDR": DEFAULT_MASTER_ADDR,
    "NCCL_IB_DISABLE": "1",
    "NCCL_DEBUG": "ERROR",
}
#: Port variables in precedence order (after the ``master_port`` argument).
PORT_ENV_VARS = ("TILESCALE_MASTER_PORT", "MASTER_PORT")
#: Variables through which launchers report a node rank; any nonzero value is multi-node.
NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK")

#: Names the job every rank belongs to; default: the process that started the ranks.
JOB_ID_ENV = "TILESCALE_JOB_ID"
#: Rendezvous store key under which rank 0 publishes its job id.
_JOB_KEY = "tilescale/job_id"


@dataclass(frozen=True)
class LaunchPlan:
    """What :func:`init_dist` will do, computed by :func:`resolve_launch`.

    Attributes:
        rank: this process's rank in the group (equal to its local rank: one node).
        world_size: number of ranks in the group.
        device_index: CUDA ordinal this rank uses.
        backend: ``"nccl"``, or ``"gloo"`` when two ranks share a GPU.
        master_addr: TCP rendezvous address.
        master_port: TCP rendezvous port.
        launch_mode: ``"spawn"`` or ``"torchrun"``.
        shared: True when at least two ranks use the same GPU.
        env_defaults: environment variables to set because the caller left them unset.
        job_id: the job this rank belongs to (:func:`job_id`); empty: read it when joining.
    """

    rank: int
    world_size: int
    device_index: int
    backend: str
    master_addr: str
    master_port: int
    launch_mode: str
    shared: bool = False
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    job_id: str = ""

    @property
    def init_method(self) -> str:
        """The ``tcp://addr:port`` URL for ``torch.distributed.init_process_group``."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def _parse_int(name: str, value) -> int:
    """Parse ``value`` (from variable or argument ``name``) as an int, naming it on failure."""
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """``env[name]`` as an int, None when unset."""
    return None if name not in env else _parse_int(name, env[name])


def _check_port(name: str, port: int) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"{name}={port!r} is not a TCP port (1..65535)")
    return port


def resolve_master_port(master_port: int | None, env: Mapping[str, str]) -> int:
    """Rendezvous port: ``master_port``, TILESCALE_MASTER_PORT, MASTER_PORT, then 8361."""
    if master_port is not None:
        return _check_port("master_port", _parse_int("master_port", master_port))
    for name in PORT_ENV_VARS:
        value = _env_int(env, name)
        if value is not None:
            return _check_port(name, value)
    return DEFAULT_MASTER_PORT


def share_gpus_requested(share_gpus: bool | None, env: Mapping[str, str]) -> bool:
    """Whether single-GPU sharing is on: the argument when given, else TILESCALE_SHARE_GPUS
    (read by :func:`tilescale_core.env.flag`: 1/true/yes/on, 0/false/no/off, default off)."""
    if share_gpus is not None:
        return bool(share_gpus)
    from tilescale_core.env import flag

    return flag(SHARE_GPUS_ENV, False, env)


def master_addr(env: Mapping[str, str]) -> str:
    """Rendezvous address: MASTER_ADDR (surrounding blanks dropped), 127.0.0.1 when unset or
    empty; ValueError naming the variable when it is blank or holds blanks or control characters."""
    value = env.get("MASTER_ADDR")
    if value is None or value == "":
        return DEFAULT_MASTER_ADDR
    addr = value.strip()
    if not addr or not addr.isprintable() or any(c.isspace() for c in addr):
        raise ValueError(f"MASTER_ADDR={value!r} is not a host name or address; unset it "
                         f"(default {DEFAULT_MASTER_ADDR}) or name the rendezvous host")
    return addr


def _start_ticks(pid: int) -> str:
    """Start time of process ``pid`` in clock ticks since boot (Linux), or ``"?"``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return "?"


def job_id(env: Mapping[str, str] | None = None) -> str:
    """The id every rank of one job shares (checked at rendezvous, see the module docstring).

    ``TILESCALE_JOB_ID`` when set (ranks started by different parents set the same value);
    otherwise the parent process, by pid and start time: the ranks of ``tilescale-run``,
    torchrun or one spawning script share it, two jobs do not.  The id ``tilescale-run`` sets
    (with ``TILESCALE_PARENT_PID``, its pid) names its own ranks only: a process those ranks
    start inherits both and uses its own parent instead, so sub-jobs started by different
    ranks stay apart.

    Raises:
        ValueError: TILESCALE_JOB_ID is blank or holds control characters (named).
    """
    env = os.environ if env is None else env
    value = env.get(JOB_ID_ENV)
    launcher = env.get("TILESCALE_PARENT_PID", "").strip()
    if value is not None and launcher and launcher != str(os.getppid()):
        value = None  # inherited from a tilescale-run further up: not this process's job
    if value is not None:
        if not value.strip() or not value.isprintable():
            raise ValueError(f"{JOB_ID_ENV}={value!r} is not a job id: use the same non-blank, "
                             "printable text in every rank of the job, or unset it")
        return value.strip()
    parent = os.getppid()
    return f"parent pid {parent} started at tick {_start_ticks(parent)}"


def _check_arguments(local_rank, num_local_ranks) -> None:
    for name, value in (("local_rank", local_rank), ("num_local_ranks", num_local_ranks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_local_ranks < 1:
        raise ValueError(f"num_local_ranks={num_local_ranks} must be at least 1")
    if not 0 <= local_rank < num_local_ranks:
        raise ValueError(f"local_rank={local_rank} is outside [0, num_local_ranks={num_local_ranks})")


def _reject_multi_node(env: Mapping[str, str]) -> None:
    nnodes = env.get("NNODES")
    if nnodes is not None and _parse_int("NNODES", nnodes) > 1:
        raise ValueError(f"NNODES={nnodes!r}: TileScale supports a single node only")
    for name in NODE_RANK_VARS:
        value = _env_int(env, name)
        if value:
            raise ValueError(f"{name}={env[name]!r}: nonzero node rank; TileScale supports a single node only")


def _check_torchrun(env: Mapping[str, str], local_rank: int, num_local_ranks: int) -> None:
    """Single-node torchrun: every rank variable must agree with the arguments."""
    local_world = _env_int(env, "LOCAL_WORLD_SIZE")
    world = _env_int(env, "WORLD_SIZE")
    if world is not None and world > local_world:
        raise ValueError(
            f"WORLD_SIZE={env['WORLD_SIZE']!r} > LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']!r}: "
            "a multi-node launch; TileScale supports a single node only"
        )
    expected = {
        "LOCAL_WORLD_SIZE": num_local_ranks,
        "WORLD_SIZE": num_local_ranks,
        "RANK": local_rank,
        "LOCAL_RANK": local_rank,
    }
    for name, want in expected.items():
        got = _env_int(env, name)
        if got is not None and got != want:
            arg = "num_local_ranks" if name.endswith("WORLD_SIZE") else "local_rank"
            raise ValueError(
                f"{name}={env[name]!r} disagrees with {arg}={want}: under torchrun the "
                "arguments must match the launcher's variables"
            )
    missing = [name for name in expected if name not in env]
    if missing:
        raise ValueError(
            f"LOCAL_WORLD_SIZE is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not: single-node torchrun sets LOCAL_WORLD_SIZE, WORLD_SIZE, RANK and LOCAL_RANK, and "
            "all four must agree with the arguments"
        )


def _check_spawn(env: Mapping[str, str]) -> None:
    """Spawn-style: WORLD_SIZE/RANK may only be the neutral pair 1/0 (or unset)."""
    world, rank = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
    if world in (None, 1) and rank in (None, 0):
        return
    shown = ", ".join(f"{n}={env[n]!r}" for n in ("WORLD_SIZE", "RANK") if n in env)
    raise ValueError(
        f"{shown} without LOCAL_WORLD_SIZE: ambiguous launcher environment; use a "
        "spawn-style launch without rank variables or single-node torchrun (tilescale-run)"
    )


def _assign_device(
    local_rank: int, num_local_ranks: int, device_count: int, share: bool, env: Mapping[str, str]
) -> tuple[int, bool]:
    """Return ``(device_index, shared)`` for this rank."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    if device_count < 1:
        raise ValueError(f"no CUDA device is visible ({where}); init_dist needs at least one GPU")
    if share:
        return local_rank % device_count, num_local_ranks > device_count
    if device_count < num_local_ranks:
        raise ValueError(
            f"{num_local_ranks} ranks need CUDA ordinals 0..{num_local_ranks - 1} (rank i uses "
            f"cuda:i) but only {device_count} device(s) are visible ({where}); restrict "
            f"CUDA_VISIBLE_DEVICES to the participating GPUs, or set {SHARE_GPUS_ENV}=1 to "
            "run several ranks per GPU"
        )
    return local_rank, False


def resolve_launch(
    local_rank: int,
    num_local_ranks: int,
    master_port: int | None = None,
    *,
    share_gpus: bool | None = None,
    env: Mapping[str, str] | None = None,
    device_count: int,
) -> LaunchPlan:
    """Decide how ``init_dist(local_rank, num_local_ranks, master_port)`` launches; no side effects.

    Args:
        local_rank: this process's rank on the node, in ``[0, num_local_ranks)``.
        num_local_ranks: number of ranks (one node).
        master_port: rendezvous port; overrides TILESCALE_MASTER_PORT and MASTER_PORT.
        share_gpus: run several ranks per GPU; None reads TILESCALE_SHARE_GPUS.
        env: the environment to read (default ``os.environ``); it is not modified.
        device_count: number of CUDA devices visible to this process.

    Raises:
        ValueError: an argument or variable is invalid or describes an unsupported launch;
            the message names the variable and its value.
    """
    env = os.environ if env is None else env
    _check_arguments(local_rank, num_local_ranks)
    _reject_multi_node(env)
    if "LOCAL_WORLD_SIZE" in env:
        mode = "torchrun"
        _check_torchrun(env, local_rank, num_local_ranks)
    else:
        mode = "spawn"
        _check_spawn(env)
    port = resolve_master_port(master_port, env)
    share = share_gpus_requested(share_gpus, env)
    device_index, shared = _assign_device(local_rank, num_local_ranks, device_count, share, env)
    return LaunchPlan(
        rank=local_rank,
        world_size=num_local_ranks,
        device_index=device_index,
        backend="gloo" if shared else "nccl",
        master_addr=master_addr(env),
        master_port=port,
        launch_mode=mode,
        shared=shared,
        env_defaults={k: v for k, v in DEFAULT_ENV.items() if k not in env},
        job_id=job_id(env),
    )


def apply_env_defaults(plan: LaunchPlan, env: dict | None = None) -> None:
    """Set the plan's default variables in ``env`` (default ``os.environ``) where still unset."""
    env = os.environ if env is None else env
    for name, value in plan.env_defaults.items():
        env.setdefault(name, value)


def _rendezvous(plan: LaunchPlan, job: str, timeout):
    """The TCP store of ``plan``'s job: rank 0 serves it and publishes ``job``; every other
    rank checks that the store it reached is its own job's (RuntimeError naming both jobs
    otherwise).  Returns the store under a prefix private to the job."""
    import torch.distributed as dist

    where = f"{plan.master_addr}:{plan.master_port}"
    try:
        store = dist.TCPStore(plan.master_addr, plan.master_port, plan.world_size, is_master=plan.rank == 0,
                              timeout=timeout, wait_for_workers=False, multi_tenant=True)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {plan.rank} of job {job!r} could not {'listen' if plan.rank == 0 else 'connect'} "
            f"at {where} ({exc}); if another job holds the port, give each job its own master_port "
            "(or TILESCALE_MASTER_PORT)"
        ) from None
    if plan.rank == 0:
        store.set(_JOB_KEY, job)
    else:
        try:
            theirs = store.get(_JOB_KEY).decode(errors="replace")
        except RuntimeError as exc:  # a timeout: something that is not a TileScale rank 0 holds the port
            raise RuntimeError(
                f"rank {plan.rank} of job {job!r}: no TileScale job answered at {where} ({exc}); "
                "another program holds the port?"
            ) from None
        if theirs != job:
            raise RuntimeError(
                f"rank {plan.rank} of job {job!r} reached the rendezvous of another job, {theirs!r}, "
                f"at {where}: refusing to join it (two jobs on one port: give each its own master_port "
                f"or TILESCALE_MASTER_PORT; ranks of one job started by different parents must share "
                f"{JOB_ID_ENV})"
            )
    return dist.PrefixStore(f"tilescale-job/{job}", store)


def _init_group(plan: LaunchPlan, backend: str | None = None, timeout_s: float | None = None):
    """Create the default process group described by ``plan``; return (rank, size, WORLD).

    ``backend`` overrides ``plan.backend`` (the CPU tests use ``"gloo"``); an NCCL group is
    bound to ``cuda:<plan.device_index>`` so that NCCL knows its device up front.  The group
    forms only among ranks of one job (:func:`_rendezvous`).
    """
    import datetime

    import torch
    import torch.distributed as dist

    backend = backend or plan.backend
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", plan.device_index)
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    store = _rendezvous(plan, plan.job_id or job_id(), kwargs.get("timeout", dist.default_pg_timeout))
    dist.init_process_group(
        backend,
        store=store,
        rank=plan.rank,
        world_size=plan.world_size,
        **kwargs,
    )
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


#: Seconds a collective of the process group may block before it fails (torch's own
#: default is 30 minutes: far too long to notice a dead rank).
DEFAULT_TIMEOUT_S = 300.0


def check_timeout(timeout, name: str = "timeout") -> float:
    """``timeout`` as a positive, finite number of seconds; ValueError/TypeError naming it.

    Raises:
        TypeError: not a real number (or a bool).
        ValueError: zero, negative, NaN or infinite (:func:`tilescale_core.interface.check_seconds`).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    return check_seconds(name, timeout)


def init_dist(
    local_rank: int,
    num_local_ranks: int,
    master_port: int | None = None,
    *,
    share_gpus: bool | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
):
    """Set ``cuda:local_rank``, create the NCCL process group, return ``(rank, world_size, group)``.

    Args:
        local_rank: this process's rank, also its CUDA ordinal (``0..num_local_ranks-1``).
        num_local_ranks: number of ranks on this node (the group size).
        master_port: rendezvous port. Precedence: this argument, TILESCALE_MASTER_PORT,
            MASTER_PORT, then 8361. The address is MASTER_ADDR (default 127.0.0.1).
        share_gpus: several ranks per GPU (rank ``r`` uses ``cuda:r % device_count``, gloo
            group when ranks share a device). None reads TILESCALE_SHARE_GPUS (default off).
        timeout: seconds a collective of the process group (and its rendezvous) may block
            before it raises, instead of torch's 30-minute default; > 0.

    Returns:
        ``(rank, world_size, torch.distributed.group.WORLD)``.

    Side effects: sets MASTER_ADDR=127.0.0.1, NCCL_IB_DISABLE=1 and NCCL_DEBUG=ERROR where
    unset, selects the CUDA device, initialises ``torch.distributed``. Nothing else (torch's
    default dtype and device are left alone).

    Raises:
        ValueError: an unsupported launch (see :func:`resolve_launch`) or a bad ``timeout``.
    """
    import torch

    timeout = check_timeout(timeout)
    plan = resolve_launch(
        local_rank,
        num_local_ranks,
        master_port,
        share_gpus=share_gpus,
        device_count=torch.cuda.device_count(),
    )
    apply_env_defaults(plan)
    torch.cuda.set_device(plan.device_index)
    return _init_group(plan, timeout_s=timeout)
