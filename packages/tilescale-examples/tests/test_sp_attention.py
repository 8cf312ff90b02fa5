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

import math

import pytest
import torch
from examples_helpers import (CpuAllocator, LaunchRecorder, close_rank_heap, expect_checks, gpu_rank_test, in_order,
                              lower_with, needs_nvcc, nvcc_resources, open_rank_heap, record_compiles,
                              side_stream_beside)

from tilescale_examples import ClosedError
from tilescale_examples.sequence.flash_attention import torch_reference as attention_reference
from tilescale_examples.sequence.sp_attention import (SPAllGatherAttention, build_sp_attention_kernel,
                                                      build_sp_own_attention_kernel, build_sp_peer_attention_kernel,
                                                      positions, torch_reference)


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
    # (query block 7 - blockIdx.x: the heaviest first)
    assert "for (int kb = 0; kb < min(32, (((q_start + 1151) >> 7) - ((int)blockIdx.x))); ++kb)" in src
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
    ({"algorithm": "ring"}, ValueError, "algorithm must be one of"),
    ({"fast_math": 1}, TypeError, "fast_math must be a bool, got 1"),
])
def test_argument_errors_before_anything_is_allocated(monkeypatch, kwargs, error, match):
    record_compiles(monkeypatch)
    alloc = CpuAllocator(2)
    with pytest.raises(error, match=match):
        SPAllGatherAttention(alloc, **{**ARGS, **kwargs})
    assert alloc.allocations == []


def test_fast_math_reaches_every_attention_compile(monkeypatch):
    """The attention kernels compile with fast math by default (TL_ENABLE_FAST_MATH, as
    flash_attention's), with TileLang's default configuration under fast_math=False; the
    all-gathers' kernels never with it."""
    from tilelang import PassConfigKey

    from tilescale_examples import base

    seen = []
    record_compiles(monkeypatch)
    recorder = base.compile_once
    monkeypatch.setattr(base, "compile_once", lambda func, group=None, target=None, pass_configs=None: seen.append(
        (str(func.attrs["global_symbol"]), pass_configs)) or recorder(func, group, target, pass_configs))
    fast = {PassConfigKey.TL_ENABLE_FAST_MATH: True}
    for fast_math, want in ((True, fast), (False, None)):
        seen.clear()
        SPAllGatherAttention(CpuAllocator(2, 1), **ARGS, fast_math=fast_math, algorithm="sequential")
        attention = [configs for name, configs in seen if name.startswith("sp_attention")]
        assert attention == [want], seen
        assert all(configs is None for name, configs in seen if not name.startswith("sp_attention"))


def test_heap_and_the_calls_sequence(monkeypatch):
    record_compiles(monkeypatch)
    op = SPAllGatherAttention(CpuAllocator(2, 1), **ARGS)
    shard = (2, 256, 2, 128)
    assert op.gather_k.output.shape == (2, *shard) and op.gather_v.output.shape == (2, *shard)
    sequential = 2 * type(op.gather_k).heap_bytes(shard, torch.bfloat16, world_size=2, device="cpu")
    fused = 2 * 2 * math.prod(shard) * 2 + 4 * 256  # two (W, *shard) buffers; ready and free flags of K and V
    for algorithm, size in (("sequential", sequential), ("fused", fused), ("auto", max(sequential, fused))):
        assert SPAllGatherAttention.heap_bytes(2, 256, 8, 2, 128, torch.bfloat16, world_size=2, device="cpu",
                                               algorithm=algorithm) == size, algorithm
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
    # outputs may not overlap the inputs or each other (the kernels read inputs after other blocks wrote outputs)
    alias = torch.empty((2, 256, 8, 128), dtype=torch.bfloat16)  # q's shape; v's elements at its start
    v_inside = alias.view(-1)[:v.numel()].view(v.shape)
    v_inside.copy_(v)
    lse_inside = alias.view(-1).view(torch.float32)[:2 * 8 * 256].view(2, 8, 256)
    for args, kwargs, match in (((q, k, v), {"out": q}, "out overlaps q"),
                                ((q, k, v_inside), {"out": alias}, "out overlaps v"),
                                ((q, k, v), {"out": alias, "lse": lse_inside}, "out overlaps lse")):
        with pytest.raises(ValueError, match=match):
            op(*args, **kwargs)
    op.close()
    with pytest.raises(ClosedError):
        op(q, k, v)


