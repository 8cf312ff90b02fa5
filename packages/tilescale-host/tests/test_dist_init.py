"""init_dist's launch resolution: every rule in-process, and real spawned groups over gloo."""

from __future__ import annotations

import dataclasses
import os
import queue
import time

import pytest
from tilescale_core.multiprocess import RankFailure, find_free_port, run_ranks

from tilescale_host.dist_init import (
    DEFAULT_MASTER_PORT,
    _init_group,
    apply_env_defaults,
    job_id,
    resolve_launch,
    resolve_master_port,
)


def plan(local_rank=0, n=2, port=None, *, env=None, devices=8, share=None):
    return resolve_launch(local_rank, n, port, share_gpus=share, env=env or {}, device_count=devices)


# --------------------------------------------------------------------------- port and defaults


@pytest.mark.parametrize(
    ("arg", "env", "expected"),
    [
        (1234, {"TILESCALE_MASTER_PORT": "2000", "MASTER_PORT": "3000"}, 1234),
        (None, {"TILESCALE_MASTER_PORT": "2000", "MASTER_PORT": "3000"}, 2000),
        (None, {"MASTER_PORT": "3000"}, 3000),
        (None, {}, DEFAULT_MASTER_PORT),
    ],
)
def test_port_precedence(arg, env, expected):
    assert resolve_master_port(arg, env) == expected
    assert plan(port=arg, env=env).master_port == expected


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TILESCALE_MASTER_PORT": "http"}, "TILESCALE_MASTER_PORT='http' is not an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ],
)
def test_bad_port_names_variable(env, needle):
    with pytest.raises(ValueError, match=needle):
        plan(env=env)


def test_defaults_apply_only_when_unset():
    p = plan(env={"NCCL_DEBUG": "INFO"})
    assert p.master_addr == "127.0.0.1"
    assert dict(p.env_defaults) == {"MASTER_ADDR": "127.0.0.1", "NCCL_IB_DISABLE": "1"}
    env = {"NCCL_DEBUG": "INFO"}
    apply_env_defaults(p, env)
    assert env == {"NCCL_DEBUG": "INFO", "MASTER_ADDR": "127.0.0.1", "NCCL_IB_DISABLE": "1"}
    assert plan(env={"MASTER_ADDR": "10.0.0.2"}).init_method == "tcp://10.0.0.2:8361"
    assert plan(env={"MASTER_ADDR": "::1"}).init_method == "tcp://[::1]:8361"


@pytest.mark.parametrize("value", [" ", "\t", "host name", "a\nb"])
def test_a_blank_master_addr_is_refused_naming_it(value):
    """Issue 39: MASTER_ADDR=" " went into the plan and failed late, at rendezvous."""
    with pytest.raises(ValueError, match=r"MASTER_ADDR=.* is not a host name or address"):
        plan(env={"MASTER_ADDR": value})


def test_master_addr_blanks_around_and_empty():
    assert plan(env={"MASTER_ADDR": " 10.0.0.2 "}).master_addr == "10.0.0.2"
    assert plan(env={"MASTER_ADDR": ""}).master_addr == "127.0.0.1"


def test_resolution_has_no_side_effects(clean_env):
    before = dict(os.environ)
    resolve_launch(0, 2, device_count=2)
    assert dict(os.environ) == before


# --------------------------------------------------------------------------- launch modes


def test_spawn_mode():
    p = plan(1, 4)
    assert (p.rank, p.world_size, p.device_index, p.backend, p.launch_mode) == (1, 4, 1, "nccl", "spawn")
    assert plan(env={"WORLD_SIZE": "1", "RANK": "0"}).launch_mode == "spawn"  # the neutral pair


