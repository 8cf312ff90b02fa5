"""MoE dispatch and combine: TileScale's MoEDispatcher against the torch all-to-all path,
measured in the same run.

``python -m tilescale_examples.benchmarks.moe [--ranks N] [--tokens 4096,128]
[--hidden 7168] [--experts 64] [--topk 8] [--routing uniform,skewed] [--iters 50]
[--dtype bfloat16] [--no-graph] [--out DIR]`` (or under ``tilescale-run -n N -m ...``). ``--ranks``
defaults to the number of visible GPUs (one rank per GPU, NCCL); more ranks than GPUs share
them (gloo, time-sliced: not a performance measurement, the title says so).

For every token count and routing (``uniform``: ``topk`` distinct experts drawn uniformly;
``skewed``: drawn without replacement with probability proportional to ``1 / (expert +
1)``, the same hot experts on every rank) each rank draws fresh tokens, indices and softmax
weights, then:

1. **validates** once: TileScale's ``recv_x`` rows and counts must equal the torch path's
   bit for bit, and its combine (of ``y = recv_x``) must be ``allclose`` to the torch path's
   (``rtol = 2**-7``: both round a float32 sum once, in different orders); a failure is
   counted in the row and makes the exit status 1;
2. **times** back-to-back calls with CUDA events (slowest rank): TileScale's ``dispatch``
   (``validate=False``: no host synchronisation), ``combine`` (the same handle combined
   again and again, so every call runs the ready handshake) and ``dispatch+combine`` (a
   dispatch and the combine of its handle, what an MoE layer runs; such a combine skips the
   handshake), the same calls replayed from a captured CUDA graph (``graph us``), the torch
   path's dispatch, combine and both, and a torch device-to-device copy of the same bytes
   (``tokens * topk * hidden`` elements, read and written once; twice for
   ``dispatch+combine``).

The torch path (:class:`TorchAllToAllMoE`) is the usual implementation: sort the entries by
expert, ``all_to_all_single`` of the per-expert counts, the split sizes to the host
(``.tolist()``), ``index_select`` of the token rows, ``all_to_all_single`` of the rows with
those splits, and a local permutation into expert-major order; the combine reverses it and
sums the ``topk`` rows weighted in float32.

Columns: ``speedup`` = torch us / TileScale us (eager calls; above 1: faster); ``GB/s`` =
token bytes moved (``tokens * topk * hidden * itemsize``, twice for ``dispatch+combine``) /
TileScale time; ``vs copy`` = copy us / TileScale us (only at one rank, where the copy is the
ceiling; goal >= 0.8); ``graph vs copy`` = the same ratio with both replayed from CUDA graphs (GPU time without the host's
launch cost, which bounds small batches: a TileLang launch costs several microseconds of
host time).

``--mode low_latency`` (``[--fp8]``) measures :class:`~tilescale_examples.moe.low_latency.MoELowLatency`
instead (:func:`run_low_latency`): per token count and routing, after one validation of its
dispatch against :func:`~tilescale_examples.moe.ll_reference.ll_dispatch_reference`, the
graph time of ``dispatch`` and of ``dispatch+combine`` (one-call CUDA graphs) of the
low-latency mode, of the normal ``MoEDispatcher``, of a same-bytes ``copy_`` and the torch
path's eager time (``all_to_all_single`` + index ops, whose host synchronisation a graph cannot
hold); token counts above the low-latency limit (1024) show ``-`` there.
"""

from __future__ import annotations

import argparse

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._timing import time_ms
from tilescale_examples.benchmarks._report import gb_per_s, print_table, ratio

__all__ = ["TorchAllToAllMoE", "make_routing", "graph_ms", "add_shape_arguments", "check_shape_arguments",
           "main", "run", "run_low_latency", "HEADERS", "LL_HEADERS", "COMPARE_RTOL"]

HEADERS = ["tokens", "routing", "phase", "TileScale us", "graph us", "torch us", "speedup", "GB/s",
           "copy us", "vs copy", "copy graph us", "graph vs copy", "check"]
#: Columns of ``--mode low_latency`` (graph times in microseconds; ratios: the other's time / the
#: low-latency time).
LL_HEADERS = ["tokens", "routing", "phase", "low-latency us", "normal us", "copy us", "torch us", "vs copy",
              "vs normal", "vs torch", "check"]
#: The check of TileScale's combine against the torch path's: both round a float32 sum of the
#: same products once, in different orders (one ulp of bfloat16 is up to 2**-7 relative).
COMPARE_RTOL = 2.0 ** -7
COMPARE_ATOL = 1e-5


