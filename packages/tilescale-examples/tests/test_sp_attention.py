"""Sequence-parallel attention over all-gathered K/V (tilescale_examples.sequence.sp_attention).

CPU: the reference is global (causal) attention sliced to each rank's queries, the generated
CUDA (WGMMA, key tiles read from their rank's gathered shard, the causal loop bound over the
run-time first position), an nvcc compile, argument errors before anything is allocated, heap
bytes, the call's sequence (two all-gathers, then the kernel with this rank's first position).
GPU (``gpu``, ranks sharing one GPU, worlds 1, 2, 4): every rank's output and log-sum-exp
against the float32 reference, causal and not, fresh data with poisoned outputs, 200 back-to-back
calls with a straggler, CUDA-graph replays on fresh inputs, a call on a side stream beside another
instance's on the current stream."""

from __future__ import annotations

import pytest
import torch
from examples_helpers import (CpuAllocator, LaunchRecorder, check_gpu_ranks, close_rank_heap, lower_with, needs_nvcc, on_gpu_ranks,
                              open_rank_heap, record_compiles)

from tilescale_examples import ClosedError
from tilescale_examples.sequence.flash_attention import torch_reference as attention_reference
from tilescale_examples.sequence.sp_attention import (SPAllGatherAttention, build_sp_attention_kernel, positions,
                                                      torch_reference)


def _shards(world, B, SP, H, Hkv, D, dtype=torch.float32, seed=0):
    """Every rank's ``(q, k, v)`` from seeds alone (each rank can make every rank's)."""
    out = []
    for p in range(world):
        g = torch.Generator().manual_seed(seed * 1009 + p)
        out.append((torch.randn((B, SP, H, D), generator=g).to(dtype), torch.randn((B, SP, Hkv, D), generator=g).to(dtype),
                    torch.randn((B, SP, Hkv, D), generator=g).to(dtype)))
    return out


def test_positions_of_the_orders():
    assert positions(1, 3, 4).tolist() == [4, 5, 6, 7]
    assert positions(0, 3, 4, "zigzag").tolist() == [0, 1, 10, 11]  # chunks 0 and 5 of 2 positions
    assert positions(2, 3, 4, "zigzag").tolist() == [4, 5, 6, 7]  # chunks 2 and 3
    assert sorted(torch.cat([positions(r, 3, 4, "zigzag") for r in range(3)]).tolist()) == list(range(12))


