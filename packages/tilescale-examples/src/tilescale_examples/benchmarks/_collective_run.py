"""One rank's part of a collective's bus-bandwidth benchmark: for every dtype and size, build
the collective, check it once against the torch.distributed baseline, then time both (eager,
replayed from a CUDA graph, and for the reductions against torch symmetric memory) with the
harness (:mod:`~tilescale_examples.benchmarks._timing`). The rows' cells are the table of
:mod:`~tilescale_examples.benchmarks._collective_cli`.
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _timing
from tilescale_examples.benchmarks._collectives import (GRAPH_GOAL_BYTES, _op, bus_bandwidth, heap_bytes, iters_for,
                                                        outputs_match, pick_baseline, random_input, shard_numel,
                                                        tolerance)
from tilescale_examples.benchmarks._report import format_bytes, ratio, size_sweep

__all__ = ["run", "options", "grid_cell"]


def options(op, args) -> dict:
    """Constructor options of ``op``'s collective from the command line: the ``algorithm``
    of the all-reduce and the all-gather (the only ones with a choice)."""
    return {"algorithm": args.algorithm} if _op(op).module in ("allreduce", "allgather") else {}


def grid_cell(op, coll, world: int) -> str:
    """The grid column: ``chunks x world`` (put exchanges) or the reduction's mode and blocks."""
    plan = getattr(coll, "plan", None)
    if plan is not None:
        return f"{plan.mode} {plan.blocks}"
    if getattr(coll, "algorithm", "sm") == "copy":
        return "copy engine"
    return f"{coll.chunks}x{world}" if _op(op).grid_per_peer else f"{coll.chunks}"


def run(op, rank: int, world: int, group, device, args) -> dict | None:
    """One rank's part of the benchmark of ``op``; on rank 0 returns ``{dtype: [rows,
    failures, baseline name, symmetric-memory title, graph goal]}`` (None elsewhere; the graph
    goal: ``(TileScale us, symm op, symm us)`` of the :data:`GRAPH_GOAL_BYTES` all-reduce
    replayed from CUDA graphs, or None where not measured)."""
    import tilelang
    import torch
    import torch.distributed as dist

    op = _op(op)
    sizes = size_sweep(args.min_bytes, args.max_bytes, 4)
    heap = sum(heap_bytes(op, sizes, world, d, device=device, **options(op, args)) for d in args.dtype)
    alloc = tilelang.get_allocator(size=heap, device=device, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=group)
    backend = dist.get_backend(group)
    symm = None
    if op.reduces:
        from tilescale_examples.benchmarks._symm_baseline import SymmBaseline

        share = torch.cuda.device_count() < world
        symm = SymmBaseline(op.module, group, device, backend, share)
    results = {}
    for dtype_name in args.dtype:
        results[dtype_name] = _run_dtype(op, rank, world, group, device, args, alloc, dtype_name, sizes, symm)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return results if rank == 0 else None


def _bad_ranks(out, ref, tol, group, flag_device) -> int:
    """How many ranks' ``out`` does not match ``ref`` (:func:`outputs_match` with ``tol``);
    every rank makes this collective, ok or not."""
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize(out.device)
    flag = torch.tensor([0 if outputs_match(out.reshape(-1), ref, tol) else 1], dtype=torch.int32, device=flag_device)
    dist.all_reduce(flag, group=group)
    return int(flag.item())


def _check_cell(bad: int, graph_bad: int) -> str:
    """The check column: ``ok``, or which check failed on how many ranks."""
    fails = [f"FAIL{what} ({n} rank(s))" for what, n in (("", bad), (" graph", graph_bad)) if n]
    return ", ".join(fails) or "ok"


class _Size:
    """One size of one dtype on this rank: the collective, its input ``x`` (reductions: an
    ordinary tensor, so that staging is part of the call; exchanges: their symmetric input),
    the baseline's output ``ref`` and the first call's output, checked against it."""

    def __init__(self, op, cls, alloc, rank, world, group, device, args, dtype, nbytes, baseline):
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        self.shard = shard_numel(nbytes, world, itemsize)
        self.total = world * self.shard * itemsize
        self.coll = cls(alloc, op.shape(self.shard, world), dtype, group=group, **options(op, args))  # collective
        g = torch.Generator().manual_seed(rank * 7919 + nbytes % 1000003)
        coll = self.coll
        self.x = random_input(coll.input.shape, dtype, g).to(device) if op.reduces else coll.input
        if not op.reduces:
            self.x.copy_(random_input(self.x.shape, dtype, g))
        self.ref = torch.empty(coll.output.numel(), dtype=dtype, device=device)
        self.baseline = baseline
        baseline(self.ref, self.x.reshape(-1))
        self.out = coll(self.x)

    def call(self):
        return self.coll(self.x)

    def call_baseline(self):
        return self.baseline(self.ref, self.x.reshape(-1))


