"""The ``tilescale`` pytest plugin (entry point ``pytest11``): multi-rank tests and their record.

Markers:

* ``@pytest.mark.ranks(n, timeout=120, cpu_only=False)`` runs the test body on ``n`` spawned
  ranks (see :mod:`tilescale_host.testing`); ``n`` may name a ``parametrize`` argument
  (``@pytest.mark.ranks("world")``: one run per value of ``world``).  It is skipped, with the
  reason, when no GPU is visible or fewer GPUs than ranks are visible and TILESCALE_SHARE_GPUS
  is not 1 (unless ``cpu_only``); it fails with the failing rank's traceback when any rank
  fails and is killed after ``timeout`` seconds (each rank's Python stack is dumped first).
* ``@pytest.mark.requires_capability(name)`` skips, with the probe's reason, unless the
  capability is present.
* ``@pytest.mark.distributed`` is registered for :func:`tilescale_host.testing.requires_distributed`
  (``tilelang.testing.requires_distributed``), which adds it.
* ``@pytest.mark.tilescale_gpu`` skips when no CUDA GPU is visible.  The plugin claims no
  generic marker name: a project whose tests say ``@pytest.mark.gpu`` makes that name an
  alias with :func:`add_gpu_marker_alias` (TileScale's own test suites do, in their
  ``conftest.py``).

Validation record (see docs/host.md, "Validation record"): with ``--tilescale-record DIR`` or
TILESCALE_VALIDATION_RECORD=DIR the plugin writes ``DIR/tilescale-validation-<time>-<pid>.jsonl``:
one ``session`` line (GPU count and names, mode, versions), one ``test`` line per gated test
(ranks, mode, capabilities, outcome, skip reason) and a ``summary`` line listing which gated
tests ran and which were skipped and why.  The plugin imports torch only when a gated test or
the record needs it, so it costs nothing in other test suites.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import platform
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from . import testing

RECORD_ENV = "TILESCALE_VALIDATION_RECORD"
#: The plugin's GPU marker (namespaced: it never claims a marker name another plugin may use).
GPU_MARKER = "tilescale_gpu"
_GPU_MARKER_HELP = "needs a CUDA GPU (skipped with a reason when none is visible)"
_GATED = ("ranks", "requires_capability")
_GPU_ALIASES = pytest.StashKey[set]()


def add_gpu_marker_alias(config, name: str) -> None:
    """Register marker ``name`` and treat it as ``tilescale_gpu`` in this pytest run.

    Call it from a ``conftest.py``'s ``pytest_configure(config)``; for example TileScale's own
    suites keep their ``@pytest.mark.gpu`` (and ``-m gpu`` / ``-m "not gpu"`` selections) with
    ``add_gpu_marker_alias(config, "gpu")``.
    """
    config.addinivalue_line("markers", f"{name}: {_GPU_MARKER_HELP} (alias of {GPU_MARKER})")
    config.stash.setdefault(_GPU_ALIASES, set()).add(name)


def _gpu_markers(config) -> tuple[str, ...]:
    return (GPU_MARKER, *sorted(config.stash.get(_GPU_ALIASES, set())))


@dataclass
class _Gate:
    """What the plugin decided about one gated test."""

    ranks: int | None = None
    mode: str | None = None
    capabilities: list[str] = field(default_factory=list)
    cpu_only: bool = False


class _Record:
    """Writer of the JSON-lines validation record (a no-op without a directory)."""

    def __init__(self, directory: str | None):
        self.path = None
        self.ran: list[str] = []
        self.skipped: dict[str, str] = {}
        self.failed: list[str] = []
        if directory:
            stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.path = Path(directory) / f"tilescale-validation-{stamp}-{os.getpid()}.jsonl"
            self._write(kind="session", **_session_facts())

    def _write(self, **entry) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(entry, default=str) + "\n")

    def test(self, nodeid: str, gate: _Gate, outcome: str, reason: str | None, duration: float) -> None:
        {"passed": self.ran, "failed": self.failed}.get(outcome, []).append(nodeid)
        if outcome == "skipped":
            self.skipped[nodeid] = reason or ""
        self._write(kind="test", nodeid=nodeid, outcome=outcome, skip_reason=reason,
                    duration_s=round(duration, 3), **asdict(gate))

    def close(self) -> None:
        self._write(kind="summary", ran=self.ran, failed=self.failed, skipped=self.skipped,
                    counts={"ran": len(self.ran), "failed": len(self.failed), "skipped": len(self.skipped)})


def _share_mode() -> bool:
    from .dist_init import share_gpus_requested

    return share_gpus_requested(None, os.environ)


def _session_facts() -> dict:
    """GPU count and names, the multi-rank mode and versions, for the record's first line."""
    import torch

    count = testing.gpu_count()
    return {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu_count": count,
        "gpu_names": _gpu_names(count),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "mode": "shared" if _share_mode() else "one-rank-per-GPU",
    }


