"""Bus bandwidth of the example collectives against torch.distributed (and, for the
reductions, torch symmetric memory), measured in the same run.

What the all-gather, reduce-scatter, all-to-all and all-reduce benchmarks share; each has a
thin entry module (``python -m tilescale_examples.benchmarks.allgather | reducescatter |
alltoall | allreduce``
``[--ranks 4] [--min-bytes 4096] [--max-bytes 1073741824] [--iters 20] [--dtype float16
bfloat16] [--algorithm auto|one_shot|two_shot] [--engine auto|sm|copy] [--graph-calls 10]
[--no-graph]`` (``--algorithm`` for all-reduce, ``--engine`` for all-gather)).
Without a launcher the benchmark spawns its ranks (one per GPU with an NCCL group when there
are enough GPUs, else sharing the GPUs with a gloo group); under ``tilescale-run -n 4
[--share-gpus] -m ...`` it uses the launcher's ranks and ``init_dist``'s group.

For every dtype (one table each; the reductions default to float16 and bfloat16) and total
size S (4 KiB .. 1 GiB by 4x; shard = S / ranks; S is the all-gather's output, the
reduce-scatter's input, the all-to-all's input, the all-reduce's tensor) it builds the
collective, fills its input with random values (the exchanges: their symmetric input; the
reductions: an ordinary tensor, so that staging into the heap is part of the timed call),
checks its output once against the baseline's (bit exact, except a floating-point reduction:
``torch.allclose``, because the order of the additions differs), then times back-to-back
calls of both with CUDA events (the slowest rank's time). A failed check is counted, printed
in the row and makes the exit status 1.

``TileScale graph us`` (unless ``--no-graph``): the same call, ``--graph-calls`` of them captured
into one CUDA graph (after an eager warm-up call), the graph replayed back to back and timed
like the eager calls (:func:`graph_ms_per_call`): GPU time per replayed call. The output of the
last captured call is poisoned before the replays and checked against the baseline's after
them; a mismatch shows in the check column ("FAIL graph"). For the reductions the graph's
input is the ordinary tensor (staging counted), as in the eager column: the zero-copy input of
a double-buffered collective cannot be used once it has been captured.

The baseline is the torch.distributed collective on the host group, chosen by a probe on
every run (the first candidate that gives the right answer on a small input): NCCL with one
rank per GPU; gloo when ranks share a GPU (host staging, not NCCL, and time-sliced: the title
says so). Bus bandwidth as nccl-tests define it: ``busbw = (n - 1) / n * S / t`` for the first
three and ``2 (n - 1) / n * S / t`` for all-reduce (S its size). The ratio column is TileScale
/ baseline (above 1: faster).

The reductions get more columns (:mod:`tilescale_examples.benchmarks._symm_baseline`):
TileScale called on its own symmetric input buffer (``coll(coll.input)``, no staging), the
fastest torch symmetric-memory op on a ``symm_mem.empty`` buffer holding the same input
(checked against TileScale's output first), its name, and the ratio (symm time / TileScale
time, above 1: TileScale faster); then the fastest symmetric-memory op replayed from a CUDA
graph the same way (``symm graph us``, its name, and ``graph vs symm`` = symm graph us /
TileScale graph us). They read "n/a (reason)" when ranks share a GPU.

``--ranks 1`` runs one rank (NCCL group of size 1): the bus bandwidth is 0 by definition, the
us columns are the measurement. For the all-reduce the run ends with the 4 KiB line
(:func:`graph_goal_line`): TileScale's replayed call against torch symmetric memory's replayed
one-shot, ratio TileScale / symm (goal at one rank on one H200: <= 0.8)::

    python -m tilescale_examples.benchmarks.allreduce --ranks 1 --max-bytes 4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable

from tilescale_examples.collectives.reduce_engine import FLAG_STRIDE
from tilescale_examples.benchmarks._report import format_bytes, gb_per_s, print_table, ratio, size_sweep

__all__ = ["Op", "Baseline", "OPS", "bus_bandwidth", "pick_baseline", "outputs_match", "tolerance",
           "heap_bytes", "title", "run", "main", "entry", "run_on_ranks", "time_ms", "capture_calls",
           "graph_ms_per_call", "poison_", "graph_goal_line", "GRAPH_GOAL_BYTES", "GRAPH_GOAL"]

HEADERS = ["size", "shard", "blocks", "TileScale GB/s", "baseline GB/s", "ratio",
           "TileScale us", "baseline us", "TileScale graph us", "check"]
#: Relative tolerance of a floating-point reduction, about one ulp of the dtype (bfloat16 has 8
#: significant bits: one ulp is up to 2**-7 relative). The absolute one is ``rtol * n * (n +
#: 1) / 2`` for ``n`` ranks: inputs lie in [-1, 1), and a baseline that rounds each of its
#: partial sums (of at most ``k`` terms) in the dtype errs by up to half an ulp of ``k`` each.
RTOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-5, "float64": 1e-12}
#: Grid cap assumed for the flags when sizing the heap (chunks <= max_blocks <= SM count).
MAX_BLOCKS = 256


@dataclass(frozen=True)
class Baseline:
    """A torch.distributed way to compute the collective: ``call(dist, out, x, group, rank,
    world)`` on flat tensors (``x`` the rank's input, ``out`` the rank's output); ``name`` goes
    into the table title."""

    name: str
    call: Callable


@dataclass(frozen=True)
class Op:
    """One collective: its class (``module.cls`` in :mod:`tilescale_examples`), the baselines
    to try in order (the last one must work on any backend), the dtypes the benchmark offers,
    the symmetric heap it needs per size (``input_rows`` + ``output_rows`` shards, plus flags),
    its bus-bandwidth factor, and whether it sums (tolerance for floats) or moves data (exact)."""

    name: str
    module: str
    cls: str
    baselines: tuple
    dtypes: tuple
    input_rows: Callable[[int], int]
    output_rows: Callable[[int], int]
    bus_factor: Callable[[int], float]
    reduces: bool = False
    grid_per_peer: bool = True  # grid chunks x world (else chunks)
    #: The collective's shape argument for ``shard`` elements per rank and ``world`` ranks.
    shape: Callable[[int, int], tuple] = lambda shard, world: (shard,)
    #: Symmetric-heap shards per collective (default input_rows + output_rows).
    heap_rows: Callable[[int], int] | None = None

    def collective(self):
        return getattr(importlib.import_module(f"tilescale_examples.collectives.{self.module}"), self.cls)

    def reference(self, inputs, rank: int):
        """The expected output on ``rank`` from every rank's input (the example's
        ``torch_reference``)."""
        ref = importlib.import_module(f"tilescale_examples.collectives.{self.module}").torch_reference
        return ref(inputs) if self.module == "allgather" else ref(inputs, rank)


def _all_gather_into_tensor(dist, out, x, group, rank, world):
    dist.all_gather_into_tensor(out, x, group=group)


def _all_gather_views(dist, out, x, group, rank, world):
    dist.all_gather(list(out.chunk(world)), x, group=group)


def _reduce_scatter_tensor(dist, out, x, group, rank, world):
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)


def _all_reduce_slice(dist, out, x, group, rank, world):
    total = x.clone()  # all_reduce works in place; the input must survive the call
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    out.copy_(total.view(world, -1)[rank])


def _all_reduce(dist, out, x, group, rank, world):
    out.copy_(x)  # all_reduce works in place; the input must survive the call
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)


def _all_to_all_single(dist, out, x, group, rank, world):
    dist.all_to_all_single(out, x, group=group)


def _all_to_all_lists(dist, out, x, group, rank, world):
    dist.all_to_all(list(out.chunk(world)), list(x.chunk(world)), group=group)


def _all_gather_select(dist, out, x, group, rank, world):
    import torch

    gathered = torch.empty((world, x.numel()), dtype=x.dtype, device=x.device)
    dist.all_gather(list(gathered.unbind(0)), x, group=group)
    out.view(world, -1).copy_(gathered.view(world, world, -1)[:, rank])


def _ring(world: int) -> float:
    """nccl-tests' bus factor of all-gather, reduce-scatter and all-to-all: ``(n - 1) / n``."""
    return (world - 1) / world