def make_routing(kind: str, tokens: int, experts: int, topk: int, generator):
    """``(tokens, topk)`` int64 expert indices, distinct within a token: ``uniform`` or
    ``skewed`` (Zipf: probability proportional to ``1 / (expert + 1)``)."""
    import torch

    if kind == "uniform":
        return torch.rand(tokens, experts, generator=generator).argsort(1)[:, :topk].contiguous()
    if kind == "skewed":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        return torch.multinomial(p.expand(tokens, experts), topk, generator=generator)
    raise ValueError(f"routing must be 'uniform' or 'skewed', got {kind!r}")


class TorchAllToAllMoE:
    """The torch.distributed implementation of expert-parallel dispatch and combine that the
    benchmark compares against (every index must be in ``[0, num_experts)``).

    ``dispatch(x, topk_idx)`` returns ``(rows, counts)``, the received rows in
    :class:`~tilescale_examples.moe.dispatcher.MoEDispatcher`'s layout (expert, then source rank, then
    entry) and the ``(EL,)`` counts, and keeps the permutations for ``combine(y,
    topk_weights)``, which returns ``(T, hidden)`` in ``y``'s dtype. On a backend other than
    NCCL the two ``all_to_all_single`` calls stage through host memory (gloo takes CPU
    tensors)."""

    def __init__(self, num_experts: int, group, world_size: int):
        import torch.distributed as dist

        self.num_experts, self.group, self.world = num_experts, group, world_size
        self.nccl = dist.get_backend(group) == "nccl"
        self.state = None

    def _all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        import torch.distributed as dist

        if self.nccl:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
            return
        host = out.new_empty(out.shape, device="cpu")
        dist.all_to_all_single(host, inp.cpu(), out_splits, in_splits, group=self.group)
        out.copy_(host)

    def dispatch(self, x, topk_idx):
        import torch

        E, W = self.num_experts, self.world
        EL = E // W
        tokens, topk = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # entries by expert (so by owner), then entry
        send = x.index_select(0, order // topk)
        counts = torch.bincount(flat, minlength=E)
        recv_counts = torch.empty_like(counts)
        self._all_to_all(recv_counts, counts)  # (W, EL): rows from rank s for local expert j
        in_splits = counts.view(W, EL).sum(1).tolist()  # host synchronisation
        per_src = recv_counts.view(W, EL)
        out_splits = per_src.sum(1).tolist()
        total = sum(out_splits)
        recv = x.new_empty((total, x.shape[1]))
        self._all_to_all(recv, send, out_splits, in_splits)
        expert = torch.repeat_interleave(torch.arange(EL, device=x.device).repeat(W), per_src.reshape(-1),
                                         output_size=total)
        perm = torch.argsort(expert, stable=True)  # (source, expert, entry) -> (expert, source, entry)
        self.state = (order, perm, in_splits, out_splits, tokens, topk)
        return recv.index_select(0, perm), per_src.sum(0)

    def combine(self, y, topk_weights):
        import torch

        order, perm, in_splits, out_splits, tokens, topk = self.state
        by_source = torch.empty_like(y)
        by_source[perm] = y
        back = y.new_empty((sum(in_splits), y.shape[1]))
        self._all_to_all(back, by_source, in_splits, out_splits)
        entries = torch.empty_like(back)
        entries[order] = back
        weighted = entries.view(tokens, topk, -1).float() * topk_weights[..., None]
        return weighted.sum(1).to(y.dtype)


def run(rank: int, world: int, group, device, args) -> list | None:
    """One rank's part; returns ``[rows, failures]`` on rank 0 (None elsewhere)."""
    if getattr(args, "mode", "normal") == "low_latency":
        return run_low_latency(rank, world, group, device, args)
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_examples.moe.dispatcher import MoEDispatcher

    dtype = getattr(torch, args.dtype)
    token_counts = [int(t) for t in args.tokens.split(",")]
    routings = args.routing.split(",")
    E, K, H = args.experts, args.topk, args.hidden
    max_tokens = max(token_counts)
    heap = MoEDispatcher.heap_bytes(E, H, K, max_tokens, dtype, world_size=world, device=device) + (64 << 20)
    alloc = tilelang.get_allocator(size=heap, device=device, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=group)
    flag_device = device if dist.get_backend(group) == "nccl" else "cpu"
    moe = MoEDispatcher(alloc, E, H, K, max_tokens, dtype, group=group, threads=args.threads)
    ref = TorchAllToAllMoE(E, group, world)
    gen = torch.Generator().manual_seed(rank * 7919 + 11)
    rows, failures = [], 0
    for tokens in token_counts:
        src = torch.randn(tokens * K, H, device=device).to(dtype)
        dst = torch.empty_like(src)
        copy_ms = time_ms(lambda: dst.copy_(src), args.iters, group, device)
        copy_graph = graph_ms(lambda: dst.copy_(src), args.iters, group, device) if args.graph else float("nan")
        del src, dst
        token_bytes = tokens * K * H * dtype.itemsize
        for kind in routings:
            x = torch.randn(tokens, H, generator=gen).to(dtype).to(device)
            idx = make_routing(kind, tokens, E, K, gen).to(device)
            w = torch.softmax(torch.randn(tokens, K, generator=gen), 1).to(device)
            # ---- validate once
            want_rows, want_counts = ref.dispatch(x, idx)
            want_out = ref.combine(want_rows, w)
            recv, counts, handle = moe.dispatch(x, idx, w, validate=True)
            out = moe.combine(recv, handle)
            torch.cuda.synchronize(device)
            total = want_rows.shape[0]
            ok = (torch.equal(counts.long(), want_counts) and torch.equal(recv[:total], want_rows)
                  and torch.allclose(out.float(), want_out.float(), rtol=COMPARE_RTOL, atol=COMPARE_ATOL))
            flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=flag_device)
            dist.all_reduce(flag, group=group)
            bad = int(flag.item())
            failures += bad
            check = "ok" if bad == 0 else f"FAIL ({bad} rank(s))"
            # ---- time
            ts_d = time_ms(lambda: moe.dispatch(x, idx, w, validate=False), args.iters, group, device)
            handle = moe.dispatch(x, idx, w, validate=False)[2]
            ts_c = time_ms(lambda: moe.combine(moe.recv_x, handle), args.iters, group, device)
            graph_d = graph_c = float("nan")
            if args.graph:
                graph_d = graph_ms(lambda: moe.dispatch(x, idx, w, validate=False), args.iters, group, device)
                handle = moe.dispatch(x, idx, w, validate=False)[2]
                graph_c = graph_ms(lambda: moe.combine(moe.recv_x, handle), args.iters, group, device)
            def layer():  # what an MoE layer runs: a dispatch, then the combine of its handle
                return moe.combine(moe.recv_x, moe.dispatch(x, idx, w, validate=False)[2])

            ts_p = time_ms(layer, args.iters, group, device)
            graph_p = graph_ms(layer, args.iters, group, device) if args.graph else float("nan")
            ref_d = time_ms(lambda: ref.dispatch(x, idx), args.iters, group, device)
            ref.dispatch(x, idx)
            ref_c = time_ms(lambda: ref.combine(want_rows, w), args.iters, group, device)
            ref_p = time_ms(lambda: ref.combine(ref.dispatch(x, idx)[0], w), args.iters, group, device)
            for phase, ts, graph, base, moves in (("dispatch", ts_d, graph_d, ref_d, 1),
                                                  ("combine", ts_c, graph_c, ref_c, 1),
                                                  ("dispatch+combine", ts_p, graph_p, ref_p, 2)):
                copy, copy_g = moves * copy_ms, moves * copy_graph
                rows.append([tokens, kind, phase, ts * 1e3, graph * 1e3, base * 1e3, ratio(base, ts),
                             gb_per_s(moves * token_bytes, ts), copy * 1e3,
                             ratio(copy, ts) if world == 1 else "-", copy_g * 1e3,
                             ratio(copy_g, graph) if world == 1 and args.graph else "-", check])
            del want_rows, want_out, recv, out
    moe.close()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return [rows, failures] if rank == 0 else None


