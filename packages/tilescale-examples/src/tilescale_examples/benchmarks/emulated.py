"""Kernel efficiency of the reductions on one GPU, with emulated peers.

``python -m tilescale_examples.benchmarks.emulated [--ranks 2 4 8] [--min-bytes 4096]
[--max-bytes 1073741824] [--dtype float16] [--ops allreduce reducescatter]
[--algorithm auto|one_shot|two_shot] [--iters 50] [--threads 512] [--unroll U]
[--max-blocks B] [--no-graph] [--out DIR]``

One process, no process group: ``N`` emulated ranks are ``N`` regions of one device buffer
(:mod:`tilescale_examples.testing.emulated`), and their metadata tables map PE ``p`` to region ``p``,
so the unchanged all-reduce and reduce-scatter kernels run with local memory standing in for
NVLink. Every emulated rank's kernel runs alone on the GPU, in turn (the peers' flags preset
so that waits pass at once), so a kernel's time is one rank's share of the collective.

For every ``N``, op and size (all-reduce: the tensor's bytes; reduce-scatter: each rank's
input, ``N`` rows of ``size / N``) it builds the collective on every emulated rank, fills the
inputs with random values, runs one round and checks every rank's output bit for bit against
the rank-order reference (a failure is printed and makes the exit status 1), then times
each rank's kernel: ``--iters`` back-to-back launches (inputs already in the symmetric
buffers, so the kernel is all that runs) between two CUDA events, enqueued behind a stream
hold so that the host's launch cost is not counted
(:func:`~tilescale_examples.benchmarks._timing.held_ms_per_launch`), divided by the launch count. ``GB/s`` counts the bytes one rank's kernel reads plus writes:
one-shot reads ``N`` rows per output row and writes one; two-shot reads ``N`` rows of its shard
and writes the result to ``N`` ranks; reduce-scatter reads ``N`` rows per output row and writes
one. The baseline is torch's device-to-device ``copy_`` moving the same number of bytes (half
read, half written), timed the same way in the same run; ``ratio`` = kernel GB/s / copy GB/s.
Baseline B (``copy B GB/s``, ``ratio B``) is the same copy with the kernel's memory footprint:
one-shot and reduce-scatter alternate between two staging buffers from call to call, so their
back-to-back calls touch twice the input bytes, and baseline B alternates between two source
buffers likewise (two-shot: one buffer, baseline B is the plain copy). Where the plain copy
runs out of L2 and the two buffers do not fit (about 16 MiB on an H200), B is the fair
measure of the kernel's data movement; the goal is stated against the plain copy.

``graph us`` (unless ``--no-graph``): one round (every emulated rank's call, rank order)
captured in one CUDA graph, the graph replayed ``--iters`` times behind a stream hold (as
above), GPU time per replay divided by the ranks: the GPU time per call replayed from a graph.
The round's inputs (:func:`graph_inputs`): two-shot calls ``c(c.input)`` as the kernel column
does; one-shot and reduce-scatter take an ordinary tensor, staged by the kernel (the zero-copy
input of a double-buffered collective is not usable once captured), so their graph calls also
read and write one more copy of the input's bytes. Every replayed call also holds the copy of
its emulated rank's metadata table (a few bytes, device to device: the emulated ranks share
one compiled kernel; a real rank's kernel needs none). After the replays, the inputs restaged
(two-shot: its input is overwritten by its result) and the outputs poisoned, one more replay
is checked bit for bit like the eager round ("FAIL graph" in the check column). The graph
column is measured after every eager column of the sweep, on freshly built collectives: once
captured, a kernel shared by emulated ranks rebinds its table on every eager call, which would
slow the eager columns' calls.

A second table (unless ``--no-ab``) is the A/B of the call numbers
(:mod:`~tilescale_examples.benchmarks._call_number_ab`): per rank count, op and size, the
kernel as the op built it (its call number read from and written to a device counter:
graph-safe) against the same kernel built with the host passing the number as an argument
(the kernels before they were graph-safe), same arguments, same timing, same run.

The goals (printed at the end): from 16 MiB up, ratio >= 0.9; a 4 KiB all-reduce kernel takes
<= 8 us of GPU time (the replayed call's time printed beside it); the device-numbered kernel
at most 1.03x the host-numbered one at every size.
"""

from __future__ import annotations

import contextlib
import statistics

from tilescale_examples.benchmarks import _call_number_ab, _harness, _timing
from tilescale_examples.benchmarks._report import format_bytes, gb_per_s, print_table, ratio, size_sweep

