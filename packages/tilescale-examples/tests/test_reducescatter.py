"""ReduceScatter on the reduction engine: staging, padding, double buffering, outputs and
argument checks on the CPU; shapes x dtypes on 2 and 4 ranks sharing one GPU, bit-identical
to the rank-order reference, and back-to-back calls with a straggler (``-m gpu``)."""

from __future__ import annotations

import random

import pytest
import torch
from examples_helpers import (CpuAllocator, call_rejected, close_rank_heap, open_rank_heap, poison, random_tensor,
                              rejects_before_allocating, needs_nvcc, expect_checks, gpu_rank_test)
from examples_cache import CACHE_NAME, reduction_kernels

from tilescale_examples.collectives.reducescatter import ReduceScatter, torch_reference
from tilescale_examples.collectives.reduce_engine import FLAG_STRIDE


def test_torch_reference_sums_row_rank_in_rank_order():
    xs = [torch.arange(6, dtype=torch.float32).view(3, 2) * (p + 1) for p in range(3)]
    assert torch.equal(torch_reference(xs, 1), torch.tensor([2.0, 3.0]) * 6)
    h = [torch.full((2, 4), 1e-4, dtype=torch.float16), torch.full((2, 4), 2048.0, dtype=torch.float16)]
    assert torch.equal(torch_reference(h, 0), h[1][0])  # float32 sum, one rounding
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        torch_reference(xs, 3)


