"""The shared GEMM pieces on the CPU: tiles, shape checks, the error bound, the stock
kernel's generated CUDA and an nvcc compile."""

from __future__ import annotations

import pytest
import tilelang
import torch
from examples_helpers import kernel_body, lower_source, needs_nvcc

from tilescale_examples.base import TARGET
from tilescale_examples.overlap.gemm import (RASTER_MIN_COLUMN_BLOCKS, RASTER_PANEL, GemmTiles, build_gemm_kernel,
                                             check_gemm_dims, count_outside, default_swizzle, default_tiles,
                                             error_bound, resolve_tiles, unit_roundoff)


def test_default_tiles_are_the_hopper_example_shape():
    t = GemmTiles()
    assert (t.block_m, t.block_n, t.block_k, t.num_stages, t.threads, t.swizzle, t.pipeline) == (128, 256, 64, 3, 256, 0,
                                                                                                  "sync")


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=0), "block_m must be a positive int"),
    (dict(num_stages=True), "num_stages must be a positive int"),
    (dict(threads=192), "threads must be a multiple of 128"),
    (dict(swizzle=-1), "swizzle must be an int >= 0"),
    (dict(swizzle=True), "swizzle must be an int >= 0"),
    (dict(pipeline="fast"), "pipeline must be one of"),
    (dict(pipeline="async", num_stages=1), "num_stages must be >= 2 for the async pipeline"),
])
def test_tiles_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GemmTiles(**kwargs)


@pytest.mark.parametrize("dims,match", [
    (dict(m_local=1000), r"Owner: m_local=1000 is not a multiple of block_m=128 \(the GEMM tile\); pad m_local to 1024"),
    (dict(k=8200), "k=8200 is not a multiple of block_k=64"),
    (dict(n=3000), "n=3000 is not a multiple of block_n=256"),
    (dict(n=0), "n must be a positive int"),
    (dict(m=-128), "m must be a positive int"),
])
def test_dims_must_be_tile_multiples(dims, match):
    with pytest.raises(ValueError, match=match):
        check_gemm_dims("Owner", GemmTiles(), **dims)
    check_gemm_dims("Owner", GemmTiles(), m_local=1024, k=8192, n=3584)  # the benchmark shape passes


def test_error_bound_accepts_rounding_and_rejects_wrong_elements():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(256, 256, generator=g)
    for dtype in (torch.float16, torch.bfloat16):
        bad, worst = count_outside(ref.to(dtype), ref, dtype)  # one rounding: inside
        assert bad == 0 and 0.1 < worst <= 1.0
        wrong = ref.to(dtype).clone()
        wrong[3, 7] += 0.05
        wrong[9, 9] = float("nan")
        assert count_outside(wrong, ref, dtype)[0] == 2
    # rounded intermediates widen the bound by u * their magnitude
    u = unit_roundoff(torch.bfloat16)
    assert torch.allclose(error_bound(ref, torch.bfloat16, torch.ones_like(ref)) - error_bound(ref, torch.bfloat16),
                          torch.full_like(ref, u))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        unit_roundoff(torch.float32)


def test_stock_gemm_uses_tma_and_wgmma_and_no_tilescale():
    body = kernel_body(lower_source(build_gemm_kernel(512, 512, 256, "bfloat16")))
    assert "tl::tma_load(A_desc" in body and "tl::tma_load(B_desc" in body and "wgmma" in body
    assert "tilescale::" not in body
    with pytest.raises(ValueError, match="m=200 is not a multiple of block_m=128"):
        build_gemm_kernel(200, 512, 256)


def test_swizzle_rasterizes_every_tiled_gemm():
    """``swizzle`` remaps the blocks of the plain GEMM, the AllGatherGEMM peer GEMM and the
    GemmReduceScatter GEMM in panels; 0 leaves the grid's order (and the kernel's source) as it
    was."""
    from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel
    from tilescale_examples.overlap.gemm_rs import build_gemm_rs_kernel

    raster = "const dim3 blockIdx = tl::rasterization2DRow<8>();"
    for build in (lambda t: build_gemm_kernel(512, 512, 256, "bfloat16", t),
                  lambda t: build_ag_gemm_kernel(256, 256, 512, 2, 2, "bfloat16", t),
                  lambda t: build_gemm_rs_kernel(256, 256, 512, 2, "bfloat16", t)):
        plain, swizzled = lower_source(build(GemmTiles())), lower_source(build(GemmTiles(swizzle=8)))
        assert "rasterization" not in plain and raster in swizzled


