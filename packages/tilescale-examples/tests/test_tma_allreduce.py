"""The upstream-style all-reduce (remote TMA + remote atomic counters + one-word barrier):
generated CUDA, nvcc compile and argument checks on CPU; the result on 1 and 2 ranks (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch
from examples_helpers import (TOOLKIT, CpuAllocator, LaunchRecorder, close_rank_heap, kernel_body, lower_source,
                              open_rank_heap, record_compiles, rejects_before_allocating,
                              needs_toolkit, expect_checks, gpu_rank_test)

from tilescale_examples import ClosedError
from tilescale_examples.tutorials import tma_allreduce
from tilescale_examples.tutorials.tma_allreduce import COLS, TILE_ROWS, TmaAllReduce, build_tma_allreduce_kernel, torch_reference


def test_torch_reference_sums_the_ranks():
    xs = [torch.full((2, 3), float(r)) for r in range(4)]
    assert torch.equal(torch_reference(xs, 0), torch.full((2, 3), 6.0))
    assert torch.equal(TmaAllReduce.torch_reference(xs, 3), torch.full((2, 3), 6.0))
    with pytest.raises(ValueError):
        torch_reference([], 0)


def test_the_object_answers_as_an_all_reduce(monkeypatch):
    """Its input is ``shape`` (not ``(world_size, *shape)``), its bus bytes are an
    all-reduce's, ``out=`` gets a copy of the result, and a closed one raises ClosedError."""
    record_compiles(monkeypatch, tma_allreduce)
    alloc = CpuAllocator(num_ranks=2)
    ar = TmaAllReduce(alloc, (TILE_ROWS, COLS), torch.float32)
    assert ar.input_shape == ar.shape == (TILE_ROWS, COLS) and ar.algorithm == "tma"
    assert ar.bus_bytes() == 2 * (2 - 1) / 2 * TILE_ROWS * COLS * 4
    assert alloc.allocations == [((TILE_ROWS, COLS), torch.float32), ((2 * TILE_ROWS, COLS), torch.float32),
                                 ((8,), torch.int32)]
    launched = []
    ar.kernel = LaunchRecorder(launched)
    monkeypatch.setattr("tilelang.distributed.barrier_all_on_stream", lambda group=None: None)
    with pytest.raises(ValueError, match=r"input has shape \(2, 64, 128\), expected shape \(64, 128\)"):
        ar(torch.zeros(2, TILE_ROWS, COLS))
    with pytest.raises(ValueError, match=r"out has shape \(64,\)"):
        ar(torch.zeros(TILE_ROWS, COLS), out=torch.zeros(64))
    ar.output.fill_(3.0)  # what the kernel would have written
    mine = torch.zeros(TILE_ROWS, COLS)
    assert ar(torch.ones(TILE_ROWS, COLS), out=mine) is mine and torch.equal(mine, ar.output)
    assert ar(torch.ones(TILE_ROWS, COLS)) is ar.output is ar.out and ar.epoch == 2 and len(launched) == 2
    ar.close()
    with pytest.raises(ClosedError, match="TmaAllReduce is closed"):
        ar(torch.ones(TILE_ROWS, COLS))


def test_kernel_uses_the_three_upstream_features():
    body = kernel_body(lower_source(build_tma_allreduce_kernel(1024, 4, 8)))
    assert "tilescale::init_barrier_gpu1((&(Bar[0])), (uint)8);" in body  # one-word barrier
    assert "tilescale::sync_barrier_gpu1((&(Bar[0])));" in body
    for k in range(4):
        assert f"tl::tma_store(tilescale_tma_peer{k}_Y_desc" in body  # remote TMA store per peer
    assert "tilescale::atomic_add_sys<tilescale::Sem::RELEASE, tilescale::AType::S32>((&(Count[me])), 1, p" in body
    assert "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Count[" in body
    # order: the stores completed (not only read), async proxy fenced, then the counters
    wait = body.index("tl::tma_store_wait<0, false>();")
    assert wait < body.index("tl::fence_proxy_async();") < body.index("tilescale::atomic_add_sys<")
    assert body.index("tilescale::wait_until<") < body.index("tilescale::sync_barrier_gpu1(")


@needs_toolkit
def test_kernel_compiles(tmp_path):
    out, _, _ = TOOLKIT.compile(lower_source(build_tma_allreduce_kernel(4096, 8, 132)), tmp_path, "ptx", "sm_90a")
    ptx = out.read_text(encoding="utf-8")
    for instr in ("cp.async.bulk.tensor.2d.global.shared::cta", "atom.release.sys.add.u32", "ld.acquire.sys.b32",
                  "atom.acq_rel.gpu.add.u32", "fence.proxy.async"):
        assert instr in ptx, instr


test_constructor_rejects_before_allocating = rejects_before_allocating(
    TmaAllReduce, dict(shape=(TILE_ROWS, COLS), dtype=torch.float32), [
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(shape=(100, COLS)), ValueError, "multiple of 64"),
    (dict(shape=(64, 64)), ValueError, f"rows, {COLS}"),
    (dict(shape=(64,)), ValueError, f"rows, {COLS}"),
    (dict(num_ranks=9), ValueError, "cover 8 ranks"),
])


# ------------------------------------------------------------------------------ GPU
def _input(rank, shape, step):
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank * 1000003 + step * 7919))


def _want(world, shape, step):
    """The kernel's own order: float32, 0 + x_0 + x_1 + ... (so the result is exact)."""
    acc = torch.zeros(shape)
    for q in range(world):
        acc = acc + _input(q, shape, step)
    return acc


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    alloc = open_rank_heap(rank, world, cache_dir, 2**27)
    dev = torch.device(alloc.device)
    checks = 0
    for shape in ((TILE_ROWS, COLS), (4096, COLS), (64 * 133, COLS)):  # one tile, 64 tiles, > one per block
        ar = TmaAllReduce(alloc, shape, torch.float32)
        for step in range(12):  # back-to-back calls: stream barrier + epoch counters, no reset
            x = _input(rank, shape, step).to(dev)
            ar.output.fill_(float("nan"))  # poison
            out = ar(x)
            torch.cuda.synchronize()
            want = _want(world, shape, step)
            if not torch.equal(out.cpu(), want):
                bad = (out.cpu() != want).nonzero()[:5].tolist()
                raise AssertionError(f"rank {rank} world {world} shape {shape} step {step}: first mismatches at {bad}")
            checks += 1
        assert torch_reference([_input(q, shape, 11) for q in range(world)], rank).allclose(out.cpu(), atol=1e-5)
        ar.close()
    from tilelang.distributed import close_stream_barriers

    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    close_stream_barriers()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, timeout=300, cache="tma_allreduce")
def test_tma_allreduce_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), 3 * 12)