__all__ = ["build", "fill_inputs", "expected", "check_round", "bytes_moved", "time_kernels", "copy_fn", "copy_ms",
           "preset_flags", "graph_inputs", "time_graph", "run", "main", "HEADERS", "SMALL_BYTES", "LARGE_BYTES"]

HEADERS = ["ranks", "size", "op", "blocks", "kernel us", "graph us", "moved", "GB/s", "copy GB/s", "ratio",
           "copy B GB/s", "ratio B", "check"]
#: The latency goal's size and the bandwidth goal's smallest size.
SMALL_BYTES, LARGE_BYTES = 4096, 16 << 20
DTYPES = ("float16", "bfloat16", "float32")


def shape_of(op: str, nbytes: int, ranks: int, itemsize: int) -> tuple:
    """The collective's shape argument: the tensor (all-reduce) or its ``(ranks, shard)``
    input (reduce-scatter, shards of ``size / ranks`` bytes)."""
    per = nbytes // itemsize if op == "allreduce" else nbytes // ranks // itemsize
    return (max(1, per),) if op == "allreduce" else (ranks, max(1, per))


def build(op: str, algorithm: str, ranks: int, nbytes: int, dtype, device, max_blocks=None,
          threads: int = 512, unroll=None):
    """``(peers, collectives)``: an :class:`~tilescale_examples.testing.emulated.EmulatedPeers` sized
    for one collective and the collective built on each of its ranks (rank order);
    ``threads`` and ``unroll`` as for the collectives."""
    import torch

    from tilescale_examples.collectives.allreduce import AllReduce, choose_algorithm
    from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers
    from tilescale_examples.collectives.reduce_engine import plan_grid

    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = shape_of(op, nbytes, ranks, itemsize)
    if max_blocks is None:
        max_blocks = torch.cuda.get_device_properties(device).multi_processor_count
    if op == "allreduce":
        mode = choose_algorithm(shape[0] * itemsize, ranks) if algorithm == "auto" else algorithm
    else:
        mode = "reduce_scatter"
    plan = plan_grid(mode, shape[-1], itemsize, ranks, threads, unroll, max_blocks)
    kw = dict(max_blocks=max_blocks, threads=threads, unroll=unroll)
    stages = 1 if mode == "two_shot" else 2
    region = stages * (plan.stage_rows * 16 + ALIGNMENT) + plan.flag_words * 8 + 2 * ALIGNMENT
    peers = EmulatedPeers(ranks, region, device)
    colls = []
    for r in range(ranks):
        if op == "allreduce":
            colls.append(AllReduce(peers.rank(r), shape, dtype, algorithm=mode, **kw))
        else:
            from tilescale_examples.collectives.reducescatter import ReduceScatter

            colls.append(ReduceScatter(peers.rank(r), shape, dtype, **kw))
    return peers, colls


def fill_inputs(colls, seed: int) -> list:
    """Random inputs in every emulated rank's symmetric input buffer (``c.input``, the
    buffer the next call reads); returns those views, rank order."""
    import torch

    views = []
    for r, c in enumerate(colls):
        g = torch.Generator(device=c.device).manual_seed(seed * 1009 + r)
        x = c.input
        if x.dtype.is_floating_point:
            x.normal_(generator=g)
        else:
            x.random_(-1000, 1000, generator=g)
        views.append(x)
    return views


def expected(op: str, inputs: list) -> list:
    """Every rank's expected output (bit-exact rank-order reference)."""
    from tilescale_examples.collectives.reduce_engine import torch_reference

    if op == "allreduce":
        total = torch_reference(inputs)
        return [total] * len(inputs)
    return [torch_reference([x[r] for x in inputs]) for r in range(len(inputs))]


def check_round(op: str, colls, seed: int) -> list:
    """Fill fresh inputs, poison the outputs, run one round, compare every rank's output
    with :func:`expected`; returns failure messages (empty when all match)."""
    from tilescale_examples.testing.emulated import run_round

    _poison_outputs(colls)
    inputs = fill_inputs(colls, seed)
    want = expected(op, inputs)  # before the round: the two-shot overwrites its inputs
    return _compare(op, run_round(colls), want)


def _poison_outputs(colls) -> None:
    """Poison every rank's output, except where it is the input buffer (two-shot)."""
    for c in colls:
        if c.mode != "two_shot":
            _timing.poison_(c.output)


