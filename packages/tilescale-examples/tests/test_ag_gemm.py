"""All-gather + GEMM on the CPU: tile order, generated CUDA, nvcc compile, reference,
argument checks and the plan choice (fused vs sequential). The GPU runs are in
``test_overlap_gpu.py``."""

from __future__ import annotations

import pytest
import tilelang
import torch
from examples_helpers import (CpuAllocator, gemm_fused_on_one_rank, gemm_heap_bytes_per_plan, gemm_sequential_on_cpu,
                              kernel_body, lower_source, needs_nvcc, rejects_before_allocating)

from tilescale_examples import ClosedError
from tilescale_examples.overlap.ag_gemm import AllGatherGEMM, build_ag_gemm_kernel, heap_bytes, tile_order, torch_reference
from tilescale_examples.base import TARGET
from tilescale_examples.overlap.stream_ops import plan_row_chunks


def test_torch_reference_is_gathered_matmul():
    a = [torch.eye(2), 2 * torch.eye(2)]
    b = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    inputs = [(a[0], b), (a[1], 3 * b)]  # every rank's (a, b); the result uses this rank's b
    assert torch.equal(torch_reference(inputs, 0), torch.cat([b, 2 * b]))
    assert torch.equal(AllGatherGEMM.torch_reference(inputs, 1), torch.cat([3 * b, 6 * b]))
    with pytest.raises(ValueError, match="one \\(a, b\\) pair per rank"):
        torch_reference([], 0)


def test_tile_order_follows_chunk_arrival_over_the_peers():
    chunks = plan_row_chunks(8)  # [(0, 1), (1, 2), (3, 5)]
    order = tile_order(3, chunks, 8).tolist()
    # chunk 0 of ranks +1, +2, then chunk 1 (units 1, 2) of +1, then of +2, ...
    assert order[:6] == [[8, 0], [16, 0], [9, 1], [10, 1], [17, 1], [18, 1]]
    assert sorted(code for code, _ in order) == list(range(8, 24))  # every peer unit once, no own unit
    for code, c in order:  # each unit is tagged with the chunk that carries it
        first, n = chunks[c]
        assert first <= code % 8 < first + n
    with pytest.raises(ValueError, match="do not cover 8 units"):
        tile_order(2, [(0, 4)], 8)
    assert tile_order(1, chunks, 8).shape == (0, 2)


def test_generated_cuda_waits_for_its_chunk_then_fences_then_tma():
    m_local, k, n, W, C = 512, 256, 512, 4, 3
    src = lower_source(build_ag_gemm_kernel(m_local, k, n, W, C))
    body = kernel_body(src)
    assert "tilescale::get_rank()" in body
    wait = body.index("tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>(")
    sync = body.index("__syncthreads();", wait)
    fence = body.index("tl::fence_proxy_async();", sync)
    tma_a = body.index("tl::tma_load(A_desc")
    assert wait < sync < fence < tma_a
    # the ready flag of the tile's chunk (src * C + Order[by, 1]) until it is 1; no call number anywhere
    assert "(int64_t)3) + ((int64_t)Order[" in body[wait:sync] and "(uint64_t)1" in body[wait:sync]
    assert "epoch" not in src
    # the A rows straight from the single gathered buffer: row = src * m_local + unit * block_m
    assert f"* {m_local})" in body[tma_a:body.index(";", tma_a)]
    assert "wgmma" in body and "tl::tma_load(B_desc" in body
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        build_ag_gemm_kernel(m_local, k, n, 1, C)