@pytest.mark.parametrize("causal, order", [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")])
def test_reference_is_global_attention_sliced_by_rank(causal, order):
    world, SP = 3, 8
    shards = _shards(world, 2, SP, 4, 2, 16)
    q, k, v = (torch.zeros(2, world * SP, *shards[0][i].shape[2:]) for i in range(3))
    for p in range(world):  # the global sequence, each rank's rows in their places
        for full, part in zip((q, k, v), shards[p]):
            full[:, positions(p, world, SP, order)] = part
    o, lse = attention_reference(q, k, v, causal=causal)
    for rank in range(world):
        got_o, got_lse = torch_reference(shards, rank, causal, order)
        mine = positions(rank, world, SP, order)
        assert torch.allclose(got_o, o[:, mine], atol=1e-5) and torch.allclose(got_lse, lse[:, :, mine], atol=1e-5)
    if causal and order == "contiguous":  # against a direct computation: rank r's queries see the first (r + 1) SP keys
        r = 1
        want = attention_reference(shards[r][0], k[:, :(r + 1) * SP], v[:, :(r + 1) * SP], causal=causal)
        assert torch.allclose(torch_reference(shards, r, causal)[0], want[0], atol=1e-5)


def test_generated_cuda():
    src = lower_with(build_sp_attention_kernel(4, 2, 1024, 8, 2, 128, True, 128 ** -0.5), {})
    assert "wgmma" in src.lower() and "exp2f" in src
    # 4 ranks x 8 key tiles; a causal block stops after its diagonal's tile, from the run-time first position
    assert "for (int kb = 0; kb < min(32, (((q_start + 255) >> 7) + ((int)blockIdx.x))); ++kb)" in src
    full = lower_with(build_sp_attention_kernel(4, 2, 1024, 8, 2, 128, False, 128 ** -0.5), {})
    assert "for (int kb = 0; kb < 32; ++kb)" in full
    zigzag = lower_with(build_sp_attention_kernel(4, 1, 1024, 8, 2, 128, True, 128 ** -0.5, order="zigzag"), {})
    # key tiles in global order up to the block's diagonal, each read at its chunk's offset in its shard
    assert "for (int kb = 0; kb < min(32, ((condval + 255) >> 7)); ++kb)" in zigzag
    assert "(((kb & 3) * 128) + condval_1)" in zigzag


@needs_nvcc
def test_kernel_compiles_with_nvcc(tmp_path, monkeypatch):
    import tilelang

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    kernel = tilelang.compile(build_sp_attention_kernel(2, 1, 256, 4, 1, 128, True, 128 ** -0.5),
                              target={"kind": "cuda", "arch": "sm_90a"})
    assert kernel.prim_func.attrs["global_symbol"] == "sp_attention_contiguous"


ARGS = dict(batch=2, seq_local=256, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"heads": 6, "kv_heads": 4}, ValueError, "heads=6 must be a multiple of kv_heads=4"),
    ({"head_dim": 96}, ValueError, "head_dim must be one of"),
    ({"seq_local": 192}, ValueError, "seq_local=192 must be a multiple of block_m=128"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"scale": 0}, ValueError, "scale must be a positive number"),
    ({"order": "ring"}, ValueError, "order must be one of"),
    ({"order": "zigzag", "seq_local": 128}, ValueError, r"seq_local=128 must be a multiple of 2 x block_m=128"),
    ({"block_k": 64}, TypeError, r"unknown tile options \['block_k'\]"),
    ({"dtype": torch.float32}, (TypeError, ValueError), "dtype"),
])
def test_argument_errors_before_anything_is_allocated(monkeypatch, kwargs, error, match):
    record_compiles(monkeypatch)
    alloc = CpuAllocator(2)
    with pytest.raises(error, match=match):
        SPAllGatherAttention(alloc, **{**ARGS, **kwargs})
    assert alloc.allocations == []