def _compare(op: str, outs, want, what: str = "") -> list:
    """Failure messages of the ranks whose output differs from ``want`` (bit for bit)."""
    import torch

    if outs and outs[0].is_cuda:
        torch.cuda.synchronize(outs[0].device)
    bad = []
    for r, (out, w) in enumerate(zip(outs, want)):
        if not torch.equal(out, w):
            bad.append(f"{op}{what} rank {r}/{len(outs)} {tuple(out.shape)} {out.dtype}: "
                       f"{int((out != w).sum())} wrong elements")
    return bad


def bytes_moved(coll) -> int:
    """Bytes one emulated rank's kernel reads plus writes (padding included)."""
    p = coll.plan
    reads = p.world_size * p.span * 16
    writes = (p.world_size if p.mode == "two_shot" else 1) * p.span * 16
    return reads + writes


def time_kernels(colls, iters: int) -> float:
    """Milliseconds of GPU time of one rank's kernel: for every emulated rank, ``iters``
    back-to-back calls (inputs already staged, every flag preset so that waits pass) timed as
    one stretch behind a stream hold (:func:`~tilescale_examples.benchmarks._timing.held_ms_per_launch`:
    the host's launch cost is not counted); the mean over ranks."""
    per_rank = []
    for c in colls:
        preset_flags(colls)  # a peer's earlier calls set its flag words to its (smaller) epochs
        c.bind_table()  # stream-ordered, before the hold; the calls below keep this table
        per_rank.append(_timing.held_ms_per_launch(lambda: c(c.input), iters, c.device))
    return statistics.fmean(per_rank)


