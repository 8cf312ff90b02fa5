"""tilescale_examples.overlap.tuning: the library GEMM's tiles from the rank-consistent
autotuner, on the CPU with a stand-in compiler (each candidate a torch matmul, wrong on purpose
for some) and a stand-in timer: the fastest correct candidate wins, the winner is cached and
read back without timing, ``mode="off"`` times nothing, bad arguments fail first."""

from __future__ import annotations

import pytest
import torch

from tilescale_examples.overlap.gemm import GemmTiles
from tilescale_examples.overlap.tuning import tiles_of, tune_tiles

M, N, K = 128, 256, 128


@pytest.fixture
def fake_compiler(monkeypatch):
    """``tilelang.compile`` returns a kernel that computes ``a @ b`` into ``out`` (off by one
    everywhere when the tiles have ``num_stages == 2``); the compiled configs are recorded."""
    import tilelang

    from tilescale_examples.overlap import tuning

    built = []
    def build(m, n, k, name, tiles, store):
        assert store == tuning.default_store(tiles)  # the epilogue the ops give these tiles
        return tiles

    monkeypatch.setattr(tuning, "build_gemm_kernel", build)

    def compile(tiles, target=None):
        built.append(tiles)

        def kernel(a, b, out):
            out.copy_((a.float() @ b.float() + (1.0 if tiles.num_stages == 2 else 0.0)).to(out.dtype))

        return kernel

    monkeypatch.setattr(tilelang, "compile", compile)
    from tilescale_examples.testing import precompile

    monkeypatch.setattr(precompile, "precompile", lambda jobs, **kw: built.append(("precompile", list(jobs), kw)))
    return built


def test_fastest_correct_candidate_wins_and_is_cached(fake_compiler, tmp_path):
    from tilescale_lang.autotune import gemm_space

    space = gemm_space(M, N, K, "bfloat16", block_m=(64, 128), block_n=(128, 256), num_stages=(2, 3),
                       threads=(128,), block_k=(64,))
    candidates = list(space)
    timed = []
    #: milliseconds per (block_m, block_n); num_stages 3 a quarter slower
    speed = {(64, 128): 3.0, (64, 256): 2.0, (128, 128): 1.5, (128, 256): 2.5}

    def timer(launch):
        config = fake_compiler[-1]  # the candidate just built
        launch()
        timed.append(config)
        return speed[(config.block_m, config.block_n)] + (0.0 if config.num_stages == 2 else 0.25)

    tiles, result = tune_tiles(M, N, K, torch.bfloat16, device="cpu", space=space, timer=timer, cache_dir=tmp_path,
                               mode="on", workers=3)
    (_, jobs, options), *_ = fake_compiler  # every candidate compiled in parallel first, then built one by one
    assert fake_compiler[0][0] == "precompile" and options == {"workers": 3}
    assert [job[1][4] for job in jobs] == [tiles_of(c) for c in candidates]
    assert [job[1][5] for job in jobs] == ["tma"] * len(candidates)  # the sync pipeline's default epilogue
    assert jobs[0][0] == "tilescale_examples.overlap.gemm:build_gemm_kernel" and jobs[0][1][:4] == (M, N, K, "bfloat16")
    del fake_compiler[0]
    # num_stages 2 is the fastest for every tile but wrong: skipped; the fastest right one wins
    assert tiles == GemmTiles(128, 128, 64, 3, 128) and result.source == "tuned"
    assert all(t.num_stages == 3 for t in timed)
    assert len(result.skipped) == len([c for c in candidates if c["num_stages"] == 2])
    n_built = len(fake_compiler)
    again, cached = tune_tiles(M, N, K, "bfloat16", device="cpu", space=space, timer=timer, cache_dir=tmp_path,
                               mode="cache_only")
    assert again == tiles and cached.source == "cache" and len(fake_compiler) == n_built  # nothing compiled


def test_mode_off_takes_the_first_candidate_without_timing(fake_compiler, tmp_path):
    from tilescale_lang.autotune import gemm_space

    space = gemm_space(M, N, K, "float16", block_m=(128,), block_n=(256, 128), num_stages=(3,), threads=(256,),
                       block_k=(64,))
    tiles, result = tune_tiles(M, N, K, torch.float16, device="cpu", space=space, cache_dir=tmp_path, mode="off",
                               timer=lambda launch: pytest.fail("timed with mode='off'"))
    assert result.source == "off" and tiles == tiles_of(next(iter(space))) and fake_compiler == []


def test_cache_only_without_an_entry_raises(fake_compiler, tmp_path):
    from tilescale_lang.autotune import AutotuneCacheMiss

    with pytest.raises(AutotuneCacheMiss):
        tune_tiles(M, N, K, torch.bfloat16, device="cpu", cache_dir=tmp_path, mode="cache_only")
    assert fake_compiler == []


def test_bad_arguments_fail_before_anything_is_compiled(fake_compiler, tmp_path):
    with pytest.raises(TypeError, match="dtype must be one of"):
        tune_tiles(M, N, K, torch.float32, device="cpu", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="n must be a positive int"):
        tune_tiles(M, 0, K, torch.bfloat16, device="cpu", cache_dir=tmp_path)
    assert fake_compiler == []


def test_tiles_of_reads_the_five_axes_the_swizzle_the_pipeline_and_the_warp_policy():
    assert tiles_of({"block_m": 64, "block_n": 128, "block_k": 64, "num_stages": 4, "threads": 128,
                     "swizzle": 8}) == GemmTiles(64, 128, 64, 4, 128, 8)
    five = tiles_of({"block_m": 64, "block_n": 128, "block_k": 64, "num_stages": 4, "threads": 128})
    assert five.swizzle == 0 and five.pipeline == "sync" and five.warp_policy == "square"
    assert tiles_of({"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 4, "threads": 256,
                     "warp_policy": "row"}).warp_policy == "row"
    assert tiles_of({"block_m": 64, "block_n": 128, "block_k": 64, "num_stages": 4, "threads": 128,
                     "pipeline": "async"}) == GemmTiles(64, 128, 64, 4, 128, 0, "async")
    with pytest.raises(ValueError, match=r"lacks the tile axes \['threads'\]"):
        tiles_of({"block_m": 64, "block_n": 128, "block_k": 64, "num_stages": 4})


def test_overlap_benchmarks_take_tune():
    from tilescale_examples.benchmarks import _overlap

    for op in ("ag_gemm", "gemm_rs"):
        parser = _overlap.parser(op)
        assert parser.parse_args(["--tune"]).tune and not parser.parse_args([]).tune


def test_the_parallel_compile_builds_the_library_gemm():
    """The workers import GEMM_BUILDER: the real builder, and its job arguments are hashable
    (precompile drops duplicate jobs) and picklable (they go to spawned processes)."""
    import importlib
    import pickle

    from tilescale_examples.overlap import gemm
    from tilescale_examples.overlap.tuning import GEMM_BUILDER

    module, name = GEMM_BUILDER.split(":")
    assert getattr(importlib.import_module(module), name) is gemm.build_gemm_kernel
    job = (GEMM_BUILDER, (M, N, K, "bfloat16", GemmTiles(128, 128, 64, 3, 128)), None)
    assert pickle.loads(pickle.dumps(job)) == job and hash(job[1])
