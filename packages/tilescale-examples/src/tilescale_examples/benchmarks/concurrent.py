"""All-reduce algorithms with emulated ranks running at the same time: the evidence for the size tables.

``python -m tilescale_examples.benchmarks.concurrent [--ranks 2 4 8] [--min-bytes 4096]
[--max-bytes 262144] [--dtype bfloat16] [--algorithms lamport one_shot] [--iters 50]
[--out DIR]``

The emulated peers of :mod:`~tilescale_examples.benchmarks.emulated` run one after the other
with their flags preset, so they measure a kernel's bytes per second and never its waits; a
flagless kernel (``algorithm="lamport"``, whose data is its own signal) cannot run that way
at all. Here ``N`` emulated ranks (:mod:`tilescale_examples.testing.emulated`: ``N`` regions of
one device buffer, local memory standing in for NVLink) run at once, one stream each, with
real waits: each rank's ``AllReduce`` has a compiled kernel of its own
(:func:`~tilescale_examples.testing.emulated.build_concurrent`) and a grid of at most ``SMs /
N`` blocks, so every rank's blocks are resident together. One round (every rank's call, forked
from the current stream and joined back) is captured in a CUDA graph and replayed ``--iters``
times behind a stream hold: ``us`` is GPU time per round, i.e. per call with the ranks
concurrent. Then fresh inputs, poisoned outputs and one more replay, every rank's output
checked bit for bit against the rank-order reference (a failure is printed and makes the exit
status 1).

The ranks share one GPU's SMs and memory, so this is a proxy for latency-bound sizes (where
the flag rounds and launch costs, not the bytes, set the time), not a bandwidth measurement.
For every rank count it prints the largest size up to which the first algorithm of
``--algorithms`` beats the second at every size (with the defaults: the ``LAMPORT_MAX_BYTES``
entry that the measurement supports) beside the shipped entry.
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import format_bytes, print_table, ratio, size_sweep

__all__ = ["HEADERS", "ALGORITHMS", "build", "concurrent_round", "time_case", "largest_win", "summary_lines", "run",
           "main"]

#: The algorithms a run may compare (``AllReduce``'s forced ones).
ALGORITHMS = ("lamport", "one_shot", "two_shot")


def headers(algorithms) -> list:
    """The table's columns for ``algorithms``: ranks, size, ``<algorithm> us`` each, the first
    over the second, the check."""
    return (["ranks", "size"] + [f"{a} us" for a in algorithms]
            + ([f"{algorithms[0]}/{algorithms[1]}"] if len(algorithms) > 1 else []) + ["check"])


HEADERS = headers(("lamport", "one_shot"))


def build(n: int, nbytes: int, dtype, algorithm: str, device) -> tuple:
    """``(peers, ops, kernels)``: ``AllReduce`` of ``nbytes`` on ``n`` emulated ranks, each with
    a kernel of its own and at most ``SMs // n`` blocks."""
    import torch

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers, build_concurrent

    count = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    cap = max(1, torch.cuda.get_device_properties(device).multi_processor_count // n)
    kw = dict(algorithm=algorithm, max_blocks=cap)
    region = AllReduce.heap_bytes((count,), dtype, world_size=n, device=device, **kw) + ALIGNMENT
    peers = EmulatedPeers(n, region, device)
    try:
        ops, kernels = build_concurrent(lambda r: AllReduce(peers.rank(r), (count,), dtype, **kw), n)
    except BaseException:
        peers.close()
        raise
    return peers, ops, kernels


def concurrent_round(ops, xs, streams) -> list:
    """Every rank's call ``ops[r](xs[r])`` on its own stream ``streams[r]``, forked from the
    current stream and joined back to it; the ranks' outputs (rank order)."""
    import torch

    main = torch.cuda.current_stream()
    outs = []
    for op, x, stream in zip(ops, xs, streams):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            outs.append(op(x))
    for stream in streams:
        main.wait_stream(stream)
    return outs


def _inputs(ops, seed: int) -> list:
    import torch

    out = []
    for r, op in enumerate(ops):
        g = torch.Generator(device=op.device).manual_seed(seed * 1009 + r)
        out.append(torch.randn(op.shape, generator=g, device=op.device).to(op.dtype))
    return out


def time_case(n: int, nbytes: int, dtype, algorithm: str, iters: int, device) -> tuple:
    """``(us per round, failures)`` of one rank count, size and algorithm (see the module
    docstring): built, warmed up, captured, timed, checked, closed."""
    import torch

    from tilescale_examples.collectives.reduce_engine import torch_reference
    from tilescale_examples.testing.emulated import release_kernels

    peers, ops, kernels = build(n, nbytes, dtype, algorithm, device)
    try:
        xs = _inputs(ops, 0)
        streams = [torch.cuda.Stream(device) for _ in ops]
        ms, graph, outs = _timing.graph_ms_per_call(
            lambda: concurrent_round(ops, xs, streams), 1, iters,
            lambda replay, count: _timing.held_ms_per_launch(replay, count, device))
        fresh = _inputs(ops, 1)
        for x, f in zip(xs, fresh):
            x.copy_(f)
        for out in outs:
            _timing.poison_(out)
        graph.replay()
        torch.cuda.synchronize(device)
        want = torch_reference(fresh)
        failures = [f"{algorithm} {n} ranks {format_bytes(nbytes)} rank {r}: {int((out != want).sum())} wrong elements"
                    for r, out in enumerate(outs) if not torch.equal(out, want)]
        return ms * 1e3, failures
    finally:
        for op in ops:
            op.close()
        release_kernels(kernels)
        peers.close()


def largest_win(rows, first: int = 2, second: int = 3):
    """The largest size (bytes, from the rows' ``(ranks, size, ...)``: sizes in increasing
    order, ``size`` in bytes) up to which column ``first`` is smaller than column ``second``
    at every size; None when it loses at the smallest."""
    best = None
    for row in rows:
        if not row[first] < row[second]:
            break
        best = row[1]
    return best


def summary_lines(tables: dict, algorithms, shipped=None) -> list:
    """Per rank count: the largest size up to which ``algorithms[0]`` beat ``algorithms[1]``
    at every size, and ``shipped`` (``{ranks: bytes}``, the size table in use) beside it."""
    from tilescale_examples.base import size_table_entry

    lines = []
    for n, rows in tables.items():
        win = largest_win(rows)
        said = "at no size" if win is None else f"up to {format_bytes(win)}"
        table = "" if shipped is None else f" (shipped entry: {format_bytes(size_table_entry(shipped, n))})"
        lines.append(f"{n} ranks: {algorithms[0]} faster than {algorithms[1]} {said}{table}")
    return lines


def run(args, device) -> tuple:
    """``({ranks: rows}, failures)``: rows are :func:`headers`' columns with ``size`` in bytes."""
    import torch

    dtype = getattr(torch, args.dtype)
    tables, failures = {}, []
    for n in args.ranks:
        for nbytes in size_sweep(args.min_bytes, args.max_bytes, 2):
            times, bad = [], []
            for algorithm in args.algorithms:
                us, fails = time_case(n, nbytes, dtype, algorithm, args.iters, device)
                times.append(us)
                bad += fails
            extra = [ratio(times[0], times[1])] if len(times) > 1 else []
            tables.setdefault(n, []).append([n, nbytes] + times + extra + ["ok" if not bad else "FAIL"])
            failures += bad
    return tables, failures


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("concurrent", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="emulated rank counts (2 to 8)")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest all-reduce size (bytes)")
    p.add_argument("--max-bytes", type=int, default=256 << 10, help="largest all-reduce size (bytes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--algorithms", nargs="+", default=["lamport", "one_shot"], choices=ALGORITHMS,
                   help="the algorithms timed (the first is compared with the second)")
    p.add_argument("--iters", type=int, default=50, help="graph replays timed per case")
    args = _harness.parse_args(p, argv)
    if any(not 2 <= n <= 8 for n in args.ranks) or args.iters < 1:
        p.error("--ranks must be in [2, 8] and --iters >= 1")
    if not 16 <= args.min_bytes <= args.max_bytes:
        p.error("--min-bytes must be at least 16 and at most --max-bytes")
    if len(set(args.algorithms)) != len(args.algorithms):
        p.error("--algorithms must not repeat an algorithm")
    device = _harness.emulated_device(p, args, "concurrent")
    if device is None:
        return 0
    import torch

    from tilescale_examples.collectives.allreduce import LAMPORT_MAX_BYTES
    tables, failures = run(args, device)
    cols = headers(args.algorithms)
    for n, rows in tables.items():
        print_table(f"all-reduce, {n} emulated ranks running at once (one {torch.cuda.get_device_name(device)}), "
                    f"{args.dtype}; GPU time per round replayed from a CUDA graph ({args.iters} replays)", cols,
                    [[r[0], format_bytes(r[1])] + r[2:] for r in rows])
    for failure in failures[:20]:
        print("FAILED:", failure)
    shipped = LAMPORT_MAX_BYTES if args.algorithms[:2] == ["lamport", "one_shot"] else None
    for line in summary_lines(tables, args.algorithms, shipped) if len(args.algorithms) > 1 else []:
        print(line)
    print(f"correctness (every rank's output against the rank-order reference): "
          f"{'ok' if not failures else f'{len(failures)} FAILURE(S)'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