@pytest.mark.parametrize("n,block_n,expected", [(3584, 256, 0), (4096, 256, 0), (4352, 256, 8), (28672, 256, 8),
                                                (3584, 128, 8), (1024, 64, 0)])
def test_default_swizzle_rasterizes_outputs_wider_than_16_column_blocks(n, block_n, expected):
    assert default_swizzle(n, block_n) == expected
    assert RASTER_PANEL == 8 and RASTER_MIN_COLUMN_BLOCKS == 16
    assert default_tiles(n).swizzle == default_swizzle(n, GemmTiles.block_n)
    tiles = resolve_tiles(n, 128, block_n, 64, 3, 256, None)
    assert tiles == GemmTiles(128, block_n, 64, 3, 256, expected)
    assert resolve_tiles(n, 128, block_n, 64, 3, 256, 0).swizzle == 0  # an explicit choice wins
    assert resolve_tiles(n, 128, block_n, 64, 3, 256, 4).swizzle == 4
    with pytest.raises(ValueError, match="block_n must be a positive int"):
        resolve_tiles(n, 128, 0, 64, 3, 256, None)


def test_builders_default_to_the_shape_s_rasterization():
    """Given no tiles, the builders use :func:`default_tiles` of the output width: the wide
    output rasterizes, the benchmark's n 3584 keeps the grid's order (the same source as
    ``GemmTiles()``)."""
    from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel

    assert "rasterization2DRow<8>" in lower_source(build_gemm_kernel(128, 4608, 64, "bfloat16"))
    assert "rasterization2DRow<8>" in lower_source(build_ag_gemm_kernel(128, 64, 4608, 2, 1, "bfloat16"))
    assert lower_source(build_gemm_kernel(128, 3584, 64, "bfloat16")) == \
        lower_source(build_gemm_kernel(128, 3584, 64, "bfloat16", GemmTiles()))


@needs_nvcc
def test_stock_gemm_compiles_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(build_gemm_kernel(256, 256, 128, "float16"), target=TARGET, execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"
    swizzled = tilelang.compile(build_gemm_kernel(256, 512, 128, "bfloat16", GemmTiles(swizzle=8)), target=TARGET,
                                execution_backend="tvm_ffi")
    assert swizzled.adapter.rt_mod.imports[0].kind == "cuda"


@needs_nvcc
def test_rasterized_peer_and_remote_epilogue_gemms_compile_for_sm90a(tmp_path, monkeypatch):
    from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel
    from tilescale_examples.overlap.gemm_rs import build_gemm_rs_kernel

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    for func in (build_ag_gemm_kernel(256, 128, 512, 2, 2, "bfloat16", GemmTiles(swizzle=8)),
                 build_gemm_rs_kernel(256, 128, 512, 2, "bfloat16", GemmTiles(swizzle=8))):
        kernel = tilelang.compile(func, target=TARGET, execution_backend="tvm_ffi")
        assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


def test_every_block_n_224_candidate_of_the_default_space_lowers_to_tma_and_wgmma():
    """The tuner's default space holds block_n 224 (n 3584 in 16 column blocks: 128 tiles of
    128 x 224 fill one wave of 132 SMs where 128 x 256 leaves 112 tiles); each such candidate
    lowers to the TMA + WGMMA program."""
    from tilescale_lang.autotune import gemm_space

    wide = [c for c in gemm_space(1024, 3584, 8192, "bfloat16") if c["block_n"] == 224]
    assert len(wide) == 14
    for config in wide:
        body = kernel_body(lower_source(build_gemm_kernel(1024, 3584, 8192, "bfloat16", GemmTiles(**config))))
        assert "tl::tma_load(B_desc" in body and "wgmma" in body, config


@needs_nvcc
def test_a_block_n_224_gemm_compiles_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(build_gemm_kernel(256, 448, 128, "bfloat16", GemmTiles(block_n=224)), target=TARGET,
                              execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"

