"""The get_block reduce-scatter: generated CUDA, real nvcc compile, reference and argument
checks on the CPU; the result on 1, 2 and 4 ranks sharing one GPU (``-m gpu``)."""

from __future__ import annotations


import pytest
import tilelang
import torch
from examples_helpers import CpuAllocator, close_rank_heap, kernel_body, lower_source, needs_nvcc, open_rank_heap, run_gpu_ranks

from tilescale_examples.collective import TARGET, plan_chunks
from tilescale_examples.reducescatter import ReduceScatter, build_reducescatter_kernel, torch_reference


# ------------------------------------------------------------------------------ reference
def test_torch_reference_sums_shard_rank_in_rank_order():
    xs = [torch.arange(6, dtype=torch.float32).view(3, 2) * (p + 1) for p in range(3)]
    assert torch.equal(torch_reference(xs, 1), torch.tensor([2.0, 3.0]) * 6)
    h = [torch.full((2, 4), 1e-4, dtype=torch.float16), torch.full((2, 4), 2048.0, dtype=torch.float16)]
    # float32 accumulation, one rounding at the end (2048 + 1e-4 rounds back to 2048 in half)
    assert torch_reference(h, 0).dtype == torch.float16 and torch.equal(torch_reference(h, 0), h[1][0])
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        torch_reference(xs, 3)


# ------------------------------------------------------------------------------ codegen
def test_generated_cuda_handshake_gets_reduction_and_done_flags():
    S, W = 1000, 4
    C, CH = plan_chunks(S, 2, 1, max_blocks=16, min_chunk_bytes=512)
    assert (C, CH) == (4, 256)
    body = kernel_body(lower_source(build_reducescatter_kernel(S, "float16", W, C, CH, threads=128)))
    assert "tilescale::get_rank()" in body  # rank-agnostic
    notify = "tilescale::notify<false>("
    wait = "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>("
    ready_notify, ready_wait = body.index(notify), body.index(wait)
    get = body.index("tilescale::get_block<4>(")
    fence = body.index("tilescale::fence_sys();")
    done_notify = body.index(notify, fence)
    reduce_at = body.index("Out[i] = ")
    done_wait = body.index(wait, reduce_at)
    assert ready_notify < ready_wait < get < fence < done_notify < reduce_at < done_wait
    get_call = body[get:body.index(";", get)]
    # chunk c of shard `me` on rank p lands in stage[p]
    assert f"(&(In[((((int64_t)me) * (int64_t){S}) + ((int64_t)start))]))" in get_call
    assert f"(&(Stage[((((int64_t)p_2) * (int64_t){S}) + ((int64_t)start))]))" in get_call
    assert f"min({CH}, ({S} - start))) * (uint64_t)2), p_2)" in get_call
    # float32 accumulation in rank order
    assert (f"Out[i] = ((half_t)(((((float)Stage[i]) + ((float)Stage[(i + {S})])) + "
            f"((float)Stage[(i + {2 * S})])) + ((float)Stage[(i + {3 * S})])));") in body
    # ready flags after the W * C done flags; every signal carries the epoch
    assert f"Flags[(((me * {C}) + ((int)blockIdx.x)) + {W * C})]" in body[ready_notify:ready_wait]
    assert f"Flags[((me * {C}) + ((int)blockIdx.x))]" in body[done_notify:reduce_at]
    assert body.count("((uint64_t)epoch)") == 4


@pytest.mark.parametrize("dtype,line", [
    ("bfloat16", "Out[i] = ((bfloat16_t)(((float)Stage[i]) + ((float)Stage[(i + 64)])));"),
    ("float32", "Out[i] = (Stage[i] + Stage[(i + 64)]);"),  # accumulates in its own type
    ("int32", "Out[i] = (Stage[i] + Stage[(i + 64)]);"),
])
def test_accumulation_type_per_dtype(dtype, line):
    assert line in kernel_body(lower_source(build_reducescatter_kernel(64, dtype, 2, 1, 64, threads=64)))


