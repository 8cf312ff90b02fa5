"""The flash-attention forward (tilescale_examples.sequence.flash_attention).

CPU: the torch reference against torch's own attention and a row-by-row computation (causal
with more keys than queries: the queries are the last positions), argument errors before
anything is compiled, the generated CUDA (tensor-core WGMMA, base-2 exponentials, a causal
block's loop bound, a tail tile's key mask and row guard) and an nvcc compile. GPU (``gpu``): outputs and log-sum-exps against the
float32 reference for causal and full attention, grouped-query heads, head dims 64/128/256,
lengths that are not multiples of the tiles,
fresh random inputs and poisoned outputs, on a side stream and replayed from a CUDA graph."""

from __future__ import annotations

import math
import re

import pytest
import torch
from examples_helpers import exits_naming, lower_with, needs_nvcc

from tilescale_examples.sequence.flash_attention import (build_flash_attention_kernel, default_tiles,
                                                         flash_attention, torch_reference)


def _inputs(B, Sq, Skv, H, Hkv, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((B, Sq, H, D), generator=g, device=device).to(dtype)
    k = torch.randn((B, Skv, Hkv, D), generator=g, device=device).to(dtype)
    v = torch.randn((B, Skv, Hkv, D), generator=g, device=device).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_torch_attention(causal):
    q, k, v = _inputs(2, 16, 16, 4, 2, 8)
    o, lse = torch_reference(q, k, v, causal=causal)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=causal).transpose(1, 2)
    assert torch.allclose(o, want, atol=1e-5)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / math.sqrt(8)
    if causal:
        s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-5)


def test_reference_causal_with_more_keys_sees_the_last_positions():
    q, k, v = _inputs(1, 4, 10, 2, 1, 8)
    o, lse = torch_reference(q, k, v, causal=True, scale=0.5)
    for i in range(4):  # query i is position 6 + i: keys 0..6+i
        s = torch.einsum("hd,khd->hk", q[0, i], k[0, :7 + i].expand(-1, 2, -1)) * 0.5
        assert torch.allclose(lse[0, :, i], torch.logsumexp(s, -1), atol=1e-5)
        assert torch.allclose(o[0, i], torch.softmax(s, -1) @ v[0, :7 + i, 0], atol=1e-5)


