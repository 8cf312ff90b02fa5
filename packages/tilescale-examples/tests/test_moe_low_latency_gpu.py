"""MoE low-latency mode on the GPU (``-m gpu``): 1, 2 and 4 ranks sharing one GPU; uniform and
skewed routing with unused slots; 1, 7, 128 and 256 tokens; hidden 7168 and hidden 7296 / 7176
(not multiples of 256); top-8 of 64 and of 256 experts; bf16 and FP8 dispatch; the send/receive
split; eager calls and CUDA-graph replays; poisoned buffers before every checked call; 1000
back-to-back calls (200 on 4 ranks) with stragglers. The dispatch is bit-exact against
:func:`~tilescale_examples.moe.ll_reference.ll_dispatch_reference`, the combine within the normal
mode's tolerance of a float32 sum in slot order."""

from __future__ import annotations

import torch
from examples_helpers import close_rank_heap, expect_checks, gpu_rank_test, open_rank_heap

from tilescale_examples.moe.low_latency import MoELowLatency
from tilescale_examples.moe.ll_reference import ll_dispatch_reference
from tilescale_examples.moe.reference import COMBINE_ATOL, COMBINE_RTOL

#: (experts, topk, hidden, max_tokens, fp8) of the GPU cases.
CONFIGS = [(64, 8, 7168, 256, False), (64, 8, 7176, 256, False), (256, 8, 7296, 256, True)]
TOKENS = (1, 7, 128, 256)


def _heap_bytes(world: int) -> int:
    return sum(MoELowLatency.heap_bytes(e, h, k, t, torch.bfloat16, world_size=world, fp8=f)
               for e, k, h, t, f in CONFIGS) + (64 << 20)


def _gather(t: torch.Tensor, world: int) -> list:
    """Every rank's ``t`` (on the CPU; first dims may differ), through the group."""
    import torch.distributed as dist

    every = [None] * world
    dist.all_gather_object(every, t.cpu())
    return every


def _routing(kind: str, tokens: int, experts: int, topk: int, gen) -> torch.Tensor:
    """Distinct uniform or Zipf-skewed experts per token, with about one slot in 16 unused."""
    if kind == "uniform":
        idx = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk]
    else:
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.5
        idx = torch.multinomial(p.expand(tokens, experts), topk, generator=gen)
    idx[torch.rand(tokens, topk, generator=gen) < 1 / 16] = -1
    return idx.contiguous()


def _experts(ll, recv) -> torch.Tensor:
    """A stand-in for the experts, on the device: local expert ``j``'s rows (dequantised with
    FP8) times ``1 + j / (4 EL)``, minus 1/8, in the op's dtype."""
    rows = recv[0].float().view(*recv[1].shape, 128) * recv[1][..., None] if ll.fp8 else recv.float()
    rows = rows.reshape(ll.experts_per_rank, -1, ll.hidden)
    scale = 1 + torch.arange(ll.experts_per_rank, device=rows.device)[:, None, None] / (4 * ll.experts_per_rank)
    return (rows * scale - 0.125).to(ll.dtype)


def _expected_out(ll, x, idx, w) -> torch.Tensor:
    """The combine of :func:`_experts` on this rank's tokens: float32 sums in slot order (with
    FP8, of the rows :func:`~tilescale_examples.moe.ll_reference.ll_dispatch_reference`
    quantises)."""
    from tilescale_examples.moe.ll_reference import quantize_fp8_blocks

    rows = x.float()
    if ll.fp8:
        # quantised on the host, as ll_dispatch_reference does (the dispatch is checked bit for
        # bit against it): torch's CUDA path rounds a few elements to the neighbouring e4m3 value
        q, s = quantize_fp8_blocks(x.cpu())
        rows = (q.float().view(x.shape[0], -1, 128) * s[..., None]).view_as(rows.cpu()).to(x.device)
    acc = torch.zeros_like(rows)
    EL = ll.experts_per_rank
    for k in range(ll.topk):
        e = idx[:, k].long()
        y = (rows * (1 + (e % EL).float()[:, None] / (4 * EL)) - 0.125).to(ll.dtype).float()
        valid = (e >= 0) & (e < ll.num_experts)
        acc = acc + torch.where(valid[:, None], w[:, k, None] * y, torch.zeros_like(y))
    return acc