def test_kernel_rejects_bad_plans_and_dtypes():
    with pytest.raises(ValueError, match="does not tile shard_numel=100"):
        build_reducescatter_kernel(100, "float32", 2, 1, 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_reducescatter_kernel(64, "uint8", 2, 1, 64)


@needs_nvcc
def test_real_compile_to_cubin(tmp_path, monkeypatch):
    """nvcc compiles the kernel (tilescale headers and flags) into a CUDA module."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    S, W = (1 << 18) + 3, 4
    C, CH = plan_chunks(S, 2, 1, max_blocks=32, min_chunk_bytes=4096)
    kernel = tilelang.compile(build_reducescatter_kernel(S, "float16", W, C, CH), target=TARGET, execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"
    assert "tilescale::get_block<4>" in kernel.get_kernel_source()


# ------------------------------------------------------------------------------ the class
@needs_nvcc
def test_reducescatter_object_on_cpu_allocator(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    rs = ReduceScatter(alloc, (3, 5), "float32", threads=128)
    assert alloc.allocations == [((2, 3, 5), torch.float32), ((3, 5), torch.float32), ((2 * 2 * rs.chunks,), torch.uint64)]
    assert not rs.flags.ne(0).any() and rs.stage.shape == (30,)
    assert rs.bus_bytes() == 0.5 * 2 * 15 * 4
    assert "ReduceScatter(shard_shape=(3, 5)" in repr(rs)
    launched = []
    rs.kernel = lambda *a: launched.append(a)  # stands in for the GPU launch
    with pytest.raises(TypeError, match="input has dtype torch.float16"):
        rs(torch.zeros(2, 3, 5, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"input has shape \(3, 5\), expected \(world_size, \*shard_shape\) = \(2, 3, 5\)"):
        rs(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="input must be contiguous"):
        rs(torch.zeros(2, 5, 3).transpose(1, 2))
    assert launched == [] and rs.epoch == 0
    x = torch.randn(2, 3, 5)
    assert rs(x) is rs.output and torch.equal(rs.input, x)  # copied into the symmetric input
    assert launched[0][4] == 1 and launched[0][0].shape == (30,)
    rs.input.fill_(3.0)
    rs(rs.input)  # zero-copy
    assert launched[1][4] == 2 and torch.equal(rs.input, torch.full((2, 3, 5), 3.0))
    rs.close()
    with pytest.raises(RuntimeError, match="ReduceScatter is closed"):
        rs(x)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dtype="uint8"), TypeError, "dtype must be one of"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
    (dict(shard_shape=(0,)), ValueError, "shard_shape must be non-empty positive ints"),
    (dict(threads=48), ValueError, "threads must be a multiple of 32"),
])
def test_constructor_rejects_before_allocating(kwargs, exc, match):
    alloc = CpuAllocator(num_ranks=2)
    args = dict(allocator=alloc, shard_shape=(16,), dtype=torch.float32)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        ReduceScatter(**args)
    assert alloc.allocations == []


# ------------------------------------------------------------------------------ GPU
#: (shard shape, dtype): odd sizes (byte tails, misaligned shard starts) up to 1 Mi elements.
GPU_CASES = [((1,), torch.float32), ((7,), torch.float16), ((1000,), torch.bfloat16), ((3, 333), torch.float32),
             ((4096 + 5,), torch.int32), (((1 << 20) + 3,), torch.float16)]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: several shapes and dtypes, poisoned outputs, fresh inputs, repeated and
    back-to-back calls, each compared with ``torch_reference`` over the gathered inputs."""
    import torch.distributed as dist

    alloc = open_rank_heap(rank, world, cache_dir, 2**28)
    dev = torch.device(alloc.device)
    checks = 0

    def expect_equal(out, inputs, what):
        want = torch_reference(inputs, rank)
        exact = not out.dtype.is_floating_point
        if not (torch.equal(out, want) if exact else torch.allclose(out.float(), want.float(), rtol=1e-6, atol=0)):
            bad = (out != want).nonzero()[:5].tolist()
            raise AssertionError(f"rank {rank} world {world} {what}: first mismatches at {bad}")

    for case, (shape, dtype) in enumerate(GPU_CASES):
        rs = ReduceScatter(alloc, shape, dtype, min_chunk_bytes=4096)  # small chunks: many blocks
        for step in range(4):
            g = torch.Generator().manual_seed(rank * 1000003 + case * 7919 + step)
            full = (world, *shape)
            x = (torch.randint(-1000, 1000, full, generator=g) if dtype == torch.int32
                 else torch.randn(full, generator=g)).to(dtype).to(dev)
            rs.output.fill_(-7)  # poison
            if step % 2:
                rs.input.copy_(x)
            out = rs(rs.input if step % 2 else x)
            torch.cuda.synchronize()
            inputs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(inputs, x)
            expect_equal(out, inputs, f"shape {shape} {dtype} step {step} (chunks {rs.chunks}x{rs.chunk})")
            checks += 1
        for _ in range(20):  # back-to-back, no host synchronisation: the flags order the calls
            rs(rs.input)
        torch.cuda.synchronize()
        inputs = [torch.empty_like(rs.input) for _ in range(world)]
        dist.all_gather(inputs, rs.input)
        expect_equal(rs.output, inputs, f"shape {shape} back-to-back")
        checks += 1
        rs.close()
    return close_rank_heap(alloc, rank, checks)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_reducescatter_on_gpu(world, tmp_path_factory):
    reports = run_gpu_ranks(gpu_rank_body, world, tmp_path_factory, "reducescatter")
    assert [r["checks"] for r in reports] == [len(GPU_CASES) * 5] * world