def _ring_twice(world: int) -> float:
    """nccl-tests' bus factor of all-reduce: ``2 (n - 1) / n``."""
    return 2 * (world - 1) / world


_COPY_DTYPES = ("float16", "bfloat16", "float32", "uint8")
OPS = {
    "allgather": Op("all-gather", "allgather", "AllGather",
                    (Baseline("all_gather_into_tensor", _all_gather_into_tensor),
                     Baseline("all_gather", _all_gather_views)),
                    _COPY_DTYPES, lambda n: 1, lambda n: n, _ring),
    "reducescatter": Op("reduce-scatter", "reducescatter", "ReduceScatter",
                        (Baseline("reduce_scatter_tensor", _reduce_scatter_tensor),
                         Baseline("all_reduce + slice", _all_reduce_slice)),
                        ("float16", "bfloat16", "float32", "int32"), lambda n: n, lambda n: 1, _ring,
                        reduces=True, grid_per_peer=False),
    "alltoall": Op("all-to-all", "alltoall", "AllToAll",
                   (Baseline("all_to_all_single", _all_to_all_single),
                    Baseline("all_to_all", _all_to_all_lists),
                    Baseline("all_gather + select", _all_gather_select)),
                   _COPY_DTYPES, lambda n: n, lambda n: n, _ring),
    # heap: two staging buffers of the whole tensor (one-shot double-buffers; two-shot uses one)
    "allreduce": Op("all-reduce", "allreduce", "AllReduce",
                    (Baseline("all_reduce", _all_reduce),),
                    ("float16", "bfloat16", "float32", "int32"), lambda n: n, lambda n: n, _ring_twice,
                    reduces=True, grid_per_peer=False, shape=lambda shard, world: (world * shard,),
                    heap_rows=lambda n: 2 * n),
}
OPS["reducescatter"] = dataclasses.replace(OPS["reducescatter"], heap_rows=lambda n: 2 * n)  # double-buffered input
#: Column headers added for the reductions: TileScale with its input already in the symmetric
#: buffer against torch symmetric memory (whose input is always there), eager; then torch
#: symmetric memory replayed from a CUDA graph against ``TileScale graph us``.
SYMM_HEADERS = ["TS heap us", "symm us", "symm op", "vs symm", "symm graph us", "symm graph op", "graph vs symm"]
#: All-reduce size (bytes) of the graph goal line, and the goal: TileScale's replayed call at
#: most this fraction of torch symmetric memory's replayed one-shot (one rank, one H200).
GRAPH_GOAL_BYTES, GRAPH_GOAL = 4096, 0.8
#: Bytes of padding a reduction may add per collective (whole 16-byte vectors per shard).
REDUCE_PAD = 64


