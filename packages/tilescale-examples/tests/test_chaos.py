"""Chaos tests on a GPU (``-m gpu``; ranks share one GPU, gloo): a rank SIGKILLed in the middle
of a loop of each collective, and 1000 calls of each with a random straggler before every
call.  Each test prints its measurement (time to detect, calls checked) with ``-s``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from examples_helpers import run_gpu_ranks

import chaos_bodies

pytestmark = [pytest.mark.gpu, pytest.mark.chaos, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpu_pids() -> set:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return {int(x) for x in out.stdout.split() if x.strip().isdigit()}


@pytest.mark.parametrize("name", chaos_bodies.CASES)
def test_sigkill_one_rank_mid_loop(name, tmp_path_factory):
    from tilescale_core.multiprocess import find_free_port
    from tilescale_core.peer_watch import EXIT_PEER_DIED, process_alive

    world, victim = 3, 1
    cache = str(tmp_path_factory.getbasetemp() / "tilelang-cache-chaos")
    env = dict(os.environ, TILESCALE_SHARE_GPUS="1", TILESCALE_WAIT_TIMEOUT_MS="20000")
    port = find_free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "chaos_bodies.py"), name, str(r), str(world), str(port), cache],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE)
             for r in range(world)]
    try:
        deadline = time.monotonic() + 240
        line = ""
        while time.monotonic() < deadline:  # let the victim get well into the loop
            line = procs[victim].stdout.readline()
            if line.startswith("iter 50") or not line:
                break
        assert line.startswith("iter 50"), (line, procs[victim].poll())
        procs[victim].kill()
        killed = time.monotonic()
        outs = {}
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=60)
            outs[r] = (p.returncode, time.monotonic() - killed, err[-2000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    detect = max(outs[r][1] for r in outs if r != victim)
    print(f"\n[chaos] {name}: rank {victim} SIGKILLed after 50 calls; survivors stopped within {detect:.2f} s")
    for r, (code, elapsed, err) in outs.items():
        if r == victim:
            continue
        assert code == EXIT_PEER_DIED, (r, code, err)
        assert f"peer rank {victim} (pid {procs[victim].pid}) died" in err, err
        assert elapsed < 30
    pids = {p.pid for p in procs}
    time.sleep(1.0)
    assert not any(process_alive(p) for p in pids)
    assert not (pids & _gpu_pids()), "a rank is still on the GPU"
    # a new heap can be created right after
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch, tilelang; a = tilelang.get_allocator(size=2**24, device='cuda:0', "
         "is_distributed=False); t = tilelang.tensor((16,), torch.float32, allocator=a); t.fill_(3); "
         "torch.cuda.synchronize(); assert t.sum().item() == 48; a.close(); print('HEAP-OK')"],
        capture_output=True, text=True, env=env, timeout=120)
    assert "HEAP-OK" in fresh.stdout, fresh.stderr[-2000:]


@pytest.mark.parametrize("name", chaos_bodies.CASES)
def test_1000_calls_with_random_stragglers(name, tmp_path_factory):
    # run_gpu_ranks passes (rank, world, cache); the collective's name rides in the env
    reports = run_gpu_ranks(_stragglers, 3, tmp_path_factory, f"chaos-{name}")
    for rep in reports:
        assert rep["checks"] == 1000 and rep["wrong"] == [], rep
    assert sum(rep["delayed"] for rep in reports) == 1000
    print(f"\n[chaos] {name}: 1000 calls x 3 ranks with a random straggler each; no wrong element")


def _stragglers(rank, world, cache):
    return chaos_bodies.stragglers_body(rank, world, cache, os.environ["CHAOS_COLLECTIVE"], 1000, seed=1234)


@pytest.fixture(autouse=True)
def _collective_env(request, monkeypatch):
    """Spawned ranks inherit the environment: tell them which collective to run."""
    name = request.node.callspec.params.get("name") if hasattr(request.node, "callspec") else None
    if name:
        monkeypatch.setenv("CHAOS_COLLECTIVE", name)
    monkeypatch.setenv("TILESCALE_SHARE_GPUS", "1")