def _gpu_names(count: int) -> list[str]:
    import torch

    try:
        return [torch.cuda.get_device_name(i) for i in range(count)]
    except Exception as exc:  # a CUDA-less build or a broken driver: say so in the record
        return [f"unknown ({type(exc).__name__}: {exc})"] * count


# --------------------------------------------------------------------------- hooks

_RECORD = pytest.StashKey[_Record]()
_GATES = pytest.StashKey[dict]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("tilescale", "TileScale multi-rank tests")
    group.addoption("--tilescale-record", metavar="DIR", default=None,
                    help=f"write a JSON-lines validation record under DIR (env {RECORD_ENV})")


def pytest_configure(config) -> None:
    for line in (
        "ranks(n, timeout=120, cpu_only=False): run the test body on n spawned ranks (tilescale)",
        "requires_capability(name): skip unless the named TileScale capability is present",
        f"{GPU_MARKER}: {_GPU_MARKER_HELP}",
        testing.DISTRIBUTED_MARKER_HELP,
    ):
        config.addinivalue_line("markers", line)
    directory = config.getoption("--tilescale-record") or os.environ.get(RECORD_ENV) or None
    config.stash[_RECORD] = _Record(directory)
    config.stash[_GATES] = {}


def pytest_unconfigure(config) -> None:
    record = config.stash.get(_RECORD, None)
    if record is not None:
        record.close()


def _ranks_marker(item):
    """``(n, timeout, cpu_only)`` of the item's ``ranks`` marker, or None."""
    marker = item.get_closest_marker("ranks")
    if marker is None:
        return None
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(n, str):  # the name of a parametrize argument
        params = getattr(getattr(item, "callspec", None), "params", {})
        if n not in params:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.ranks({n!r}) names no parametrize argument "
                                    f"of the test (it has {sorted(params)})")
        n = params[n]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.ranks needs a positive rank count, got {n!r}")
    return n, float(marker.kwargs.get("timeout", testing.DEFAULT_RANK_TIMEOUT)), bool(marker.kwargs.get("cpu_only", False))