@needs_nvcc
@pytest.mark.parametrize("world", [2, 3])
def test_fused_kernel_compiles_for_sm90a(world, tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(build_ag_gemm_kernel(256, 128, 256, world, 2, "bfloat16"), target=TARGET,
                              execution_backend="tvm_ffi")
    assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


def test_auto_plan_on_cpu_falls_back_to_sequential_with_a_log_line(compiles, caplog):
    alloc, agg = gemm_sequential_on_cpu(AllGatherGEMM, "bfloat16", caplog)
    assert compiles == ["allgather", "gemm_tma_store"]  # the all-gather kernel, then the stock GEMM
    assert alloc.allocations == [((256, 128), torch.bfloat16), ((2, 256, 128), torch.bfloat16),
                                 ((2 * 2 * agg.all_gather.chunks,), torch.uint64), ((2, 2), torch.int32)]
    assert agg.output.shape == (512, 256) and agg.flops() == 2.0 * 512 * 256 * 128
    assert "algorithm='sequential'" in repr(agg)
    with pytest.raises(ValueError, match=r"a has shape \(128, 128\), expected \(m_local, k\) = \(256, 128\)"):
        agg.check_inputs(torch.zeros(128, 128, dtype=torch.bfloat16), torch.zeros(128, 256, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="b has dtype torch.float32, this AllGatherGEMM was built for torch.bfloat16"):
        agg.check_inputs(torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(128, 256))
    with agg:
        pass
    assert agg.closed and agg.all_gather is None and agg.output is None
    with pytest.raises(ClosedError, match="AllGatherGEMM is closed"):
        agg(torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(128, 256, dtype=torch.bfloat16))
    agg.close()  # idempotent


def test_fused_plan_allocates_the_gathered_buffer_and_the_handshake_flags(compiles, fused_available):
    alloc = CpuAllocator(num_ranks=3, rank=2)
    agg = AllGatherGEMM(alloc, 1024, 128, 512, torch.float16, algorithm="fused")
    assert (agg.algorithm, agg.algorithm_reason) == ("fused", "stub")
    assert agg.chunks == [(0, 1), (1, 2), (3, 5)]
    assert alloc.allocations == [((3, 1024, 128), torch.float16), ((3 * 3,), torch.uint64), ((3,), torch.uint64)]
    assert agg.gathered.shape == (3, 1024, 128) and int(agg.flags.sum()) == 0  # ready flags zeroed
    assert agg.free.view(torch.int64).tolist() == [1, 1, 1]  # every peer's slot free
    assert compiles == ["gemm_tma_store", "ag_gemm"]  # this rank's rows (stock), then the peers' rows
    assert agg._order.tolist()[:3] == [[8, 0], [16, 0], [9, 1]]
    agg.close()
    assert agg.closed and agg.own_kernel is None and agg.gathered is None


class _Stream:
    """Stands in for a CUDA stream on the CPU."""

    cuda_stream = 0

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event):
        pass


class _Push:
    """Stands in for CopyEnginePush: records its calls."""

    def __init__(self, log):
        self.log = log

    def mark(self, stream):
        self.log.append(("mark", stream.name))

    def enqueue(self, ptr):
        self.log.append(("enqueue", ptr))

    def release(self, stream):
        self.log.append(("release", stream.name))

    def finish(self, stream):
        self.log.append(("finish", stream.name))


@pytest.mark.parametrize("captured", [False, True])
def test_fused_call_sequence(compiles, fused_available, monkeypatch, captured):
    """Two ranks: copies marked on the caller's stream, the compute stream forked, this rank's
    rows on the caller's stream, the peers' rows on the compute stream (no call number: the
    handshake's flags are constants), the copies enqueued, the compute stream joined, then the
    gathered rows released and the copies joined, on every call; the same under CUDA graph
    capture (nothing refuses it)."""
    from examples_helpers import LaunchRecorder
    from tilescale_lang import metadata

    if captured:
        monkeypatch.setattr(AllGatherGEMM, "_capturing", lambda self: True)
        monkeypatch.setattr(metadata, "loaded", lambda kernel: True)
    log = []
    main, compute = _Stream(log, "main"), _Stream(log, "compute")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: type("E", (), {"record": lambda self, s: None})())
    agg = AllGatherGEMM(CpuAllocator(num_ranks=2, rank=1), 256, 128, 256, torch.bfloat16, algorithm="fused")
    monkeypatch.setattr(agg, "_make_push", lambda: _Push(log))
    monkeypatch.setattr(agg, "_make_compute_stream", lambda: compute)
    agg.own_kernel, agg.kernel = LaunchRecorder(log, "own"), LaunchRecorder(log, "peers")
    a, b = torch.zeros((256, 128), dtype=torch.bfloat16), torch.zeros((128, 256), dtype=torch.bfloat16)
    for _ in range(2):
        del log[:]
        out = agg(a, b)
        names = [entry[0] for entry in log]
        assert names == ["mark", "wait", "own", "peers", "enqueue", "wait", "release", "finish"], log
        assert log[0] == ("mark", "main") and log[1] == ("wait", "compute", "main")
        own, peers = log[2][1], log[3][1]
        assert own[0] is a and own[2].data_ptr() == out[256:].data_ptr()  # rank 1's rows
        assert peers[0].shape == (512, 128) and peers[0].data_ptr() == agg.gathered.data_ptr()
        assert peers[2] is out and peers[3] is agg.flags and peers[4] is agg._order and len(peers) == 5
        assert log[4] == ("enqueue", a.data_ptr()) and log[5] == ("wait", "main", "compute")
        assert log[6:] == [("release", "main"), ("finish", "main")]


