"""Distributed flash-decode (tilescale_examples.sequence.flash_decode).

CPU: the partials-then-combine arithmetic the kernels implement equals attention over the whole
cache (grouped-query heads, several ranks and splits), the generated CUDA (WGMMA partials; the
combine's offsets into the gathered buffer), nvcc compiles, the op's argument errors before
anything is allocated, its default splits, heap bytes, call sequence and lifetime. GPU
(``gpu``, ranks sharing one GPU, worlds 1, 2, 4): every rank's output and log-sum-exp against
the float32 reference over every rank's cache shard (full, and partly filled with per-sequence
lengths), fresh data and poisoned outputs, 200
back-to-back calls with a straggler, CUDA-graph replays on fresh inputs, a call on a side stream
beside another instance's on the current stream."""

from __future__ import annotations

import pytest
import torch
from examples_helpers import (CpuAllocator, LaunchRecorder, close_rank_heap, lower_with, needs_nvcc, expect_checks,
                              gpu_rank_test, open_rank_heap, record_compiles, side_stream_beside)

from tilescale_examples import ClosedError
from tilescale_examples.sequence.flash_decode import (BLOCK_N, SPFlashDecode, build_decode_combine_kernel,
                                                      build_decode_partial_kernel, combine_heads_per_block,
                                                      combine_reference,
                                                      partial_reference, rounds_combine_reference, torch_reference)


def _shard(seed, B, S, Hkv, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((B, S, Hkv, D), generator=g).to(dtype), torch.randn((B, S, Hkv, D), generator=g).to(dtype))