def _online_softmax(q, keys, values, scale, state=None):
    """The kernels' online softmax in float64 (base 2, raw-score running maximum), over key
    tiles of 4, from ``state = (out, denom, row_max)`` or from nothing; ``(out, lse)`` after
    finish_rows."""
    LOG2E, LN2 = math.log2(math.e), math.log(2.0)
    out, denom, row_max = state if state is not None else (
        torch.zeros(q.shape[0], values.shape[1], dtype=torch.float64), torch.zeros(q.shape[0], dtype=torch.float64),
        torch.full((q.shape[0],), float("-inf"), dtype=torch.float64))
    for t in range(0, keys.shape[0], 4):
        s = q @ keys[t:t + 4].T
        prev, row_max = row_max, torch.maximum(row_max, s.max(dim=1).values)
        rescale = torch.exp2(prev * scale * LOG2E - row_max * scale * LOG2E)
        p = torch.exp2(s * scale * LOG2E - row_max[:, None] * scale * LOG2E)
        denom = denom * rescale + p.sum(dim=1)
        out = out * rescale[:, None] + p @ values[t:t + 4]
    return out / denom[:, None], torch.log2(denom) * LN2 + row_max * scale


def test_resuming_from_a_finished_result_equals_one_pass():
    """resume_rows' state (the normalised output, denominator 1, running maximum lse / scale)
    continued over the peers' keys gives the one-pass result over every key: the fused
    algorithm's own-shard-first split is exact, in any shard order."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((5, 8), (24, 8), (24, 8)))
    scale = 8 ** -0.5
    whole_o, whole_lse = _online_softmax(q, k, v, scale)
    own_o, own_lse = _online_softmax(q, k[8:16], v[8:16], scale)  # this rank's shard first
    peers = torch.cat([k[16:], k[:8]]), torch.cat([v[16:], v[:8]])
    o, lse = _online_softmax(q, *peers, scale, state=(own_o, torch.ones(5, dtype=torch.float64), own_lse / scale))
    assert torch.allclose(o, whole_o, atol=1e-12) and torch.allclose(lse, whole_lse, atol=1e-12)
    s = q @ k.T * scale
    assert torch.allclose(lse, torch.logsumexp(s, 1)) and torch.allclose(o, torch.softmax(s, 1) @ v)


def _peer_tiles(rank, world, seq_local, block_n, causal, order, second):
    """The (shard, first key) of every key tile the peers' kernel reads for a block of the
    first (``second`` False) or second chunk, in its order: the kernel's index arithmetic."""
    tps, C = seq_local // block_n, seq_local // 2
    tpc = C // block_n
    if causal and order == "zigzag":
        visits = (2 * world - 2 - rank) * tpc if second else rank * tpc
        out = []
        for t in range(visits):
            late, early = t >= (world - 1) * tpc, t // tpc
            shard = rank + 1 + (t - (world - 1) * tpc) // tpc if late else (early + 1 if second and early >= rank else early)
            out.append((shard, (C if late else 0) + (t % tpc) * block_n))
        return out
    visits = rank * tps if causal else (world - 1) * tps
    kbs = [t if causal else t + (tps if t >= rank * tps else 0) for t in range(visits)]
    return [(kb // tps, (kb % tps) * block_n) for kb in kbs]


@pytest.mark.parametrize("world, causal, order", [(3, True, "contiguous"), (3, False, "contiguous"),
                                                  (4, True, "zigzag"), (2, True, "zigzag"), (3, False, "zigzag")])
def test_fused_split_is_global_attention(world, causal, order):
    """For every rank and chunk of queries: attention over the own shard (causal in local
    positions), resumed over exactly the peers' key tiles the peers' kernel reads (no mask),
    equals global attention sliced to those rows. Every key a query sees is read once."""
    SP, block_n, D = 8, 2, 4
    shards = _shards(world, 1, SP, 1, 1, D, torch.float32, seed=world)
    for rank in range(world):
        q, k, v = (t[0, :, 0] for t in shards[rank])
        want_o, want_lse = torch_reference(shards, rank, causal, order)
        halves = (False, True) if order == "zigzag" and causal else (None,)
        for second in halves:
            rows = slice(0, SP) if second is None else (slice(SP // 2, SP) if second else slice(0, SP // 2))
            s_own = q[rows] @ k.T / D ** 0.5
            if causal:
                i = torch.arange(SP)[rows][:, None]
                s_own = s_own.masked_fill(torch.arange(SP)[None, :] > i, float("-inf"))
            keys = [shards[p][1][0, f:f + block_n, 0] for p, f in _peer_tiles(rank, world, SP, block_n, causal, order,
                                                                              bool(second))]
            vals = [shards[p][2][0, f:f + block_n, 0] for p, f in _peer_tiles(rank, world, SP, block_n, causal, order,
                                                                              bool(second))]
            s = torch.cat([s_own] + [q[rows] @ kk.T / D ** 0.5 for kk in keys], dim=1)
            vv = torch.cat([v] + vals)
            assert torch.allclose(torch.logsumexp(s, 1), want_lse[0, 0, rows], atol=1e-5), (rank, second)
            assert torch.allclose(torch.softmax(s, 1) @ vv, want_o[0, rows, 0], atol=1e-5), (rank, second)


def test_generated_cuda_of_the_fused_kernels():
    peers = lower_with(build_sp_peer_attention_kernel(4, 2, 1024, 8, 2, 128, True, 128 ** -0.5), {})
    assert "wgmma" in peers.lower() and "exp2f" in peers
    # thread 0 waits (acquire, system scope) for both flags of the shards before this rank
    wait = "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>"
    assert "for (int src = 0; src < 4; ++src)" in peers and "if ((src != rank) && (src < rank))" in peers
    for flags in ("FlagsK", "FlagsV"):
        assert f"{wait}((&({flags}[src])), (uint64_t)1);" in peers  # ready: 1 (a constant: graph-safe)
    assert "epoch" not in peers
    # before the producer / consumer split, then the proxy fence before the TMA loads
    assert peers.index(wait) < peers.index("__syncthreads();\n  tl::fence_proxy_async();") < peers.index("tma_load")
    assert peers.index("tl::fence_proxy_async();") < peers.index("warpgroup_reg_dealloc")
    # rank x 8 key tiles (producer and consumer), resumed from the own shard's output and lse / scale
    assert peers.count("for (int t = 0; t < (rank * 8); ++t)") == 1 and "t_1 < (rank * 8)" in peers
    assert "__bfloat1622float2" in peers and "row_max[i_4] = (LSE[" in peers and "denom[i_4] = 0x1p+0f" in peers
    full = lower_with(build_sp_peer_attention_kernel(4, 2, 1024, 8, 2, 128, False, 128 ** -0.5), {})
    assert "if (src != rank) {" in full and "for (int t = 0; t < 24; ++t)" in full  # 3 other shards x 8 tiles
    assert "if (((rank * 8) <= t)) {" in full and "condval = 8;" in full  # past the own shard: skip its 8 tiles
    # zigzag (4 ranks, chunks of 512 = 4 tiles): a first-chunk block reads the first chunks of the shards
    # before this rank; a second-chunk block (blockIdx.x >= 4) reads every other shard's first chunk
    # (skipping its own), then the later shards' second chunks
    zz = lower_with(build_sp_peer_attention_kernel(4, 1, 1024, 8, 2, 128, True, 128 ** -0.5, order="zigzag"), {})
    assert "sp_attention_peers_zigzag_kernel" in zz
    assert "if ((src != rank) && ((src < rank) || (4 <= ((int)blockIdx.x)))) {" in zz
    assert "if ((4 <= ((int)blockIdx.x))) {\n      condval = (24 - (rank * 4));\n    } else {\n      condval = (rank * 4);" in zz
    assert "condval_2 = (((t >> 2) + rank) - 2);" in zz and "(((4 <= ((int)blockIdx.x)) && (rank <= (t >> 2))))" in zz
    assert "if ((12 <= t)) {\n            condval_1 = 512;" in zz  # the second chunk's rows of the later shards
    # without a mask the order changes nothing: non-causal zigzag is the contiguous kernel
    assert lower_with(build_sp_peer_attention_kernel(4, 1, 1024, 8, 2, 128, False, 128 ** -0.5, order="zigzag"), {}) \
        == lower_with(build_sp_peer_attention_kernel(4, 1, 1024, 8, 2, 128, False, 128 ** -0.5), {})
    own = lower_with(build_sp_own_attention_kernel(2, 1024, 8, 2, 128, True, 128 ** -0.5), {})
    assert "sp_attention_own_kernel" in own and "FlagsK" not in own


@needs_nvcc
def test_fused_kernels_compile_with_nvcc(tmp_path, monkeypatch):
    import tilelang

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    for func, name in ((build_sp_peer_attention_kernel(2, 1, 256, 4, 1, 128, True, 128 ** -0.5), "sp_attention_peers"),
                       (build_sp_peer_attention_kernel(2, 1, 256, 4, 2, 64, False, 64 ** -0.5), "sp_attention_peers"),
                       (build_sp_peer_attention_kernel(2, 1, 512, 4, 1, 128, True, 128 ** -0.5, order="zigzag"),
                        "sp_attention_peers_zigzag"),
                       (build_sp_own_attention_kernel(1, 256, 4, 1, 128, True, 128 ** -0.5), "sp_attention_own")):
        kernel = tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"})
        assert kernel.prim_func.attrs["global_symbol"] == name


@needs_nvcc
@pytest.mark.parametrize("build, args", [
    (build_sp_peer_attention_kernel, (4, 1, 1024, 8, 2, 128, True, 128 ** -0.5)),
    (build_sp_peer_attention_kernel, (4, 1, 1024, 8, 2, 128, False, 128 ** -0.5)),
    (build_sp_peer_attention_kernel, (4, 1, 1024, 8, 2, 128, True, 128 ** -0.5, "bfloat16", 128, 128, 2, 256,
                                      "zigzag")),
    (build_sp_own_attention_kernel, (1, 1024, 8, 2, 128, True, 128 ** -0.5)),
    (build_sp_attention_kernel, (4, 1, 1024, 8, 2, 128, True, 128 ** -0.5, "bfloat16", 128, 128, 2, 256, "zigzag"))])
def test_async_kernels_keep_the_sync_structure_and_compile_without_spills(build, args, tmp_path):
    """pipeline="async": the producer and consumer warpgroups of the async attention pipeline,
    the peer kernel's flag waits before them and its rows resumed in the consumers; nvcc
    without spills."""
    src = lower_with(build(*args, pipeline="async"), {})
    peers = build is build_sp_peer_attention_kernel
    start = "__syncthreads();\n  tl::fence_proxy_async();" if peers else "__syncthreads();"
    assert in_order(src, start, "if (((int)threadIdx.x) < 128)", "warpgroup_reg_alloc<232>()", "wgmma_ss<",
                    "wgmma_rs<", "wait_wgmma<1>()")
    assert ("wait_until<" in src) == peers and ("denom[i_4] = 0x1p+0f" in src) == peers  # flags; resumed rows
    assert nvcc_resources(src, tmp_path)[1] == 0


class _Push:
    """Stands in for CopyEnginePush: records its construction and calls."""

    def __init__(self, log, gathered, flags, rows):
        self.log = log
        log.append(("push", tuple(gathered[0].shape), len(flags), rows))

    def mark(self, stream):
        self.log.append("mark")

    def enqueue(self, ptr):
        self.log.append(("enqueue", ptr))

    def release(self, stream):
        self.log.append("release")

    def finish(self, stream):
        self.log.append("finish")


def test_fused_plan_buffers_and_call_sequence(monkeypatch, fused_available):
    """Two ranks, fused: the gathered buffers, zeroed ready flags and set free flags instead of
    all-gathers; a call is own shard, pushes of k and v, the peers' kernel on the gathered
    buffers with the ready flags and the rank (not for a causal rank 0; no call number: the
    flags are constants), then each push's release and join, on every call."""
    compiles = record_compiles(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for rank, causal, order in ((1, True, "contiguous"), (0, True, "contiguous"), (0, False, "contiguous"),
                                (0, True, "zigzag")):
        compiles.clear()
        log = []
        op = SPAllGatherAttention(CpuAllocator(2, rank), **ARGS, causal=causal, algorithm="fused", order=order)
        assert (op.algorithm, op.algorithm_reason) == ("fused", "stub") and op.gather_k is None
        assert compiles == ["sp_attention_own", "sp_attention_peers" + ("_zigzag" if order == "zigzag" else "")]
        assert op.gathered_k.shape == op.gathered_v.shape == (2, 2, 256, 2, 128)
        assert op.flags_k.dtype == torch.uint64 and int(op.flags_k.sum()) == int(op.flags_v.sum()) == 0
        assert op.free_k.view(torch.int64).tolist() == op.free_v.view(torch.int64).tolist() == [1, 1]
        monkeypatch.setattr(op, "_make_push", lambda gathered, flags, free, rows: _Push(log, gathered, flags, rows))
        op.own_kernel, op.kernel = LaunchRecorder(log, "own"), LaunchRecorder(log, "peers")
        q, k, v = _shards(2, 2, 256, 8, 2, 128, torch.bfloat16)[rank]
        for call in (1, 2):
            del log[:]
            out, lse = op(q, k, v)
            pushes = [("push", (2, 512, 256), 2, 512)] * 2 if call == 1 else []
            assert log[:len(pushes)] == pushes
            body = log[len(pushes):]
            assert body[:2] == ["mark", "mark"] and body[2][0] == "own"
            own = body[2][1]
            assert own[0] is q and own[1].shape == (1, 2, 256, 2, 128) and own[1].data_ptr() == k.data_ptr()
            assert own[2].data_ptr() == v.data_ptr() and own[3:] == (out, lse, 0)
            assert body[3:5] == [("enqueue", k.data_ptr()), ("enqueue", v.data_ptr())]
            if rank == 0 and causal and order == "contiguous":  # no earlier shard; zigzag's second chunk has some
                assert body[5:] == ["release", "finish", "release", "finish"]
                continue
            tag, peers = body[5]
            assert tag == "peers" and peers[0] is q and peers[3:5] == (out, lse)
            assert peers[1] is op.gathered_k and peers[2] is op.gathered_v
            assert peers[5] is op.flags_k and peers[6] is op.flags_v and peers[7:] == (rank,)
            assert body[6:] == ["release", "finish", "release", "finish"]
        op.close()


def test_fused_plan_on_one_rank_is_the_flash_kernel_alone(monkeypatch, fused_available):
    compiles = record_compiles(monkeypatch)
    alloc = CpuAllocator(1)
    op = SPAllGatherAttention(alloc, **ARGS, algorithm="fused")
    assert op.algorithm == "fused" and "nothing to gather" in op.algorithm_reason
    assert alloc.allocations == [] and compiles == ["sp_attention_own"] and op.kernel is op.own_kernel
    calls = []
    op.kernel = op.own_kernel = LaunchRecorder(calls)
    q, k, v = _shards(1, 2, 256, 8, 2, 128, torch.bfloat16)[0]
    out, lse = op(q, k, v)
    assert len(calls) == 1 and calls[0][0] is q and calls[0][3:] == (out, lse, 0)


def test_auto_algorithm_choices(monkeypatch, fused_available, caplog):
    compiles = record_compiles(monkeypatch)
    zigzag = SPAllGatherAttention(CpuAllocator(2), **ARGS, order="zigzag")
    assert zigzag.algorithm == "fused" and compiles[-1] == "sp_attention_peers_zigzag"
    assert SPAllGatherAttention(CpuAllocator(2), **ARGS).algorithm == "fused"
    monkeypatch.setattr("tilescale_examples.overlap.stream_ops.stream_ops_available", lambda device: (False, "none"))
    import logging

    with caplog.at_level(logging.WARNING, logger="tilescale_examples"):
        assert SPAllGatherAttention(CpuAllocator(2), **ARGS).algorithm == "sequential"
    assert "SPAllGatherAttention: none; using the sequential plan" in caplog.text
    with pytest.raises(RuntimeError, match="algorithm='fused' needs stream memory operations"):
        SPAllGatherAttention(CpuAllocator(2), **ARGS, algorithm="fused")


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [  # batch, seq_local, heads, kv_heads, head_dim, causal, dtype, order, algorithm, pipeline
    (1, 1024, 8, 2, 128, True, torch.bfloat16, "contiguous", "auto", "sync"),
    (2, 512, 4, 4, 64, False, torch.float16, "contiguous", "auto", "sync"),
    (1, 256, 4, 1, 256, True, torch.bfloat16, "contiguous", "auto", "sync"),
    (1, 1024, 8, 2, 128, True, torch.bfloat16, "zigzag", "auto", "sync"),
    (1, 512, 8, 2, 128, True, torch.bfloat16, "contiguous", "sequential", "sync"),  # auto is fused at one rank
    (1, 1024, 8, 2, 128, True, torch.bfloat16, "zigzag", "auto", "async"),
    (2, 512, 4, 4, 64, False, torch.float16, "contiguous", "sequential", "async"),
]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    alloc = open_rank_heap(rank, world, cache_dir, 2**29)
    dev = torch.device(alloc.device)
    checks = 0
    for c, (B, SP, H, Hkv, D, causal, dtype, order, algorithm, pipeline) in enumerate(GPU_CASES):
        op = SPAllGatherAttention(alloc, B, SP, H, Hkv, D, dtype, causal=causal, order=order, algorithm=algorithm,
                                  pipeline=pipeline)

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
        other = SPAllGatherAttention(alloc, B, SP, H, Hkv, D, dtype, causal=causal, order=order, algorithm=algorithm,
                                     pipeline=pipeline)
        sa = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + 70)
        sb = _shards(world, B, SP, H, Hkv, D, dtype, seed=100 * c + 71)
        checks += side_stream_beside(lambda: op(*(t.to(dev) for t in sa[rank])),
                                     lambda: other(*(t.to(dev) for t in sb[rank])),
                                     (lambda: check(sa, f"case {c} side stream"),
                                      lambda: check(sb, f"case {c} second instance", inst=other)))
        other.close()
        op.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, 4, timeout=400, cache="sp-attention")
def test_sp_attention_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) * (3 + 1 + 2 + 2))


def test_benchmark_goals():
    from tilescale_examples.benchmarks.sp_attention import goal_lines

    sp = [[4096, 100.0, 97.0, 0.97, "fused", 120.0, 0.81, "ok"], [16384, 900.0, 850.0, 0.944, "fused", 990.0, 0.86, "ok"]]
    decode = [[1, 8192, 10.0, 9.5, 2.5, 0.95, 16, "ok"], [64, 131072, 500.0, "-", 3.5, "-", 1, "ok"]]
    assert goal_lines(sp, decode) == ["worst flash/sp: 0.944 (goal >= 0.95)", "worst torch/decode: 0.950 (goal >= 0.9)",
                                      "slowest combine: 3.50 us (goal <= 3.0)"]
    assert goal_lines([], []) == ["worst flash/sp: not measured", "worst torch/decode: not measured",
                                  "slowest combine: not measured"]