def _poison(ll) -> None:
    """NaN everywhere a call writes (0xFF, an e4m3 NaN, in FP8 rows), -7 in the counts; then
    every rank waits for every other rank's poison (the receive buffer is written by the peers'
    next dispatch, which may otherwise start before this rank's fill)."""
    import torch.distributed as dist

    ll.recv_x_buf.fill_(0xFF if ll.fp8 else float("nan"))
    if ll.fp8:
        ll.recv_scales_buf.fill_(float("nan"))
    ll.recv_counts_buf.fill_(-7)
    ll.output.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier()


def _check_call(ll, rank, world, x, idx, w, label, hook=False) -> int:
    """One checked dispatch (+ receive hook) + experts + combine on poisoned buffers."""
    _poison(ll)
    got = ll.dispatch(x, idx, w, return_recv_hook=hook)
    if hook:
        torch.cuda._sleep(100_000)  # compute overlapping the sends
        got[3]()
    recv, counts, handle = got[:3]
    out = ll.combine(_experts(ll, recv), handle)
    torch.cuda.synchronize()
    ref = ll_dispatch_reference(_gather(x, world), _gather(idx, world), ll.num_experts, ll.max_tokens, rank, fp8=ll.fp8)
    where = f"rank {rank}/{world} {label}"
    assert counts.cpu().long().tolist() == ref["counts"].tolist(), where
    mask = ref["mask"].to(x.device)
    rows = recv[0].view(torch.uint8) if ll.fp8 else recv
    want = ref["x"].view(torch.uint8) if ll.fp8 else ref["x"]
    assert torch.equal(rows[mask], want.to(x.device)[mask]), f"{where}: received rows differ"
    if ll.fp8:
        assert torch.equal(recv[1][mask], ref["scales"].to(x.device)[mask]), f"{where}: scales differ"
    src_rank, src_token, src_slot = handle.origin()
    assert torch.equal(torch.stack([src_token, src_slot], -1)[mask].cpu(), ref["src"][ref["mask"]]), where
    exp = _expected_out(ll, x, idx, w)
    ok = torch.allclose(out.double(), exp.double(), rtol=COMBINE_RTOL[ll.dtype], atol=COMBINE_ATOL)
    assert ok, f"{where}: combine off by {(out.double() - exp.double()).abs().max().item():g}"
    return 1


def _inputs(ll, tokens, kind, gen):
    dev = ll.device
    x = torch.randn(tokens, ll.hidden, generator=gen).to(ll.dtype).to(dev)
    idx = _routing(kind, tokens, ll.num_experts, ll.topk, gen).to(dev, ll.index_dtype)
    w = torch.softmax(torch.randn(tokens, ll.topk, generator=gen), 1).to(dev)
    return x, idx, w


def _graph_replays(ll, rank, world, gen) -> int:
    """dispatch + experts + combine captured once, replayed on fresh inputs copied in."""
    x, idx, w = _inputs(ll, 128 - rank, "uniform", gen)

    def step():
        recv, _, handle = ll.dispatch(x, idx, w)
        return ll.combine(_experts(ll, recv), handle)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    checks = 0
    for replay in range(4):
        nx, nidx, nw = _inputs(ll, x.shape[0], "skewed" if replay % 2 else "uniform", gen)
        x.copy_(nx), idx.copy_(nidx), w.copy_(nw)
        _poison(ll)
        graph.replay()
        torch.cuda.synchronize()
        ref = ll_dispatch_reference(_gather(x, world), _gather(idx, world), ll.num_experts, ll.max_tokens, rank)
        assert torch.equal(ll.recv_x[ref["mask"].to(x.device)], ref["x"].to(x.device)[ref["mask"].to(x.device)])
        assert torch.allclose(out.double(), _expected_out(ll, x, idx, w).double(), rtol=COMBINE_RTOL[ll.dtype],
                              atol=COMBINE_ATOL), f"rank {rank}: replay {replay}"
        checks += 1
    return checks


