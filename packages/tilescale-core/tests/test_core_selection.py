"""Memory-path selection (the spec's order) and the multicast preconditions, as pure functions."""

from __future__ import annotations

import itertools

import pytest

from tilescale_core.allocator import VmmUnavailableError, check_multicast, select_path
from tilescale_core.probes import Probe

OK = Probe(True, "fine")
NO = Probe(False, "absent here")


class CountingProbe:
    def __init__(self, result: Probe):
        self.result = result
        self.calls = 0

    def __call__(self) -> Probe:
        self.calls += 1
        return self.result


def expected_path(env_value, use_vmm, is_distributed, fabric_ok, fd_ok):
    """The spec's order, written independently of the implementation."""
    if env_value is not None:
        if env_value not in ("1", "0", ""):
            return ValueError  # an unrecognised spelling is an error, not a silent IPC
        want = env_value == "1"
    elif use_vmm is not None:
        want = use_vmm
    else:
        want = is_distributed and fabric_ok
    if not want:
        return "ipc" if is_distributed else "local"
    if fabric_ok:
        return "vmm-fabric"
    if fd_ok:
        return "vmm-fd"
    return VmmUnavailableError


ENV_VALUES = [None, "1", "0", "", "true", "yes", " 1"]
MATRIX = list(itertools.product(ENV_VALUES, [None, True, False], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize("env_value,use_vmm,is_distributed,fabric_ok,fd_ok", MATRIX)
def test_selection_matrix(env_value, use_vmm, is_distributed, fabric_ok, fd_ok):
    fabric, fd = CountingProbe(OK if fabric_ok else NO), CountingProbe(OK if fd_ok else NO)
    want = expected_path(env_value, use_vmm, is_distributed, fabric_ok, fd_ok)
    kwargs = dict(is_distributed=is_distributed, use_vmm=use_vmm, env_value=env_value, fabric_probe=fabric, fd_probe=fd)
    if want is ValueError:
        with pytest.raises(ValueError, match=f"TILESCALE_USE_VMM={env_value!r} is not a recognised value"):
            select_path(**kwargs)
    elif want is VmmUnavailableError:
        with pytest.raises(VmmUnavailableError, match="no fallback to CUDA IPC"):
            select_path(**kwargs)
    else:
        assert select_path(**kwargs) == want


def test_env_override_beats_explicit_argument():
    args = dict(is_distributed=True, fabric_probe=lambda: OK, fd_probe=lambda: OK)
    assert select_path(use_vmm=True, env_value="0", **args) == "ipc"
    assert select_path(use_vmm=False, env_value="1", **args) == "vmm-fabric"
    assert select_path(use_vmm=True, env_value="", **args) == "ipc"
    with pytest.raises(ValueError, match="TILESCALE_USE_VMM='anything'"):
        select_path(use_vmm=None, env_value="anything", **args)


@pytest.mark.parametrize("value", ["true", "1 ", " 1", "yes", "TRUE", "on", "2", "vmm"])
def test_unrecognised_env_spelling_is_an_error(value):
    with pytest.raises(ValueError, match=r"use 1 \(VMM\) or 0 \(CUDA IPC\)"):
        select_path(is_distributed=True, use_vmm=None, env_value=value, fabric_probe=lambda: OK, fd_probe=lambda: OK)


@pytest.mark.parametrize("value", ["no", "yes", 0, 1, "False", 0.0])
def test_use_vmm_must_be_a_bool(value):
    with pytest.raises(TypeError, match=f"use_vmm must be True, False or None, got {type(value).__name__}"):
        select_path(is_distributed=True, use_vmm=value, env_value=None, fabric_probe=lambda: OK, fd_probe=lambda: OK)


def test_ipc_choice_does_not_probe():
    fabric, fd = CountingProbe(OK), CountingProbe(OK)
    assert select_path(is_distributed=True, use_vmm=False, env_value=None, fabric_probe=fabric, fd_probe=fd) == "ipc"
    assert select_path(is_distributed=True, use_vmm=None, env_value="0", fabric_probe=fabric, fd_probe=fd) == "ipc"
    assert fabric.calls == fd.calls == 0


def test_auto_never_uses_fd_handles():
    # With use_vmm=None the fabric probe decides alone: fd handles are only for forced VMM.
    path = select_path(is_distributed=True, use_vmm=None, env_value=None, fabric_probe=lambda: NO, fd_probe=lambda: OK)
    assert path == "ipc"


def test_forced_vmm_error_gives_both_reasons():
    with pytest.raises(VmmUnavailableError) as info:
        select_path(
            is_distributed=True,
            use_vmm=None,
            env_value="1",
            fabric_probe=lambda: Probe(False, "no IMEX channel"),
            fd_probe=lambda: Probe(False, "no fd support"),
        )
    text = str(info.value)
    assert "TILESCALE_USE_VMM='1'" in text and "no IMEX channel" in text and "no fd support" in text


@pytest.mark.parametrize(
    "mcast_size,path,dist,probe,match",
    [
        (0, "vmm-fabric", True, OK, "positive"),
        (-4, "vmm-fabric", True, OK, "positive"),
        (1.5, "vmm-fabric", True, OK, "positive"),
        (True, "vmm-fabric", True, OK, "positive"),
        (4096, "vmm-fabric", False, OK, "distributed"),
        (4096, "ipc", True, OK, "VMM allocator with fabric"),
        (4096, "vmm-fd", True, OK, "VMM allocator with fabric"),
        (4096, "local", True, OK, "VMM allocator with fabric"),
        (4096, "vmm-fabric", True, NO, "multicast is unavailable: absent here"),
    ],
)
def test_multicast_preconditions(mcast_size, path, dist, probe, match):
    with pytest.raises(ValueError, match=match):
        check_multicast(mcast_size, path, dist, lambda: probe)


def test_multicast_accepted_and_probe_only_when_needed():
    probe = CountingProbe(OK)
    check_multicast(None, "ipc", True, probe)
    assert probe.calls == 0
    check_multicast(4096, "vmm-fabric", True, probe)
    assert probe.calls == 1