@pytest.mark.parametrize("world, splits", [(1, 1), (2, 4), (4, 3)])
def test_partials_combined_equal_attention_over_the_whole_cache(world, splits):
    B, H, Hkv, D, S = 2, 8, 2, 16, 24
    q = torch.randn(B, H, D)
    shards = [_shard(p, B, S, Hkv, D) for p in range(world)]
    parts = []
    for k, v in shards:  # in the kernels' order: rank, then split
        for s in range(splits):
            rows = slice(s * S // splits, (s + 1) * S // splits)
            parts.append(partial_reference(q, k[:, rows], v[:, rows], D ** -0.5))
    o, lse = combine_reference(parts)
    want_o, want_lse = torch_reference([(q, k, v) for k, v in shards], 0)
    assert torch.allclose(o, want_o, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)
    full = torch.softmax(torch.einsum("bhd,bshd->bhs", q, torch.cat([k for k, _ in shards], 1).repeat_interleave(4, 2))
                         * D ** -0.5, -1)
    assert torch.allclose(want_o, torch.einsum("bhs,bshd->bhd", full,
                                               torch.cat([v for _, v in shards], 1).repeat_interleave(4, 2)), atol=1e-5)


def test_reference_with_cache_lengths_counts_only_the_filled_positions():
    B, H, Hkv, D, S = 3, 4, 2, 8, 10
    q = torch.randn(B, H, D)
    shards = [_shard(p, B, S, Hkv, D) for p in range(2)]
    lens = [torch.tensor([10, 3, 0], dtype=torch.int32), torch.tensor([2, 10, 5], dtype=torch.int32)]
    o, lse = torch_reference([(q, k, v, n) for (k, v), n in zip(shards, lens)], 0)
    for b in range(B):
        k = torch.cat([shards[p][0][b:b + 1, :int(lens[p][b])] for p in range(2)], dim=1)
        v = torch.cat([shards[p][1][b:b + 1, :int(lens[p][b])] for p in range(2)], dim=1)
        want_o, want_lse = partial_reference(q[b:b + 1], k, v, D ** -0.5)
        assert torch.allclose(o[b:b + 1], want_o, atol=1e-5) and torch.allclose(lse[b:b + 1], want_lse, atol=1e-5)
    # an empty partial (-inf lse, zero output) changes nothing in the combine
    part = partial_reference(q, shards[0][0], shards[0][1], D ** -0.5)
    empty = (torch.zeros_like(part[0]), torch.full_like(part[1], float("-inf")))
    combined = combine_reference([part, empty])
    assert torch.allclose(combined[0], part[0], atol=1e-6) and torch.allclose(combined[1], part[1], atol=1e-6)


@pytest.mark.parametrize("count, per_round, empty", [
    (16, 32, []), (40, 32, [0, 5]), (37, 32, list(range(19))), (37, 8, list(range(20))), (6, 4, [5])])
def test_the_kernels_rounds_give_the_combine(count, per_round, empty):
    # the combine kernel's arithmetic (rounds, a running maximum, empty partials skipped, a
    # first round of only empty partials included) equals the one-pass combine
    g = torch.Generator().manual_seed(count * 100 + per_round)
    parts = [(torch.randn(2, 8, 64, generator=g), torch.randn(2, 8, generator=g) * 4) for _ in range(count)]
    for i in empty:
        parts[i] = (torch.zeros(2, 8, 64), torch.full((2, 8), float("-inf")))
    want_o, want_lse = combine_reference(parts)
    got_o, got_lse = rounds_combine_reference(parts, per_round)
    assert torch.allclose(got_o, want_o, atol=1e-5) and torch.allclose(got_lse, want_lse, atol=1e-5)
    assert not got_o.isnan().any()


def test_generated_cuda():
    partial = lower_with(build_decode_partial_kernel(2, 32, 8, 4096, 128, 4, 128 ** -0.5), {})
    assert "wgmma" in partial.lower() and "exp2f" in partial and "log2f" in partial
    # a split reads only its filled positions: the loop's extent comes from the sequence's length
    assert "int valid = min(max((Lens[((int)blockIdx.z)] - (((int)blockIdx.x) * 1024)), 0), 1024);" in partial
    assert "for (int kb = 0; kb < ((valid + 63) >> 6); ++kb)" in partial
    combine = lower_with(build_decode_combine_kernel(2, 4, 2, 32, 128), {})
    # every (rank, split) part of the 2 x 4: its lse at 32768 + split * B * H + b * H + h of the rank's
    # 33024-element row and this thread's channel of its output at split * B * H * D + b * H * D + h * D + d,
    # all 8 of each loaded in one unrolled loop (one round: no loop over rounds) before the first use
    t = "((int)threadIdx.x)"
    loads = combine[combine.index("for (int u = 0; u < 8; ++u)"):combine.index("m_new[0] = m[0];")]
    assert "#pragma unroll" in combine[:combine.index("for (int u = 0; u < 8; ++u)")]
    assert ("lse[u] = G[((((((u >> 2) * 33024) + ((u & 3) * 64)) + (((int)blockIdx.y) * 32)) "
            "+ ((int)blockIdx.x)) + 32768)];") in loads
    assert ("val[u] = G[((((((u >> 2) * 33024) + ((u & 3) * 8192)) + (((int)blockIdx.y) * 4096)) "
            f"+ (((int)blockIdx.x) * 128)) + {t})];") in loads
    assert "for (int r = 0" not in combine and "__syncthreads()" not in combine
    # empty partials (lse = -inf) add nothing; a round of only empty ones rescales nothing
    assert combine.count("if ((m_new[0] == -CUDART_INF_F))") == 2
    assert f"if ({t} == 0) {{\n    LSE[((((int)blockIdx.y) * 32) + ((int)blockIdx.x))]" in combine
    # more parts than a round (8 ranks x 5 splits = 40): 2 rounds of 20; 37 parts: 2 of 19, the last slot guarded
    two = lower_with(build_decode_combine_kernel(8, 5, 1, 8, 64), {})
    assert "for (int r = 0; r < 2; ++r)" in two and "for (int u = 0; u < 20; ++u)" in two and "< 40" not in two
    odd = lower_with(build_decode_combine_kernel(1, 37, 1, 8, 64), {})
    assert "for (int u = 0; u < 19; ++u)" in odd and "< 37)" in odd
    # 4 heads per 512-thread block: head 4 * blockIdx.x + threadIdx.x / 128, its channel threadIdx.x % 128
    packed = lower_with(build_decode_combine_kernel(1, 1, 64, 32, 128, heads_per_block=4), {})
    assert "__launch_bounds__(512" in packed
    assert "lse[0] = G[((((((int)blockIdx.y) * 32) + (((int)blockIdx.x) * 4)) + (((int)threadIdx.x) >> 7)) + 262144)];" in packed
    assert "val[0] = G[(((((int)blockIdx.y) * 4096) + (((int)blockIdx.x) * 512)) + ((int)threadIdx.x))];" in packed
    assert "if ((((int)threadIdx.x) % 128) == 0) {" in packed


def test_combine_packs_heads_when_the_grid_is_large():
    # batch 64 x 32 heads: 512 blocks of 4 heads, not 2048 of one; batch 16: 256 of 2; batch 1: one head each
    assert [combine_heads_per_block(b, 32, 128) for b in (1, 8, 16, 64)] == [1, 1, 2, 4]
    assert combine_heads_per_block(64, 6, 128) == 1 and combine_heads_per_block(128, 6, 128) == 2  # 6 % 4 != 0
    assert combine_heads_per_block(64, 32, 256) == 2  # at most 512 threads per block
    with pytest.raises(ValueError, match="heads_per_block=3 must divide heads=32"):
        build_decode_combine_kernel(1, 1, 64, 32, 128, heads_per_block=3)
    with pytest.raises(ValueError, match="heads_per_block=8 must divide heads=32 with head_dim"):
        build_decode_combine_kernel(1, 1, 64, 32, 256, heads_per_block=8)


@needs_nvcc
def test_kernels_compile_with_nvcc(tmp_path, monkeypatch):
    import tilelang

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    target = {"kind": "cuda", "arch": "sm_90a"}
    for func in (build_decode_partial_kernel(1, 8, 1, 256, 128, 2, 128 ** -0.5),
                 build_decode_combine_kernel(2, 2, 1, 8, 128)):
        assert tilelang.compile(func, target=target).prim_func is not None


def _make(monkeypatch, world=2, **kw):
    record_compiles(monkeypatch)
    args = dict(batch=2, heads=8, kv_heads=2, seq_local=256, head_dim=128, dtype=torch.bfloat16)
    args.update(kw)
    return SPFlashDecode(CpuAllocator(world), **args)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"heads": 6, "kv_heads": 4}, ValueError, "heads=6 must be a multiple of kv_heads=4"),
    ({"heads": 256, "kv_heads": 2}, ValueError, "at most 64 times it"),
    ({"head_dim": 96}, ValueError, "head_dim must be one of"),
    ({"seq_local": 100}, ValueError, "seq_local=100 must be a multiple of 64"),
    ({"splits": 3}, ValueError, "splits=3 must divide the 4 K/V tiles"),
    ({"scale": -1.0}, ValueError, "scale must be a positive number"),
    ({"batch": 0}, ValueError, "batch"),
    ({"dtype": torch.float32}, (TypeError, ValueError), "dtype"),
])
def test_argument_errors_before_anything_is_allocated(monkeypatch, kwargs, error, match):
    record_compiles(monkeypatch)
    alloc = CpuAllocator(2)
    args = dict(batch=2, heads=8, kv_heads=2, seq_local=256, head_dim=128, dtype=torch.bfloat16)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        SPFlashDecode(alloc, **args)
    assert alloc.allocations == []


