"""The autotuner on a GPU: a small real TileLang GEMM tuned over gemm_space (with swizzle and
a deliberately wrong variant that the check must reject), at world 1 and on 2 ranks sharing
one GPU with a noisy rank. Run with ``pytest -m gpu``; skipped with a reason without a GPU."""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

import random

import pytest

pytestmark = pytest.mark.gpu

M = N = K = 256
TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _space():
    """gemm_space's tiles and swizzle, times a ``wrong`` axis (True: the last k tile is skipped)."""
    from tilescale_lang.autotune import SearchSpace, gemm_space

    base = gemm_space(M, N, K, "bfloat16", block_m=(64, 128), block_n=(128,), block_k=(64,), num_stages=(2,),
                      threads=(128,), swizzle=(0, 4))
    return SearchSpace({**dict(base.axes), "wrong": (False, True)},
                       valid=lambda c: {a: v for a, v in c.items() if a != "wrong"} in base, name="gemm-test")


def _gemm(block_m, block_n, block_k, num_stages, threads, swizzle, wrong):
    import tilelang.language as T

    steps = K // block_k - (1 if wrong else 0)

    @T.prim_func
    def gemm(A: T.Tensor((M, K), "bfloat16"), B: T.Tensor((K, N), "bfloat16"), C: T.Tensor((M, N), "bfloat16")):
        with T.Kernel(N // block_n, M // block_m, threads=threads) as (bx, by):
            T.use_swizzle(panel_size=max(swizzle, 1), enable=swizzle > 0)
            A_s = T.alloc_shared((block_m, block_k), "bfloat16")
            B_s = T.alloc_shared((block_k, block_n), "bfloat16")
            C_f = T.alloc_fragment((block_m, block_n), "float32")
            T.clear(C_f)
            for kk in T.Pipelined(steps, num_stages=num_stages):
                T.copy(A[by * block_m, kk * block_k], A_s)
                T.copy(B[kk * block_k, bx * block_n], B_s)
                T.gemm(A_s, B_s, C_f)
            T.copy(C_f, C[by * block_m, bx * block_n])

    return gemm


def _problem(seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = a.float() @ b.float()
    return a, b, torch.empty(M, N, device="cuda", dtype=torch.bfloat16), ref


def _correct(out, ref) -> bool:
    """Within a bfloat16 rounding of the float32 reference plus summation-order slack."""
    rms = ref.pow(2).mean().sqrt()
    return bool(((out.float() - ref).abs() <= 2.0**-7 * ref.abs() + 1e-3 * rms).all())


def _build(a, b, c, group=None):
    import tilelang

    def build(config):
        kernel = tilelang.compile(_gemm(**config), target=TARGET, compile_once=True)

        def launch():
            kernel(a, b, c)
            return c

        return launch

    return build


def test_tunes_a_real_gemm_at_world_1(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    from tilescale_lang.autotune import tune

    a, b, c, ref = _problem()
    space = _space()
    result = tune(space, _build(a, b, c), name="gemm-test", dtype="bfloat16", shapes={"m": M, "n": N, "k": K},
                  check=lambda out: _correct(out, ref), cache_dir=tmp_path)
    assert result.source == "tuned" and result.config["wrong"] is False, result
    wrong = [s for s in result.skipped if s.config["wrong"]]
    assert len(wrong) == len(space) // 2 and {s.stage for s in wrong} == {"check"}, result.skipped
    assert len(result.timings) == len(space) // 2 and result.time_ms > 0
    c.zero_()
    assert _correct(_build(a, b, c)(result.config)(), ref)  # the winner, compiled again, is correct

    def no_timing(launch):
        raise AssertionError("a cached config was timed again")

    again = tune(space, _build(a, b, c), name="gemm-test", dtype="bfloat16", shapes={"m": M, "n": N, "k": K},
                 check=lambda out: _correct(out, ref), cache_dir=tmp_path, timer=no_timing)
    assert again.source == "cache" and again.config == result.config


def _shared_gpu_body(rank, world, cache_dir):
    """Both policies on ranks sharing cuda:0; rank 1's clock multiplies by up to 6 at random."""
    import os

    import torch

    from tilescale_lang.autotune import default_timer, tune

    os.environ["TILELANG_CACHE_DIR"] = os.path.join(cache_dir, "tilelang")
    torch.cuda.set_device(0)
    a, b, c, ref = _problem()
    jitter = random.Random()

    def timer(launch):
        ms = default_timer(launch)
        return ms * (1 + 5 * jitter.random()) if rank == 1 else ms

    out = {}
    for policy in ("root", "slowest"):
        result = tune(_space(), _build(a, b, c), name=f"gemm-shared-{policy}", dtype="bfloat16",
                      shapes={"m": M, "n": N, "k": K}, check=lambda o: _correct(o, ref), cache_dir=cache_dir,
                      policy=policy, timer=timer)
        c.zero_()
        out[policy] = (result.config, _correct(_build(a, b, c)(result.config)(), ref))
    return out


def test_ranks_sharing_a_gpu_pick_the_same_gemm(tmp_path):
    from tilescale_core.multiprocess import run_ranks

    out = run_ranks(_shared_gpu_body, 2, args=(str(tmp_path),), backend="gloo", timeout=580)
    for policy in ("root", "slowest"):
        assert out[0][policy] == out[1][policy], (policy, out)
        assert out[0][policy][0]["wrong"] is False and out[0][policy][1] is True