def preset_flags(colls) -> None:
    """Every emulated rank's flag words to :data:`~tilescale_examples.testing.emulated.PRESET` (above
    any call number: every wait passes), on the current stream: one fill over every region
    when the ranks' flags lie at one offset of equal regions (they do: same allocation
    sequence), else one fill per rank."""
    import torch

    from tilescale_examples.testing.emulated import PRESET

    first = colls[0].flags.view(torch.int64)
    step = colls[1].flags.data_ptr() - first.data_ptr() if len(colls) > 1 else 0
    if len(colls) > 1 and step > 0 and step % 8 == 0 and all(
            c.flags.data_ptr() == first.data_ptr() + r * step and c.flags.numel() == first.numel()
            for r, c in enumerate(colls)):
        torch.as_strided(first, (len(colls), first.numel()), (step // 8, 1)).fill_(PRESET)
        return
    for c in colls:
        c.flags.view(torch.int64).fill_(PRESET)


def graph_inputs(colls, xs) -> list:
    """The inputs of a captured round, rank order: two-shot ``c.input`` (zero copy, as
    :func:`time_kernels` calls it; refilled before a checked replay), the others ``xs[r]``
    (an ordinary tensor, staged by the kernel: a double-buffered collective's zero-copy input
    is not usable once it has been captured)."""
    return [c.input if c.mode == "two_shot" else x for c, x in zip(colls, xs)]


def time_graph(op: str, colls, iters: int, seed: int) -> tuple:
    """``(milliseconds, failures)``: GPU time per call of one round (every emulated rank's call
    on :func:`graph_inputs`, after one fill presetting every rank's flags, as an eager round
    does: the calls set them to their call numbers) captured in a CUDA graph
    and replayed ``iters`` times behind a stream hold
    (:func:`~tilescale_examples.benchmarks._timing.graph_ms_per_call`), divided by the
    ranks; then one more replay on restaged inputs and poisoned outputs, checked against
    :func:`expected` (failure messages, empty when every rank matches)."""
    xs = [x.clone() for x in fill_inputs(colls, seed)]
    ins = graph_inputs(colls, xs)

    def round_():  # the flags are set to call numbers by every call: preset them each round
        preset_flags(colls)
        return [c(x) for c, x in zip(colls, ins)]

    device = colls[0].device
    ms, graph, outs = _timing.graph_ms_per_call(round_, 1, iters,
                                                lambda replay, n: _timing.held_ms_per_launch(replay, n, device))
    for c, x, i in zip(colls, xs, ins):
        if i is not x:
            i.copy_(x)  # two-shot: the replays left sums of sums in the input buffers
    _poison_outputs(colls)
    graph.replay()
    return ms / len(colls), _compare(op, outs, expected(op, xs), " graph")


def copy_fn(nbytes: int, device, sources: int = 1):
    """A function that makes torch's device-to-device ``copy_`` of ``nbytes`` bytes; with
    ``sources`` > 1, consecutive calls read ``sources`` different source buffers in turn (into
    one destination), the memory footprint of a kernel that alternates between that many
    staging buffers."""
    import torch

    if sources < 1:
        raise ValueError(f"sources must be >= 1, got {sources}")
    srcs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(sources)]
    dst = torch.empty_like(srcs[0])
    turn = [0]

    def copy():
        turn[0] = (turn[0] + 1) % sources
        dst.copy_(srcs[turn[0]])

    return copy


def copy_ms(nbytes: int, iters: int, device, sources: int = 1) -> float:
    """Milliseconds of GPU time of :func:`copy_fn` (``sources`` as there), measured like
    :func:`time_kernels` (``iters`` back-to-back copies behind a stream hold, after one
    warm-up copy)."""
    copy = copy_fn(nbytes, device, sources)
    copy()
    return _timing.held_ms_per_launch(copy, iters, device)


def iters_for(nbytes: int, iters: int) -> int:
    """Back-to-back launches timed per size: ``iters``, fewer above 64 MiB (at least 5)."""
    return max(5, min(iters, iters * (64 << 20) // max(nbytes, 1)))


@contextlib.contextmanager
def built(args, n: int, op: str, nbytes: int, dtype, device):
    """:func:`build` with the command line's options; closes the collectives and the peers
    (and empties torch's cache) on exit. Yields the collectives, rank order."""
    import torch

    peers, colls = build(op, args.algorithm, n, nbytes, dtype, device, max_blocks=args.max_blocks,
                         threads=args.threads, unroll=args.unroll)
    try:
        yield colls
    finally:
        for c in colls:
            c.close()
        peers.close()
        del colls, peers
        torch.cuda.empty_cache()


GRAPH_COLUMN, CHECK_COLUMN = HEADERS.index("graph us"), HEADERS.index("check")


def run(args, device) -> tuple:
    """``(rows, failures, small_us, worst_large, ab_rows)`` of the whole sweep (``small_us``:
    ranks -> ``[kernel us, graph us or None]`` of the 4 KiB all-reduce; ``ab_rows``: the call
    numbers' A/B, :data:`~tilescale_examples.benchmarks._call_number_ab.HEADERS`, empty
    without ``args.ab``)."""
    import torch

    dtype = getattr(torch, args.dtype)
    cases = [(n, op, nbytes) for n in args.ranks for op in args.ops
             for nbytes in size_sweep(args.min_bytes, args.max_bytes, 4)]
    rows, failures, small, worst, ab_rows, host_kernels = [], [], {}, float("inf"), [], {}
    for n, op, nbytes in cases:
        with built(args, n, op, nbytes, dtype, device) as colls:
            bad = check_round(op, colls, seed=nbytes % 100003 + n)
            failures += bad
            it = iters_for(nbytes, args.iters)
            ms = time_kernels(colls, it)
            moved = bytes_moved(colls[0])
            base = copy_ms(moved // 2, it, device)
            stages = len(colls[0].stages)  # 2: one-shot and reduce-scatter alternate buffers
            base_b = base if stages == 1 else copy_ms(moved // 2, it, device, sources=stages)
            bw, ref, ref_b = gb_per_s(moved, ms), gb_per_s(moved, base), gb_per_s(moved, base_b)
            name = colls[0].mode if op == "allreduce" else "reduce-scatter"
            rows.append([n, format_bytes(nbytes), name, colls[0].plan.blocks, ms * 1e3, "-", format_bytes(moved),
                         bw, ref, ratio(bw, ref), ref_b, ratio(bw, ref_b), "ok" if not bad else "FAIL"])
            if op == "allreduce" and nbytes == SMALL_BYTES:
                small[n] = [ms * 1e3, None]
            if nbytes >= LARGE_BYTES:
                worst = min(worst, ratio(bw, ref))
            if args.ab:
                key = (colls[0].mode, n)
                if key not in host_kernels:
                    host_kernels[key] = _call_number_ab.host_number_kernel(colls[0])
                ab = _call_number_ab.time_call_numbers(colls, it, host_kernels[key], preset_flags)
                ab_rows.append(_call_number_ab.row(n, format_bytes(nbytes), name, *ab))
    # after every eager column: a captured kernel shared by emulated ranks rebinds on every eager call
    for row, (n, op, nbytes) in zip(rows if args.graph else [], cases):
        with built(args, n, op, nbytes, dtype, device) as colls:
            ms, bad = time_graph(op, colls, iters_for(nbytes, args.iters), seed=nbytes % 100003 + n + 1)
        failures += bad
        row[GRAPH_COLUMN] = ms * 1e3
        if bad:
            row[CHECK_COLUMN] = "FAIL graph" if row[CHECK_COLUMN] == "ok" else "FAIL, FAIL graph"
        if op == "allreduce" and nbytes == SMALL_BYTES:
            small[n][1] = ms * 1e3
    return rows, failures, small, worst, ab_rows


def main(argv=None) -> int:
    p = _harness.parser("emulated", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="emulated world sizes")
    p.add_argument("--ops", nargs="+", default=["allreduce", "reducescatter"], choices=["allreduce", "reducescatter"])
    p.add_argument("--algorithm", default="auto", choices=["auto", "one_shot", "two_shot"], help="all-reduce algorithm")
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--iters", type=int, default=50, help="back-to-back launches timed per rank and size (fewer above 64 MiB)")
    p.add_argument("--dtype", default="float16", choices=DTYPES)
    p.add_argument("--threads", type=int, default=512, help="threads per block of the kernels")
    p.add_argument("--unroll", type=int, default=None, help="rows per thread and iteration (default max(1, 8 // ranks))")
    p.add_argument("--max-blocks", type=int, default=None,
                   help="grid limit (default: the SM count; larger grids are safe here only: emulated waits pass at once)")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="skip the graph column (one round captured in a CUDA graph, replayed)")
    p.add_argument("--no-ab", dest="ab", action="store_false",
                   help="skip the call numbers' A/B table (the kernels numbered on the device against by the host)")
    args = _harness.parse_args(p, argv)
    if not 0 < args.min_bytes <= args.max_bytes:
        p.error("need 0 < --min-bytes <= --max-bytes")
    device = _harness.emulated_device(p, args, "emulated-peers")
    if device is None:
        return 0
    import torch

    from tilescale_examples.testing.precompile import precompile, reduction_jobs

    modes = (["one_shot", "two_shot"] if args.algorithm == "auto" else [args.algorithm]) * ("allreduce" in args.ops)
    modes += ["reduce_scatter"] * ("reducescatter" in args.ops)
    numbers = ("device", "argument") if args.ab else ("device",)
    precompile(reduction_jobs(modes, [args.dtype], args.ranks, args.threads, args.unroll, numbers))  # cache hits below
    rows, failures, small, worst, ab_rows = run(args, device)
    name = torch.cuda.get_device_name(device)
    graph_text = (f"graph us: one round (every rank's call) captured in a CUDA graph, {args.iters} replays, GPU time "
                  "per call (one-shot and reduce-scatter: an ordinary tensor in, staged by the kernel)")
    print_table(f"reduction kernels with emulated peers (one {name}, {args.dtype}, all-reduce algorithm "
                f"{args.algorithm}, {args.threads} threads, unroll {args.unroll or 'max(1, 8 // ranks)'}, "
                f"grid <= {args.max_blocks or 'SM count'} blocks; GPU time of {args.iters} back-to-back launches); GB/s = bytes one rank's kernel reads + writes / its GPU time; "
                f"{graph_text if args.graph else 'graph us: not measured (--no-graph)'}; baseline "
                "torch device-to-device copy_ of the same bytes, same run; copy B: the same copy reading as many "
                "source buffers in turn as the kernel has staging buffers (its memory footprint)", HEADERS, rows)
    if args.ab:
        print_table(f"call numbers, A/B (one {name}, {args.dtype}): GPU us per launch of each rank's kernel, "
                    "its call number on the device (the library's, graph-safe) against passed by the host (the "
                    "same kernel built with call_number='argument'), same arguments, same run",
                    _call_number_ab.HEADERS, ab_rows)
    for f in failures[:20]:
        print("FAILED:", f)
    small_txt = ", ".join(f"{n} ranks {us:.2f} us" + ("" if g is None else f" (graph {g:.2f} us)")
                          for n, (us, g) in small.items()) or "not measured"
    print(f"\n4 KiB all-reduce kernel: {small_txt} (goal <= 8 us)")
    print(f"worst ratio from {format_bytes(LARGE_BYTES)} up: "
          f"{worst if worst != float('inf') else float('nan'):.3f} (goal >= 0.9)")
    if ab_rows:
        worst_ab = max(ab_rows, key=lambda r: r[-1])
        print(f"device-numbered / host-numbered kernel: worst {worst_ab[-1]:.3f} ({worst_ab[0]} ranks, {worst_ab[1]} "
              f"{worst_ab[2]}; goal <= {_call_number_ab.GOAL})")
    print(f"correctness (every rank's output, bit-exact rank-order reference, every size"
          f"{', eager and graph' if args.graph else ''}): "
          f"{'ok' if not failures else f'{len(failures)} FAILURE(S)'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