def test_out_may_not_overlap_the_operands(compiles, caplog):
    _, agg = gemm_sequential_on_cpu(AllGatherGEMM, "bfloat16", caplog)
    space = torch.zeros((512 * 256 + 256 * 128,), dtype=torch.bfloat16)
    out, a = space[:512 * 256].view(512, 256), space[512 * 256 - 256 * 128:512 * 256].view(256, 128)
    b = torch.zeros((128, 256), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out overlaps a"):
        agg(a, b, out=out)
    with pytest.raises(ValueError, match="out overlaps b"):
        agg(torch.zeros((256, 128), dtype=torch.bfloat16), space[:128 * 256].view(128, 256), out=out)
    agg.close()


def test_fused_plan_on_one_rank_is_the_gemm_alone(compiles, fused_available):
    agg = gemm_fused_on_one_rank(AllGatherGEMM, torch.bfloat16, compiles)
    assert agg.kernel is agg.own_kernel


test_constructor_rejects_before_allocating = rejects_before_allocating(
    AllGatherGEMM, dict(m_local=128, k=64, n=256, dtype=torch.float16), [
    (dict(dtype=torch.float32), TypeError, "dtype must be one of"),
    (dict(m_local=0), ValueError, "m_local must be a positive int"),
    (dict(m_local=200), ValueError, "AllGatherGEMM: m_local=200 is not a multiple of block_m=128"),
    (dict(k=100), ValueError, "AllGatherGEMM: k=100 is not a multiple of block_k=64"),
    (dict(n=384), ValueError, "AllGatherGEMM: n=384 is not a multiple of block_n=256"),
    (dict(n=384, block_n=128), None, None),
    (dict(threads=160), ValueError, "threads must be a multiple of 128"),
    (dict(max_chunks=0), ValueError, "max_chunks must be a positive int"),
    (dict(algorithm="overlap"), ValueError, "algorithm must be one of"),
    (dict(algorithm="fused"), RuntimeError, "algorithm='fused' needs stream memory operations"),
    (dict(allocator=object()), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(m_local=2**20, k=2**10), ValueError, "exceed the kernels' int32 indexing"),
])


def test_heap_bytes_is_the_larger_plan_of_a_dry_run(compiles, request):
    fused = 2 * 4096 * 8192 * 2
    assert heap_bytes(2, 4096, 8192) >= fused  # the module's 0.1.0 function: a dry run too
    one = AllGatherGEMM.heap_bytes(128, 64, 256, torch.float16, world_size=1, device="cpu")
    alloc = CpuAllocator(num_ranks=1)
    AllGatherGEMM(alloc, 128, 64, 256, torch.float16, algorithm="sequential")  # one rank fused: no heap
    assert one == alloc.heap_bytes == heap_bytes(1, 128, 64, torch.float16, max_blocks=128)
    request.getfixturevalue("fused_available")  # from here on
    gemm_heap_bytes_per_plan(AllGatherGEMM, (256, 128, 256, torch.float16), 2)
