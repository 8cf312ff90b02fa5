"""MoE low-latency mode on the CPU: the torch references of the masked layout, the FP8
quantisation and the combine against brute-force loops; every argument check before any
kernel; the object on a CPU stand-in allocator (allocations, heap_bytes, launches, the receive
hook, lifetime); the generated CUDA of each kernel and one nvcc compile within the register
budget. The GPU tests are in ``test_moe_low_latency_gpu.py``."""

from __future__ import annotations

import re

import pytest
import torch
from examples_helpers import (CpuAllocator, LaunchRecorder, kernel_body, lower_with, needs_toolkit, nvcc_resources,
                              rejects_before_allocating)

from tilescale_examples.moe._common import PASS_CONFIGS
from tilescale_examples.moe.ll_combine import build_ll_combine_kernel
from tilescale_examples.moe.ll_dispatch import (build_ll_dispatch_kernel, build_ll_recv_kernel, check_ll_sizes,
                                                ll_shared_bytes)
from tilescale_examples.moe.ll_reference import (FP8_MAX, ll_combine_reference, ll_dispatch_reference,
                                                 quantize_fp8_blocks)
from tilescale_examples.moe.low_latency import LowLatencyHandle, MoELowLatency

E, K, H, TMAX = 8, 2, 256, 16


def _inputs(world, tokens, experts, topk, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = [torch.randint(-1, experts, (tokens + s, topk), generator=g) for s in range(world)]
    xs = [torch.randn(tokens + s, hidden, generator=g).to(torch.bfloat16) for s in range(world)]
    return xs, idx, g


# ------------------------------------------------------------------------------ references
def test_dispatch_reference_matches_a_brute_force_loop():
    W, experts, topk, tmax = 3, 6, 3, 12
    xs, idx, _ = _inputs(W, 9, experts, topk, 16)
    EL = experts // W
    for rank in range(W):
        ref = ll_dispatch_reference(xs, idx, experts, tmax, rank)
        next_row = {}
        for s in range(W):  # entries in token order; each (expert, source) segment fills up in turn
            for t in range(idx[s].shape[0]):
                for k in range(topk):
                    e = int(idx[s][t, k])
                    if e // EL != rank or e < 0:
                        continue
                    j = e % EL
                    r = next_row.get((j, s), 0)
                    next_row[(j, s)] = r + 1
                    assert torch.equal(ref["x"][j, s * tmax + r], xs[s][t])
                    assert ref["src"][j, s * tmax + r].tolist() == [t, k]
        for j in range(EL):
            for s in range(W):
                n = next_row.get((j, s), 0)
                assert int(ref["counts"][j, s]) == n
                assert ref["mask"][j, s * tmax:(s + 1) * tmax].tolist() == [True] * n + [False] * (tmax - n)
                assert not ref["x"][j, s * tmax + n:(s + 1) * tmax].any()


def test_fp8_quantisation_matches_deepseek_v3_per_128_channels():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 384, generator=g) * torch.tensor([1.0, 100.0, 1e-3])[:, None]).to(torch.bfloat16)
    x[1, 128:256] = 0  # a zero group: scale 0, values 0
    q, scales = quantize_fp8_blocks(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 3) and scales.dtype == torch.float32
    for t in range(3):
        for b in range(3):
            group = x[t, 128 * b:128 * (b + 1)].float()
            scale = group.abs().max() / FP8_MAX
            assert scales[t, b] == scale
            want = (group / scale if scale > 0 else torch.zeros_like(group)).clamp(-FP8_MAX, FP8_MAX)
            assert torch.equal(q[t, 128 * b:128 * (b + 1)].view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))
    deq = q.float().view(3, 3, 128) * scales[..., None]
    assert torch.allclose(deq.view(3, 384), x.float(), rtol=2.0 ** -3, atol=1e-6)
    ref = ll_dispatch_reference([x], [torch.tensor([[0], [1], [0]])], 2, 4, 0, fp8=True)
    assert torch.equal(ref["x"][0, :2].view(torch.uint8), q[[0, 2]].view(torch.uint8))
    assert torch.equal(ref["scales"][1, 0], scales[1]) and ref["counts"].tolist() == [[2], [1]]


