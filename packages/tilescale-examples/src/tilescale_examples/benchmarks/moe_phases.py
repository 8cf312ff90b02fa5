"""Where an MoE dispatch's time goes: the dispatch kernel's phases, against a device copy of
the same bytes measured in the same run.

``python -m tilescale_examples.benchmarks.moe_phases [--ranks N] [--tokens 128,4096]
[--hidden 7168] [--experts 64] [--topk 8] [--routing uniform] [--replays 20] [--out DIR]``
(or under ``tilescale-run -n N -m ...``; ``--ranks`` defaults to 1).

For every token count each rank draws fresh tokens, indices and weights, then:

1. **checks** the plain and the profiled dispatch (``MoEDispatcher.dispatch`` and
   ``dispatch_profiled``, receive buffer poisoned before each) against
   :func:`~tilescale_examples.moe.dispatcher.torch_dispatch_reference` bit for bit;
2. **times** from CUDA graphs of one call, replayed back to back (what the MoE benchmark's
   ``graph us`` column does): the dispatch, a torch device-to-device copy of the same bytes
   (``tokens * topk * hidden`` elements), and an empty kernel with the dispatch's grid
   (``max_blocks`` blocks of 1024 threads: how fast one-call graphs of that grid replay
   when the kernel does nothing);
3. **profiles**: a graph of one ``dispatch_profiled`` call replayed ``--replays`` times; the
   last replay's timestamps of every block's thread 0 at the end of each of
   :data:`~tilescale_examples.moe.kernels.DISPATCH_PHASES`, in microseconds after the
   earliest block's ``start``, as min / median / max over the blocks (rank 0's; a phase the
   batch's path does not have is left out). ``median / copy`` relates each to the copy's
   graph time.

A small batch (at most 1024 entries, e.g. 128 tokens of top-8) plans every entry in every
block before any row is stored, so ``planned`` is the part of the dispatch that no copy
has; ``data issued`` - ``planned`` is the row stores. Exit status 1 when a check failed.
"""

from __future__ import annotations

import statistics

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks.moe import add_shape_arguments, check_shape_arguments
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["main", "run", "phase_offsets", "empty_grid_kernel", "HEADERS", "PHASE_HEADERS"]

HEADERS = ["tokens", "routing", "dispatch graph us", "copy graph us", "graph vs copy", "empty grid graph us", "check"]
PHASE_HEADERS = ["tokens routing", "phase", "min us", "median us", "max us", "median / copy"]


def phase_offsets(events, phases) -> list[tuple[str, float, float, float]]:
    """``(phase, min, median, max)`` in microseconds after the earliest ``start`` event, over
    the blocks, for every phase with at least one event (in ``phases`` order). ``events``:
    :class:`tilescale_lang.profiler.Event` objects whose ``task`` indexes ``phases``."""
    by_phase: dict[int, list[int]] = {}
    for e in events:
        by_phase.setdefault(e.task, []).append(e.time_ns)
    if 0 not in by_phase:
        raise ValueError(f"no {phases[0]!r} event was recorded")
    origin = min(by_phase[0])
    rows = []
    for p, name in enumerate(phases):
        if p in by_phase:
            us = [(t - origin) / 1e3 for t in by_phase[p]]
            rows.append((name, min(us), statistics.median(us), max(us)))
    return rows


def empty_grid_kernel(blocks: int, threads: int):
    """A kernel of ``blocks`` x ``threads`` that writes shared memory, synchronises and
    stores nothing (launch bounds of one block per SM, like the dispatch)."""
    import tilelang
    import tilelang.language as T

    from tilescale_examples.base import TARGET

    @T.prim_func
    def empty_grid(Out: T.Tensor((blocks * threads,), "int32")):
        with T.Kernel(blocks, threads=threads) as bx:
            scratch = T.alloc_shared((threads,), "int32")
            tx = T.get_thread_binding()
            scratch[tx] = tx
            T.sync_threads()
            if scratch[threads - 1 - tx] < 0:  # never: the stores are not removed as dead code
                Out[bx * threads + tx] = 1

    return tilelang.compile(empty_grid, target=TARGET)


def _copy_graph_ms(rows: int, hidden: int, iters: int, group, device) -> float:
    """:func:`~tilescale_examples.benchmarks.moe.graph_ms` of a torch copy of ``(rows,
    hidden)`` bfloat16 elements (the bytes a dispatch of ``rows`` entries stores)."""
    import torch

    from tilescale_examples.benchmarks.moe import graph_ms

    src = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src), iters, group, device)


def _inputs(source: int, tokens: int, kind: str, args):
    """Rank ``source``'s tokens, indices and weights (CPU), the same on every rank that draws them."""
    import torch

    from tilescale_examples.benchmarks.moe import make_routing

    gen = torch.Generator().manual_seed(source * 7919 + tokens * 31 + (kind == "skewed"))
    x = torch.randn(tokens, args.hidden, generator=gen).to(torch.bfloat16)
    idx = make_routing(kind, tokens, args.experts, args.topk, gen)
    return x, idx, torch.softmax(torch.randn(tokens, args.topk, generator=gen), 1)


