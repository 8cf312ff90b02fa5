"""The overlapped GEMMs' output epilogue on the CPU: the ``store`` argument and its default
(the TMA store with the sync pipeline, the direct store with the async one), what each plan
compiles, the peer GEMM's generated CUDA and nvcc compile with the TMA store, and the
alignment that TMA needs, checked before any kernel runs."""

import pytest
import torch
import tilelang
from examples_helpers import CpuAllocator, gemm_fused_on_one_rank, in_order, kernel_body, lower_source, needs_nvcc

from tilescale_examples import AllGatherGEMM, GemmReduceScatter
from tilescale_examples.base import TARGET
from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel
from tilescale_examples.overlap.gemm import GemmTiles, default_store, resolve_store

OPS = [AllGatherGEMM, GemmReduceScatter]


def test_default_store_is_the_tma_store_on_the_sync_pipeline_only():
    assert default_store(GemmTiles()) == "tma"
    assert default_store(GemmTiles(pipeline="async", num_stages=4)) == "direct"
    assert resolve_store(None, GemmTiles()) == "tma" and resolve_store("direct", GemmTiles()) == "direct"
    assert resolve_store("tma", GemmTiles(pipeline="async", num_stages=3)) == "tma"  # 3 stages fit beside the tile
    with pytest.raises(ValueError, match="store must be one of .* or None"):
        resolve_store("fast", GemmTiles())
    with pytest.raises(ValueError, match="num_stages=4 does not fit beside the TMA-store epilogue"):
        resolve_store("tma", GemmTiles(pipeline="async", num_stages=4))


@pytest.mark.parametrize("cls", OPS)
@pytest.mark.parametrize("kwargs,store,symbol", [
    ({}, "tma", "gemm_tma_store"),
    (dict(store="direct"), "direct", "gemm"),
    (dict(pipeline="async", num_stages=4), "direct", "gemm_async"),
    (dict(pipeline="async", store="tma"), "tma", "gemm_async_tma_store"),  # 3 stages: fits
])
def test_the_ops_compile_the_epilogue_they_are_given(cls, kwargs, store, symbol, compiles, fused_available):
    op = cls(CpuAllocator(num_ranks=1), 256, 128, 256, torch.bfloat16, **kwargs)
    assert op.store == store and compiles == [symbol]
    op.close()


@pytest.mark.parametrize("cls", OPS)
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(store="fast"), ValueError, "store must be one of"),
    (dict(pipeline="async", num_stages=4, store="tma"), ValueError, "num_stages=4 does not fit"),
])
def test_bad_stores_are_named_before_anything_is_compiled(cls, kwargs, error, match, compiles):
    alloc = CpuAllocator(num_ranks=1)
    with pytest.raises(error, match=match):
        cls(alloc, 256, 128, 256, torch.bfloat16, **kwargs)
    assert compiles == [] and alloc.allocations == []


def test_the_sequential_plans_gemm_and_the_fused_plans_gemms_take_the_store(compiles, fused_available):
    AllGatherGEMM(CpuAllocator(num_ranks=2), 256, 128, 256, torch.bfloat16, algorithm="sequential").close()
    assert compiles[-1] == "gemm_tma_store"  # after the all-gather's kernel
    GemmReduceScatter(CpuAllocator(num_ranks=2), 256, 128, 256, torch.bfloat16, algorithm="sequential").close()
    assert compiles[-1] == "gemm_tma_store"
    del compiles[:]
    AllGatherGEMM(CpuAllocator(num_ranks=2), 256, 128, 256, torch.bfloat16, algorithm="fused").close()
    assert compiles == ["gemm_tma_store", "ag_gemm"]  # the own rows, then the peers' (both with the TMA store)


def test_the_peer_gemm_stores_its_tiles_with_tma_after_the_wait():
    src = kernel_body(lower_source(build_ag_gemm_kernel(512, 256, 512, 4, 3, "bfloat16", store="tma")))
    assert in_order(src, "wait_until<", "__syncthreads();", "fence_proxy_async", "tma_load(A_desc",
                    "ptx_stmatrix", "tma_store(Out_desc", "tma_store_wait<0")
    # the tile's rows in the gathered output: src * m_local + unit * block_m
    store = src[src.index("tma_store(Out_desc"):]
    assert "((src * 512) + ((code & 3) * 128))" in store[:store.index(";")]
    assert "tma_store" not in kernel_body(lower_source(build_ag_gemm_kernel(512, 256, 512, 4, 3, "bfloat16")))


@needs_nvcc
def test_the_peer_gemm_with_the_tma_store_compiles_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(build_ag_gemm_kernel(256, 128, 256, 2, 2, "bfloat16", store="tma"), target=TARGET,
                              execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


def _misaligned(shape, dtype=torch.bfloat16, elements: int = 1) -> torch.Tensor:
    """A contiguous ``shape`` view starting ``elements`` elements (2 bytes each) into a fresh
    buffer."""
    numel = torch.Size(shape).numel()
    return torch.zeros(numel + 8, dtype=dtype)[elements:numel + elements].view(shape)


@pytest.mark.parametrize("cls", OPS)
def test_unaligned_operands_and_outputs_are_named_before_any_kernel(cls, compiles, fused_available):
    op = gemm_fused_on_one_rank(cls, torch.bfloat16, compiles)
    launched = []
    op._launch_kernel = lambda *args, **kwargs: launched.append(args)
    a, b = torch.zeros((256, 128), dtype=torch.bfloat16), torch.zeros((128, 256), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a must be 16-byte aligned .the GEMM loads it with TMA."):
        op(_misaligned((256, 128)), b)
    with pytest.raises(ValueError, match="b must be 16-byte aligned"):
        op(a, _misaligned((128, 256)))
    with pytest.raises(ValueError, match="out must be 16-byte aligned .the GEMM writes it with TMA stores."):
        op(a, b, out=_misaligned((256, 256)))
    assert launched == []
    op.close()


@pytest.mark.parametrize("cls", OPS)
def test_a_direct_store_needs_an_output_aligned_for_its_pairs_only(cls, compiles, fused_available):
    """The direct store writes pairs of elements (4 bytes): an ``out`` 4 bytes past a 16-byte
    line is taken, one 2 bytes past it is named."""
    op = cls(CpuAllocator(num_ranks=1), 256, 128, 256, torch.bfloat16, store="direct")
    a, b = torch.zeros((256, 128), dtype=torch.bfloat16), torch.zeros((128, 256), dtype=torch.bfloat16)
    out = _misaligned((256, 256), elements=2)
    assert op._check_call(a, b, out) is out  # every check a call makes before it launches
    with pytest.raises(ValueError, match="out must be 4-byte aligned .the GEMM writes it in 4-byte pairs"):
        op._check_call(a, b, _misaligned((256, 256)))
    op.close()
