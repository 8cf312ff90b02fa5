"""Multi-process tests over gloo: the heap on the host backend, digests, set-up failures, fd exchange."""

from __future__ import annotations

import time

import pytest

import core_rank_bodies as bodies
from tilescale_core.multiprocess import RankFailure, RankTimeout, auto_backend, rank_device, run_ranks

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world_size", [2, 4])
def test_heap_roundtrip_every_peer_view(clean_env, world_size):
    results = run_ranks(bodies.heap_roundtrip, world_size, args=(1000,), timeout=60)
    offsets = {tuple(r["offsets"]) for r in results}
    assert offsets == {(0, 4096)}  # same offsets on every rank: 1000 floats -> 4000 B -> next 256-aligned 4096
    bases = [r["table"][2:] for r in results]
    assert all(len(b) == world_size for b in bases)


@pytest.mark.parametrize("order_swap,index", [(False, 1), (True, 0)])
def test_digest_mismatch_detected_at_close(clean_env, order_swap, index):
    results = run_ranks(bodies.mismatch_at_close, 3, args=(order_swap,), timeout=60)
    for r in results:
        assert r is not None, "close() did not detect the mismatch"
        assert r["ranks"] == [1] and r["index"] == index and r["leaks"] == 0
        assert f"allocation #{index}" in r["message"] and "rank 1 allocated" in r["message"]


@pytest.mark.parametrize("use_env", [False, True])
def test_check_mode_detects_mismatch_at_the_allocation(clean_env, use_env):
    results = run_ranks(bodies.mismatch_check_mode, 3, args=(use_env,), timeout=60)
    for r in results:
        assert r is not None and r["ranks"] == [2] and r["index"] == 1 and r["used"] == 64
        assert "rank 2 allocated 100 bytes" in r["message"] and "rank 0 allocated 96 bytes" in r["message"]


@pytest.mark.parametrize(
    "where,phase_fragment", [("allocate", "allocate"), ("export", "export descriptor"), ("import", "map peer descriptors")]
)
def test_setup_failure_raises_on_every_rank(clean_env, where, phase_fragment):
    start = time.monotonic()
    results = run_ranks(bodies.setup_failure, 3, args=(1, where), timeout=60)
    assert time.monotonic() - start < 40
    for r in results:
        assert r is not None, "a rank finished set-up although rank 1 failed"
        assert r["failed"] == [1] and phase_fragment in r["phase"]
        assert f"injected {where} failure" in r["message"] and r["leaks"] == 0
        assert r["fd_leaks"] == [], f"descriptors left open after the failed set-up: {r['fd_leaks']}"


def test_fd_exchange(clean_env):
    results = run_ranks(bodies.fd_exchange, 3, timeout=60)
    for rank, seen in enumerate(results):
        assert seen == {r: f"hello from rank {r}" for r in range(3) if r != rank}


def test_multicast_setup_and_teardown_with_mocked_driver(clean_env):
    results = run_ranks(bodies.multicast_mocked, 2, timeout=60)
    for rank, info in enumerate(results):
        assert info["mc_offset"] == 0 and info["local_is_physical"]
        assert info["second_offsets"] == (256, 256) and info["heap_used"] == 0 and info["leaks"] == 0
        names = [c[0] for c in info["calls"]]
        setup = ["aligned_size", "create", "export_handle", "add_device", "bind_mem", "map"]
        if rank != 0:
            setup = ["aligned_size", "import_handle", "add_device", "bind_mem", "map"]
        assert names == setup + ["unmap", "unbind", "release_handle"]
        assert ("aligned_size", 10000, 2) in info["calls"]
        handle = 77 if rank == 0 else 88
        assert ("bind_mem", handle, 16384) in info["calls"] and ("unmap", True, 16384) in info["calls"]


def test_run_ranks_reports_failing_rank_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(bodies.fail_with_message, 3, backend=None, timeout=60, grace=1.0)
    assert info.value.rank == 2
    assert "deliberate failure on rank 2" in info.value.details and "Traceback" in info.value.details
    assert time.monotonic() - start < 20


def test_run_ranks_timeout_names_stuck_rank():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(bodies.stuck_rank, 2, backend=None, timeout=6)
    assert info.value.ranks == [1]
    assert time.monotonic() - start < 20


def test_bad_argument_on_one_rank_stops_every_rank(clean_env):
    results = run_ranks(bodies.bad_arguments, 3, args=("invalid",), timeout=60)
    assert results[1][0] == "ValueError" and "size must be a positive int" in results[1][1]
    for r in (0, 2):
        kind, message = results[r]
        assert kind == "SetupError" and "validate arguments" in message and "rank(s) [1]" in message


def test_ranks_disagreeing_on_the_heap(clean_env):
    results = run_ranks(bodies.bad_arguments, 3, args=("disagree",), timeout=60)
    for kind, message in results:
        assert kind == "ValueError" and "disagree" in message and "rank 2: size=131072" in message


@pytest.mark.parametrize("world,count,share,want", [
    (2, 2, False, "nccl"), (4, 8, False, "nccl"),  # one GPU per rank
    (4, 1, False, "gloo"), (2, 0, False, "gloo"),  # ranks would share a GPU / no GPU
    (2, 2, True, "gloo"),  # sharing requested
])
def test_auto_backend(world, count, share, want):
    assert auto_backend(world, device_count=count, share=share) == want