def _run_dtype(op, rank, world, group, device, args, alloc, dtype_name, sizes, symm) -> list:
    import torch

    from tilescale_examples.base import collective_device

    dtype = getattr(torch, dtype_name)
    cls = op.collective()
    flag_device = collective_device(group, device)
    tol = tolerance(op, dtype_name, world)
    rows, failures, goal = [], 0, None
    name, baseline = pick_baseline(op, group, device, dtype)
    for nbytes in sizes:
        s = _Size(op, cls, alloc, rank, world, group, device, args, dtype, nbytes, baseline)
        bad = _bad_ranks(s.out, s.ref, tol, group, flag_device)
        it = iters_for(s.total, args.iters)
        graph_time = None
        if args.graph:
            def graph_time(fn, it=it):
                return _timing.graph_ms_per_call(fn, args.graph_calls, it,
                                                 lambda replay, n: _timing.time_ms(replay, n, group, device))
        ts_ms = _timing.time_ms(s.call, it, group, device)
        ref_ms = _timing.time_ms(s.call_baseline, it, group, device)
        heap_ms = times = None
        if symm is not None:  # before the graph: coll.input is not usable once coll has been captured
            heap_ms, times = _symm_times(s.coll, s.x, s.out, tol, symm, it, group, device, graph_time)
        graph_call_ms, graph_bad = None, 0
        if graph_time is not None:
            graph_call_ms, _, graph_out = graph_time(s.call)
            graph_bad = _bad_ranks(graph_out, s.ref, tol, group, flag_device)
        failures += bad + graph_bad
        ts_bw, ref_bw = bus_bandwidth(s.total, world, ts_ms, op), bus_bandwidth(s.total, world, ref_ms, op)
        row = [format_bytes(s.total), format_bytes(s.shard * s.x.element_size()), grid_cell(op, s.coll, world),
               ts_bw, ref_bw, ratio(ts_bw, ref_bw), ts_ms * 1e3, ref_ms * 1e3,
               "-" if graph_call_ms is None else graph_call_ms * 1e3, _check_cell(bad, graph_bad)]
        if symm is not None:
            row += _symm_cells(heap_ms, times, graph_call_ms)
            one_shot = symm.families.get("one-shot")
            if op.module == "allreduce" and s.total == GRAPH_GOAL_BYTES and graph_call_ms and one_shot in times.graph:
                goal = (graph_call_ms * 1e3, one_shot, times.graph[one_shot] * 1e3)
        rows.append(row)
        s.coll.close()
    return [rows, failures, name, None if symm is None else symm.title(), goal]


def _symm_times(coll, x, out, tol, symm, iters, group, device, graph_time) -> tuple:
    """``(TileScale heap ms, SymmTimes)``: TileScale called on its symmetric input buffer (no
    staging), and the torch symmetric-memory ops checked against ``out`` and timed
    (:meth:`SymmBaseline.measure`; replayed from CUDA graphs with ``graph_time``)."""
    import torch

    expect = out.reshape(-1).clone()
    heap_ms = _timing.time_ms(lambda: coll(coll.input), iters, group, device)
    times = symm.measure(x, expect, lambda got, want: outputs_match(got, want, tol), _timing.time_ms, iters,
                         graph_time)
    torch.cuda.synchronize(device)
    return heap_ms, times


def _symm_cells(heap_ms: float, times, graph_call_ms) -> list:
    """The :data:`~tilescale_examples.benchmarks._collectives.SYMM_HEADERS` cells: TileScale on
    its symmetric input against the fastest torch symmetric-memory op, then the fastest one
    replayed from a CUDA graph against TileScale's graph time ``graph_call_ms`` (None: not
    measured)."""
    cells = [heap_ms * 1e3]
    for graph, ts_ms in ((False, heap_ms), (True, graph_call_ms)):
        name, ms = times.fastest(graph)
        if name is None:
            cells += ["n/a", ms, "n/a"]
        else:
            cells += [ms * 1e3, name, "-" if ts_ms is None else ratio(ms, ts_ms)]
    return cells
