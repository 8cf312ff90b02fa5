"""The put_signal_block all-gather: plan, generated CUDA, real nvcc compiles and argument checks on
the CPU; the result on 1, 2 and 4 ranks sharing one GPU (``-m gpu``)."""

from __future__ import annotations

import math

import pytest
import tilelang  # noqa: F401  (the import hook attaches tilescale-lang)
import torch
from examples_helpers import (LaunchRecorder, CpuAllocator, close_rank_heap, lower_source, needs_nvcc, open_rank_heap,
                              rejects_before_allocating, expect_checks, gpu_rank_test)

from tilescale_examples.collectives import allgather as ag_mod
from tilescale_examples import ClosedError
from tilescale_examples.collectives.allgather import AllGather, build_allgather_kernel, plan_chunks, torch_reference



# ------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("numel,itemsize,world,max_blocks", [
    (1, 2, 1, 128), (7, 2, 4, 128), (1000, 4, 4, 132), (4096 // 4 // 2, 2, 4, 132),
    ((1 << 28) // 4, 4, 4, 132), ((1 << 30) // 8 // 2, 2, 8, 132), (123457, 1, 3, 16), (5, 8, 8, 4),
])
def test_plan_chunks_tiles_the_shard(numel, itemsize, world, max_blocks):
    chunks, chunk = plan_chunks(numel, itemsize, world, max_blocks)
    assert chunks >= 1 and (chunks - 1) * chunk < numel <= chunks * chunk  # no empty chunk
    assert (chunk * itemsize) % 16 == 0  # chunk starts keep the 16-byte alignment
    assert chunks * world <= max(max_blocks, world)  # the grid stays co-resident
    if numel * itemsize >= ag_mod.MIN_CHUNK_BYTES * max_blocks:
        assert chunks == max_blocks // world  # big shards use the whole grid


def test_plan_chunks_rejects_bad_values():
    with pytest.raises(ValueError, match="shard_numel"):
        plan_chunks(0, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        plan_chunks(10, 2, 0)
    with pytest.raises(ValueError, match="does not tile"):
        build_allgather_kernel(100, "float16", 2, 4, 8)


def test_torch_reference():
    shards = [torch.full((3, 2), float(r)) for r in range(4)]
    ref = torch_reference(shards, 1)
    assert ref.shape == (4, 3, 2) and torch.equal(ref[2], shards[2])
    assert torch.equal(AllGather.torch_reference(shards, 3), ref)  # the same on every rank
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match="rank must be in"):
        torch_reference(shards, 4)


# ------------------------------------------------------------------------------ codegen
def test_one_rank_copies_its_chunk_without_flags():
    """World 1: each block copies its chunk (local put_block) and counts the call; no handshake,
    no signal, no wait, no barrier, and the flags are not a kernel parameter at all."""
    S = 1000
    C, CH = plan_chunks(S, 2, 1, max_blocks=16, min_chunk_bytes=256)
    body = lower_source(build_allgather_kernel(S, "float16", 1, C, CH, threads=256))
    body = body[body.index('extern "C" __global__ void __launch_bounds__'):]
    put = body.index("tilescale::put_block<4>((&(In[start])), (&(Out[start])), ")
    assert body.rstrip().endswith("}") and put < body.index("State[((int)blockIdx.x)] = epoch;")
    assert body[put:body.index(";", put)].endswith(", -1)")  # local: no peer address
    for absent in ("Flags", "signal", "wait_until", "__syncthreads", "fence"):
        assert absent not in body, absent