def test_torchrun_mode():
    env = {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2", "GROUP_RANK": "0"}
    p = plan(2, 4, env=env)
    assert (p.rank, p.device_index, p.launch_mode) == (2, 2, "torchrun")


@pytest.mark.parametrize(
    ("local_rank", "n", "env", "needle"),
    [
        (0, 4, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, r"WORLD_SIZE='8' > LOCAL_WORLD_SIZE='4'"),
        (0, 4, {"NNODES": "2"}, r"NNODES='2'"),
        (0, 4, {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}, r"GROUP_RANK='1': nonzero node rank"),
        (0, 4, {"NODE_RANK": "3"}, r"NODE_RANK='3': nonzero node rank"),
        (0, 4, {"WORLD_SIZE": "4", "RANK": "0"}, r"WORLD_SIZE='4', RANK='0' without LOCAL_WORLD_SIZE"),
        (0, 4, {"RANK": "2"}, r"RANK='2' without LOCAL_WORLD_SIZE"),
        (0, 4, {"LOCAL_WORLD_SIZE": "2"}, r"LOCAL_WORLD_SIZE='2' disagrees with num_local_ranks=4"),
        (0, 4, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "2"}, r"WORLD_SIZE='2' disagrees with num_local_ranks=4"),
        (1, 4, {"LOCAL_WORLD_SIZE": "4", "RANK": "2"}, r"RANK='2' disagrees with local_rank=1"),
        (1, 4, {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, r"LOCAL_RANK='3' disagrees with local_rank=1"),
        (0, 4, {"LOCAL_WORLD_SIZE": "four"}, r"LOCAL_WORLD_SIZE='four' is not an integer"),
        (1, 4, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, r"LOCAL_WORLD_SIZE is set but RANK is not"),
        (0, 4, {"LOCAL_WORLD_SIZE": "4"}, r"but WORLD_SIZE, RANK, LOCAL_RANK are not"),
        (0, 2, {"TILESCALE_SHARE_GPUS": "maybe"}, r"TILESCALE_SHARE_GPUS='maybe' is not a boolean"),
    ],
)
def test_rejected_environments(local_rank, n, env, needle):
    with pytest.raises(ValueError, match=needle):
        plan(local_rank, n, env=env)


@pytest.mark.parametrize(
    ("local_rank", "n", "exc", "needle"),
    [
        (4, 4, ValueError, r"local_rank=4 is outside \[0, num_local_ranks=4\)"),
        (-1, 4, ValueError, r"local_rank=-1"),
        (0, 0, ValueError, r"num_local_ranks=0 must be at least 1"),
        ("0", 2, TypeError, r"local_rank must be an int"),
    ],
)
def test_bad_arguments(local_rank, n, exc, needle):
    with pytest.raises(exc, match=needle):
        plan(local_rank, n)


def test_too_few_devices_is_a_non_contiguous_mapping():
    with pytest.raises(ValueError, match=r"only 2 device\(s\) are visible \(CUDA_VISIBLE_DEVICES='0,3'\)"):
        plan(0, 4, env={"CUDA_VISIBLE_DEVICES": "0,3"}, devices=2)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        plan(0, 1, devices=0)


# --------------------------------------------------------------------------- several ranks per GPU


def test_share_mode_round_robin_and_gloo():
    plans = [plan(r, 4, env={"TILESCALE_SHARE_GPUS": "1"}, devices=1) for r in range(4)]
    assert [p.device_index for p in plans] == [0, 0, 0, 0]
    assert {p.backend for p in plans} == {"gloo"} and all(p.shared for p in plans)
    assert [plan(r, 4, share=True, devices=2).device_index for r in range(4)] == [0, 1, 0, 1]


def test_share_argument_wins_over_environment():
    with pytest.raises(ValueError, match="only 1 device"):
        plan(0, 2, env={"TILESCALE_SHARE_GPUS": "1"}, devices=1, share=False)
    assert plan(0, 2, env={"TILESCALE_SHARE_GPUS": "0"}, devices=1, share=True).backend == "gloo"


def test_share_mode_with_enough_gpus_keeps_nccl():
    p = plan(1, 2, share=True, devices=2)
    assert (p.device_index, p.backend, p.shared) == (1, "nccl", False)


# --------------------------------------------------------------------------- real spawned groups


def _join(rank, world_size, local_rank, n, master_port):
    """What init_dist does, with a gloo group (no GPU here): resolve, apply defaults, join."""
    import torch
    import torch.distributed as dist

    p = resolve_launch(local_rank, n, master_port, device_count=n)
    apply_env_defaults(p)
    got_rank, got_size, group = _init_group(p, backend="gloo", timeout_s=30)
    t = torch.tensor([got_rank + 1])
    dist.all_reduce(t)
    assert group is dist.group.WORLD
    return got_rank, got_size, t.item(), p.launch_mode, p.master_port, os.environ["NCCL_DEBUG"]


def test_spawned_spawn_mode_group_uses_tilescale_port_first(clean_env):
    port = find_free_port()
    env = {"TILESCALE_MASTER_PORT": str(port), "MASTER_PORT": "1", "NCCL_DEBUG": "WARN"}
    out = run_ranks(_spawn_body, 2, args=(None,), backend=None, env=env, timeout=60)
    assert out == [(0, 2, 3, "spawn", port, "WARN"), (1, 2, 3, "spawn", port, "WARN")]


def _spawn_body(rank, world_size, master_port):
    return _join(rank, world_size, rank, world_size, master_port)


def test_spawned_torchrun_mode_group(clean_env):
    port = find_free_port()
    envs = [
        {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
         "MASTER_PORT": str(port)}
        for r in range(2)
    ]
    out = run_ranks(_spawn_body, 2, args=(None,), backend=None, env=envs, timeout=60)
    assert out == [(0, 2, 3, "torchrun", port, "ERROR"), (1, 2, 3, "torchrun", port, "ERROR")]


def test_spawned_rejection_reaches_the_parent(clean_env):
    env = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
    with pytest.raises(RankFailure, match=r"WORLD_SIZE='4' > LOCAL_WORLD_SIZE='2'"):
        run_ranks(_spawn_body, 2, args=(find_free_port(),), backend=None, env=env, timeout=60)


def test_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan().rank = 3


# --------------------------------------------------------------------------- timeout
def _fake_cuda(monkeypatch):
    import torch

    from tilescale_host import dist_init

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist_init, "_init_group", lambda plan, backend=None, timeout_s=None: calls.append(("group", timeout_s)) or (0, 1, None))
    return dist_init, calls


