"""PeerWatch: when one rank is SIGKILLed, every other rank stops within a second, naming it
(real processes over gloo, CPU only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tilescale_core.multiprocess import find_free_port
from tilescale_core.peer_watch import EXIT_PEER_DIED, process_alive

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch.distributed as dist
    from tilescale_core.peer_watch import PeerWatch
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    watch = PeerWatch()
    print("watching", flush=True)
    if rank == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # stuck, as if waiting on the dead rank
    print("NOT STOPPED", flush=True)
    """
)


def test_survivors_stop_naming_the_killed_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port, world = find_free_port(), 3
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "watching"
        start = time.monotonic()
        outs = [p.communicate(timeout=30) for p in procs]
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[2].returncode == -9
    for r in (0, 1):
        assert procs[r].returncode == EXIT_PEER_DIED, outs[r]
        assert f"[tilescale] rank {r}: peer rank 2 (pid {procs[2].pid}) died" in outs[r][1]
        assert "NOT STOPPED" not in outs[r][0]
    assert elapsed < 5.0, f"survivors took {elapsed:.1f} s to stop"


def test_process_alive():
    assert process_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not process_alive(p.pid)