@pytest.mark.parametrize("change, error, match", [
    (lambda q, k, v: (q.float(), k, v), TypeError, "q must be bfloat16 or float16"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must be \(batch, seq, heads, head_dim\)"),
    (lambda q, k, v: (q.transpose(1, 2), k, v), ValueError, "q must be contiguous"),
    (lambda q, k, v: (q, k, v[:, :128].contiguous()), ValueError, "k and v must be"),
    (lambda q, k, v: (q[:, :, :3].contiguous(), k, v), ValueError, r"q's heads \(3\) must be a multiple of k's \(2\)"),
    (lambda q, k, v: (q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous()), ValueError,
     "head_dim must be one of"),
])
def test_bad_arguments_are_named_before_anything_compiles(change, error, match, monkeypatch):
    import tilelang

    monkeypatch.setattr(tilelang, "compile", lambda *a, **kw: pytest.fail("compiled"))
    q, k, v = _inputs(1, 256, 256, 4, 2, 64, torch.bfloat16)
    with pytest.raises(error, match=match):
        flash_attention(*change(q, k, v))


def test_more_argument_errors(monkeypatch):
    import tilelang

    monkeypatch.setattr(tilelang, "compile", lambda *a, **kw: pytest.fail("compiled"))
    q, k, v = _inputs(1, 256, 128, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="causal attention needs at least as many keys as queries"):
        flash_attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="scale must be a positive number"):
        flash_attention(q, k, v, scale=0)
    with pytest.raises(TypeError, match=r"unknown tile options \['block_k'\]"):
        flash_attention(q, k, v, block_k=64)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor of shape \(1, 256, 4, 64\)"):
        flash_attention(q, k, v, out=torch.empty(1, 256, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="fast_math must be a bool, got 1"):
        flash_attention(q, k, v, fast_math=1)


def test_fast_math_reaches_the_compile_and_the_kernel_cache(monkeypatch):
    """fast_math=True (the default) compiles with TileLang's TL_ENABLE_FAST_MATH (nvcc
    --use_fast_math); fast_math=False with TileLang's default configuration, as a kernel of its
    own."""
    import tilelang

    from tilescale_examples.sequence import flash_attention as module
    from tilescale_examples.sequence.flash_attention import compile_options

    seen, launched = [], []

    def compile_(func, **kw):
        seen.append(kw.get("pass_configs"))
        number = len(seen)
        return lambda *args: launched.append(number)  # stands in for compiled kernel `number`

    monkeypatch.setattr(tilelang, "compile", compile_)
    monkeypatch.setattr(module, "_KERNELS", {})
    q, k, v = _inputs(1, 256, 256, 4, 2, 64, torch.bfloat16)
    for fast in (False, True, False, True):
        flash_attention(q, k, v, fast_math=fast)
    flash_attention(q, k, v)  # the default: fast math
    assert seen == [None, {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}]  # two kernels, each compiled once
    assert launched == [1, 2, 1, 2, 2]  # each call on its own kernel
    assert compile_options(False) is None


@pytest.mark.parametrize("causal", [False, True])
def test_generated_cuda_uses_wgmma_and_base_2(causal):
    src = lower_with(build_flash_attention_kernel(1, 8, 2, 1024, 2048, 128, causal, 128 ** -0.5), {})
    assert "wgmma" in src.lower() and "exp2" in src and "log2" in src
    # 16 key tiles; a causal query block stops after its diagonal's tile: ceil((q_start + (bx + 1) * 128) / 128),
    # q_start = Skv - Sq given at launch (the queries are the last positions); causal grids run the query
    # blocks last to first (bx = 7 - blockIdx.x: the heaviest first)
    bound = "kb < min(16, (((q_start + 1151) >> 7) - ((int)blockIdx.x)))" if causal else "kb < 16"
    assert f"for (int kb = 0; {bound}; ++kb)" in src


def test_a_tail_tile_masks_its_keys_and_guards_its_rows():
    """1000 positions: 8 tiles of 128, the last one short; its keys are masked (position < 1000
    joins the causal test) and only existing rows store their LSE (the loads are TMA's, which
    read zeros past the end)."""
    def mask(src):  # the condition of the scores' initial value: causal, and the key mask with a tail
        lines = src.splitlines()
        return lines[next(n for n, line in enumerate(lines) if "float condval;" in line) + 1]

    src = lower_with(build_flash_attention_kernel(1, 4, 2, 1000, 1000, 128, True, 128 ** -0.5), {})
    assert "for (int kb = 0; kb < min(8, (((q_start + 1151) >> 7) - ((int)blockIdx.x))); ++kb)" in src
    assert "q_start" in mask(src) and "&&" in mask(src)  # causal and before the end
    lse = src.index("LSE[")
    assert "if (" in src[src.rindex("\n", 0, src.rindex("\n", 0, lse)):lse]  # a guarded store
    whole = lower_with(build_flash_attention_kernel(1, 4, 2, 1024, 1024, 128, True, 128 ** -0.5), {})
    assert "q_start" in mask(whole) and "&&" not in mask(whole)  # whole tiles: causal only


@needs_nvcc
def test_kernel_compiles_with_nvcc(tmp_path, monkeypatch):
    """Head dims 64 and 256 with the default configuration (fast math), 128 without fast math."""
    import tilelang

    from tilescale_examples.sequence.flash_attention import compile_options

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    for D, fast in ((64, True), (256, True), (128, False)):
        kernel = tilelang.compile(build_flash_attention_kernel(1, 4, 2, 256, 256, D, True, D ** -0.5,
                                                               **default_tiles(D)),
                                  target={"kind": "cuda", "arch": "sm_90a"}, pass_configs=compile_options(fast))
        assert kernel.prim_func.attrs["global_symbol"] == "flash_attention"


# ------------------------------------------------------------------------------ GPU
CASES = [  # B, Sq, Skv, H, Hkv, D, causal, dtype
    (2, 1024, 1024, 8, 8, 128, False, torch.bfloat16),
    (2, 1024, 1024, 8, 2, 128, True, torch.bfloat16),
    (1, 512, 2048, 4, 1, 128, True, torch.float16),
    (1, 2048, 2048, 16, 4, 64, True, torch.bfloat16),
    (1, 512, 512, 4, 4, 256, False, torch.bfloat16),
    (2, 1000, 1000, 8, 2, 128, True, torch.bfloat16),  # tail tiles
    (1, 300, 700, 4, 4, 64, True, torch.float16),
    (1, 77, 77, 4, 1, 128, False, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_gpu_flash_attention_matches_the_reference(case):
    """Three seeds: two with the default kernel (fast math), the third compiled without
    fast math (``fast_math=False``: IEEE exponentials and division)."""
    B, Sq, Skv, H, Hkv, D, causal, dtype = case
    for seed in range(3):
        q, k, v = _inputs(B, Sq, Skv, H, Hkv, D, dtype, "cuda", seed)
        out = torch.full((B, Sq, H, D), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((B, H, Sq), float("nan"), device="cuda")
        flash_attention(q, k, v, causal=causal, out=out, lse=lse, fast_math=seed != 2, pipeline="sync")
        want_o, want_lse = torch_reference(q, k, v, causal=causal)
        torch.cuda.synchronize()
        assert torch.allclose(out.float(), want_o, atol=2e-2, rtol=2e-2), (out.float() - want_o).abs().max()
        assert torch.allclose(lse, want_lse, atol=1e-3, rtol=1e-3), (lse - want_lse).abs().max()


@pytest.mark.gpu
def test_gpu_flash_attention_on_a_side_stream_and_in_a_cuda_graph():
    q, k, v = _inputs(1, 1024, 1024, 8, 2, 128, torch.bfloat16, "cuda")
    out, lse = flash_attention(q, k, v, causal=True, pipeline="sync")  # compiled and warm
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.fill_(float("nan"))
        flash_attention(q, k, v, causal=True, out=out, lse=lse, pipeline="sync")
    torch.cuda.current_stream().wait_stream(side)
    want_o, _ = torch_reference(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), want_o, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_attention(q, k, v, causal=True, out=out, lse=lse, pipeline="sync")
    for seed in (5, 6):
        fresh = _inputs(1, 1024, 1024, 8, 2, 128, torch.bfloat16, "cuda", seed)
        for dst, src in zip((q, k, v), fresh):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out.float(), torch_reference(q, k, v, causal=True)[0], atol=2e-2, rtol=2e-2)


def test_benchmark_flops_and_goal():
    from tilescale_examples.benchmarks.attention import flops, goal_lines

    assert flops(1, 32, 4096, 128, False) == 4.0 * 32 * 4096 * 4096 * 128
    assert flops(1, 32, 4096, 128, True) == flops(1, 32, 4096, 128, False) / 2
    rows = [[4096, False, 100.0, 90.0, 120.0, 500.0, 550.0, 0.9, "128x128:2:256", "ok"],
            [4096, True, 60.0, "-", "-", 400.0, "-", "-", "128x128:2:256", "ok"]]
    assert goal_lines(rows) == ["worst tilescale vs best torch backend: 0.900 (goal >= 0.9)"]
    assert goal_lines(rows[1:]) == ["worst tilescale vs best torch backend: not measured"]


def test_benchmark_tiles_option(capsys):
    from tilescale_examples.benchmarks.attention import main, parse_tiles, tiles_label
    from tilescale_examples.sequence.flash_attention import check_tiles

    assert parse_tiles("128x64") == {"block_m": 128, "block_n": 64}
    assert parse_tiles("64x128:3:128") == {"block_m": 64, "block_n": 128, "num_stages": 3, "threads": 128}
    assert tiles_label(check_tiles(parse_tiles("128x64:1"), 128)) == "128x64:1:256"  # threads: the default
    assert tiles_label(check_tiles({}, 128), fast_math=False) == "128x128:1:256 ieee"
    exits_naming(main, ["--fast-math", "yes"], "--fast-math", capsys)
    for bad, words in (("128x64x64", "BMxBN[:STAGES[:THREADS]]"), ("128x64:1:128:4", "BMxBN[:STAGES[:THREADS]]"),
                       ("128xa", "ints only")):
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_tiles(bad)
    exits_naming(main, ["--tiles", "128x64", "64"], "--tiles must be BMxBN[:STAGES[:THREADS]], got '64'", capsys)