def _ll_row_check(ll, x, idx, rank: int, world: int) -> bool:
    """One low-latency dispatch against the reference on every rank (bit-exact rows and counts)."""
    import torch

    from tilescale_examples.moe.ll_reference import ll_dispatch_reference

    recv, counts, handle = ll.dispatch(x, idx)
    y = torch.zeros((ll.experts_per_rank, world * ll.max_tokens, ll.hidden), dtype=ll.dtype, device=x.device)
    ll.combine(y, handle, torch.ones(idx.shape, device=x.device))
    xs, idxs = [x.cpu()] * world, [idx.cpu()] * world  # (every rank routes the same tokens: same seed)
    ref = ll_dispatch_reference(xs, idxs, ll.num_experts, ll.max_tokens, rank, fp8=ll.fp8)
    rows = (recv[0] if ll.fp8 else recv).cpu()
    mask = ref["mask"]
    view = (lambda t: t.view(torch.uint8)) if ll.fp8 else (lambda t: t)
    return torch.equal(counts.cpu().long(), ref["counts"]) and torch.equal(view(rows)[mask], view(ref["x"])[mask])


def run_low_latency(rank: int, world: int, group, device, args) -> list | None:
    """``--mode low_latency``: one rank's part; ``[rows, failures]`` on rank 0 (None elsewhere)."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_examples.moe.dispatcher import MoEDispatcher
    from tilescale_examples.moe.ll_dispatch import LL_MAX_TOKENS
    from tilescale_examples.moe.low_latency import MoELowLatency

    dtype, E, K, H = getattr(torch, args.dtype), args.experts, args.topk, args.hidden
    token_counts = [int(t) for t in args.tokens.split(",")]
    tmax = max(token_counts)
    ll_tmax = max([t for t in token_counts if t <= LL_MAX_TOKENS] or [1])
    heap = (MoEDispatcher.heap_bytes(E, H, K, tmax, dtype, world_size=world, device=device)
            + MoELowLatency.heap_bytes(E, H, K, ll_tmax, dtype, world_size=world, fp8=args.fp8) + (64 << 20))
    alloc = tilelang.get_allocator(size=heap, device=device, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=group)
    normal = MoEDispatcher(alloc, E, H, K, tmax, dtype, group=group, threads=args.threads)
    ll = MoELowLatency(alloc, E, H, K, ll_tmax, dtype, group=group, fp8=args.fp8, max_blocks=args.ll_blocks)
    ref, rows, failures = TorchAllToAllMoE(E, group, world), [], 0
    flag_device = device if dist.get_backend(group) == "nccl" else "cpu"
    for tokens in token_counts:
        gen = torch.Generator().manual_seed(tokens)  # the same tokens on every rank
        src = torch.randn(tokens * K, H, device=device).to(dtype)
        dst = torch.empty_like(src)
        copy = graph_ms(lambda: dst.copy_(src), args.iters, group, device)
        for kind in args.routing.split(","):
            x = torch.randn(tokens, H, generator=gen).to(dtype).to(device)
            idx = make_routing(kind, tokens, E, K, gen).to(device)
            w = torch.softmax(torch.randn(tokens, K, generator=gen), 1).to(device)
            fits = tokens <= ll_tmax
            ok = _ll_row_check(ll, x, idx, rank, world) if fits else True
            flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=flag_device)
            dist.all_reduce(flag, group=group)
            failures += int(flag.item())
            y = torch.zeros((ll.experts_per_rank, world * ll_tmax, H), dtype=dtype, device=device)
            timed = {
                "dispatch": (lambda: ll.dispatch(x, idx), lambda: normal.dispatch(x, idx, w, validate=False),
                             lambda: ref.dispatch(x, idx)),
                "dispatch+combine": (lambda: ll.combine(y, ll.dispatch(x, idx)[2], w),
                                     lambda: normal.combine(normal.recv_x,
                                                            normal.dispatch(x, idx, w, validate=False)[2]),
                                     lambda: ref.combine(ref.dispatch(x, idx)[0], w))}
            for phase, (low, norm, torch_path) in timed.items():
                t_ll = graph_ms(low, args.iters, group, device) if fits else float("nan")
                t_n = graph_ms(norm, args.iters, group, device)
                t_t = time_ms(torch_path, args.iters, group, device)
                moves = 2 if "+" in phase else 1
                rows.append([tokens, kind, phase, t_ll * 1e3 if fits else "-", t_n * 1e3, moves * copy * 1e3, t_t * 1e3,
                             ratio(moves * copy, t_ll) if fits else "-", ratio(t_n, t_ll) if fits else "-",
                             ratio(t_t, t_ll) if fits else "-", "ok" if int(flag.item()) == 0 else "FAIL"])
    ll.close()
    normal.close()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return [rows, failures] if rank == 0 else None


def graph_ms(fn, iters: int, group, device) -> float:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (after one eager call),
    timed like :func:`~tilescale_examples.benchmarks._timing.time_ms`."""
    import torch

    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, iters, group, device)