def test_splits_heap_and_the_calls_kernels(monkeypatch):
    op = _make(monkeypatch)
    tiles = 256 // BLOCK_N
    assert op.splits in [d for d in range(1, tiles + 1) if tiles % d == 0]
    total = op.splits * 2 * 8 * (128 + 1)
    assert op.partials.shape == (total,) and op.gather.output.shape == (2, total)
    assert SPFlashDecode.heap_bytes(2, 8, 2, 256, 128, torch.bfloat16, world_size=2, splits=op.splits, device="cpu") \
        == type(op.gather).heap_bytes((total,), torch.float32, world_size=2, device="cpu")
    calls = []

    op.kernel, op.combine_kernel, op.gather.kernel = LaunchRecorder(calls, "partial"), LaunchRecorder(calls, "combine"), LaunchRecorder(calls, "gather")
    q = torch.randn(2, 8, 128).bfloat16()
    k, v = _shard(0, 2, 256, 2, 128, torch.bfloat16)
    out, lse = op(q, k, v)
    assert [c[0] for c in calls] == ["partial", "gather", "combine"]
    assert calls[0][1][:3] == (q, k, v) and calls[0][1][3] is op.full_lengths and calls[0][1][4] is op.partials
    assert op.full_lengths.tolist() == [256, 256]
    lens = torch.tensor([5, 256], dtype=torch.int32)
    op(q, k, v, cache_seqlens=lens)
    assert calls[-3][1][3] is lens  # the partial kernel (then the gather, the combine)
    with pytest.raises(TypeError, match="cache_seqlens has dtype torch.int64, this SPFlashDecode was built for torch.int32"):
        op(q, k, v, cache_seqlens=lens.long())
    del calls[3:]
    assert calls[1][1][0].data_ptr() == op.partials.data_ptr()  # the partials are what is gathered
    assert calls[2][1][0] is op.gather.output and calls[2][1][1:] == (out, lse) and out is op.output
    with pytest.raises(ValueError, match=r"k has shape \(2, 128, 2, 128\)"):
        op(q, k[:, :128].contiguous(), v)
    op.close()
    with pytest.raises(ClosedError):
        op(q, k, v)