def test_generated_cuda_puts_with_signal_and_waits():
    S, W = 1000, 4
    C, CH = plan_chunks(S, 2, W, max_blocks=16, min_chunk_bytes=256)
    assert C == 4 and CH == 256
    src = lower_source(build_allgather_kernel(S, "float16", W, C, CH, threads=256))
    assert "#include <tilescale/tilescale.cuh>" in src
    body = src[src.index('extern "C" __global__ void __launch_bounds__'):]
    assert "__launch_bounds__(256" in body
    assert "int64_t epoch" in body
    # rank-agnostic: the rank comes from the table, never a constant
    assert "tilescale::get_rank()" in body
    # the call number comes from block (c, p)'s own counter on the device, never the host
    assert "epoch = (State[((((int)blockIdx.y) * 4) + ((int)blockIdx.x))] + (int64_t)1);" in body
    assert "int64_t epoch)" not in body and "epoch," not in body.split("{", 1)[0]
    # block (c, p): put chunk c into rank p's output at me * S + c * CH (p = blockIdx.y) and
    # add 1 to the data flag data[me, c] on p (put_signal: data before signal)
    put = body.index("tilescale::put_signal<4, false, false, true>(")
    put_call = body[put:body.index(";", put)]
    assert f"start = (((int)blockIdx.x) * {CH});" in body[:put]
    assert "(&(In[start]))" in put_call
    assert f"(&(Out[((((int64_t)me) * (int64_t){S}) + ((int64_t)start))]))" in put_call
    # the chunk's element count (signed, run-time) goes through the checked count, then bytes
    assert f'(((uint64_t)tilescale::checked_count(min({CH}, ({S} - start)), "put_signal_block size")) * (uint64_t)2)' in put_call
    assert f"(&(Flags[((me * {C}) + ((int)blockIdx.x))])), (uint64_t)1" in put_call
    assert put_call.rstrip(")").endswith("((int)blockIdx.y")
    # ready handshake and a block barrier before the put; acquire wait for p's chunk after
    notify = "tilescale::signal_op<true>("
    wait = "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>("
    ready_notify = body.index(notify)
    ready_wait = body.index(wait)
    first_sync = body.index("__syncthreads();")
    data_wait = body.index(wait, put)
    assert ready_notify < ready_wait < first_sync < put < data_wait
    assert body.count(notify) == 1 and body.count(wait) == 2 and body.count("__syncthreads();") == 1
    assert "fence_sys" not in body  # the signal is itself a release
    # the ready flags live after the W * C data flags; signals add 1, waits compare with the
    # call number, and thread 0 records the call in its block's counter after its last wait
    assert f"Flags[(((me * {C}) + ((int)blockIdx.x)) + {W * C})]" in body[ready_notify:ready_wait]
    assert f"Flags[((((int)blockIdx.y) * {C}) + ((int)blockIdx.x))]" in body[data_wait:]
    assert body.count("((uint64_t)epoch)") == 2
    assert body.index("State[((((int)blockIdx.y) * 4) + ((int)blockIdx.x))] = epoch;") > data_wait