def add_shape_arguments(p: argparse.ArgumentParser, tokens: str, routing: str) -> None:
    """The options of both MoE benchmarks: ``--tokens`` (default ``tokens``), ``--hidden``,
    ``--experts``, ``--topk``, ``--routing`` (default ``routing``) and ``--iters``; checked
    by :func:`check_shape_arguments`."""
    p.add_argument("--tokens", default=tokens, help="comma-separated tokens per rank (<= 4096)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--routing", default=routing, help="comma-separated: uniform, skewed")
    p.add_argument("--iters", type=int, default=50, help="calls (or graph replays) timed per row")


def check_shape_arguments(p: argparse.ArgumentParser, args) -> None:
    """Exit through ``p.error`` (status 2, naming the option) unless the options of
    :func:`add_shape_arguments` are valid."""
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens must be comma-separated ints, got {args.tokens!r}")
    if any(not 1 <= t <= 4096 for t in tokens):
        p.error("--tokens must be in [1, 4096]")
    if any(r not in ("uniform", "skewed") for r in args.routing.split(",")):
        p.error(f"--routing must list uniform and/or skewed, got {args.routing!r}")
    if not 1 <= args.topk <= min(8, args.experts) or args.hidden < 8 or args.hidden % 8 or args.iters < 1:
        p.error("need 1 <= --topk <= min(8, --experts), --hidden a positive multiple of 8, --iters >= 1")