def test_heap_and_the_calls_sequence(monkeypatch):
    record_compiles(monkeypatch)
    op = SPAllGatherAttention(CpuAllocator(2, 1), **ARGS)
    shard = (2, 256, 2, 128)
    assert op.gather_k.output.shape == (2, *shard) and op.gather_v.output.shape == (2, *shard)
    assert SPAllGatherAttention.heap_bytes(2, 256, 8, 2, 128, torch.bfloat16, world_size=2, device="cpu") == \
        2 * type(op.gather_k).heap_bytes(shard, torch.bfloat16, world_size=2, device="cpu")
    calls = []

    op.kernel, op.gather_k.kernel, op.gather_v.kernel = LaunchRecorder(calls, "attention"), LaunchRecorder(calls, "k"), LaunchRecorder(calls, "v")
    q, k, v = _shards(1, 2, 256, 8, 2, 128, torch.bfloat16)[0]
    out, lse = op(q, k, v)
    assert [c[0] for c in calls] == ["k", "v", "attention"]
    assert calls[0][1][0].data_ptr() == k.data_ptr() and calls[1][1][0].data_ptr() == v.data_ptr()
    attention = calls[2][1]
    assert attention[0] is q and attention[1] is op.gather_k.output and attention[2] is op.gather_v.output
    assert attention[3:5] == (out, lse) and attention[5] == 256  # rank 1's first position
    zigzag = SPAllGatherAttention(CpuAllocator(2, 1), **ARGS, order="zigzag")
    zigzag.kernel = LaunchRecorder(calls, "zigzag")
    zigzag.gather_k.kernel = zigzag.gather_v.kernel = LaunchRecorder(calls, "gather")
    zigzag(q, k, v)
    assert calls[-1][0] == "zigzag" and calls[-1][1][5] == 128  # chunk 1 of four 128-position chunks
    with pytest.raises(ValueError, match=r"q has shape \(2, 128, 8, 128\)"):
        op(q[:, :128].contiguous(), k, v)
    op.close()
    with pytest.raises(ClosedError):
        op(q, k, v)


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [  # batch, seq_local, heads, kv_heads, head_dim, causal, dtype, order
    (1, 1024, 8, 2, 128, True, torch.bfloat16, "contiguous"),
    (2, 512, 4, 4, 64, False, torch.float16, "contiguous"),
    (1, 256, 4, 1, 256, True, torch.bfloat16, "contiguous"),
    (1, 1024, 8, 2, 128, True, torch.bfloat16, "zigzag"),
]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    alloc = open_rank_heap(rank, world, cache_dir, 2**29)
    dev = torch.device(alloc.device)
    checks = 0
    for c, (B, SP, H, Hkv, D, causal, dtype, order) in enumerate(GPU_CASES):
        op = SPAllGatherAttention(alloc, B, SP, H, Hkv, D, dtype, causal=causal, order=order)

        def check(shards, where, inst=op):
            want_o, want_lse = torch_reference(shards, rank, causal, order)
            if not torch.allclose(inst.output.float().cpu(), want_o, atol=2e-2, rtol=2e-2):
                raise AssertionError(f"rank {rank}/{world} {where}: output differs")
            if not torch.allclose(inst.lse.cpu(), want_lse, atol=1e-3, rtol=1e-3):
                raise AssertionError(f"rank {rank}/{world} {where}: lse differs")

        for step in range(3):
            shards = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + step)
            op.output.fill_(float("nan"))
            op.lse.fill_(float("nan"))
            op(*(t.to(dev) for t in shards[rank]))
            torch.cuda.synchronize()
            check(shards, f"case {c} step {step}")
            checks += 1
        shards = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + 50)
        mine = [t.to(dev) for t in shards[rank]]
        for call in range(200):  # back to back, a straggling rank every 50 calls
            if call % 50 == 0 and rank == (call // 50) % world:
                torch.cuda._sleep(2_000_000)
            op(*mine)
        torch.cuda.synchronize()
        check(shards, f"case {c} after 200 calls")
        checks += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(*mine)
        for replay in range(2):
            shards = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + 60 + replay)
            for dst, src in zip(mine, shards[rank]):
                dst.copy_(src.to(dev))
            op.output.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(shards, f"case {c} replay {replay}")
            checks += 1
        # two instances at once: this one on a side stream, another on the current stream
        other = SPAllGatherAttention(alloc, B, SP, H, Hkv, D, dtype, causal=causal, order=order)
        sa = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + 70)
        sb = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + 71)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(*(t.to(dev) for t in sa[rank]))
        other(*(t.to(dev) for t in sb[rank]))
        torch.cuda.synchronize()
        check(sa, f"case {c} side stream")
        check(sb, f"case {c} second instance", inst=other)
        checks += 2
        other.close()
        op.close()
    return close_rank_heap(alloc, rank, checks)


@on_gpu_ranks(1, 2, 4, timeout=400)
def test_sp_attention_on_gpu(world, tmp_path_factory):
    check_gpu_ranks(gpu_rank_body, world, tmp_path_factory, "sp-attention", len(GPU_CASES) * (3 + 1 + 2 + 2))


def test_benchmark_goals():
    from tilescale_examples.benchmarks.sp_attention import goal_lines

    sp = [[4096, 100.0, 97.0, 0.97, "ok"], [16384, 900.0, 850.0, 0.944, "ok"]]
    decode = [[1, 8192, 10.0, 9.5, 2.5, 0.95, "ok"], [64, 131072, 500.0, "-", 3.5, "-", "ok"]]
    assert goal_lines(sp, decode) == ["worst flash/sp: 0.944 (goal >= 0.95)", "worst torch/decode: 0.950 (goal >= 0.9)",
                                      "slowest combine: 3.50 us (goal <= 3.0)"]
    assert goal_lines([], []) == ["worst flash/sp: not measured", "worst torch/decode: not measured",
                                  "slowest combine: not measured"]
