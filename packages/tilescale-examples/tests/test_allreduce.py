"""AllReduce = ReduceScatter + AllGather: reference, composition and argument checks on the
CPU; the result on 1, 2 and 4 ranks (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch
from examples_helpers import CpuAllocator, close_rank_heap, open_rank_heap, run_gpu_ranks, needs_nvcc

from tilescale_examples.allreduce import AllReduce, torch_reference


def test_torch_reference_is_the_rank_order_sum():
    xs = [torch.full((2, 3), float(p + 1), dtype=torch.float16) for p in range(3)]
    assert torch.equal(torch_reference(xs), torch.full((2, 3), 6.0, dtype=torch.float16))
    h = [torch.full((4,), 2048.0, dtype=torch.float16), torch.full((4,), 1.0, dtype=torch.float16),
         torch.full((4,), 1.0, dtype=torch.float16)]
    # float32 accumulation, one rounding: 2050 (a half rounding after each add would give 2048)
    assert torch.equal(torch_reference(h), torch.full((4,), 2050.0, dtype=torch.float16))
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([])


@needs_nvcc
def test_allreduce_composes_reduce_scatter_and_all_gather(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    ar = AllReduce(alloc, (3, 5), "float32", threads=128)  # 15 elements: shards of 8, 1 pad
    assert ar.shard == 8 and ar.input.shape == (3, 5) and ar.output.shape == (3, 5)
    assert float(ar.reduce_scatter.input.view(-1)[15]) == 0.0  # the pad is zeroed
    assert ar.bus_bytes() == 2 * 0.5 * 15 * 4
    calls = []
    ar.reduce_scatter.kernel = lambda *a: calls.append(("rs", a))
    ar.all_gather.kernel = lambda *a: calls.append(("ag", a))
    with pytest.raises(ValueError, match=r"input has shape \(15,\), expected the shape \(3, 5\)"):
        ar(torch.zeros(15))
    with pytest.raises(TypeError, match="this AllReduce was built for torch.float32"):
        ar(torch.zeros(3, 5, dtype=torch.float64))
    x = torch.randn(3, 5)
    out = ar(x)
    assert out.data_ptr() == ar.all_gather.output.data_ptr() and out.shape == (3, 5)
    assert torch.equal(ar.input, x)  # copied in
    assert [c[0] for c in calls] == ["rs", "ag"]
    rs_args, ag_args = calls[0][1], calls[1][1]
    assert rs_args[0].data_ptr() == ar.reduce_scatter.input.data_ptr() and rs_args[4] == 1
    assert ag_args[0].data_ptr() == ar.reduce_scatter.output.data_ptr() and ag_args[3] == 1  # RS output feeds AG
    ar(ar.input)  # zero-copy; both epochs advance together
    assert ar.epoch == 2 and ar.all_gather.epoch == 2
    assert "AllReduce(shape=(3, 5)" in repr(ar)
    ar.close()
    assert ar.closed
    with pytest.raises(RuntimeError, match="AllReduce is closed"):
        ar(x)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(shape=(4, 0)), ValueError, "shape must be non-empty positive ints"),
    (dict(dtype="uint8"), TypeError, "dtype must be one of"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
])
def test_constructor_rejects_before_allocating(kwargs, exc, match):
    alloc = CpuAllocator(num_ranks=2)
    args = dict(allocator=alloc, shape=(16,), dtype=torch.float32)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        AllReduce(**args)
    assert alloc.allocations == []


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [((1,), torch.float32), ((7, 3), torch.float16), ((1000,), torch.bfloat16), ((4096 + 5,), torch.int32),
             ((513, 1024), torch.float16)]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: shapes whose size the ranks do not divide, poisoned outputs, fresh inputs,
    heap and plain inputs and 20 back-to-back calls, compared exactly with torch_reference."""
    import torch.distributed as dist

    alloc = open_rank_heap(rank, world, cache_dir, 2**28)
    dev = torch.device(alloc.device)
    checks = 0
    for case, (shape, dtype) in enumerate(GPU_CASES):
        ar = AllReduce(alloc, shape, dtype, min_chunk_bytes=4096)
        for step in range(5):
            g = torch.Generator().manual_seed(rank * 1000003 + case * 7919 + step)
            x = (torch.randint(-1000, 1000, shape, generator=g) if dtype == torch.int32
                 else torch.randn(shape, generator=g)).to(dtype).to(dev)
            ar.all_gather.output.fill_(-7)  # poison
            if step < 4:
                out = ar(ar.input.copy_(x) if step % 2 else x.clone())
            else:
                ar.input.copy_(x)
                for _ in range(20):  # back-to-back: the two kernels' handshakes order the calls
                    out = ar(ar.input)
            torch.cuda.synchronize()
            inputs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(inputs, x)
            want = torch_reference(inputs)
            if not torch.equal(out, want):
                bad = (out != want).nonzero()[:5].tolist()
                raise AssertionError(f"rank {rank} world {world} shape {shape} {dtype} step {step}: first mismatches at {bad}")
            checks += 1
        ar.close()
    return close_rank_heap(alloc, rank, checks)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_allreduce_on_gpu(world, tmp_path_factory):
    reports = run_gpu_ranks(gpu_rank_body, world, tmp_path_factory, "allreduce")
    assert [r["checks"] for r in reports] == [len(GPU_CASES) * 5] * world