def _op(op) -> Op:
    return OPS[op] if isinstance(op, str) else op


# ------------------------------------------------------------------------------ numbers
def bus_bandwidth(total_bytes: int, world: int, milliseconds: float, op="allgather") -> float:
    """nccl-tests' bus bandwidth in GB/s: ``factor(n) * total_bytes / t`` (``(n - 1) / n`` for
    the three collectives here; ``total_bytes`` is S, the larger of input and output)."""
    return gb_per_s(_op(op).bus_factor(world) * total_bytes, milliseconds)


def iters_for(nbytes: int, iters: int) -> int:
    """Fewer timed calls for large sizes (at least 3)."""
    return max(3, min(iters, iters * (64 << 20) // max(nbytes, 1)))


def shard_numel(nbytes: int, world: int, itemsize: int) -> int:
    """Elements per shard for a total size of ``nbytes`` (at least 1)."""
    return max(1, nbytes // world // itemsize)


def heap_bytes(op, sizes, world: int, itemsize: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Symmetric heap per rank for one collective of every size in ``sizes`` (the heap is
    only returned at ``allocator.close()``): input and output rows, flags, alignment, plus
    64 MiB of slack."""
    op = _op(op)
    total = 64 << 20
    for nbytes in sizes:
        shard = shard_numel(nbytes, world, itemsize) * itemsize
        rows = op.heap_rows(world) if op.heap_rows else op.input_rows(world) + op.output_rows(world)
        pad = REDUCE_PAD * world * rows if op.reduces else 0
        flags = 2 * world * max_blocks * 8 * (FLAG_STRIDE if op.reduces else 1)
        total += shard * rows + pad + flags + 3 * 256
    return total


def tolerance(op, dtype: str, world: int):
    """``(rtol, atol)`` of the check against the baseline, or None for a bit-exact check."""
    if not _op(op).reduces or dtype not in RTOL:
        return None
    return RTOL[dtype], RTOL[dtype] * world * (world + 1) / 2


def outputs_match(out, ref, tol) -> bool:
    """Whether ``out`` equals ``ref`` (``tol`` None) or is ``allclose`` within ``tol``."""
    import torch

    if tol is None:
        return torch.equal(out, ref)
    return out.shape == ref.shape and torch.allclose(out, ref, rtol=tol[0], atol=tol[1])


def _check_name(tol) -> str:
    return "bit-exact" if tol is None else f"allclose rtol={tol[0]:g} atol={tol[1]:g}"


def random_input(shape, dtype, generator):
    """Floats uniform in [-1, 1) (rounding to the dtype may reach 1); ints in [0, 256) for uint8, [-1000, 1000) otherwise."""
    import torch

    if dtype.is_floating_point:
        return (torch.rand(shape, generator=generator) * 2 - 1).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(lo, hi, tuple(shape), generator=generator).to(dtype)


# ------------------------------------------------------------------------------ baseline
def pick_baseline(op, group, device, dtype, dist=None):
    """``(name, fn)``: the first of ``op.baselines`` that computes the right answer for a small
    input on this group (a backend may lack a collective, or, like older gloo with CUDA
    tensors, refuse it); ``fn(out, x)`` runs it on flat tensors. Every rank probes the same
    candidates in the same order, and a backend refuses on every rank alike."""
    import torch

    if dist is None:
        import torch.distributed as dist
    op = _op(op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = op.input_rows(world)
    inputs = [((torch.arange(rows * 2) + p * rows * 2) % 61).to(dtype).to(device).view(rows, 2)
              for p in range(world)]
    expect = op.reference(inputs, rank).reshape(-1)
    tol = tolerance(op, str(dtype).removeprefix("torch."), world)
    for baseline in op.baselines:
        out = torch.zeros_like(expect)
        try:
            baseline.call(dist, out, inputs[rank].reshape(-1), group, rank, world)
            ok = outputs_match(out, expect, tol)
        except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError):
            ok = False
        if ok:
            return baseline.name, functools.partial(baseline.call, dist, group=group, rank=rank, world=world)
    raise RuntimeError(f"no torch.distributed baseline for {op.name} works on this group")


# ------------------------------------------------------------------------------ timing
def time_ms(fn, iters: int, group, device) -> float:
    """Milliseconds per call of ``iters`` back-to-back calls (after 2 warm-up calls), timed
    with CUDA events on each rank; the slowest rank's time (every rank gets the same)."""
    import torch
    import torch.distributed as dist

    from tilescale_examples.base import collective_device
    from tilescale_host import synchronize_streams

    stream = torch.cuda.current_stream(device)
    for _ in range(2):
        fn()
    synchronize_streams([stream], timeout=300.0)
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        fn()
    end.record(stream)
    synchronize_streams([stream], timeout=300.0)  # a lost signal fails instead of hanging
    ms = torch.tensor([start.elapsed_time(end) / iters], dtype=torch.float64,
                      device=collective_device(group, device))
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms.item())


def poison_(t) -> None:
    """Fill tensor ``t`` with values no check accepts: NaN for floating point, the dtype's
    largest value for integers."""
    import torch

    t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max)


def capture_calls(fn, calls: int) -> tuple:
    """``(graph, result)``: one eager call of ``fn`` (warm-up: compile, first-call setup), then
    ``calls`` calls captured into one ``torch.cuda.CUDAGraph`` on the current device; ``result``
    is what the last captured call returned. Its tensors (a tensor, or a list or tuple of them)
    are poisoned (:func:`poison_`) after the capture, so only replays write them: a check of
    ``result`` after the replays sees what the graph computed. Collective ``fn``: every rank
    captures the same calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    result = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            result = fn()
    for t in result if isinstance(result, (list, tuple)) else [result]:
        if isinstance(t, torch.Tensor):
            poison_(t)
    return graph, result


def graph_ms_per_call(fn, calls: int, replays: int, timer, capture=None) -> tuple:
    """``(milliseconds per call, graph, result)`` of ``fn`` replayed from a CUDA graph:
    ``capture(fn, calls)`` (default :func:`capture_calls`: one eager call, then ``calls`` calls
    captured into one graph), ``timer(graph.replay, replays)`` milliseconds per replay (e.g.
    ``functools.partial(time_ms, group=group, device=device)``, or
    :func:`~tilescale_examples.benchmarks._gpu_time.gpu_ms_per_launch` with ``device``), divided
    by ``calls``. ``result`` is the last captured call's return value (written by every replay)."""
    if calls < 1 or replays < 1:
        raise ValueError(f"calls and replays must be >= 1, got {calls} and {replays}")
    graph, result = (capture or capture_calls)(fn, calls)
    return timer(graph.replay, replays) / calls, graph, result


def graph_goal_line(world: int, dtype: str, ts_us: float, symm_op: str, symm_us: float) -> str:
    """The all-reduce's graph goal line: TileScale's and torch symmetric memory's one-shot
    GPU time per replayed :data:`GRAPH_GOAL_BYTES` call (microseconds) and their ratio
    TileScale / symm, against :data:`GRAPH_GOAL` (stated for one rank on one H200)."""
    r = ratio(ts_us, symm_us)
    verdict = "met" if r <= GRAPH_GOAL else "NOT met"
    return (f"{format_bytes(GRAPH_GOAL_BYTES)} all-reduce replayed from a CUDA graph, {world} rank(s), {dtype}: "
            f"TileScale {ts_us:.2f} us, torch.ops.symm_mem.{symm_op} {symm_us:.2f} us per call; "
            f"TileScale / symm one-shot = {r:.3f} (goal <= {GRAPH_GOAL} at one rank on one H200: {verdict})")


def options(op, args) -> dict:
    """Constructor options of ``op``'s collective from the command line (the all-reduce's
    ``algorithm``, the all-gather's ``engine``)."""
    module = _op(op).module
    if module == "allreduce":
        return {"algorithm": args.algorithm}
    if module == "allgather":
        return {"engine": args.engine}
    return {}


def grid_cell(op, coll, world: int) -> str:
    """The grid column: ``chunks x world`` (put exchanges) or the reduction's mode and blocks."""
    plan = getattr(coll, "plan", None)
    if plan is not None:
        return f"{plan.mode} {plan.blocks}"
    if getattr(coll, "engine", "sm") == "copy":
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
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    itemsizes = [torch.empty((), dtype=getattr(torch, d)).element_size() for d in args.dtype]
    heap = sum(heap_bytes(op, sizes, world, i, max(sms, MAX_BLOCKS)) for i in itemsizes)
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


def _run_dtype(op, rank, world, group, device, args, alloc, dtype_name, sizes, symm) -> list:
    import torch

    from tilescale_examples.base import collective_device

    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    cls = op.collective()
    flag_device = collective_device(group, device)
    tol = tolerance(op, dtype_name, world)
    rows, failures, goal = [], 0, None
    name, baseline = pick_baseline(op, group, device, dtype)
    timer = functools.partial(time_ms, group=group, device=device)
    for nbytes in sizes:
        shard = shard_numel(nbytes, world, itemsize)
        coll = cls(alloc, op.shape(shard, world), dtype, group=group, **options(op, args))  # collective
        g = torch.Generator().manual_seed(rank * 7919 + nbytes % 1000003)
        # reductions: an ordinary tensor (staging is part of the call); exchanges read in place
        x = random_input(coll.input.shape, dtype, g).to(device) if op.reduces else coll.input
        if not op.reduces:
            x.copy_(random_input(x.shape, dtype, g))
        ref = torch.empty(coll.output.numel(), dtype=dtype, device=device)
        baseline(ref, x.reshape(-1))
        out = coll(x)
        bad = _bad_ranks(out, ref, tol, group, flag_device)
        total = world * shard * itemsize
        it = iters_for(total, args.iters)
        graph_time = None
        if args.graph:
            graph_time = functools.partial(graph_ms_per_call, calls=args.graph_calls, replays=it, timer=timer)
        ts_ms = time_ms(lambda: coll(x), it, group, device)
        ref_ms = time_ms(lambda: baseline(ref, x.reshape(-1)), it, group, device)
        heap_ms = times = None
        if symm is not None:  # before the graph: coll.input is not usable once coll has been captured
            heap_ms, times = _symm_times(coll, x, out, tol, symm, it, group, device, graph_time)
        graph_call_ms, graph_bad = None, 0
        if graph_time is not None:
            graph_call_ms, _, graph_out = graph_time(lambda: coll(x))
            graph_bad = _bad_ranks(graph_out, ref, tol, group, flag_device)
        failures += bad + graph_bad
        ts_bw, ref_bw = bus_bandwidth(total, world, ts_ms, op), bus_bandwidth(total, world, ref_ms, op)
        row = [format_bytes(total), format_bytes(shard * itemsize), grid_cell(op, coll, world), ts_bw, ref_bw,
               ratio(ts_bw, ref_bw), ts_ms * 1e3, ref_ms * 1e3, "-" if graph_call_ms is None else graph_call_ms * 1e3,
               _check_cell(bad, graph_bad)]
        if symm is not None:
            row += _symm_cells(heap_ms, times, graph_call_ms)
            one_shot = symm.families.get("one-shot")
            if op.module == "allreduce" and total == GRAPH_GOAL_BYTES and graph_call_ms and one_shot in times.graph:
                goal = (graph_call_ms * 1e3, one_shot, times.graph[one_shot] * 1e3)
        rows.append(row)
        coll.close()
    return [rows, failures, name, None if symm is None else symm.title(), goal]


def _symm_times(coll, x, out, tol, symm, iters, group, device, graph_time) -> tuple:
    """``(TileScale heap ms, SymmTimes)``: TileScale called on its symmetric input buffer (no
    staging), and the torch symmetric-memory ops checked against ``out`` and timed
    (:meth:`SymmBaseline.measure`; replayed from CUDA graphs with ``graph_time``)."""
    import torch

    expect = out.reshape(-1).clone()
    heap_ms = time_ms(lambda: coll(coll.input), iters, group, device)
    times = symm.measure(x, expect, lambda got, want: outputs_match(got, want, tol), time_ms, iters, graph_time)
    torch.cuda.synchronize(device)
    return heap_ms, times


def _symm_cells(heap_ms: float, times, graph_call_ms) -> list:
    """The :data:`SYMM_HEADERS` cells: TileScale on its symmetric input against the fastest
    torch symmetric-memory op, then the fastest one replayed from a CUDA graph against
    TileScale's graph time ``graph_call_ms`` (None: not measured)."""
    cells = [heap_ms * 1e3]
    for graph, ts_ms in ((False, heap_ms), (True, graph_call_ms)):
        name, ms = times.fastest(graph)
        if name is None:
            cells += ["n/a", ms, "n/a"]
        else:
            cells += [ms * 1e3, name, "-" if ts_ms is None else ratio(ms, ts_ms)]
    return cells


# ------------------------------------------------------------------------------ report
def title(op, world: int, backend: str, gpus: int, dtype: str, baseline: str | None = None,
          symm: str | None = None, algorithm: str | None = None, graph_calls: int | None = None) -> str:
    """The table title: collective, ranks, dtype, GPU mode and which baseline ran over what;
    for the reductions also the all-reduce algorithm and the torch symmetric-memory baseline
    (``symm``, from :meth:`SymmBaseline.title`); what the graph column times
    (``graph_calls`` calls per CUDA graph; None: not measured)."""
    op = _op(op)
    baseline = baseline or op.baselines[0].name
    if backend == "nccl":
        base = f"baseline torch.distributed.{baseline} over NCCL"
        mode = f"one rank per GPU ({gpus} GPUs)"
    else:
        base = (f"baseline torch.distributed.{baseline} over {backend} (host staging, NOT NCCL: "
                "ranks share a GPU)")
        mode = f"{world} ranks sharing {gpus} GPU(s): time-sliced, not a bandwidth measurement"
    text = f"{op.name} bus bandwidth, {world} ranks, {dtype}, {mode}; {base}; busbw = (n-1)/n * size / t"
    if algorithm is not None:
        text = text.replace(f"{op.name} bus bandwidth,", f"{op.name} ({algorithm}) bus bandwidth,", 1)
    if op.reduces:
        text += ("; TileScale us/GB/s: an ordinary tensor in (staging counted); TS heap us: input already "
                 "in its symmetric buffer")
    if world == 1:
        text += "; 1 rank: bus bandwidth 0 by definition, compare the us columns"
    if graph_calls is not None:
        text += (f"; TileScale graph us: GPU time per call of {graph_calls} calls captured in one CUDA graph, "
                 "replayed back to back")
    if symm is not None:
        text += f"; {symm}; vs symm = symm us / TS heap us"
        if graph_calls is not None:
            text += "; graph vs symm = symm graph us / TileScale graph us"
    return text


def _spawned_rank(rank: int, world: int, fn, fn_args):
    import torch
    import torch.distributed as dist
    from tilescale_core.multiprocess import rank_device

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renames
    device = torch.device(rank_device(rank))  # its own GPU, or shared round-robin
    torch.cuda.set_device(device)
    return fn(rank, world, dist.group.WORLD, device, *fn_args)


def run_on_ranks(fn, ranks: int, *fn_args):
    """Run ``fn(rank, world, group, device, *fn_args)`` on every rank and return ``(rank 0's
    result, backend, world)``: under ``tilescale-run``/torchrun on the launcher's ranks (group
    from ``init_dist``), otherwise on ``ranks`` spawned ranks (NCCL with one GPU each, gloo
    when they share GPUs). ``fn`` must be picklable (module level)."""
    import torch

    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:  # under tilescale-run / torchrun
        import torch.distributed as dist

        from tilelang.distributed.host import init_dist

        warnings.filterwarnings("ignore", category=FutureWarning)
        rank, world, group = init_dist(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
        result = fn(rank, world, group, torch.device("cuda", torch.cuda.current_device()), *fn_args)
        backend = dist.get_backend(group)
        dist.destroy_process_group()
        return (result if rank == 0 else None), backend, world
    from tilescale_core.multiprocess import auto_backend, run_ranks

    backend = auto_backend(ranks, share=False)  # NCCL when every rank has a GPU, else gloo
    result = run_ranks(_spawned_rank, ranks, args=(fn, fn_args), backend=backend, timeout=1200)[0]
    return result, backend, ranks


def _run_op(rank: int, world: int, group, device, op: str, args):
    return run(op, rank, world, group, device, args)


def parser(op) -> argparse.ArgumentParser:
    op = _op(op)
    p = argparse.ArgumentParser(prog=f"python -m tilescale_examples.benchmarks.{op.module}",
                                description=f"{op.name} bus bandwidth: TileScale's {op.cls} against "
                                            "torch.distributed, same run.")
    p.add_argument("--ranks", type=int, default=4, help="ranks to spawn (ignored under tilescale-run)")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest total size in bytes")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="largest total size in bytes")
    p.add_argument("--iters", type=int, default=20, help="timed calls (graph: replays) per size (fewer above 64 MiB)")
    p.add_argument("--graph-calls", type=int, default=10,
                   help="calls captured in the CUDA graph of the graph columns (time per call = replay time / this)")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph columns")
    default = ["float16", "bfloat16"] if op.reduces else ["float16"]
    p.add_argument("--dtype", nargs="+", default=default, choices=list(op.dtypes),
                   help=f"one table per dtype (default: {' '.join(default)})")
    if op.module == "allreduce":
        from tilescale_examples.collectives.allreduce import ALGORITHMS

        p.add_argument("--algorithm", default="auto", choices=list(ALGORITHMS),
                       help="auto: the size table (allreduce.ONE_SHOT_MAX_BYTES); or force one")
    if op.module == "allgather":
        from tilescale_examples.collectives.allgather import ENGINES

        p.add_argument("--engine", default="auto", choices=list(ENGINES),
                       help="auto: the size table (allgather.COPY_ENGINE_MIN_BYTES); sm: put_block kernel; copy: copy engines")
    return p


def main(op, argv=None) -> int:
    """Run the benchmark of ``op`` (a key of :data:`OPS`); 0 when every check passed (or there
    is no GPU to measure on), 1 otherwise."""
    op = _op(op)
    p = parser(op)
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error("--ranks must be >= 1")
    if args.graph_calls < 1:
        p.error("--graph-calls must be >= 1")
    if not 0 < args.min_bytes <= args.max_bytes:
        p.error("need 0 < --min-bytes <= --max-bytes")
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print(f"{op.name} benchmark: no CUDA GPU visible, nothing to measure")
        return 0
    result, backend, world = run_on_ranks(_run_op, args.ranks, op.module, args)
    if result is None:  # a launcher rank other than 0
        return 0
    total = 0
    for dtype, (rows, failures, baseline, symm, goal) in result.items():
        heads = HEADERS + (SYMM_HEADERS if symm is not None else [])
        print_table(title(op, world, backend, min(gpus, world), dtype, baseline, symm,
                          getattr(args, "algorithm", None) or getattr(args, "engine", None),
                          args.graph_calls if args.graph else None), heads, rows)
        print(f"\ncorrectness ({_check_name(tolerance(op, dtype, world))} vs the baseline's output, "
              f"every size{', eager and graph' if args.graph else ''}): "
              f"{'ok' if failures == 0 else f'{failures} FAILURE(S)'}")
        if goal is not None:
            print(graph_goal_line(world, dtype, *goal))
        total += failures
    return 0 if total == 0 else 1


def entry(name: str):
    """``(main, run, bus_bandwidth)`` of one collective, for its entry module."""
    return (functools.partial(main, name), functools.partial(run, name),
            functools.partial(bus_bandwidth, op=name))
