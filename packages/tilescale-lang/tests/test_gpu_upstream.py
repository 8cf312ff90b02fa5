"""GPU tests of upstream TileScale compatibility (issue 13): the one-word barrier, remote
atomics, remote TMA, compile_root / jit compile_once, create_host_device_tensor and
tilelang.distributed.bench -- on 1 rank and on 2 ranks sharing one GPU -- and the debug trap
of a remote TMA PE without a descriptor.

Run with ``pytest -m gpu``; skipped with a reason when no GPU is visible.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tilelang-cache-upstream"))


@pytest.mark.parametrize("world", [1, 2])
def test_upstream_features_across_ranks(world, cache_dir):
    from tilescale_core.multiprocess import run_ranks

    import gpu_upstream_kernels as G

    reports = run_ranks(G.rank_body, world, args=(cache_dir,), backend="auto", timeout=240)
    for rank, rep in enumerate(reports):
        # barriers 6, atomics 1 (+8 on rank 0, which every rank adds into), TMA 3 x 2 + 2, host 3
        assert rep["checks"] == 6 + (9 if rank == 0 else 1) + 8 + 3, f"rank {rank}: {rep['checks']} checks"
        assert rep["errors"] == [], f"rank {rank}: {rep['errors'][:10]}"


def test_remote_tma_pe_without_descriptor_traps_under_debug(tmp_path):
    import gpu_upstream_kernels as G

    script = tmp_path / "tma_debug.py"
    script.write_text(G.TMA_DEBUG_SCRIPT)
    env = dict(os.environ, TILESCALE_DEBUG="1", TILELANG_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(G.__file__), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-3000:]
    assert "[tilescale] remote TMA: PE 9 is outside the PEs 0..7" in text, text[-3000:]
    assert "HOST-ERROR" in text, text[-3000:]
