"""The put_signal_block all-to-all: generated CUDA, nvcc compile, reference and argument checks on
the CPU; the result on 1, 2 and 4 ranks sharing one GPU (``-m gpu``)."""

from __future__ import annotations


import pytest
import tilelang
import torch
from examples_helpers import (LaunchRecorder, CpuAllocator, close_rank_heap, kernel_body, lower_source, needs_nvcc,
                              open_rank_heap, rejects_before_allocating, expect_checks, gpu_rank_test)

from tilescale_examples import ClosedError
from tilescale_examples.collectives.alltoall import AllToAll, build_alltoall_kernel, torch_reference
from tilescale_examples.base import TARGET, plan_chunks


def test_torch_reference_takes_row_rank_of_every_input():
    xs = [torch.arange(6).view(3, 2) + 10 * p for p in range(3)]
    assert torch.equal(torch_reference(xs, 1), torch.tensor([[2, 3], [12, 13], [22, 23]]))
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        torch_reference(xs, -1)


def test_generated_cuda_puts_row_p_to_rank_p():
    S, W = 1000, 4
    C, CH = plan_chunks(S, 2, W, max_blocks=16, min_chunk_bytes=256)
    body = kernel_body(lower_source(build_alltoall_kernel(S, "float16", W, C, CH, threads=256)))
    assert "alltoall_kernel(" in body
    put = body[body.index("tilescale::put_signal<4, false, false, true>("):]  # adds 1 to the data flag
    put = put[:put.index(";")]
    # source: row blockIdx.y (= p) of the input; destination: row `me` of rank p's output
    assert f"(&(In[((((int64_t)((int)blockIdx.y)) * (int64_t){S}) + ((int64_t)start))]))" in put
    assert f"(&(Out[((((int64_t)me) * (int64_t){S}) + ((int64_t)start))]))" in put
    # the chunk's element count (signed, run-time) goes through the checked count, then bytes
    assert f'(((uint64_t)tilescale::checked_count(min({CH}, ({S} - start)), "put_signal_block size")) * (uint64_t)2)' in put
    assert put.rstrip(")").endswith("((int)blockIdx.y")
    # the same protocol as the all-gather: a ready signal, a put with signal, 2 waits
    assert body.count("tilescale::signal_op<true>(") == 1 and body.count("tilescale::wait_until<") == 2
    assert body.count("__syncthreads();") == 1 and "fence_sys" not in body


@needs_nvcc
def test_real_compile_to_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    S, W = (1 << 16) + 3, 4
    C, CH = plan_chunks(S, 4, W, max_blocks=32, min_chunk_bytes=4096)
    kernel = tilelang.compile(build_alltoall_kernel(S, "float32", W, C, CH), target=TARGET, execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


@needs_nvcc
def test_alltoall_object_on_cpu_allocator(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    a2a = AllToAll(alloc, (2, 3, 5), "float32", threads=128)
    assert alloc.allocations == [((2, 3, 5), torch.float32), ((2, 3, 5), torch.float32), ((2 * 2 * a2a.chunks,), torch.uint64)]
    assert not a2a.flags.ne(0).any() and a2a.bus_bytes() == 0.5 * 2 * 15 * 4
    assert a2a.shard_shape == (3, 5) and a2a.input_shape == (2, 3, 5)
    assert repr(a2a).startswith("AllToAll(shape=(2, 3, 5), dtype=torch.float32, world_size=2")
    launched = []
    a2a.kernel = LaunchRecorder(launched)
    with pytest.raises(ValueError, match=r"input has shape \(3, 5\), expected the shape \(2, 3, 5\)"):
        a2a(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="input has dtype torch.int32"):
        a2a(torch.zeros(2, 3, 5, dtype=torch.int32))
    assert launched == []
    x = torch.randn(2, 3, 5)
    assert a2a(x) is a2a.output and launched[0][0].data_ptr() == x.data_ptr() and launched[0][3] is a2a.state
    a2a.close()
    assert a2a.input is None and a2a.closed
    with pytest.raises(ClosedError, match="AllToAll is closed"):
        a2a(x)


test_constructor_rejects_before_allocating = rejects_before_allocating(
    AllToAll, dict(shape=(2, 16), dtype=torch.float16), [
    (dict(dtype=torch.bool), TypeError, "dtype must be one of"),
    (dict(world_size=4), ValueError, r"world_size=4 but the allocator spans 2 rank\(s\)"),
    (dict(shape=(2, 0)), ValueError, "shape must be non-empty positive ints"),
    (dict(shape=(3, 16)), ValueError, r"shape must be \(world_size, \*row\) = \(2, ...\)"),
    (dict(shape=(2,)), ValueError, "with a non-empty row"),
])


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [((1,), torch.float16), ((7,), torch.float32), ((3, 333), torch.bfloat16), ((4096 + 5,), torch.int32),
             (((1 << 18) + 3,), torch.float16)]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: shapes and dtypes, poisoned outputs, fresh rows per call, heap and plain
    inputs, 20 back-to-back calls, compared exactly with the inputs gathered by the group."""
    import torch.distributed as dist

    alloc = open_rank_heap(rank, world, cache_dir, 2**27)
    dev = torch.device(alloc.device)
    checks = 0
    for case, (shape, dtype) in enumerate(GPU_CASES):
        a2a = AllToAll(alloc, (world, *shape), dtype, min_chunk_bytes=4096)
        for step in range(5):
            g = torch.Generator().manual_seed(rank * 1000003 + case * 7919 + step)
            full = (world, *shape)
            x = (torch.randint(-1000, 1000, full, generator=g) if dtype == torch.int32
                 else torch.randn(full, generator=g)).to(dtype).to(dev)
            a2a.output.fill_(-7)
            if step % 2:
                a2a.input.copy_(x)
            if step < 4:
                out = a2a(a2a.input if step % 2 else x.clone())
            else:
                a2a.input.copy_(x)
                for _ in range(20):  # back-to-back: the handshake orders the calls
                    out = a2a(a2a.input)
            torch.cuda.synchronize()
            inputs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(inputs, x)
            want = torch_reference(inputs, rank)
            if not torch.equal(out, want):
                bad = (out != want).nonzero()[:5].tolist()
                raise AssertionError(f"rank {rank} world {world} shape {shape} {dtype} step {step}: first mismatches at {bad}")
            checks += 1
        a2a.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, 4, timeout=300, cache="alltoall")
def test_alltoall_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) * 5)
