"""All-reduce algorithms with emulated ranks running at the same time: the evidence for the size tables.

``python -m tilescale_examples.benchmarks.concurrent [--op allreduce|norm] [--ranks 2 4 8]
[--min-bytes 4096] [--max-bytes 262144] [--hidden 4096] [--dtype bfloat16]
[--algorithms lamport one_shot] [--iters 50] [--launch graph|eager] [--case-timeout 120] [--out DIR]``

The emulated peers of :mod:`~tilescale_examples.benchmarks.emulated` run one after the other
with their flags preset, so they measure a kernel's bytes per second and never its waits; a
flagless kernel (``algorithm="lamport"``, whose data is its own signal) cannot run that way
at all. Here ``N`` emulated ranks (:mod:`tilescale_examples.testing.emulated`: ``N`` regions of one
device buffer, local memory standing in for NVLink) run at once, one stream each, with real
waits: each rank's op (``--op allreduce``: ``AllReduce`` of ``size`` bytes; ``norm``:
``AllReduceResidualRMSNorm`` of ``size / (hidden * itemsize)`` token rows of ``--hidden``,
``size`` the bytes of its ``x``) has a compiled kernel of its own
(:func:`~tilescale_examples.testing.emulated.build_concurrent`) and a grid of at most ``SMs /
N`` blocks, so every rank's blocks are resident together. Every rank's call is captured in a
CUDA graph of its own (:func:`captured_round`); one round (every rank's graph replayed on its
own stream, forked from the current stream and joined back) is launched ``--iters`` times
behind a stream hold (``--launch eager``: ``--iters`` rounds launched eagerly behind the hold):
``us`` is GPU time per round, i.e. per call with the ranks concurrent. Then fresh inputs,
poisoned outputs and one more round, every rank's output checked bit for bit against the
rank-order reference (a failure is printed and makes the exit status 1; the norm's outputs
against its float32 torch reference, ``residual_out`` bit for bit).

Every rank's kernel is loaded before the ranks run at once (:func:`preload`): a kernel's first
launch loads its module, and a load may synchronise the whole CUDA context, so a rank whose
kernel loads while another rank's kernel waits for it would never launch. A case that does not
finish within ``--case-timeout`` seconds ends the run with the case named
(:func:`~tilescale_examples.benchmarks._harness.watchdog`). The run sets
``CUDA_DEVICE_MAX_CONNECTIONS`` to :data:`MAX_CONNECTIONS` unless it is set: streams that share a
hardware queue run one after the other.

The ranks share one GPU's SMs and memory, so this is a proxy for latency-bound sizes (where
the flag rounds and launch costs, not the bytes, set the time), not a bandwidth measurement.
For every rank count it prints the largest size up to which the first algorithm of
``--algorithms`` beats the second at every size (with the defaults: the ``LAMPORT_MAX_BYTES``
entry that the measurement supports) beside the shipped entry.
"""

from __future__ import annotations

import contextlib
import functools
import math

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import format_bytes, print_table, ratio, size_sweep

__all__ = ["HEADERS", "ALGORITHMS", "OPS", "shape_of", "sizes", "build", "built", "on_streams", "concurrent_round",
           "captured_round", "pass_every_wait", "preload", "time_case", "largest_win", "summary_lines", "kernel_jobs",
           "run", "main"]

#: The algorithms a run may compare (``AllReduce``'s forced ones; the norm takes the first two).
ALGORITHMS = ("lamport", "one_shot", "two_shot")
#: The ops a run may time (``--op``).
OPS = ("allreduce", "norm")
#: ``CUDA_DEVICE_MAX_CONNECTIONS`` of a run (unless set): CUDA's largest number of hardware
#: queues, so that the ranks' streams (up to 8, and the main stream) never share one.
MAX_CONNECTIONS = 32