def _make_gate(item) -> _Gate:
    """Describe a gated test: its rank count, mode and required capabilities."""
    gate = _Gate(capabilities=[name for m in item.iter_markers("requires_capability") for name in m.args])
    ranks = _ranks_marker(item)
    if ranks is not None:
        gate.ranks, gate.cpu_only = ranks[0], ranks[2]
        if gate.cpu_only:
            gate.mode = "cpu"
        else:
            shared = _share_mode() and gate.ranks > testing.gpu_count()
            gate.mode = "shared" if shared else "one-rank-per-GPU"
    return gate


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Note every gated test at collection, so that skips added by other plugins are recorded too."""
    gates = config.stash[_GATES]
    gated = (*_GATED, *_gpu_markers(config))
    for item in items:
        if any(item.get_closest_marker(m) for m in gated):
            gates[item.nodeid] = _make_gate(item)


def _skip_unless_gpus(n: int) -> None:
    count = testing.gpu_count()
    if count == 0:
        pytest.skip(f"no CUDA GPU is visible; this test runs {n} ranks on GPUs")
    if count < n and not _share_mode():
        pytest.skip(f"needs {n} GPUs (one rank per GPU) but {count} visible; "
                    "set TILESCALE_SHARE_GPUS=1 to run several ranks per GPU")


def pytest_runtest_setup(item) -> None:
    gate = item.config.stash[_GATES].get(item.nodeid)
    if gate is None:
        return
    if any(item.get_closest_marker(m) for m in _gpu_markers(item.config)) and testing.gpu_count() == 0:
        pytest.skip("no CUDA GPU is visible (torch.cuda.device_count() == 0)")
    if gate.ranks is not None and not gate.cpu_only:
        _skip_unless_gpus(gate.ranks)
    for name in gate.capabilities:
        ok, reason = testing.capability(name)
        if not ok:
            pytest.skip(reason)


def _spec(item, timeout: float, cpu_only: bool) -> testing.RankTestSpec:
    """The picklable description of ``item`` sent to every rank."""
    import inspect
    import sys

    from tilescale_core.multiprocess import find_free_port

    params = inspect.signature(item.obj).parameters
    kwargs = {p: item.funcargs[p] for p in params if p not in testing.RANK_PARAMS}
    try:
        pickle.dumps(kwargs)
    except Exception as exc:
        raise pytest.UsageError(f"{item.nodeid}: arguments {sorted(kwargs)} cannot be sent to the ranks: {exc}") from exc
    return testing.RankTestSpec(
        module_name=item.module.__name__,
        module_file=str(item.module.__file__),
        function=item.originalname,
        sys_path=list(sys.path),
        kwargs=kwargs,
        rank_params=tuple(p for p in params if p in testing.RANK_PARAMS),
        cpu_only=cpu_only,
        master_port=find_free_port(),
        timeout=timeout,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run a ``ranks`` test on its ranks instead of in the pytest process."""
    ranks = _ranks_marker(pyfuncitem)
    if ranks is None:
        return None
    from tilescale_core.multiprocess import RankFailure, RankTimeout, run_ranks

    n, timeout, cpu_only = ranks
    spec = _spec(pyfuncitem, timeout, cpu_only)
    try:
        results = run_ranks(testing.run_test_on_rank, n, args=(spec,), timeout=timeout, backend=None, grace=2.0)
    except RankFailure as exc:
        pytest.fail(f"rank {exc.rank} of {n} failed:\n{exc.details}", pytrace=False)
    except RankTimeout as exc:
        pytest.fail(f"{exc} (test timeout {timeout:g} s)", pytrace=False)
    skips = [why for status, why in results if status == "skipped"]
    if skips:
        pytest.skip(skips[0])
    return True


def _rank_placeholder(request, name: str):
    if request.node.get_closest_marker("ranks") is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the {name!r} fixture needs @pytest.mark.ranks(n)")
    return None  # each rank passes its own value


@pytest.fixture
def rank(request):
    """This rank's number inside a ``@pytest.mark.ranks`` test (filled in by each rank)."""
    return _rank_placeholder(request, "rank")


@pytest.fixture
def world_size(request):
    """The number of ranks inside a ``@pytest.mark.ranks`` test (filled in by each rank)."""
    return _rank_placeholder(request, "world_size")


def _skip_reason(report) -> str | None:
    if not report.skipped:
        return None
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Record the outcome of a gated test (its setup skip/error, or its call)."""
    report = yield
    gate = item.config.stash[_GATES].get(item.nodeid)
    final = report.when == "call" or (report.when == "setup" and not report.passed)
    if gate is not None and final:
        outcome = "error" if report.when == "setup" and report.failed else report.outcome
        item.config.stash[_RECORD].test(item.nodeid, gate, outcome, _skip_reason(report), report.duration)
    return report
