"""Bus bandwidth of the example collectives against torch.distributed (and, for the
reductions, torch symmetric memory), measured in the same run.

What the all-gather, reduce-scatter, all-to-all and all-reduce benchmarks share; each has a
thin entry module (``python -m tilescale_examples.benchmarks.allgather | reducescatter |
alltoall | allreduce``
``[--ranks 4] [--min-bytes 4096] [--max-bytes 1073741824] [--iters 20] [--dtype float16
bfloat16] [--algorithm auto|one_shot|two_shot] [--engine auto|sm|copy] [--graph-calls 10]
[--no-graph] [--out DIR]`` (``--algorithm`` for all-reduce and all-gather, whose
``--engine`` is the same option)).
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
calls of both with CUDA events (the slowest rank's time;
:func:`tilescale_examples.benchmarks._timing.time_ms`, on ``tilescale_host.bench.perf_fn``). A failed check is counted, printed
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

import functools

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._collectives import (GRAPH_GOAL, GRAPH_GOAL_BYTES, HEADERS, SYMM_HEADERS, _check_name,
                                                        _op, bus_bandwidth, tolerance)
from tilescale_examples.benchmarks._collective_run import run
from tilescale_examples.benchmarks._report import format_bytes, print_table, ratio

__all__ = ["title", "graph_goal_line", "parser", "main", "entry"]


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




def graph_goal_line(world: int, dtype: str, ts_us: float, symm_op: str, symm_us: float) -> str:
    """The all-reduce's graph goal line: TileScale's and torch symmetric memory's one-shot
    GPU time per replayed :data:`GRAPH_GOAL_BYTES` call (microseconds) and their ratio
    TileScale / symm, against :data:`GRAPH_GOAL` (stated for one rank on one H200)."""
    r = ratio(ts_us, symm_us)
    verdict = "met" if r <= GRAPH_GOAL else "NOT met"
    return (f"{format_bytes(GRAPH_GOAL_BYTES)} all-reduce replayed from a CUDA graph, {world} rank(s), {dtype}: "
            f"TileScale {ts_us:.2f} us, torch.ops.symm_mem.{symm_op} {symm_us:.2f} us per call; "
            f"TileScale / symm one-shot = {r:.3f} (goal <= {GRAPH_GOAL} at one rank on one H200: {verdict})")


def _run_op(rank: int, world: int, group, device, op: str, args):
    return run(op, rank, world, group, device, args)


def parser(op):
    """The benchmark's command line (``--out DIR`` included, :func:`_harness.parser`)."""
    op = _op(op)
    p = _harness.parser(op.module, f"{op.name} bus bandwidth: TileScale's {op.cls} against torch.distributed, same run.")
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
        from tilescale_examples.collectives.allgather import ALGORITHMS

        p.add_argument("--algorithm", "--engine", dest="algorithm", default="auto", choices=list(ALGORITHMS),
                       help="auto: the size table (allgather.COPY_ENGINE_MIN_BYTES); sm: put_block kernel; "
                            "copy: copy engines (--engine: the 0.1.0 name)")
    return p


def main(op, argv=None) -> int:
    """Run the benchmark of ``op`` (a key of :data:`~tilescale_examples.benchmarks._collectives.OPS`);
    0 when every check passed (or there is no GPU to measure on), 1 otherwise."""
    op = _op(op)
    p = parser(op)
    args = _harness.parse_args(p, argv)
    if args.ranks < 1:
        p.error("--ranks must be >= 1")
    if args.graph_calls < 1:
        p.error("--graph-calls must be >= 1")
    if not 0 < args.min_bytes <= args.max_bytes:
        p.error("need 0 < --min-bytes <= --max-bytes")
    gpus = _harness.visible_gpus(f"{op.name} benchmark")
    if gpus == 0:
        return 0
    result, backend, world = _harness.run_on_ranks(_run_op, args.ranks, op.module, args)
    if result is None:  # a launcher rank other than 0
        return 0
    total = 0
    for dtype, (rows, failures, baseline, symm, goal) in result.items():
        heads = HEADERS + (SYMM_HEADERS if symm is not None else [])
        print_table(title(op, world, backend, min(gpus, world), dtype, baseline, symm, getattr(args, "algorithm", None),
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