def test_init_dist_passes_its_timeout_to_the_group(monkeypatch, clean_env):
    dist_init, calls = _fake_cuda(monkeypatch)
    dist_init.init_dist(0, 1, 29500)
    dist_init.init_dist(0, 1, 29500, timeout=12.5)
    assert [c for c in calls if c[0] == "group"] == [("group", dist_init.DEFAULT_TIMEOUT_S), ("group", 12.5)]
    assert dist_init.DEFAULT_TIMEOUT_S <= 600  # not torch's 30-minute default


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-5, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), ("30", TypeError), (True, TypeError)])
def test_init_dist_rejects_bad_timeouts_before_anything(monkeypatch, clean_env, bad, error):
    dist_init, calls = _fake_cuda(monkeypatch)
    with pytest.raises(error, match="timeout must be"):
        dist_init.init_dist(0, 1, 29500, timeout=bad)
    assert calls == []


# --------------------------------------------------------------------------- one job per rendezvous


def _job_member(job, rank, port, value, results):
    """One rank of a 2-rank gloo job ``job`` (TILESCALE_JOB_ID): join, all_reduce ``value``."""
    import torch
    import torch.distributed as dist

    from tilescale_host.dist_init import LaunchPlan

    os.environ["TILESCALE_JOB_ID"] = job
    try:
        _init_group(LaunchPlan(rank, 2, -1, "gloo", "127.0.0.1", port, "spawn"), timeout_s=20)
        t = torch.tensor([value])
        dist.all_reduce(t)
        dist.destroy_process_group()
        results.put((job, rank, t.item()))
    except Exception as exc:
        results.put((job, rank, f"{type(exc).__name__}: {exc}"))


def test_a_stranger_from_another_job_is_refused_and_the_job_is_unharmed(clean_env):
    """Issue 39: job B's rank 0 lost the port to job A, B's rank 1 joined A and A's
    all_reduce(1.0) gave 1001.0. Now B's rank 1 is refused, naming both jobs, B's rank 0 says
    which job could not listen where, and A's own rank 1 completes A's group."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()

    def start(job, rank, value):
        return ctx.Process(target=_job_member, args=(job, rank, port, value, results))

    a0 = start("job-A", 0, 1.0)
    a0.start()
    time.sleep(3.0)  # A's rank 0 holds the port
    b0, b1 = start("job-B", 0, 1000.0), start("job-B", 1, 1000.0)
    b0.start()
    b1.start()
    b1.join(30)
    a1 = start("job-A", 1, 1.0)
    a1.start()
    procs = [a0, b0, b1, a1]
    try:
        got = {}
        deadline = time.monotonic() + 40
        while len(got) < len(procs) and time.monotonic() < deadline:
            try:
                job, rank, value = results.get(timeout=1)
            except queue.Empty:
                continue
            got[job, rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert got.get(("job-A", 0)) == 2.0 and got.get(("job-A", 1)) == 2.0, got
    refusal = got.get(("job-B", 1))
    assert isinstance(refusal, str) and "'job-B'" in refusal and "'job-A'" in refusal, refusal
    lost = got.get(("job-B", 0))  # the port was taken: an error naming the job and the port
    assert isinstance(lost, str) and "rank 0 of job 'job-B' could not listen at 127.0.0.1:" in lost, lost


def test_job_id_is_the_variable_or_the_parent():
    assert job_id({"TILESCALE_JOB_ID": " job-7 "}) == "job-7"
    assert plan(env={"TILESCALE_JOB_ID": "job-7"}).job_id == "job-7"
    own = job_id({})
    assert own.startswith(f"parent pid {os.getppid()} started at tick ") and own == plan().job_id
    assert job_id({"TILESCALE_JOB_ID": "run-1", "TILESCALE_PARENT_PID": str(os.getppid())}) == "run-1"
    # Inherited from a tilescale-run that is not our parent: a sub-job of one of its ranks.
    assert job_id({"TILESCALE_JOB_ID": "run-1", "TILESCALE_PARENT_PID": "1"}) == own
    for bad in ("", "  ", "a\nb"):
        with pytest.raises(ValueError, match="TILESCALE_JOB_ID=.* is not a job id"):
            job_id({"TILESCALE_JOB_ID": bad})


def _job_id_body(rank, world_size):
    return job_id()


def test_ranks_of_one_spawning_parent_share_a_job_id(clean_env):
    ids = run_ranks(_job_id_body, 2, backend=None, timeout=60)
    assert ids[0] == ids[1] and f"parent pid {os.getpid()} " in ids[0]
    assert ids[0] != job_id({})  # this process's own job: its parent