class FakeKernel:
    """Stands in for the GPU launch: records the arguments; writes row 0 of the staged input
    (padded rows) times 2 into the output, where the real kernel writes the sum."""

    def __init__(self):
        self.calls, self.tables = [], []

    def initialize(self, allocator, stream=None):
        self.tables.append(int(allocator.table[0]))
        return self

    def __call__(self, x, stages, out, flags, state, blocks, iters, span, rows_in, stage_in):
        epoch = int(state[0]) + 1  # the device's call number: block 0's counter
        state += 1
        stage = stages.split(stages.shape[0] // 2)[epoch % 2]
        self.calls.append((x, stage, out, epoch, span, rows_in, stage_in))
        if stage_in:
            stage.copy_(x)
        out.copy_(stage[:span] * 2)


def make(row, dtype="float32", tmp_path=None, monkeypatch=None):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    rs = ReduceScatter(alloc, (2, *row), dtype, threads=128)
    rs.kernel = FakeKernel()
    return alloc, rs


@needs_nvcc
def test_a_repeated_call_relaunches_the_kept_input_view(tmp_path, monkeypatch):
    """The same input buffer again (refilled in place, no ``out``): the kept arguments are
    launched again without the full call, the device call number advancing and the output
    right; another aligned address is launched the same, moved there; ``out=`` takes the
    full call; a padded input is never kept."""
    alloc, rs = make((4, 8), tmp_path=tmp_path, monkeypatch=monkeypatch)  # rows of whole vectors
    full = []
    monkeypatch.setattr(rs, "_check_call", lambda *a: full.append(a[0]) or ReduceScatter._check_call(rs, *a))
    x = torch.randn(2, 4, 8)
    rs(x), rs(x)  # two full calls on one buffer: the launch kept
    for epoch in (3, 4):
        x.copy_(torch.randn(2, 4, 8))
        rs.output.fill_(float("nan"))
        assert rs(x) is rs.output and torch.equal(rs.output, x[0] * 2)
        assert rs.kernel.calls[-1][3] == epoch and len(full) == 2
    moved = x.clone()
    assert rs(moved) is rs.output and torch.equal(rs.output, moved[0] * 2)
    assert len(full) == 2 and rs.kernel.calls[-1][0].data_ptr() == moved.data_ptr()
    out = torch.empty(4, 8)
    assert rs(x, out=out) is out and torch.equal(out, x[0] * 2) and rs._kept_launch is None
    _, odd = make((3, 5), tmp_path=tmp_path, monkeypatch=monkeypatch)
    z = torch.randn(2, 3, 5)
    odd(z), odd(z)
    assert odd._kept_launch is None


@needs_nvcc
def test_padded_rows_double_buffering_and_outputs(tmp_path, monkeypatch):
    alloc, rs = make((3, 5), tmp_path=tmp_path, monkeypatch=monkeypatch)  # 15 float32: 4 rows of 4, 1 pad
    assert alloc.allocations == [((16, 4), torch.float32)] + [((2 * 2 * rs.plan.blocks * FLAG_STRIDE,), torch.uint64)]
    assert rs.input.shape == (2, 3, 5) and not rs.input.is_contiguous()  # padded rows
    x = torch.randn(2, 3, 5)
    out = rs(x)
    x_, stage, kout, epoch, span, rows_in, stage_in = rs.kernel.calls[-1]
    # padded by a copy into a zero-padded local buffer that the kernel stages into call 1's buffer
    assert stage_in == 1 and x_ is rs._padded and stage.data_ptr() == rs.stages[1].data_ptr() and epoch == 1
    assert torch.equal(stage.view(2, 16)[:, :15], x.view(2, 15)) and not stage.view(2, 16)[:, 15].ne(0).any()
    assert out is rs.output and torch.equal(out, x[0] * 2)
    rs.input.copy_(x * 3)  # zero-copy into the next buffer (a strided view)
    rs(rs.input)
    assert rs.kernel.calls[-1][1].data_ptr() == rs.stages[0].data_ptr() and rs.kernel.calls[-1][-1] == 0
    assert torch.equal(rs.output, x[0] * 6)
    mine = torch.full((3, 5), float("nan"))
    assert rs(x, out=mine) is mine and torch.equal(mine, x[0] * 2)


@needs_nvcc
def test_whole_vectors_are_staged_in_the_kernel(tmp_path, monkeypatch):
    alloc, rs = make((64,), "float16", tmp_path=tmp_path, monkeypatch=monkeypatch)
    x = torch.randn(2, 64).half()
    out = torch.empty(64, dtype=torch.float16)
    rs(x, out=out)
    x_, stage, kout, *_, stage_in = rs.kernel.calls[-1]
    assert stage_in == 1 and x_.data_ptr() == x.data_ptr() and kout.data_ptr() == out.data_ptr()
    assert torch.equal(out, x[0] * 2)


@pytest.mark.parametrize("call,exc,match", [
    (lambda rs: rs(torch.zeros(2, 16, dtype=torch.float16)), TypeError, "input has dtype torch.float16"),
    (lambda rs: rs(torch.zeros(16)), ValueError, r"input has shape \(16,\), expected the shape \(2, 16\)"),
    (lambda rs: rs(torch.zeros(16, 2).t()), ValueError, "input must be contiguous"),
    (lambda rs: rs(torch.zeros(2, 16), out=torch.zeros(2, 16)), ValueError, r"out has shape \(2, 16\)"),
    (lambda rs: rs(torch.zeros(2, 16), out=rs.input[0]), ValueError, "out overlaps this ReduceScatter's symmetric staging"),
])
@needs_nvcc
def test_call_rejects_bad_arguments(call, exc, match, tmp_path, monkeypatch):
    call_rejected(make((16,), tmp_path=tmp_path, monkeypatch=monkeypatch)[1], call, exc, match)


test_constructor_rejects_before_allocating = rejects_before_allocating(
    ReduceScatter, dict(shape=(2, 16), dtype=torch.float32), [
    (dict(dtype="uint8"), TypeError, "dtype must be one of"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
    (dict(shape=(2, 0)), ValueError, "shape must be non-empty positive ints"),
    (dict(shape=(16,)), ValueError, r"shape must be \(world_size, \*row\)"),
    (dict(threads=48), ValueError, "threads must be a multiple of 32"),
])


# ------------------------------------------------------------------------------ GPU
#: (shard shape, dtype): rows that are not whole vectors, misaligned, up to 1 Mi + 3 elements.
GPU_CASES = [((1,), torch.float32), ((7,), torch.float16), ((1000,), torch.bfloat16), ((3, 333), torch.float32),
             ((4096 + 5,), torch.int32), ((2048,), torch.bfloat16), (((1 << 20) + 3,), torch.float16),
             ((1 << 18,), torch.int32)]


#: The case (7 float16 elements per shard: one padded vector) that also gets back-to-back
#: calls with a straggling rank, and their number by world size (1000 on 2 ranks; every call
#: on 4 ranks needs all 4 time-sliced contexts, so fewer there).
STRAGGLER_CASE = 1
BACK_TO_BACK = {2: 1000, 4: 100}


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: every case with a plain input, an ``out=`` tensor and the zero-copy
    ``rs.input``, poisoned outputs and staging buffers, compared bit for bit with
    ``torch_reference`` over the gathered inputs; on the straggler case,
    ``BACK_TO_BACK[world]`` back-to-back calls with a stalling stream, checked at the end."""
    import torch.distributed as dist

    alloc = open_rank_heap(rank, world, cache_dir, 2**28)
    dev = torch.device(alloc.device)
    checks = 0
    rng = random.Random(rank)
    for case, (shape, dtype) in enumerate(GPU_CASES):
        rs = ReduceScatter(alloc, (world, *shape), dtype)
        for k, way in enumerate(("plain", "out", "heap")):
            x = random_tensor((world, *shape), dtype, torch.Generator().manual_seed(rank * 1000003 + case * 7919 + k), dev)
            inputs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(inputs, x)
            poison(rs.output)
            poison(rs.input) if way != "heap" else rs.input.copy_(x)
            if way == "out":
                out = torch.empty(shape, dtype=dtype, device=dev)
                poison(out)
                out = rs(x, out=out)
            else:
                out = rs(rs.input if way == "heap" else x)
            torch.cuda.synchronize()
            want = torch_reference(inputs, rank)
            if not torch.equal(out, want):
                bad = (out != want).nonzero()[:5].tolist()
                raise AssertionError(f"rank {rank}/{world} {shape} {dtype} {way}: first mismatches at {bad}")
            checks += 1
        if case != STRAGGLER_CASE:
            rs.close()
            continue
        # back-to-back: alternate two inputs, stall this rank's stream now and then
        xs = [random_tensor((world, *shape), dtype, torch.Generator().manual_seed(rank * 31 + v + 1), dev) for v in range(2)]
        wants = []
        for x in xs:
            inputs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(inputs, x)
            wants.append(torch_reference(inputs, rank))
        calls = BACK_TO_BACK[world]
        results = torch.empty((calls, *shape), dtype=dtype, device=dev)
        poison(results)
        for i in range(calls):
            if rng.random() < 0.05:
                torch.cuda._sleep(rng.randrange(1000, 200_000))
            poison(rs.input)
            results[i].copy_(rs(xs[i % 2]))
        torch.cuda.synchronize()
        for i in range(calls):
            if not torch.equal(results[i], wants[i % 2]):
                raise AssertionError(f"rank {rank}/{world} {shape} {dtype}: back-to-back call {i} wrong")
        checks += calls
        rs.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(2, 4, timeout=200, rank_timeout=160, cache=CACHE_NAME, jobs=reduction_kernels)  # shared, in parallel
def test_reducescatter_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) * 3 + BACK_TO_BACK[world_size],
                  "reducescatter")