def test_one_rank_combines_its_own_partials(monkeypatch):
    op = _make(monkeypatch, world=1)
    calls = []
    op.kernel, op.combine_kernel, op.gather.kernel = LaunchRecorder(calls, "partial"), LaunchRecorder(calls, "combine"), LaunchRecorder(calls, "gather")
    q = torch.randn(2, 8, 128).bfloat16()
    k, v = _shard(0, 2, 256, 2, 128, torch.bfloat16)
    out, lse = op(q, k, v)
    assert [c[0] for c in calls] == ["partial", "combine"]  # no all-gather launch
    gathered = calls[1][1][0]
    assert gathered.shape == (1, op.partials.numel()) and gathered.data_ptr() == op.partials.data_ptr()
    assert calls[1][1][1:] == (out, lse)
    op.close()


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [  # batch, heads, kv_heads, seq_local, head_dim, dtype
    (2, 32, 8, 1024, 128, torch.bfloat16),
    (1, 16, 16, 512, 64, torch.float16),
    (3, 8, 1, 256, 256, torch.bfloat16),
    (16, 32, 8, 256, 64, torch.bfloat16),  # the combine packs 2 heads per block
]


def _inputs(case, world, seed):
    """``q`` (the same on every rank) and every rank's cache shard, from seeds alone."""
    B, H, Hkv, S, D, dtype = case
    q = torch.randn((B, H, D), generator=torch.Generator().manual_seed(seed)).to(dtype)
    return q, [_shard(seed * 31 + 1 + p, B, S, Hkv, D, dtype) for p in range(world)]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> int:
    alloc = open_rank_heap(rank, world, cache_dir, 2**28)
    dev = torch.device(alloc.device)
    checks = 0
    for c, case in enumerate(GPU_CASES):
        op = SPFlashDecode(alloc, *case[:5], case[5])

        def check(q, shards, where, lens=None, inst=op):
            want_o, want_lse = torch_reference([(q, *kv, *([] if lens is None else [lens[p]]))
                                                for p, kv in enumerate(shards)], rank)
            if not torch.allclose(inst.output.float().cpu(), want_o, atol=2e-2, rtol=2e-2):
                raise AssertionError(f"rank {rank}/{world} {where}: output differs")
            if not torch.allclose(inst.lse.cpu(), want_lse, atol=1e-3, rtol=1e-3):
                raise AssertionError(f"rank {rank}/{world} {where}: lse differs")

        for step in range(3):
            q, shards = _inputs(case, world, 100 * c + step)
            op.output.fill_(float("nan"))
            op.lse.fill_(float("nan"))
            op(q.to(dev), *(t.to(dev) for t in shards[rank]))
            torch.cuda.synchronize()
            check(q, shards, f"case {c} step {step}")
            checks += 1
        for step in range(2):  # partly filled caches: every rank's lengths from one seed, rank 0's at least 1
            q, shards = _inputs(case, world, 100 * c + 10 + step)
            g = torch.Generator().manual_seed(100 * c + 20 + step)
            lens = [torch.randint(1 if p == 0 else 0, case[3] + 1, (case[0],), generator=g, dtype=torch.int32)
                    for p in range(world)]
            op.output.fill_(float("nan"))
            op(q.to(dev), *(t.to(dev) for t in shards[rank]), cache_seqlens=lens[rank].to(dev))
            torch.cuda.synchronize()
            check(q, shards, f"case {c} lengths {step}", lens)
            checks += 1
        q, shards = _inputs(case, world, 100 * c + 50)
        qd, (kd, vd) = q.to(dev), (t.to(dev) for t in shards[rank])
        for call in range(200):  # back to back, a straggling rank every 50 calls
            if call % 50 == 0 and rank == (call // 50) % world:
                torch.cuda._sleep(2_000_000)
            op(qd, kd, vd)
        torch.cuda.synchronize()
        check(q, shards, f"case {c} after 200 calls")
        checks += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(qd, kd, vd)
        for replay in range(2):
            q, shards = _inputs(case, world, 100 * c + 60 + replay)
            qd.copy_(q.to(dev))
            kd.copy_(shards[rank][0].to(dev))
            vd.copy_(shards[rank][1].to(dev))
            op.output.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(q, shards, f"case {c} replay {replay}")
            checks += 1
        # two instances at once: this one on a side stream, another on the current stream
        other = SPFlashDecode(alloc, *case[:5], case[5])
        (qa, sa), (qb, sb) = _inputs(case, world, 100 * c + 70), _inputs(case, world, 100 * c + 71)
        checks += side_stream_beside(lambda: op(qa.to(dev), *(t.to(dev) for t in sa[rank])),
                                     lambda: other(qb.to(dev), *(t.to(dev) for t in sb[rank])),
                                     (lambda: check(qa, sa, f"case {c} side stream"),
                                      lambda: check(qb, sb, f"case {c} second instance", inst=other)))
        other.close()
        op.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, 4, timeout=400, cache="flash-decode")
def test_flash_decode_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) * (3 + 2 + 1 + 2 + 2))