def test_auto_backend_reads_share_env():
    assert auto_backend(2, device_count=2, env={"TILESCALE_SHARE_GPUS": "1"}) == "gloo"
    assert auto_backend(2, device_count=2, env={"TILESCALE_SHARE_GPUS": "0"}) == "nccl"
    assert auto_backend(2, device_count=2, env={}) == "nccl"


def test_rank_device_round_robin():
    assert [rank_device(r, 4) for r in range(6)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    assert rank_device(3, 1) == "cuda:0" and rank_device(0, 0) == "cpu"


def test_run_ranks_auto_backend_without_gpus_is_gloo():
    assert run_ranks(bodies.group_backend, 2, backend="auto", timeout=60) == ["gloo", "gloo"]


def test_close_with_a_peer_that_never_closes_times_out_and_releases_memory(clean_env):
    results = run_ranks(bodies.close_with_absent_peer, 2, args=(2.0,), timeout=90)
    r = results[0]
    assert r["error"] is not None, "close() returned although rank 1 never took part"
    assert "rank 0" in r["error"] and "did not finish within 2 s" in r["error"]
    assert r["elapsed"] < 6.0, f"close(timeout=2) took {r['elapsed']:.1f} s"
    assert r["mappings"] == 0, "close() kept the local mappings after the failed barrier"
    assert r["closed"] is True and len(r["fds_closed"]) >= 1  # the heap's memfd is closed


def test_rank_body_can_start_a_process(clean_env):
    results = run_ranks(bodies.start_a_process, 2, timeout=120)
    for r in results:
        assert r["exitcode"] == 0 and r["child"] != r["me"]


@pytest.mark.parametrize("how,exit_text", [("exit3", "exited with code 3"), ("kill", "killed by signal 9 (SIGKILL)")])
def test_run_ranks_names_the_rank_that_died_and_its_exit_code(how, exit_text):
    """Rank 2 dies; ranks 0 and 1 then fail in a collective and report first: the failure
    still names rank 2, with its exit code, and keeps the survivors' tracebacks."""
    with pytest.raises(RankFailure) as info:
        run_ranks(bodies.dies_in_a_collective, 3, args=(how,), backend="gloo", timeout=60, grace=1.0)
    assert info.value.rank == 2, str(info.value)[:2000]
    assert exit_text in info.value.details and "before reporting" in info.value.details
    assert "Traceback" in info.value.details  # a survivor's report, as a consequence


@pytest.mark.parametrize("world_size", [True, False, 2.0, "2", 0])
def test_run_ranks_refuses_a_world_size_that_is_not_a_positive_int(world_size):
    with pytest.raises(ValueError, match=r"world_size must be a positive int, got"):
        run_ranks(bodies.stuck_rank, world_size)


@pytest.mark.parametrize("name", ["timeout", "grace"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, True, "10"])
def test_run_ranks_refuses_a_bad_timeout_before_starting_ranks(name, value):
    if name == "grace" and value == -1.0:
        value = -0.5
    with pytest.raises(ValueError, match=rf"{name} must be a .*number of seconds, got {value!r}"):
        run_ranks(bodies.stuck_rank, 2, **{name: value})


def test_run_ranks_unpicklable_result_is_named():
    with pytest.raises(RankFailure) as info:
        run_ranks(bodies.unpicklable_result, 2, backend=None, timeout=60, grace=1.0)
    assert info.value.rank == 1
    assert "return value" in info.value.details and "lock" in info.value.details.lower()
    assert "cannot be sent" in info.value.details and "before reporting" not in info.value.details


@pytest.mark.parametrize("text,want", [("true", "gloo"), ("yes", "gloo"), ("on", "gloo"), ("false", "nccl"),
                                       ("off", "nccl"), ("", "nccl")])
def test_auto_backend_reads_share_env_as_a_boolean(text, want):
    assert auto_backend(2, device_count=2, env={"TILESCALE_SHARE_GPUS": text}) == want


def test_auto_backend_rejects_an_unreadable_share_env():
    with pytest.raises(ValueError, match=r"TILESCALE_SHARE_GPUS='maybe' is not a boolean"):
        auto_backend(2, device_count=2, env={"TILESCALE_SHARE_GPUS": "maybe"})


def test_parent_pid_env_is_checked_early_naming_the_variable():
    from tilescale_core.interface import parent_pid_from_env

    assert parent_pid_from_env({}) is None and parent_pid_from_env({"TILESCALE_PARENT_PID": ""}) is None
    assert parent_pid_from_env({"TILESCALE_PARENT_PID": " 1234 "}) == 1234
    for bad in ("abc", "-5", "0", "1.5", "12abc", "\u00b2"):
        with pytest.raises(ValueError, match=rf"TILESCALE_PARENT_PID={bad!r} is not a process id"):
            parent_pid_from_env({"TILESCALE_PARENT_PID": bad})


def test_run_ranks_warns_about_a_rank_that_crashed_after_reporting():
    """A crash at exit (SIGABRT from a library's std::terminate) is not lost behind a
    successful run: the results come back and a RankExitWarning names the rank and signal."""
    from tilescale_core.multiprocess import RankExitWarning

    with pytest.warns(RankExitWarning, match=r"rank 1 returned its result, then was killed by signal 6 \(SIGABRT\)"):
        assert run_ranks(bodies.aborts_at_exit, 2, backend=None, timeout=60) == [0, 1]
