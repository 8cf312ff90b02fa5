"""All-gather + GEMM: generated CUDA, nvcc compile, reference and argument checks on the
CPU; the result on 1, 2 and 4 ranks (``-m gpu``)."""

from __future__ import annotations

import pytest
import tilelang
import torch
from examples_helpers import CpuAllocator, close_rank_heap, kernel_body, lower_source, needs_nvcc, open_rank_heap, run_gpu_ranks

from tilescale_examples.ag_gemm import AllGatherGEMM, build_gemm_kernel, torch_reference
from tilescale_examples.collective import TARGET, plan_chunks


def test_torch_reference_is_gathered_matmul():
    a = [torch.eye(2), 2 * torch.eye(2)]
    b = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(torch_reference(a, b), torch.cat([b, 2 * b]))
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([], b)


def test_generated_cuda_waits_for_its_rows_then_fences_then_tma():
    m_local, k, n, W = 256, 512, 256, 4
    C, CH = plan_chunks(m_local * k, 2, W, 16, 64 * k * 2)  # chunks of 64 rows: 2 per 128-row tile
    assert (C, CH) == (4, 64 * k)
    body = kernel_body(lower_source(build_gemm_kernel(m_local, k, n, W, C, CH)))
    wait = body.index("tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>(")
    fence = body.index("tl::fence_proxy_async();")
    tma_a = body.index("tl::tma_load(A_desc")
    assert wait < body.index("__syncthreads();", wait) < fence < tma_a
    # tile row block by covers chunks 2*by and 2*by+1 of rank by // 2
    assert "for (int i = 0; i < 2; ++i)" in body[:fence]
    assert "(&(Flags[((((int)blockIdx.y) * 2) + i)]))" in body[wait:fence]
    assert "wgmma" in body and "tl::tma_load(B_desc" in body


@pytest.mark.parametrize("args,match", [
    ((200, 512, 256, 2, 2, 51200), "m_local=200 must be a multiple of 128"),
    ((256, 500, 256, 2, 2, 64000), "k=500 must be a multiple of 64"),
    ((256, 512, 200, 2, 2, 65536), "n=200 must be a multiple of 128"),
    ((256, 512, 256, 2, 3, 65536), "does not tile the 256 x 512 shard"),
])
def test_kernel_rejects_bad_shapes(args, match):
    with pytest.raises(ValueError, match=match):
        build_gemm_kernel(*args)


@needs_nvcc
def test_real_compile_to_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    C, CH = plan_chunks(256 * 512, 2, 2, 16, 128 * 512 * 2)
    kernel = tilelang.compile(build_gemm_kernel(256, 512, 256, 2, C, CH, "bfloat16"), target=TARGET, execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


@needs_nvcc
def test_object_on_cpu_allocator(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    agg = AllGatherGEMM(alloc, 256, 128, 128, "float16")
    assert agg.output.shape == (512, 128) and agg.all_gather.output.shape == (2, 256, 128)
    assert agg.all_gather.chunk % (128 * 128) == 0  # default chunk: whole 128-row blocks
    assert agg.flops() == 2.0 * 512 * 128 * 128
    with pytest.raises(ValueError, match=r"a has shape \(128, 128\), expected \(m_local, k\) = \(256, 128\)"):
        agg.check_inputs(torch.zeros(128, 128, dtype=torch.float16), torch.zeros(128, 128, dtype=torch.float16))
    with pytest.raises(TypeError, match="b has dtype torch.float32, this AllGatherGEMM was built for torch.float16"):
        agg.check_inputs(torch.zeros(256, 128, dtype=torch.float16), torch.zeros(128, 128))
    assert "AllGatherGEMM(m_local=256, k=128, n=128" in repr(agg)
    agg.close()
    assert agg.closed
    with pytest.raises(RuntimeError, match="AllGatherGEMM is closed"):
        agg(torch.zeros(256, 128, dtype=torch.float16), torch.zeros(128, 128, dtype=torch.float16))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dtype=torch.float32), TypeError, "dtype must be one of"),
    (dict(m_local=0), ValueError, "m_local must be a positive int"),
    (dict(ag_blocks=0), ValueError, "ag_blocks must be a positive int"),
])
def test_constructor_rejects_before_allocating(kwargs, exc, match):
    alloc = CpuAllocator(num_ranks=2)
    args = dict(allocator=alloc, m_local=128, k=64, n=128, dtype=torch.float16)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        AllGatherGEMM(**args)
    assert alloc.allocations == []


# ------------------------------------------------------------------------------ GPU
def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: fp16 and bf16, fresh a and b, a poisoned output, then 10 back-to-back calls
    whose a changes on the caller's stream between calls (no host sync); each compared with
    torch_reference over the a's gathered through the group."""
    import torch.distributed as dist

    alloc = open_rank_heap(rank, world, cache_dir, 2**27)
    dev = torch.device(alloc.device)
    checks = 0
    for case, dtype in enumerate((torch.float16, torch.bfloat16)):
        agg = AllGatherGEMM(alloc, 256, 512, 256, dtype, ag_blocks=8)
        g = torch.Generator().manual_seed(rank * 7919 + case)
        b = torch.randn(512, 256, generator=g).to(dtype).to(dev)
        for step in range(11):
            a = torch.randn(256, 512, generator=g).to(dtype).to(dev)
            if step == 0:
                agg.output.fill_(float("nan"))
            out = agg(a, b)
            if step in (0, 10):
                torch.cuda.synchronize()
                shards = [torch.empty_like(a) for _ in range(world)]
                dist.all_gather(shards, a)
                want = torch_reference(shards, b)
                if not torch.allclose(out.float(), want, rtol=2e-2, atol=0.25):
                    err = (out.float() - want).abs().max().item()
                    raise AssertionError(f"rank {rank} world {world} {dtype} step {step}: max error {err}")
                checks += 1
        agg.close()
    return close_rank_heap(alloc, rank, checks)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ag_gemm_on_gpu(world, tmp_path_factory):
    reports = run_gpu_ranks(gpu_rank_body, world, tmp_path_factory, "ag_gemm")
    assert [r["checks"] for r in reports] == [4] * world