def headers(algorithms) -> list:
    """The table's columns for ``algorithms``: ranks, size, ``<algorithm> us`` each, the first
    over the second, the check."""
    return (["ranks", "size"] + [f"{a} us" for a in algorithms]
            + ([f"{algorithms[0]}/{algorithms[1]}"] if len(algorithms) > 1 else []) + ["check"])


HEADERS = headers(("lamport", "one_shot"))


def shape_of(op: str, nbytes: int, itemsize: int, hidden: int) -> tuple:
    """The op's shape for ``nbytes`` of input per rank: ``(elements,)`` for the all-reduce,
    ``(tokens, hidden)`` for the norm (at least one of each)."""
    if op == "allreduce":
        return (max(1, nbytes // itemsize),)
    return (max(1, nbytes // (hidden * itemsize)), hidden)


def build(n: int, nbytes: int, dtype, algorithm: str, device, op: str = "allreduce", hidden: int = 4096) -> tuple:
    """``(peers, ops, kernels)``: ``op`` (:data:`OPS`) of ``nbytes`` of input on ``n`` emulated
    ranks, each with a kernel of its own and at most ``SMs // n`` blocks."""
    import torch

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm
    from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers, build_concurrent

    cls = AllReduce if op == "allreduce" else AllReduceResidualRMSNorm
    shape = shape_of(op, nbytes, torch.empty((), dtype=dtype).element_size(), hidden)
    cap = max(1, torch.cuda.get_device_properties(device).multi_processor_count // n)
    kw = dict(algorithm=algorithm, max_blocks=cap)
    region = cls.heap_bytes(shape, dtype, world_size=n, device=device, **kw) + ALIGNMENT
    peers = EmulatedPeers(n, region, device)
    try:
        ops, kernels = build_concurrent(lambda r: cls(peers.rank(r), shape, dtype, **kw), n)
    except BaseException:
        peers.close()
        raise
    return peers, ops, kernels


def on_streams(calls, streams) -> list:
    """``call()`` of every one of ``calls`` on its stream of ``streams``, forked from the
    current stream and joined back to it; their results, in order."""
    import torch

    main = torch.cuda.current_stream()
    results = []
    for call, stream in zip(calls, streams):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            results.append(call())
    for stream in streams:
        main.wait_stream(stream)
    return results


def _flat(results) -> list:
    """The ranks' output tensors, flat, rank order (a call returning a tuple gives each of its
    tensors)."""
    return [t for got in results for t in (got if isinstance(got, tuple) else (got,))]


def concurrent_round(ops, args, streams) -> list:
    """Every rank's call ``ops[r](*args[r])`` on its own stream ``streams[r]``
    (:func:`on_streams`); the ranks' output tensors, flat, rank order (a call returning a
    tuple gives each of its tensors)."""
    return _flat(on_streams([functools.partial(op, *call_args) for op, call_args in zip(ops, args)], streams))


def captured_round(ops, args, streams) -> tuple:
    """``(replay, outs)``: one eager :func:`concurrent_round` (warm-up), then every rank's call
    captured into a CUDA graph of its own on its own stream, as each process of a real run
    captures its own. ``replay()`` launches one round: every rank's graph on its stream
    (:func:`on_streams`). ``outs`` (flat, rank order) are written only by replays (poisoned
    after the capture).

    One graph holding every rank's call would not do: CUDA does not promise to run a graph's
    independent branches at the same time, and a branch that waits for a later one never ends."""
    import torch

    concurrent_round(ops, args, streams)
    torch.cuda.synchronize()
    graphs, results = [], []
    for op, call_args, stream in zip(ops, args, streams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            results.append(op(*call_args))
        graphs.append(graph)
    outs = _flat(results)
    for out in outs:
        _timing.poison_(out)

    def replay():
        on_streams([graph.replay for graph in graphs], streams)

    return replay, outs


def pass_every_wait(ops) -> None:
    """Make every wait of the ops' next calls pass at its first poll, for ranks run one after
    the other: flags preset above any epoch (:data:`~tilescale_examples.testing.emulated.PRESET`),
    Lamport receive buffers zeroed (any value but the sentinel reads as arrived). The ops'
    buffers are then no longer fresh: :func:`preload` closes them after its round."""
    import torch

    from tilescale_examples.testing.emulated import PRESET

    for op in ops:
        if op.flags is not None:
            op.flags.view(torch.int64).fill_(PRESET)
        if op.algorithm == "lamport":
            op.stage_buffer.zero_()


@contextlib.contextmanager
def built(n: int, nbytes: int, dtype, algorithm: str, device, op: str = "allreduce", hidden: int = 4096):
    """:func:`build`'s ops for the body, then every op closed, the kernels released and the
    peers closed (whatever the body raised)."""
    from tilescale_examples.testing.emulated import release_kernels

    peers, ops, kernels = build(n, nbytes, dtype, algorithm, device, op, hidden)
    try:
        yield ops
    finally:
        for each in ops:
            each.close()
        release_kernels(kernels)
        peers.close()


def preload(n: int, nbytes: int, dtype, algorithm: str, device, op: str = "allreduce", hidden: int = 4096) -> None:
    """Load the kernel of every one of ``n`` emulated ranks (:func:`build`'s ops) while no
    kernel waits: one call per rank, one after the other on the current stream, every wait
    preset to pass (:func:`pass_every_wait`), then the ops closed. At once, the ranks' first
    launches would deadlock: a first launch loads the kernel's module, which may synchronise
    the CUDA context, i.e. wait for another rank's kernel that waits for this one. The
    kernels stay loaded (and cached) for every later case of ``n`` ranks and ``algorithm``."""
    import torch

    from tilescale_examples.testing.emulated import run_round

    with built(n, nbytes, dtype, algorithm, device, op, hidden) as ops:
        args = _inputs(ops, 0)
        run_round(ops, lambda c: c(*args[c.allocator.local_rank]), preset=pass_every_wait)
        torch.cuda.synchronize(device)


def _inputs(ops, seed: int) -> list:
    """Every rank's call arguments, normal values from ``seed``: ``(x,)`` for the all-reduce,
    the norm's ``(x, residual, weight)`` from :func:`benchmarks.decode.rank_inputs
    <tilescale_examples.benchmarks.decode.rank_inputs>`."""
    import torch

    op = ops[0]
    if hasattr(op, "residual_output"):  # the norm
        from tilescale_examples.benchmarks.decode import rank_inputs

        return rank_inputs(len(ops), op.tokens, op.hidden, op.dtype, op.device, seed)
    return [(torch.randn(op.shape, generator=torch.Generator(device=op.device).manual_seed(seed * 1009 + r),
                         device=op.device).to(op.dtype),) for r in range(len(ops))]


def _failures(ops, outs, inputs, what: str) -> list:
    """Failure messages of every rank's outputs (``outs`` flat, as :func:`concurrent_round`
    returns them) against the reference of ``inputs``: the all-reduce bit for bit, the norm by
    :func:`~tilescale_examples.decode.reference.compare`."""
    import torch

    from tilescale_examples.collectives.reduce_engine import torch_reference
    from tilescale_examples.decode.reference import compare

    per = len(outs) // len(ops)
    want = torch_reference([args[0] for args in inputs]) if per == 1 else None  # every rank's sum
    bad = []
    for r, op in enumerate(ops):
        got = outs[r * per:(r + 1) * per]
        if per == 1:
            if not torch.equal(got[0], want):
                bad.append(f"{what} rank {r}: {int((got[0] != want).sum())} wrong elements")
        else:
            bad += compare(got, op.reference(inputs, r), f"{what} rank {r}")
    return bad


def time_case(n: int, nbytes: int, dtype, algorithm: str, iters: int, device, op: str = "allreduce",
              hidden: int = 4096, graph: bool = True) -> tuple:
    """``(us per round, failures)`` of one op, rank count, size and algorithm (see the module
    docstring): built, warmed up, captured (``graph``: :func:`captured_round`; else every round
    launched eagerly, the ranks' launches behind the same stream hold), timed, checked, closed."""
    import torch

    with built(n, nbytes, dtype, algorithm, device, op, hidden) as ops:
        args = _inputs(ops, 0)
        streams = [torch.cuda.Stream(device) for _ in ops]

        def one_round():
            return concurrent_round(ops, args, streams)

        def held(launch, count):
            return _timing.held_ms_per_launch(launch, count, device)

        if graph:
            again, outs = captured_round(ops, args, streams)
            ms = held(again, iters)
        else:
            outs = one_round()  # warm-up; every round writes the ops' own outputs
            ms, again = held(one_round, iters), one_round
        fresh = _inputs(ops, 1)
        for used, new in zip(args, fresh):
            for t, f in zip(used, new):
                t.copy_(f)
        for out in outs:
            _timing.poison_(out)
        again()
        torch.cuda.synchronize(device)
        return ms * 1e3, _failures(ops, outs, fresh, f"{op} {algorithm} {n} ranks {format_bytes(nbytes)}")


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


def sizes(args, itemsize: int) -> list:
    """The input bytes per rank of the sweep: ``--min-bytes`` to ``--max-bytes`` doubling, each
    as the op's shape holds it (the norm: whole token rows), repeats left out."""
    out = []
    for nbytes in size_sweep(args.min_bytes, args.max_bytes, 2):
        size = math.prod(shape_of(args.op, nbytes, itemsize, args.hidden)) * itemsize
        if size not in out:
            out.append(size)
    return out


def kernel_jobs(op: str, algorithms, dtype: str, ranks, hidden: int) -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of every kernel a run
    builds: the ``op``'s kernel of each algorithm (``dtype`` a name, ``hidden`` the norm's) for
    each rank count ``n``, with its ``n - 1`` copies (every emulated rank compiles one of its
    own); the sizes are run-time arguments."""
    from tilescale_examples.decode.norm_kernel import norm_jobs
    from tilescale_examples.testing.precompile import reduction_jobs, with_copies

    jobs = []
    for n in ranks:
        per_rank = (reduction_jobs(algorithms, [dtype], [n]) if op == "allreduce"
                    else norm_jobs([dtype], [n], [hidden], exchanges=tuple(algorithms)))
        jobs += with_copies(per_rank, n)
    return jobs


def run(args, device, done=None) -> tuple:
    """``({ranks: rows}, failures)``: rows are :func:`headers`' columns with ``size`` in bytes.
    Every kernel is compiled first, in parallel (:func:`kernel_jobs`). ``done(n, rows)`` is
    called as soon as every size of ``n`` ranks has run (so a later rank count that never ends
    loses only its own rows)."""
    import torch

    from tilescale_examples.testing.precompile import precompile

    dtype = getattr(torch, args.dtype)
    precompile(kernel_jobs(args.op, args.algorithms, args.dtype, args.ranks, args.hidden))
    sweep = sizes(args, torch.empty((), dtype=dtype).element_size())
    tables, failures = {}, []
    for n in args.ranks:
        for algorithm in args.algorithms:
            with _harness.watchdog(args.case_timeout, f"loading {args.op} {algorithm} on {n} emulated ranks"):
                preload(n, sweep[0], dtype, algorithm, device, args.op, args.hidden)
        for nbytes in sweep:
            times, bad = [], []
            for algorithm in args.algorithms:
                with _harness.watchdog(args.case_timeout, f"{args.op} {algorithm}, {n} ranks at once, "
                                                          f"{format_bytes(nbytes)}"):
                    us, fails = time_case(n, nbytes, dtype, algorithm, args.iters, device, args.op, args.hidden,
                                          graph=args.launch == "graph")
                times.append(us)
                bad += fails
            extra = [ratio(times[0], times[1])] if len(times) > 1 else []
            tables.setdefault(n, []).append([n, nbytes] + times + extra + ["ok" if not bad else "FAIL"])
            failures += bad
        if done is not None:
            done(n, tables[n])
    return tables, failures


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("concurrent", __doc__.splitlines()[0])
    p.add_argument("--op", default="allreduce", choices=OPS, help="the op timed (norm: AllReduceResidualRMSNorm)")
    p.add_argument("--hidden", type=int, default=4096, help="the norm's hidden size (elements per token)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="emulated rank counts (2 to 8)")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest all-reduce size (bytes)")
    p.add_argument("--max-bytes", type=int, default=256 << 10, help="largest all-reduce size (bytes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="element type (the norm: bfloat16 or float16)")
    p.add_argument("--algorithms", nargs="+", default=["lamport", "one_shot"], choices=ALGORITHMS,
                   help="the algorithms timed (the first is compared with the second)")
    p.add_argument("--iters", type=int, default=50, help="graph replays timed per case")
    p.add_argument("--launch", default="graph", choices=["graph", "eager"],
                   help="each round replayed from a CUDA graph, or launched eagerly (behind the same stream hold)")
    _harness.add_case_timeout(p)
    args = _harness.parse_args(p, argv)
    if any(not 2 <= n <= 8 for n in args.ranks) or args.iters < 1:
        p.error("--ranks must be in [2, 8] and --iters >= 1")
    if not 16 <= args.min_bytes <= args.max_bytes:
        p.error("--min-bytes must be at least 16 and at most --max-bytes")
    if len(set(args.algorithms)) != len(args.algorithms):
        p.error("--algorithms must not repeat an algorithm")
    if args.op == "norm" and ("two_shot" in args.algorithms or args.dtype == "float32"):
        p.error("--op norm takes --algorithms lamport and one_shot and --dtype bfloat16 or float16")
    if args.hidden < 8 or args.hidden % 8:
        p.error("--hidden must be a positive multiple of 8")
    # every rank's stream on a hardware queue of its own (read when the CUDA context is made): two
    # streams sharing a queue run one after the other, and ranks that wait for each other then never end
    device = _harness.emulated_device(p, args, "concurrent",
                                      environ={"CUDA_DEVICE_MAX_CONNECTIONS": str(MAX_CONNECTIONS)})
    if device is None:
        return 0
    import torch

    from tilescale_examples.collectives.allreduce import LAMPORT_MAX_BYTES
    from tilescale_examples.decode import allreduce_norm

    table = LAMPORT_MAX_BYTES if args.op == "allreduce" else allreduce_norm.LAMPORT_MAX_BYTES
    shipped = table if args.algorithms[:2] == ["lamport", "one_shot"] else None
    what = "all-reduce" if args.op == "allreduce" else f"all-reduce + residual + RMSNorm, hidden {args.hidden}"

    def show(n: int, rows: list) -> None:  # each rank count's table and summary line as soon as it is done
        print_table(f"{what}, {n} emulated ranks running at once (one {torch.cuda.get_device_name(device)}), "
                    f"{args.dtype}; GPU time per round "
                    + (f"replayed from a CUDA graph ({args.iters} replays)" if args.launch == "graph"
                       else f"launched eagerly ({args.iters} rounds behind a stream hold)"),
                    headers(args.algorithms), [[r[0], format_bytes(r[1])] + r[2:] for r in rows])
        for line in summary_lines({n: rows}, args.algorithms, shipped) if len(args.algorithms) > 1 else []:
            print(line, flush=True)

    tables, failures = run(args, device, show)
    for failure in failures[:20]:
        print("FAILED:", failure)
    print(f"correctness (every rank's output against the rank-order reference): "
          f"{'ok' if not failures else f'{len(failures)} FAILURE(S)'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