def test_combine_reference_matches_a_brute_force_loop():
    W, experts, topk, tmax, hidden = 2, 4, 3, 8, 16
    xs, idx, g = _inputs(W, 6, experts, topk, hidden, seed=2)
    ys = [ll_dispatch_reference(xs, idx, experts, tmax, d)["x"] * (d + 2) for d in range(W)]
    for rank in range(W):
        w = torch.rand(idx[rank].shape, generator=g)
        out = ll_combine_reference(ys, idx, w, experts, tmax, rank)
        assert out.dtype == torch.bfloat16
        for t in range(idx[rank].shape[0]):
            acc = torch.zeros(hidden)
            for k in range(topk):
                e = int(idx[rank][t, k])
                if e >= 0:  # y of the owner = the token times (owner + 2)
                    acc = acc + w[t, k] * (xs[rank][t].float() * (e // (experts // W) + 2)).bfloat16().float()
            assert torch.equal(out[t], acc.bfloat16()), t


def test_reference_argument_checks():
    x, i = [torch.zeros(2, 8)], [torch.zeros(2, 1, dtype=torch.long)]
    with pytest.raises(ValueError, match="one tensor per rank"):
        ll_dispatch_reference([], [], 4, 4, 0)
    with pytest.raises(ValueError, match="num_experts=5 is not a multiple of 2 ranks"):
        ll_dispatch_reference(x * 2, i * 2, 5, 4, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\)"):
        ll_combine_reference(x, i, torch.zeros(2, 1), 2, 4, 1)
    with pytest.raises(ValueError, match="more than max_tokens=1"):
        ll_dispatch_reference(x, i, 2, 1, 0)


# ------------------------------------------------------------------------------ sizes and builds
def test_sizes_are_checked_naming_the_argument():
    assert ll_shared_bytes(256, 8, 256) <= 48 * 1024 < ll_shared_bytes(256, 8, 512)
    for args, match in (((257, 8, 7168, 128), "num_experts must be in"), ((64, 8, 7170, 128), "hidden must be"),
                        ((64, 8, 7168, 1025), "max_tokens must be in"), ((256, 8, 7168, 512), "shared memory")):
        with pytest.raises(ValueError, match=match):
            check_ll_sizes(*args)
    with pytest.raises(ValueError, match="multiple of 128 with fp8=True"):
        check_ll_sizes(64, 8, 7176, 128, fp8=True)
    with pytest.raises(ValueError, match="phase must be one of"):
        build_ll_dispatch_kernel(64, 8, 7168, 128, phase="recv")


# ------------------------------------------------------------------------------ the object (CPU)
def _make(alloc=None, **kwargs):
    args = dict(num_experts=E, hidden=H, topk=K, max_tokens=TMAX, dtype=torch.bfloat16)
    args.update(kwargs)
    return MoELowLatency(alloc or CpuAllocator(num_ranks=2), **args)


def test_object_on_a_cpu_allocator(compiles):
    alloc = CpuAllocator(num_ranks=2)
    ll = _make(alloc, fp8=True, index_dtype=torch.int32)
    rows = E * TMAX
    assert alloc.allocations == [((rows, H), torch.uint8), ((rows, H // 128), torch.float32), ((rows,), torch.int32),
                                 ((TMAX * K, H), torch.bfloat16), ((E,), torch.uint64), ((3, 2), torch.uint64)]
    assert not ll.signals.ne(0).any() and not ll.flags.ne(0).any()
    assert alloc.heap_bytes == MoELowLatency.heap_bytes(E, H, K, TMAX, torch.bfloat16, world_size=2, fp8=True)
    assert sorted(compiles) == ["moe_ll_combine", "moe_ll_dispatch_fp8"]
    launched = []
    ll.dispatch_kernel = LaunchRecorder(launched, "dispatch")
    ll.combine_kernel = LaunchRecorder(launched, "combine")
    ll._hook_kernels = (LaunchRecorder(launched, "send"), LaunchRecorder(launched, "recv"))
    x = torch.randn(5, H).bfloat16()
    idx = torch.tensor([[0, 7], [1, -1], [2, 3], [4, 4], [6, 5]], dtype=torch.int32)
    w = torch.rand(5, K)
    (recv, scales), counts, handle = ll.dispatch(x, idx, w)
    assert recv.shape == (4, 2 * TMAX, H) and recv.dtype == torch.float8_e4m3fn and scales.shape == (4, 2 * TMAX, 2)
    assert counts.shape == (4, 2) and counts.dtype == torch.int32 and isinstance(handle, LowLatencyHandle)
    args = launched[-1][1]
    assert launched[-1][0] == "dispatch" and args[0] is idx and args[1] is x and args[-1] is ll.state
    assert args[3] is ll.recv_scales_buf and len(args) == 13 and ll.epoch == 1
    src_rank, src_token, src_slot = handle.origin()
    assert src_rank.shape == (4, 2 * TMAX) and src_rank[:, TMAX].tolist() == [1] * 4
    y = torch.randn(4, 2 * TMAX, H).bfloat16()
    out = ll.combine(y, handle)  # the dispatch's weights
    assert out.shape == (5, H) and launched[-1][0] == "combine" and launched[-1][1][2].shape == (10,)
    with pytest.raises(RuntimeError, match="already combined"):
        ll.combine(y, handle)
    # the send/receive split: the hook runs the receive; nothing else runs before it
    _, _, handle, hook = ll.dispatch(x, idx, return_recv_hook=True)
    assert [n for n, _ in launched[-1:]] == ["send"] and not handle.received
    for call in (lambda: ll.dispatch(x, idx), lambda: ll.combine(y, handle, w)):
        with pytest.raises(RuntimeError, match="call the receive hook of the previous dispatch first"):
            call()
    hook()
    assert launched[-1][0] == "recv" and handle.received
    with pytest.raises(RuntimeError, match="already run"):
        hook()
    with pytest.raises(TypeError, match="combine needs topk_weights"):
        ll.combine(y, handle)
    ll.combine(y, handle, w)
    ll.dispatch(x[:0], idx[:0])  # an empty rank still takes part
    ll.status.copy_(torch.tensor([2, 7, 8]))
    with pytest.raises(ValueError, match=r"topk_idx\[3, 1\] = 8 is out of range.*\(2 bad entries\); the dispatch skipped"):
        ll.check_index_errors()
    assert repr(ll).startswith("MoELowLatency(num_experts=8, hidden=256, topk=2, max_tokens=16")
    ll.close()
    with pytest.raises(RuntimeError, match="MoELowLatency is closed"):
        ll.dispatch(x, idx)


def test_call_arguments_are_checked_before_any_launch(compiles):
    ll = _make()
    launched = []
    ll.dispatch_kernel = ll.combine_kernel = LaunchRecorder(launched)
    x, idx, w = torch.randn(5, H).bfloat16(), torch.zeros(5, K, dtype=torch.long), torch.rand(5, K)

    def rejects(exc, match, fn, *args, **kw):
        with pytest.raises(exc, match=match):
            fn(*args, **kw)
        assert launched == [] and ll.epoch == 0

    rejects(TypeError, "x must be a", ll.dispatch, x.float().numpy(), idx)
    rejects(ValueError, r"x must be a \(tokens, hidden=256\) tensor, got \(5, 128\)", ll.dispatch, x[:, :128], idx)
    rejects(ValueError, "x has 17 tokens, more than max_tokens=16", ll.dispatch, torch.zeros(17, H).bfloat16(),
            torch.zeros(17, K, dtype=torch.long))
    rejects(TypeError, "x has dtype torch.float16", ll.dispatch, x.half(), idx)
    rejects(TypeError, "topk_idx has dtype torch.int32", ll.dispatch, x, idx.int())
    rejects(ValueError, r"topk_idx has shape \(5, 1\)", ll.dispatch, x, idx[:, :1].contiguous())
    rejects(TypeError, "topk_weights has dtype torch.float16", ll.dispatch, x, idx, w.half())
    rejects(TypeError, "return_recv_hook must be a bool", ll.dispatch, x, idx, return_recv_hook=1)
    bad = idx.clone()
    bad[3, 1] = E
    rejects(ValueError, r"topk_idx\[3, 1\] = 8 is out of range.*nothing was sent", ll.dispatch, x, bad, validate=True)
    ll.dispatch(x, idx, w)
    handle, epoch = ll._last, ll.epoch
    y = torch.zeros(4, 2 * TMAX, H).bfloat16()
    for args, exc, match in (((y, "handle"), TypeError, "handle must be a LowLatencyHandle"),
                             ((y[:, :TMAX].contiguous(), handle), ValueError, r"y has shape \(4, 16, 256\)"),
                             ((y.half(), handle), TypeError, "y has dtype torch.float16"),
                             ((y, handle, w[:3]), ValueError, r"topk_weights has shape \(3, 2\)"),
                             ((torch.empty(y.numel() + 1).bfloat16()[1:].view(y.shape), handle), ValueError,
                              "16-byte aligned")):
        with pytest.raises(exc, match=match):
            ll.combine(*args)
    assert len(launched) == 1 and ll.epoch == epoch and ll.combines == 0


test_constructor_rejects_before_allocating = rejects_before_allocating(
    MoELowLatency, dict(num_experts=E, hidden=H, topk=K, max_tokens=TMAX, dtype=torch.bfloat16), [
    (dict(hidden=60), ValueError, "hidden must be a positive multiple of 8"),
    (dict(hidden=264, fp8=True), ValueError, "hidden must be a positive multiple of 128 with fp8=True"),
    (dict(topk=9), ValueError, "topk must be at most 8"),
    (dict(max_tokens=1025), ValueError, "max_tokens must be at most 1024"),
    (dict(num_experts=256, topk=8, max_tokens=512), ValueError, "shared memory"),
    (dict(num_experts=7), ValueError, r"num_experts=7 must be a multiple of world_size=2"),
    (dict(dtype=torch.float32), TypeError, "dtype must be one of"),
    (dict(fp8=1), TypeError, "fp8 must be a bool"),
    (dict(index_dtype=torch.int16), TypeError, "index_dtype must be torch.int64 or torch.int32"),
    (dict(world_size=4), ValueError, r"world_size=4 but the allocator spans 2 rank\(s\)"),
])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_heap_bytes_is_what_the_constructor_allocates(world, compiles):
    for fp8 in (False, True):
        alloc = CpuAllocator(num_ranks=world)
        MoELowLatency(alloc, E, H, K, TMAX, torch.bfloat16, fp8=fp8, max_blocks=world)
        assert alloc.heap_bytes == MoELowLatency.heap_bytes(E, H, K, TMAX, torch.bfloat16, world_size=world, fp8=fp8)


# ------------------------------------------------------------------------------ generated CUDA
def _source(func) -> str:
    assert dict(func.attrs["tilelang_pass_configs"]) == PASS_CONFIGS
    return kernel_body(lower_with(func, PASS_CONFIGS))


def test_dispatch_kernel_ranks_locally_stores_rows_then_the_last_block_signals_each_segment():
    body = _source(build_ll_dispatch_kernel(64, 8, 7168, 128, blocks=132))
    assert "__launch_bounds__(1024, 1) moe_ll_dispatch_kernel(" in body and "int num_tokens" in body
    # no count exchange: the only cross-rank waits are the optional ready handshake and the receive
    assert "Counts[" not in body.replace("RecvCounts[", "")
    rank = body.index("__match_any_sync(")
    data = body.index("tilescale::store_vec16(", rank)  # 16-byte remote stores from registers
    assert "tilescale::remap_ptr(RecvX, " in body[rank:data] and "put_warp" not in body
    ready = body.index("if ((again == 1) && (1 < W)) {")
    assert rank < ready < data  # a dispatch without a combine since the previous one waits for the peers first
    arrive = body.index("tilescale::atom_add<tilescale::Scope::GPU, tilescale::Sem::ACQ_REL>((&(Arrive[0])), (uint)1);")
    signal = body.index("tilescale::notify<false>((&(Sig[", arrive)
    assert data < arrive and body.rindex("__syncthreads();", 0, arrive) > data
    acquire = body.index("tilescale::ld<tilescale::Scope::GPU, tilescale::Sem::ACQUIRE, false, false>((&(Arrive[0])))")
    assert arrive < acquire < signal and "<< (uint64_t)32) | ((uint64_t)((int*)stot)[" in body[signal:signal + 400]
    receive = body.index("tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Sig[", signal)
    assert "RecvCounts[((int)threadIdx.x)] = ((int)(word & (uint64_t)4294967295));" in body[receive:]
    tail = body[body.rindex("__syncthreads();"):]
    assert "State[((int)blockIdx.x)] = epoch;" in tail and "epoch = (State[((int)blockIdx.x)] + (int64_t)1);" in body
    assert body.count("Status[0] =") == 1 and "RouteRow[" in body


def test_fp8_send_kernel_quantises_per_128_channels_and_does_not_receive():
    body = _source(build_ll_dispatch_kernel(256, 8, 7296, 256, fp8=True, phase="send", blocks=132))
    assert "moe_ll_dispatch_fp8_send_kernel(" in body and "RecvScales" in body
    assert body.count("__shfl_xor_sync((uint)4294967295, qmax, ") == 4  # 16 lanes: 128 channels
    assert "(qmax / 0x1.cp+8f/*4.480000e+02*/)" in body and "(fp8_e4_t)tl::clamp(" in body
    assert "*(fp8_e4_8_t*)(((fp8_e4_t*)" in body  # 8-byte remote stores of the e4m3 rows
    assert "tilescale::notify<false>((&(Sig[" in body and "wait_until" in body  # only the ready handshake waits
    assert "RecvCounts[" not in body


def test_recv_and_combine_kernels():
    recv = _source(build_ll_recv_kernel(64, blocks=132))
    assert "__launch_bounds__(64, 1) moe_ll_recv_kernel(" in recv and "epoch = State[0];" in recv  # the send's block 0
    assert "(((uint64_t)epoch) << (uint64_t)32)" in recv and "RecvCounts[((int)threadIdx.x)]" in recv
    body = _source(build_ll_combine_kernel(64, 8, 7168, 128, blocks=132))
    put = body.index("tilescale::put_warp<4, false>(")
    assert "RecvCounts[" in body[:put] and "(&(CombBuf[" in body[put:put + 300]
    arrive = body.index("(&(Arrive[1])), (uint)1);", put)
    notify = body.index("tilescale::notify<false>((&(Flags[", arrive)
    wait = body.index("tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Flags[", notify)
    assert wait < body.index("__float22bfloat162_rn(")  # the sums after every other rank's rows arrived
    tail = body[body.rindex("__syncthreads();"):]
    assert re.search(r"State\[\(\(\(int\)blockIdx.x\) \+ 132\)\] = epoch(_\d+)?;", tail), tail
    assert re.search(r"State\[\(\(\(int\)blockIdx.x\) \+ 264\)\] = routing(_\d+)?;", tail), tail


@needs_toolkit
def test_dispatch_fits_1024_threads_without_spills(tmp_path):
    registers, spills = nvcc_resources(lower_with(build_ll_dispatch_kernel(64, 8, 7168, 128, blocks=132),
                                                  PASS_CONFIGS), tmp_path)
    assert registers <= 64 and spills == 0, (registers, spills)
