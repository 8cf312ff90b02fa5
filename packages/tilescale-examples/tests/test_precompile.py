"""tilescale_examples.testing.precompile: kernels compiled in worker processes are cache hits for the
collectives' own compiles (the same cache key), duplicates are compiled once; precompile_op
compiles what a dry run of an op's constructor records, the kernels the op then loads."""

from __future__ import annotations

import os

from examples_helpers import needs_nvcc

from tilescale_examples.testing.precompile import precompile, precompile_op, reduction_jobs, with_copies


def cache_files(cache) -> set:
    """Files of the TileLang cache (the compile lock's directory left out)."""
    found = set()
    for root, dirs, files in os.walk(cache):
        dirs[:] = [d for d in dirs if not d.startswith("tilescale-locks")]
        found.update(os.path.relpath(os.path.join(root, f), cache) for f in files)
    return found


def test_reduction_jobs_match_the_collectives_defaults():
    from tilescale_examples.collectives.reduce_engine import PASS_CONFIGS, default_unroll

    jobs = reduction_jobs(["one_shot", "reduce_scatter"], ["float16"], [2, 8])
    assert [j[1] for j in jobs] == [("one_shot", "float16", 2, 512, default_unroll(2)),
                                    ("reduce_scatter", "float16", 2, 512, default_unroll(2)),
                                    ("one_shot", "float16", 8, 512, 1), ("reduce_scatter", "float16", 8, 512, 1)]
    assert all(j[0] == "tilescale_examples.collectives.reduce_engine:build_reduce_kernel" and j[2] == PASS_CONFIGS for j in jobs)
    assert reduction_jobs(["two_shot"], ["int32"], [4], threads=256, unroll=3)[0][1] == ("two_shot", "int32", 4, 256, 3)
    both = reduction_jobs(["one_shot", "lamport"], ["float16"], [2], call_numbers=("device", "argument"))
    assert [j[1] for j in both] == [("one_shot", "float16", 2, 512, default_unroll(2)),
                                    ("one_shot", "float16", 2, 512, default_unroll(2), "argument"),
                                    ("float16", 2, 512, default_unroll(2))]  # the Lamport kernel: no call number
    assert precompile([]) == []


@needs_nvcc
def test_precompiled_kernel_is_a_cache_hit(tmp_path, monkeypatch):
    import tilelang  # noqa: F401

    from tilescale_examples.base import compile_once, copy_symbol
    from tilescale_examples.collectives.reduce_engine import PASS_CONFIGS, build_reduce_kernel

    cache = tmp_path / "cache"
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    monkeypatch.setenv("TILESCALE_WAIT_TIMEOUT_MS", "4321")  # part of the compile flags
    job = reduction_jobs(["one_shot"], ["float32"], [2])[0]
    # one compile for duplicates; with_copies adds the copy a second emulated rank compiles
    assert precompile(with_copies([job, job], 2), str(cache)) == ["allreduce_one_shot", "allreduce_one_shot_copy1"]
    before = cache_files(cache)
    assert before
    func = build_reduce_kernel("one_shot", "float32", 2, 512, job[1][4])
    compile_once(func, None, None, PASS_CONFIGS)
    compile_once(func.with_attr("global_symbol", copy_symbol("allreduce_one_shot", 1)), None, None, PASS_CONFIGS)
    assert cache_files(cache) == before  # nothing new compiled: the same cache keys


@needs_nvcc
def test_precompiled_gemm_allreduce_is_a_cache_hit(tmp_path, monkeypatch):
    import tilelang  # noqa: F401

    from tilescale_examples.base import compile_once
    from tilescale_examples.decode.gemm_allreduce import gemm_allreduce_jobs
    from tilescale_examples.decode.gemm_ar_kernel import PASS_CONFIGS, build_gemm_ar_kernel

    cache = tmp_path / "cache"
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    [job] = gemm_allreduce_jobs([1], 64, 128, "bfloat16", [2], 132)
    assert precompile([job], str(cache)) == ["gemm_allreduce"]
    before = cache_files(cache)
    compile_once(build_gemm_ar_kernel(*job[1]), None, None, PASS_CONFIGS)
    assert cache_files(cache) == before


def test_a_dry_run_records_what_the_op_would_compile():
    import torch

    from tilescale_examples import AllGather, AllReduce
    from tilescale_examples._contract import RecordingAllocator

    alloc = RecordingAllocator(4, sm_count=132)
    AllReduce(alloc, (4096,), torch.bfloat16, world_size=4, algorithm="two_shot")
    [(build, target, pass_configs)] = alloc.builds
    assert str(build().attrs["global_symbol"]) == "allreduce_two_shot" and target is None and pass_configs
    alloc = RecordingAllocator(2)
    AllGather(alloc, (256,), torch.float16, world_size=2, algorithm="sm")
    assert len(alloc.builds) == 1


@needs_nvcc
def test_precompile_op_fills_the_cache_the_op_loads_from(tmp_path, monkeypatch):
    import pytest
    import torch

    from tilescale_examples import AllReduce
    from tilescale_examples.base import compile_once
    from tilescale_examples.collectives.reduce_engine import PASS_CONFIGS, build_reduce_kernel, default_unroll

    cache = tmp_path / "cache"
    monkeypatch.setenv("TILESCALE_WAIT_TIMEOUT_MS", "4321")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        precompile_op(AllReduce, (4096,), torch.float32, world_size=2, algorithm="three_shot", cache_dir=cache)
    assert not cache.exists()  # refused before compiling
    assert precompile_op(AllReduce, (4096,), torch.float32, world_size=3, algorithm="one_shot",
                         cache_dir=cache) == ["allreduce_one_shot"]
    assert "TILELANG_CACHE_DIR" not in os.environ or os.environ["TILELANG_CACHE_DIR"] != str(cache)
    before = cache_files(cache)
    assert before
    assert len(list((cache / "tilescale-launch").glob("*.json"))) == 1  # and its launch metadata (frozen launches)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    compile_once(build_reduce_kernel("one_shot", "float32", 3, 512, default_unroll(3)), None, None, PASS_CONFIGS)
    assert cache_files(cache) == before  # the op's own compile is a cache hit


def test_precompile_op_of_an_auto_op_compiles_every_plan_it_may_choose(monkeypatch):
    """AllGatherGEMM's ``"auto"`` picks its plan by probing the devices at construction: the
    precompile covers both plans (the fused plan's own-rows and peer GEMMs, the sequential
    plan's all-gather and whole-operand GEMM); a named plan, that plan's kernels only."""
    import tilelang
    import torch

    from tilescale_examples import AllGatherGEMM

    seen = []
    monkeypatch.setattr(tilelang, "compile", lambda func, **kw: seen.append(str(func.attrs["global_symbol"])))
    assert precompile_op(AllGatherGEMM, 256, 512, 256, torch.bfloat16, world_size=2) == [
        "gemm_tma_store", "ag_gemm", "allgather", "gemm_tma_store"] == seen
    assert precompile_op(AllGatherGEMM, 256, 512, 256, torch.bfloat16, world_size=2,
                         algorithm="sequential") == ["allgather", "gemm_tma_store"]