@pytest.mark.parametrize("world,numel,dtype", [
    (4, (1 << 30) // 4 // 2, "float16"), (8, (1 << 30) // 8 // 4, "float32"), (2, (1 << 30) // 2, "uint8"),
    (4, (1 << 20) + 3, "float32"), (2, 1, "float16"),
])
def test_benchmark_sized_kernels_lower(world, numel, dtype):
    """Up to 1 GiB outputs: chunks of >= 32768 elements once tripped a TileLang pass."""
    itemsize = {"float16": 2, "float32": 4, "uint8": 1}[dtype]
    C, CH = plan_chunks(numel, itemsize, world, 132)
    assert "tilescale::put_signal<4," in lower_source(build_allgather_kernel(numel, dtype, world, C, CH))


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_real_compile_to_cubin(dtype, tmp_path, monkeypatch):
    """nvcc compiles the kernel (with the tilescale headers and flags) into a CUDA module."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    from tilescale_lang import headers

    S = 1 << 20 | 3  # odd size (unaligned slots, byte tails), chunks above 32768 elements
    for W, copy in ((4, "tilescale::put_signal<4,"), (1, "tilescale::put_block<4>(")):  # one rank: the copy alone
        C, CH = plan_chunks(S, 2 if dtype == "float16" else 4, W, max_blocks=32, min_chunk_bytes=1024)
        assert CH >= 32768
        kernel = tilelang.compile(build_allgather_kernel(S, dtype, W, C, CH), target=ag_mod.TARGET,
                                  execution_backend="tvm_ffi")
        assert f"-I{headers.include_dir()}" in kernel.compile_flags
        assert kernel.adapter.rt_mod.imports[0].kind == "cuda"
        assert copy in kernel.get_kernel_source()


# ------------------------------------------------------------------------------ the class
@needs_nvcc
def test_allgather_object_on_cpu_allocator(tmp_path, monkeypatch):
    """Construction (buffers, zeroed flags, a real compile, initialize) and every argument
    check of ``__call__``, which fail before any kernel runs."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    ag = AllGather(alloc, (3, 5), "float32", threads=128)
    assert alloc.allocations == [((3, 5), torch.float32), ((2, 3, 5), torch.float32), ((2 * 2 * ag.chunks,), torch.uint64),
                                 ((2, 2), torch.int32)]
    assert ag.algorithm == ag.engine == "sm" and ag.output is ag.peer_outputs[0] and not ag.copy_flags.ne(0).any()
    assert ag.output.shape == (2, 3, 5) and ag.input.shape == (3, 5)
    assert not ag.flags.ne(0).any()
    assert (ag.chunks, ag.chunk) == (1, 16)
    assert ag.bus_bytes() == 0.5 * 2 * 15 * 4
    assert "AllGather(shape=(3, 5)" in repr(ag)

    launched = []
    ag.kernel = LaunchRecorder(launched)  # stands in for the GPU launch
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        ag([0.0] * 15)
    with pytest.raises(TypeError, match="input has dtype torch.float16"):
        ag(torch.zeros(3, 5, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"input has shape \(15,\), expected the shard shape \(3, 5\)"):
        ag(torch.zeros(15))
    with pytest.raises(ValueError, match="input must be contiguous"):
        ag(torch.zeros(5, 3).t())
    assert launched == [] and ag.epoch == 0
    out = ag(torch.ones(3, 5))
    assert out is ag.output and ag.epoch == 1 and launched[0][3] is ag.state  # the call counters, not a number
    assert launched[0][1].shape == (30,)
    ag(torch.ones(3, 5))
    assert launched[1][3] is ag.state and ag.state.shape == (2 * ag.chunks,) and ag.state.dtype == torch.int64
    alloc.closed = True
    with pytest.raises(ClosedError, match="allocator of this AllGather is closed"):
        ag(torch.ones(3, 5))
    ag.close()
    ag.close()
    assert ag.closed
    with pytest.raises(ClosedError, match="AllGather is closed"):
        ag(torch.ones(3, 5))


@needs_nvcc
@pytest.mark.parametrize("op", ["allgather", "alltoall"])
def test_a_call_laid_out_as_the_last_relaunches_it(op, tmp_path, monkeypatch):
    """The put exchanges (AllGather, AllToAll): an input laid out as the last call's (the same
    buffer refilled, or a fresh view of it) and no ``out``: the kept launch again, with a new
    view of the input and the op's own buffers, without the input checks, and so does an
    input of that layout at another (aligned) address; a misaligned one or ``out=`` takes the
    full call; close() and a closed allocator still refuse."""
    from tilescale_examples.collectives.alltoall import AllToAll

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    shape = (3, 8) if op == "allgather" else (2, 3, 8)
    ex = (AllGather if op == "allgather" else AllToAll)(alloc, shape, "float32", threads=128)
    launched, checked = [], []
    ex.kernel = LaunchRecorder(launched)
    monkeypatch.setattr(ex, "check_input", lambda t: checked.append(t) or type(ex).check_input(ex, t))
    x = torch.randn(shape)
    ex(x), ex(x)  # two full calls on one buffer: the launch kept
    for view in (x, x.view(shape)):
        assert ex(view) is ex.output and len(checked) == 2
        assert launched[-1][0].data_ptr() == x.data_ptr()
        assert all(a is b for a, b in zip(launched[-1][1:], launched[0][1:]))  # the op's own buffers
    assert ex.epoch == 4
    moved = x.clone()
    ex(moved)  # another address: launched there
    assert len(checked) == 2 and launched[-1][0].data_ptr() == moved.data_ptr()
    misaligned = torch.randn(x.numel() + 1)[1:].view(shape)
    ex(misaligned)  # not 16-byte aligned: the full call
    assert len(checked) == 3 and launched[-1][0].data_ptr() == misaligned.data_ptr()
    out = torch.empty_like(ex.output)
    assert ex(x, out=out) is out and len(checked) == 4 and ex._kept_launch is None
    ex(x), ex(x)
    alloc.closed = True
    with pytest.raises(ClosedError, match="allocator of this .* is closed"):
        ex(x)
    alloc.closed = False
    ex.close()
    with pytest.raises(ClosedError, match="is closed"):
        ex(x)


def test_engine_size_table():
    limit = ag_mod.COPY_ENGINE_MIN_BYTES
    assert ag_mod.choose_engine(limit[2] - 1, 2) == "sm" and ag_mod.choose_engine(limit[2], 2) == "copy"
    assert ag_mod.choose_engine(limit[4], 4) == "copy" and ag_mod.choose_engine(limit[2], 3) == "copy"
    assert ag_mod.choose_engine(1 << 40, 1) == "sm"  # one rank: nothing crosses a link
    assert ag_mod.choose_engine(10, 2, table={2: 10}) == "copy"
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        ag_mod.choose_engine(10, 0)


@needs_nvcc
def test_algorithm_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2, rank=1)
    assert AllGather(alloc, (16,), torch.float16, algorithm="copy").algorithm == "copy"
    big = AllGather(alloc, (ag_mod.COPY_ENGINE_MIN_BYTES[2] // 4,), torch.float16, algorithm="auto")
    assert big.algorithm == "copy" and big.output is big.peer_outputs[1] and big.copy_flags is big.peer_copy_flags[1]
    assert AllGather(alloc, (16,), torch.float16, algorithm="auto").algorithm == "sm"
    with pytest.raises(ValueError, match="algorithm must be one of"):
        AllGather(CpuAllocator(), (16,), torch.float16, algorithm="dma")


def test_allgather_device_check():
    ag = object.__new__(AllGather)
    ag.shape, ag.dtype, ag.device = (4,), torch.float32, torch.device("cuda", 1)
    with pytest.raises(ValueError, match="input is on cpu, the allocator's heap is on cuda:1"):
        ag.check_input(torch.zeros(4))


test_constructor_rejects_before_allocating = rejects_before_allocating(
    AllGather, dict(shape=(16,), dtype=torch.float16), [
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(shape=0), ValueError, "shape must be non-empty positive ints"),
    (dict(shape=(4, -1)), ValueError, "shape"),
    (dict(shape="x"), ValueError, "shape"),
    (dict(dtype="complex64"), TypeError, "dtype must be one of"),
    (dict(dtype=torch.bool), TypeError, "dtype must be one of"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
    (dict(world_size=0), ValueError, "world_size must be a positive int"),
    (dict(threads=100), ValueError, "threads must be a multiple of 32"),
    (dict(shape=(1 << 30,)), ValueError, "int32 indexing"),
])


def test_constructor_rejects_closed_allocator():
    alloc = CpuAllocator()
    alloc.closed = True
    with pytest.raises(ClosedError, match="allocator is closed"):
        AllGather(alloc, 16, torch.float16)


# ------------------------------------------------------------------------------ GPU
#: (shard shape, dtype): 2, 14, 4000 B ... 4 MiB; most sizes are not multiples of 16 bytes,
#: so every rank's slot (rank * shard bytes) is misaligned for 16-byte vectors somewhere.
GPU_CASES = [((1,), torch.float16), ((7,), torch.float16), ((1000,), torch.float32), ((3, 333), torch.float16),
             ((4096 + 5,), torch.float32), ((1 << 16,), torch.float16), (((1 << 20) + 3,), torch.float32)]


#: Both engines on every case: the put_block kernel and the copy engines.
ENGINES = ("sm", "copy")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gpu_rank_body(rank: int, world: int, cache_dir: str, device: str | None = None) -> dict:
    """Per rank: several shapes and dtypes, poisoned outputs, fresh shards, repeated calls,
    each compared with the shards gathered through the (gloo) group."""
    import torch.distributed as dist

    alloc = open_rank_heap(rank, world, cache_dir, 2**27, device)
    dev = torch.device(alloc.device)
    checks = 0
    # No collective after a failure: a rank raises, run_ranks reports it and stops the peers.
    for case, (shape, dtype, engine) in enumerate((s, d, e) for s, d in GPU_CASES for e in ENGINES):
        ag = AllGather(alloc, shape, dtype, min_chunk_bytes=4096, algorithm=engine)  # small chunks: many blocks
        for step in range(4):
            g = torch.Generator().manual_seed(rank * 1000003 + case * 7919 + step)
            shard = torch.randn(shape, generator=g).to(dtype).to(dev)
            ag.output.fill_(float("nan") if step % 2 else -7.0)  # poison, no barrier needed
            src = ag.input if step % 2 else shard.clone()  # symmetric or plain input
            if step % 2:
                src.copy_(shard)
            out = ag(src)
            _sync(dev)
            gathered = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(gathered, shard)
            expect = torch_reference(gathered, rank)
            if not torch.equal(out, expect):
                bad = (out != expect).nonzero()[:5].tolist()
                raise AssertionError(f"rank {rank} world {world} shape {shape} {dtype} {engine} step {step} "
                                     f"(chunks {ag.chunks}x{ag.chunk}): first mismatches at {bad}")
            checks += 1
        # back-to-back calls with no host synchronisation in between (the handshake orders
        # them); poisoning the output before a call is legal: peers write only after it starts
        for step in range(20):
            ag.output.fill_(-9.0)
            ag(ag.input)
        _sync(dev)
        gathered = [torch.empty_like(ag.input) for _ in range(world)]
        dist.all_gather(gathered, ag.input)
        if not torch.equal(ag.output, torch_reference(gathered, rank)):
            raise AssertionError(f"rank {rank} world {world} shape {shape} {engine}: back-to-back calls differ")
        checks += 1
        ag.close()
    return close_rank_heap(alloc, rank, checks)


def allgather_kernels(worlds=(1, 2, 4)) -> list:
    """Precompile jobs of the kernels ``gpu_rank_body`` builds on ``worlds`` ranks (the plan
    of :class:`AllGather` with ``min_chunk_bytes=4096`` on this GPU's SM count)."""
    from tilescale_examples.base import DTYPES, plan_chunks

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    jobs = []
    for world in worlds:
        for shape, dtype in GPU_CASES:
            numel, itemsize = math.prod(shape), torch.empty((), dtype=dtype).element_size()
            chunks, chunk = plan_chunks(numel, itemsize, world, sms, 4096)
            jobs.append(("tilescale_examples.collectives.allgather:build_allgather_kernel",
                         (numel, DTYPES[dtype], world, chunks, chunk, 512), None))
    return jobs


@gpu_rank_test(1, 2, 4, timeout=300, cache="allgather", jobs=allgather_kernels)  # every world's kernels, in parallel
def test_allgather_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) * len(ENGINES) * 5)
