"""Multi-rank tests: the ``multirank`` decorator, capability probes, and the per-rank runner.

A test marked ``@pytest.mark.ranks(n)`` (or decorated with :func:`multirank`) is run by the
``tilescale`` pytest plugin (:mod:`tilescale_host.pytest_plugin`) on ``n`` spawned ranks::

    from tilescale_host.testing import multirank

    @multirank(4, timeout=60)
    def test_all_reduce(rank, world_size):
        import torch, torch.distributed as dist
        t = torch.ones(1, device="cuda") * rank
        dist.all_reduce(t)
        assert t.item() == sum(range(world_size))

Each rank imports the test module, joins a process group set up like :func:`init_dist`
(share mode when TILESCALE_SHARE_GPUS=1; a CPU gloo group with ``cpu_only=True``) and calls
the test function.  The parameters ``rank`` and ``world_size`` receive the rank's values;
every other parameter (``parametrize`` values, picklable fixtures such as ``tmp_path``) is
sent from the pytest process.

``@pytest.mark.requires_capability("multicast")`` skips a test, with the probe's reason, when
a named capability is absent; the plugin records which capability-gated tests ran.  Built-in
capabilities: ``gpu``, ``multi_gpu``, ``p2p_native_atomic``, ``fullmesh_nvlink``, ``tma``,
``vmm_fabric``, ``multicast``; add more with :func:`register_capability`.

:func:`requires_distributed` is upstream TileScale's ``tilelang.testing.requires_distributed``
(the tilescale-host extension adds it to stock ``tilelang.testing`` when that is imported).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_RANK_TIMEOUT",
    "RankTestSpec",
    "capability",
    "gpu_count",
    "multirank",
    "register_capability",
    "requires_capability",
    "requires_distributed",
]

#: Seconds a multi-rank test may run before its ranks are killed.
DEFAULT_RANK_TIMEOUT = 120.0
#: Parameters filled in by each rank rather than sent from the pytest process.
RANK_PARAMS = ("rank", "world_size")
#: Launcher variables removed in a test rank so that init_dist sees a spawn-style launch.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "NNODES", "TILESCALE_MASTER_PORT", "MASTER_PORT")


def multirank(n: int, *, timeout: float = DEFAULT_RANK_TIMEOUT, cpu_only: bool = False):
    """Decorator: run the test on ``n`` spawned ranks (same as ``@pytest.mark.ranks(...)``).

    Args:
        n: number of ranks.
        timeout: seconds before the ranks are killed and the test fails.
        cpu_only: the test needs no GPU; ranks join a CPU gloo group and never skip.
    """
    import pytest

    return pytest.mark.ranks(n, timeout=timeout, cpu_only=cpu_only)


def requires_capability(name: str):
    """Decorator: skip the test (recording why) unless capability ``name`` is present."""
    import pytest

    return pytest.mark.requires_capability(name)


#: Upstream TileScale's switch for its distributed tests; here they run unless it is off.
DISTRIBUTED_ENV = "TILELANG_USE_DISTRIBUTED"
#: Help text of the ``distributed`` marker (registered by the ``tilescale`` pytest plugin).
DISTRIBUTED_MARKER_HELP = (f"distributed: a multi-process test (tilelang.testing.requires_distributed); "
                           f"skipped when {DISTRIBUTED_ENV} is off or torch.distributed is unavailable")


def distributed_skip_reason(env=None) -> str | None:
    """Why a :func:`requires_distributed` test is skipped here, or None when it runs.

    It runs unless ``TILELANG_USE_DISTRIBUTED`` is set to an off spelling (``0``, ``false``,
    ``no``, ``off``) or this torch build has no ``torch.distributed``.

    Raises:
        ValueError: ``TILELANG_USE_DISTRIBUTED`` is neither an on nor an off spelling.
    """
    from tilescale_core.env import parse_flag

    env = os.environ if env is None else env
    value = env.get(DISTRIBUTED_ENV)
    if not parse_flag(DISTRIBUTED_ENV, value, default=True):
        return f"{DISTRIBUTED_ENV}={value!r} turns distributed tests off"
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    return None


def requires_distributed(func):
    """Decorator (upstream TileScale's ``tilelang.testing.requires_distributed``): mark the test
    ``distributed`` (select or deselect with ``-m distributed``) and skip it, with the reason,
    where :func:`distributed_skip_reason` gives one.

    Unlike upstream, where such tests run only with ``TILELANG_USE_DISTRIBUTED=1`` (the switch
    of its distributed build), they run by default: TileScale's distributed support is always
    there once tilescale-host is installed.  ``TILELANG_USE_DISTRIBUTED=0`` skips them.
    """
    import pytest

    reason = distributed_skip_reason()
    func = pytest.mark.distributed(func)
    return pytest.mark.skipif(reason is not None, reason=reason or "")(func)


# --------------------------------------------------------------------------- capabilities

_PROBES: dict[str, Callable[[], bool]] = {}


def register_capability(name: str, probe: Callable[[], bool]) -> None:
    """Register ``probe() -> bool`` under ``name`` (replacing a previous one)."""
    _PROBES[name] = probe
    capability.cache_clear()


@functools.cache
def capability(name: str) -> tuple[bool, str]:
    """``(available, reason)`` for capability ``name``; probes run once per process.

    A probe that raises counts as absent, with the exception as the reason.
    """
    probe = _PROBES.get(name)
    if probe is None:
        return False, f"unknown capability {name!r} (known: {', '.join(sorted(_PROBES))})"
    try:
        ok = bool(probe())
    except Exception as exc:
        return False, f"capability {name!r} probe failed: {type(exc).__name__}: {exc}"
    return ok, f"capability {name!r} is {'available' if ok else 'not available'} on this host"


def gpu_count() -> int:
    """Number of CUDA devices visible to this process (0 without a CUDA build or driver)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _probe_core(name: str) -> bool:
    from tilescale_core import shared_memory

    return bool(getattr(shared_memory, name)())


def _probe_fullmesh() -> bool:
    from .topology import has_fullmesh_nvlink

    return gpu_count() >= 2 and has_fullmesh_nvlink()


def _probe_p2p_atomic() -> bool:
    from .topology import supports_p2p_native_atomic

    return supports_p2p_native_atomic()


def _probe_tma() -> bool:
    from .utils import has_tma

    return has_tma()


for _name, _probe in {
    "gpu": lambda: gpu_count() >= 1,
    "multi_gpu": lambda: gpu_count() >= 2,
    "p2p_native_atomic": _probe_p2p_atomic,
    "fullmesh_nvlink": _probe_fullmesh,
    "tma": _probe_tma,
    "vmm_fabric": functools.partial(_probe_core, "_supports_vmm_fabric"),
    "multicast": functools.partial(_probe_core, "_supports_multicast"),
}.items():
    register_capability(_name, _probe)


# --------------------------------------------------------------------------- running on ranks


@dataclass(frozen=True)
class RankTestSpec:
    """Everything a spawned rank needs to find and call one test function (picklable)."""

    module_name: str
    module_file: str
    function: str
    sys_path: list[str]
    kwargs: dict[str, Any] = field(default_factory=dict)
    rank_params: tuple[str, ...] = ()
    cpu_only: bool = False
    master_port: int = 0
    timeout: float = DEFAULT_RANK_TIMEOUT


def _load_module(spec: RankTestSpec):
    """Import the test module by name (as pytest did), else from its file."""
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        module = importlib.import_module(spec.module_name)
        if os.path.samefile(getattr(module, "__file__", "") or os.devnull, spec.module_file):
            return module
    except (ImportError, OSError):
        pass
    file_spec = importlib.util.spec_from_file_location(spec.module_name, spec.module_file)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[spec.module_name] = module
    file_spec.loader.exec_module(module)
    return module


def _join_group(rank: int, world_size: int, spec: RankTestSpec) -> None:
    from .dist_init import DEFAULT_MASTER_ADDR, LaunchPlan, _init_group, init_dist

    for name in _LAUNCHER_VARS:
        os.environ.pop(name, None)
    if spec.cpu_only:
        plan = LaunchPlan(rank, world_size, -1, "gloo", DEFAULT_MASTER_ADDR, spec.master_port, "spawn")
        _init_group(plan, timeout_s=spec.timeout)
    else:
        init_dist(rank, world_size, master_port=spec.master_port)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_test_on_rank(rank: int, world_size: int, spec: RankTestSpec) -> tuple[str, str | None]:
    """Body of one rank (called by ``run_ranks``): returns ``("passed", None)`` or ``("skipped", why)``."""
    import pytest

    fn = getattr(_load_module(spec), spec.function)
    values = {"rank": rank, "world_size": world_size}
    kwargs = dict(spec.kwargs, **{p: values[p] for p in spec.rank_params})
    _join_group(rank, world_size, spec)
    try:
        fn(**kwargs)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc.msg)
    finally:
        _leave_group()
    return "passed", None