def run(rank: int, world: int, group, device, args) -> list | None:
    """One rank's part; returns ``[rows, phase_rows, failures]`` on rank 0 (None elsewhere)."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_examples.benchmarks.moe import graph_ms
    from tilescale_examples.moe.dispatcher import MoEDispatcher, torch_dispatch_reference
    from tilescale_examples.moe.kernels import DISPATCH_PHASES, PLAN_THREADS
    from tilescale_lang.profiler import EventProfiler

    E, K, H = args.experts, args.topk, args.hidden
    token_counts = [int(t) for t in args.tokens.split(",")]
    heap = MoEDispatcher.heap_bytes(E, H, K, max(token_counts), torch.bfloat16, world_size=world,
                                    device=device) + (64 << 20)
    alloc = tilelang.get_allocator(size=heap, device=device, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=group)
    moe = MoEDispatcher(alloc, E, H, K, max(token_counts), torch.bfloat16, group=group)
    prof = EventProfiler(blocks=moe.blocks, capacity=len(DISPATCH_PHASES), device=device)
    empty = empty_grid_kernel(moe.blocks, PLAN_THREADS)
    empty_out = torch.zeros(moe.blocks * PLAN_THREADS, dtype=torch.int32, device=device)
    flag_device = device if dist.get_backend(group) == "nccl" else "cpu"
    rows, phase_rows, failures = [], [], 0
    for tokens in token_counts:
        copy_graph = _copy_graph_ms(tokens * K, H, args.iters, group, device)
        empty_graph = graph_ms(lambda: empty(empty_out), args.iters, group, device)
        for kind in args.routing.split(","):
            every = [_inputs(s, tokens, kind, args) for s in range(world)]  # every rank's, for the reference
            x, idx, w = (t.to(device) for t in every[rank])
            want, want_counts, _ = torch_dispatch_reference([e[0].to(device) for e in every], [e[1] for e in every],
                                                            E, rank)
            ok = True
            for call in (moe.dispatch, lambda *a, **kw: moe.dispatch_profiled(*a, prof, **kw)):
                moe.recv_x.fill_(float("nan"))  # poison: a row the call does not write fails the check
                recv, counts, _ = call(x, idx, w, validate=True)
                torch.cuda.synchronize(device)
                ok = ok and torch.equal(recv[:want.shape[0]], want) and torch.equal(counts.long().cpu(), want_counts)
            flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=flag_device)
            dist.all_reduce(flag, group=group)
            bad = int(flag.item())
            failures += bad
            graph = graph_ms(lambda: moe.dispatch(x, idx, w, validate=False), args.iters, group, device)
            prof.reset()
            graph_ms(lambda: moe.dispatch_profiled(x, idx, w, prof, validate=False), args.replays, group, device)
            torch.cuda.synchronize(device)
            rows.append([tokens, kind, graph * 1e3, copy_graph * 1e3, ratio(copy_graph, graph) if world == 1 else "-",
                         empty_graph * 1e3, "ok" if bad == 0 else f"FAIL ({bad} rank(s))"])
            for name, lo, med, hi in phase_offsets(prof.events()[0], DISPATCH_PHASES):
                phase_rows.append([f"{tokens} {kind}", name, lo, med, hi, ratio(med, copy_graph * 1e3)])
    moe.close()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return [rows, phase_rows, failures] if rank == 0 else None


def _parser():
    p = _harness.parser("moe_phases", "The MoE dispatch kernel's phases against a device copy of the same bytes, "
                                      "same run.")
    p.add_argument("--ranks", type=int, default=1, help="ranks to spawn (default 1; ignored under tilescale-run)")
    add_shape_arguments(p, tokens="128,4096", routing="uniform")
    p.add_argument("--replays", type=int, default=20, help="replays of the profiled call; the last one is shown")
    return p


def main(argv=None) -> int:
    """0 when every check passed (or there is no GPU to measure on), 1 otherwise."""
    p = _parser()
    args = _harness.parse_args(p, argv)
    check_shape_arguments(p, args)
    if args.replays < 1 or args.ranks < 1:
        p.error("--replays and --ranks must be >= 1")
    if args.experts % args.ranks:
        p.error(f"--experts={args.experts} must be a multiple of --ranks={args.ranks}")
    if _harness.visible_gpus("MoE dispatch phases") == 0:
        return 0
    result, backend, world = _harness.run_on_ranks(run, args.ranks, args)
    if result is None:
        return 0
    rows, phase_rows, failures = result
    shared = "" if backend == "nccl" else f"; {world} ranks sharing GPU(s): time-sliced, not a performance measurement"
    print_table(f"MoE dispatch against a device copy of the same bytes, {world} rank(s), hidden {args.hidden}, "
                f"top-{args.topk} of {args.experts} experts, bfloat16{shared}; graph vs copy = copy / dispatch "
                f"(1 rank)", HEADERS, rows)
    print_table("Dispatch phases (rank 0, the last of the profiled replays): thread 0 of each block at the end "
                "of each phase, us after the earliest block's start; median / copy = median / copy graph us",
                PHASE_HEADERS, phase_rows)
    print(f"\ncorrectness (plain and profiled dispatch bit-exact vs the torch reference): "
          f"{'ok' if failures == 0 else f'{failures} FAILURE(S)'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