def _parser():
    p = _harness.parser("moe", "MoE dispatch/combine: MoEDispatcher against the torch all_to_all_single path, "
                               "same run.")
    p.add_argument("--ranks", type=int, default=None, help="ranks to spawn (default: visible GPUs; "
                                                           "ignored under tilescale-run)")
    add_shape_arguments(p, tokens="4096,128", routing="uniform,skewed")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1024, help="threads per block of the combine kernel "
                                                            "(multiple of 32, at most 1024)")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph timings")
    p.add_argument("--mode", default="normal", choices=["normal", "low_latency"],
                   help="low_latency: MoELowLatency against MoEDispatcher, a copy and the torch path")
    p.add_argument("--fp8", action="store_true", help="--mode low_latency: FP8 dispatch")
    p.add_argument("--ll-blocks", type=int, default=None,
                   help="--mode low_latency: blocks of the low-latency kernels' grids (MoELowLatency's "
                        "max_blocks; default the SM count)")
    return p


def main(argv=None) -> int:
    """0 when every check passed (or there is no GPU to measure on), 1 otherwise."""
    p = _parser()
    args = _harness.parse_args(p, argv)
    check_shape_arguments(p, args)
    if args.ranks is not None and args.ranks < 1:
        p.error("--ranks must be >= 1")
    if args.ll_blocks is not None and args.ll_blocks < 1:
        p.error(f"--ll-blocks must be >= 1, got {args.ll_blocks}")
    from tilescale_examples.base import check_threads

    try:
        check_threads(args.threads)  # the rule MoEDispatcher applies, before any rank starts
    except ValueError as exc:
        p.error(f"--{exc}")
    gpus = _harness.visible_gpus("MoE benchmark")
    if gpus == 0:
        return 0
    ranks = args.ranks or gpus
    if args.experts % ranks:
        p.error(f"--experts={args.experts} must be a multiple of the rank count {ranks}")
    result, backend, world = _harness.run_on_ranks(run, ranks, args)
    if result is None:
        return 0
    rows, failures = result
    mode = _harness.gpu_mode(world, backend, min(gpus, world), "torch path")
    if args.mode == "low_latency":
        print_table(f"MoE low-latency dispatch/combine{' (FP8 dispatch)' if args.fp8 else ''}, {world} rank(s), hidden "
                    f"{args.hidden}, top-{args.topk} of {args.experts} experts, {args.dtype}, {mode}"
                    f"{'' if args.ll_blocks is None else f', low-latency grid {args.ll_blocks} blocks'}; one-call CUDA "
                    "graphs (torch path: eager); vs X = X us / low-latency us", LL_HEADERS, rows)
        print(f"\ncorrectness (low-latency dispatch bit-exact vs the reference): "
              f"{'ok' if failures == 0 else f'{failures} FAILURE(S)'}")
        return 0 if failures == 0 else 1
    print_table(f"MoE dispatch/combine, {world} rank(s), hidden {args.hidden}, top-{args.topk} of "
                f"{args.experts} experts, {args.dtype}, combine {args.threads} threads, {mode}; speedup = torch us / TileScale us; "
                "vs copy = device copy of the same bytes / TileScale (1 rank)", HEADERS, rows)
    print(f"\ncorrectness (dispatch bit-exact, combine allclose rtol 2**-7 vs the torch path, every row): "
          f"{'ok' if failures == 0 else f'{failures} FAILURE(S)'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
