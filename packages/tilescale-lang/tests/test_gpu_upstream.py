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
    from lang_gpu_helpers import session_cache

    return session_cache(tmp_path_factory, "tilelang-cache-upstream")


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


# ------------------------------------------------------------------------------ NVSHMEM-path programs
def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


#: The attention programs check their kernel against ``dist.all_to_all``, which the gloo group
#: of ranks sharing a GPU lacks ("Backend gloo does not support alltoall"): they need one rank
#: per GPU (NCCL).  On one GPU their kernels run in test_attention_all_to_all_kernels_on_the_heap.
NEEDS_ALL_TO_ALL = pytest.mark.skipif(_gpus() < 2, reason="its torch reference (dist.all_to_all) needs NCCL: "
                                      "2 GPUs; its kernel runs in test_attention_all_to_all_kernels_on_the_heap")

#: Upstream's NVSHMEM examples (tests/data/upstream_nvshmem, verbatim), run unmodified with no
#: NVSHMEM: ``pynvshmem`` is tilescale-host's, the ``T.get_pe`` / ``T.putmem_*`` names are
#: tilescale-lang's (issue 45 item 5).  (program, ranks, arguments, what every rank prints when
#: it passes its own check).  Ranks share a GPU (``--share-gpus``) only where there are fewer GPUs than ranks; cannon and summa
#: hard-code ``cuda:{RANK}``, so on one GPU they run with one rank (MESH 1).
NVSHMEM_PASS = [
    ("example_allgather", 2, ["--M", "1024", "--N", "1024", "--repeat", "2"], "rank {r} check passed."),
    ("example_all_to_all", 2, [], "avg time of RANK {r}:"),
    ("example_allgather_gemm", 2, [], "rank {r} check passed."),
    pytest.param("example_pre_attn_all2all", 2, [], "PE {r} Verification PASSED", marks=NEEDS_ALL_TO_ALL),
    pytest.param("example_pre_attn_all2all_transpose", 2, [], "PE {r} Verification PASSED", marks=NEEDS_ALL_TO_ALL),
    pytest.param("example_post_attn_all2all_transpose", 2, [], "PE {r} Verification PASSED", marks=NEEDS_ALL_TO_ALL),
    ("example_cannon", 1, ["--M", "1024", "--N", "1024", "--K", "1024"], "[Rank {r}] ✅"),
    ("example_summa", 1, ["--M", "1024", "--N", "1024", "--K", "1024"], "[Rank {r}] ✅"),
]
#: Programs that cannot run on the heap, and the line they must fail with.
NVSHMEM_FAIL = [
    # stock TileLang's profiler supplies ordinary torch tensors (upstream's allocates them with pynvshmem)
    ("example_simple_shift", 2, "KernelNotInitializedError"),
    # two nodes (its internode kernel sends to PE (pe + LOCAL_WORLD_SIZE) % (2 * LOCAL_WORLD_SIZE)),
    # cuda-python's metapackage, tilelang.env.env and PassConfigKey.TL_DISABLE_RDC
    ("example_overlapping_allgather", 2, "Error"),
]


def _run_upstream_program(name, ranks, args, tmp_path):
    from upstream_nvshmem import program

    script = tmp_path / f"{name}.py"
    script.write_text(program(name), encoding="utf-8")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "cache"), TILESCALE_WAIT_TIMEOUT_MS="120000")
    launcher = "import sys; from tilescale_host.launcher import main; sys.exit(main(sys.argv[1:]))"
    share = ["--share-gpus"] if ranks > _gpus() else []  # one rank per GPU (NCCL) where there are enough
    cmd = [sys.executable, "-c", launcher, "-n", str(ranks), *share, "--timeout", "540", str(script), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.parametrize("name, ranks, args, passed", NVSHMEM_PASS)
def test_upstream_nvshmem_program_passes_its_own_check(name, ranks, args, passed, tmp_path):
    rc, text = _run_upstream_program(name, ranks, args, tmp_path)
    assert rc == 0, text[-4000:]
    for r in range(ranks):
        assert passed.format(r=r) in text, text[-4000:]
    assert "FAILED" not in text and "❌" not in text, text[-4000:]


@pytest.mark.parametrize("name, ranks, line", NVSHMEM_FAIL)
def test_upstream_nvshmem_program_that_cannot_run_fails_clearly(name, ranks, line, tmp_path):
    rc, text = _run_upstream_program(name, ranks, [], tmp_path)
    assert rc != 0 and line in text, text[-4000:]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_attention_all_to_all_kernels_on_the_heap(world, cache_dir):
    """The three attention programs' kernels, verbatim, on pynvshmem tensors (bound to the
    default heap at their first launch), ranks sharing the GPUs; every element checked."""
    from tilescale_core.multiprocess import run_ranks

    import gpu_attn_kernels as A

    reports = run_ranks(A.rank_body, world, args=(cache_dir,), backend="auto", timeout=300)
    for rank, rep in enumerate(reports):
        assert rep["errors"] == [], f"rank {rank}: {rep['errors'][:6]}"
        assert rep["checks"] == A.expected_checks(), f"rank {rank}: {rep['checks']} checks"