def _back_to_back(ll, rank, world, calls, gen) -> int:
    """``calls`` calls without host synchronisation on 4 rotating checked input sets: every
    5th dispatch through the receive hook, every 7th dispatched twice (the second without a
    combine in between: the ready handshake), a straggling rank every 50 calls; every result
    must equal the checked one bit for bit."""
    sets, checks = [], 0
    for s in range(4):
        x, idx, w = _inputs(ll, (128, 7, 256, 1)[s], "uniform" if s % 2 else "skewed", gen)
        checks += _check_call(ll, rank, world, x, idx, w, f"back-to-back set {s}")
        recv, counts, handle = ll.dispatch(x, idx, w)
        sets.append((x, idx, w, counts.clone(), ll.combine(_experts(ll, recv), handle).clone()))
    bad = torch.zeros((), dtype=torch.int64, device=ll.device)
    for call in range(calls):
        x, idx, w, want_counts, want_out = sets[call % 4]
        if call % 50 == 0 and rank == (call // 50) % world:
            torch.cuda._sleep(2_000_000)  # this rank arrives late (about 1 ms)
        if call % 7 == 0:
            ll.dispatch(x, idx, w)  # not combined
        got = ll.dispatch(x, idx, w, return_recv_hook=call % 5 == 0)
        if call % 5 == 0:
            got[3]()
        ll.output.fill_(float("nan"))
        out = ll.combine(_experts(ll, got[0]), got[2])
        bad += (got[1] != want_counts).sum() + (out.view(torch.int16) != want_out.view(torch.int16)).sum()
    torch.cuda.synchronize()
    assert int(bad) == 0, f"rank {rank}/{world}: {int(bad)} wrong values over {calls} calls"
    return checks + 1


def _index_errors(ll, rank, world, gen) -> int:
    """The last rank passes out-of-range indices: skipped on the device, the call completes
    everywhere, only that rank's check_index_errors() raises."""
    x, idx, w = _inputs(ll, 40, "uniform", gen)
    if rank == world - 1:
        idx[3, 0], idx[11, 2] = -5, ll.num_experts
    checks = _check_call(ll, rank, world, x, idx, w, "bad indices")
    try:
        ll.check_index_errors()
        said = None
    except ValueError as exc:
        said = str(exc)
    want = "topk_idx[3, 0] = -5 is out of range" if rank == world - 1 else None
    assert (said if said is None else said[:len(want or "")]) == want and (want is None or "(2 bad entries)" in said)
    return checks


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank and configuration: both routings at every token count (the last through the
    receive hook), graph replays, bad indices and back-to-back calls."""
    alloc = open_rank_heap(rank, world, cache_dir, _heap_bytes(world))
    gen = torch.Generator().manual_seed(4242 + 31 * rank + world)
    checks = 0
    for c, (experts, topk, hidden, max_tokens, fp8) in enumerate(CONFIGS):
        ll = MoELowLatency(alloc, experts, hidden, topk, max_tokens, torch.bfloat16, fp8=fp8)
        for kind in ("uniform", "skewed"):
            for n, tokens in enumerate(TOKENS):
                x, idx, w = _inputs(ll, max(1, tokens - rank % 2), kind, gen)
                checks += _check_call(ll, rank, world, x, idx, w, f"config {c} {kind} {tokens}",
                                      hook=n == len(TOKENS) - 1)
        if c == 0:
            checks += _graph_replays(ll, rank, world, gen)
            checks += _index_errors(ll, rank, world, gen)
            checks += _back_to_back(ll, rank, world, 1000 if world <= 2 else 200, gen)
        ll.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, 4, timeout=600, rank_timeout=560, cache="moe-ll")
def test_moe_low_latency_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(CONFIGS) * 2 * len(TOKENS) + 4 + 1 + 5)
