"""GemmAllReduce across real ranks (one per GPU), with each reduction, against torch.matmul + an all-reduce.

``python -m tilescale_examples.benchmarks.gemm_allreduce_ranks [--ranks 2] [--m 1 16 64 128 256 512]
[--k 8192] [--n 8192] [--dtype bfloat16|float16] [--iters 20] [--rounds 5] [--out DIR]`` (under
``tilescale-run``: its ranks). Where :mod:`.gemm_allreduce` emulates the peers in one process,
this one spawns ``--ranks`` processes that read each other's tiles over the GPUs' links, so it
measures what the emulation leaves out: the flag latency between GPUs and the link's bandwidth,
which decide where the two-shot reduction (each rank reduces ``1 / W`` of every tile and pushes
it) overtakes the one-shot one (each rank reads every peer's whole tile).

For every ``m`` (``(m, k) @ (k, n)`` per rank, a row-parallel layer: every rank holds its
own ``a`` and ``b``), in rounds that time each column in turn (the median
round, the slowest rank), GPU time per call of ``--iters`` back-to-back calls:

* ``one-shot us``, ``two-shot us``: :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`
  with ``reduction="one_shot"`` / ``"two_shot"`` (``k`` whole in both);
* ``mm+AR us``: ``torch.matmul`` then TileScale's :class:`~tilescale_examples.collectives.allreduce.AllReduce`
  (its default algorithm) of the product;
* ``mm+NCCL us``: ``torch.matmul`` then ``torch.distributed.all_reduce`` (NCCL; ``n/a`` on gloo,
  when ranks share GPUs);
* ``mm us``: ``torch.matmul`` alone;
* the fused/baseline ratios and which reduction was the faster.

Every column's output is checked once against the exact float32 sum of every rank's product
(the bound of :func:`~tilescale_examples.decode.gemm_allreduce.compare`, made once per size;
the baselines with ``world_size`` times the rounding allowance, as they may round each partial
sum); a failure makes the exit status 1. The last line gives the value of
:data:`~tilescale_examples.decode.gemm_allreduce.TWO_SHOT_FROM_BYTES` for this rank count that
the table supports: the smallest output size (``m * n * itemsize``) from which two-shot was the
faster at that and every larger ``m`` measured (``None`` where it never was). Ranks sharing a
GPU run the same checks, but their times are no measurement (the title says so).
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _ranks, _timing
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["HEADERS", "M_SIZES", "COLUMNS", "two_shot_from_bytes", "jobs", "run", "main"]

#: The timed columns, in the table's order.
COLUMNS = ("one-shot", "two-shot", "mm+AR", "mm+NCCL", "mm")
HEADERS = (["m", "output", "one-shot us", "two-shot us", "mm+AR us", "mm+NCCL us", "mm us", "best/(mm+AR)",
            "best/(mm+NCCL)", "two-shot/one-shot", "check"])
M_SIZES = (1, 16, 64, 128, 256, 512)


def two_shot_from_bytes(rows) -> int | None:
    """The smallest output bytes from which the two-shot reduction was the faster at that and
    every larger size measured (``rows``: ``(output bytes, one-shot ms, two-shot ms)``), or
    None where it never was (the one-shot reduction everywhere)."""
    limit = None
    for nbytes, one, two in sorted(rows, reverse=True):
        if not two < one:
            break
        limit = nbytes
    return limit


def jobs(args, world: int, sms: int) -> list:
    """Precompile jobs of every kernel the ranks build (both reductions' GemmAllReduce at every
    ``m``, and the all-reduce kernels its ``"auto"`` may pick), for a grid cap of ``sms``."""
    from tilescale_examples.decode.gemm_allreduce import gemm_allreduce_jobs
    from tilescale_examples.testing.precompile import reduction_jobs

    fused = [job for reduction in ("one_shot", "two_shot")
             for job in gemm_allreduce_jobs(args.m, args.k, args.n, args.dtype, [world], sms, 1, reduction)]
    return fused + reduction_jobs(["one_shot", "two_shot", "lamport"], [args.dtype], [world])


def _inputs(p: int, m: int, k: int, n: int, dtype, device):
    """Rank ``p``'s ``(a, b)`` (any rank rebuilds any rank's, on the device), scaled so that
    the output is about 1."""
    import torch

    g = torch.Generator(device=device).manual_seed(1009 * m + p)
    return (torch.randn((m, k), generator=g, device=device).to(dtype),
            (torch.randn((k, n), generator=g, device=device) / k ** 0.5).to(dtype))


def _measure(rank: int, world: int, group, device, m: int, args) -> tuple:
    """``(row, timings, failures)`` of one ``m`` (every rank makes the same collectives)."""
    import torch
    import torch.distributed as dist

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce, partial_magnitudes
    from tilescale_examples.overlap.gemm_bounds import count_outside

    dtype, k, n = getattr(torch, args.dtype), args.k, args.n
    specs = {"one-shot": dict(reduction="one_shot", split_k=1), "two-shot": dict(reduction="two_shot", split_k=1)}
    heap = sum(GemmAllReduce.heap_bytes(m, k, n, dtype, world_size=world, device=device, **kw) for kw in specs.values())
    heap += AllReduce.heap_bytes((m, n), dtype, world_size=world, device=device)
    alloc = _ranks.open_heap(rank, world, group, device, heap)
    fused = {name: GemmAllReduce(alloc, m, k, n, dtype, group=group, **kw) for name, kw in specs.items()}
    ar = AllReduce(alloc, (m, n), dtype, group=group)
    every = [_inputs(p, m, k, n, dtype, device) for p in range(world)]
    a, b = every[rank]
    nccl = dist.get_backend(group) == "nccl"

    def nccl_call():
        out = torch.matmul(a, b)
        dist.all_reduce(out, group=group)
        return out

    calls = {"one-shot": lambda: fused["one-shot"](a, b), "two-shot": lambda: fused["two-shot"](a, b),
             "mm+AR": lambda: ar(torch.matmul(a, b)), "mm+NCCL": nccl_call if nccl else None,
             "mm": lambda: torch.matmul(a, b)}
    failures = []
    exact = sum(x.float() @ y.float() for x, y in every)  # compare's reference and bound, made once
    rounded = partial_magnitudes(every)
    for name in ("one-shot", "two-shot", "mm+AR", "mm+NCCL"):
        if calls[name] is None:
            continue
        out = calls[name]().clone()
        torch.cuda.synchronize(device)
        # compare's bound for the fused op; a baseline may round each partial sum: world times it
        bad, worst = count_outside(out, exact, dtype, rounded if name in fused else world * rounded)
        if bad:
            failures.append(f"rank {rank}/{world} m {m} {name}: {bad} elements outside the error bound "
                            f"(worst {worst:.3g}x)")
    times = _timing.interleaved_ms({name: fn for name, fn in calls.items() if fn is not None}, args.iters,
                                   args.rounds, group, device)
    failures = _ranks.close_case((*fused.values(), ar), alloc, failures, group, device)
    us = {name: times[name] * 1e3 if name in times else "n/a" for name in COLUMNS}
    best = min(us["one-shot"], us["two-shot"])
    row = [m, m * n * dtype.itemsize, *(us[c] for c in COLUMNS), ratio(best, us["mm+AR"]),
           ratio(best, us["mm+NCCL"]) if nccl else "n/a", ratio(us["two-shot"], us["one-shot"]),
           "ok" if not failures else "FAIL"]
    return row, (m * n * dtype.itemsize, times["one-shot"], times["two-shot"]), failures


def run(rank: int, world: int, group, device, args):
    """One rank's part: ``(rows, size rows, failures)`` on rank 0, None elsewhere."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
    rows, sizes, failures = [], [], []
    for m in args.m:
        row, size, bad = _measure(rank, world, group, device, m, args)
        rows.append(row)
        sizes.append(size)
        failures += bad
    return (rows, sizes, failures) if rank == 0 else None


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("gemm_allreduce_ranks", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn, one per GPU (ignored under tilescale-run)")
    p.add_argument("--m", type=int, nargs="+", default=list(M_SIZES), help="rows of a (tokens)")
    p.add_argument("--k", type=int, default=8192, help="columns of a (a multiple of 64)")
    p.add_argument("--n", type=int, default=8192, help="columns of b and the output (a multiple of 64)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20, help="timed back-to-back calls per column and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over every column; each column's median counts")
    args = _harness.parse_args(p, argv)
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (one rank has nothing to reduce: see benchmarks.gemm_allreduce)")
    if any(m < 1 for m in args.m) or args.iters < 1 or args.rounds < 1:
        p.error("--m, --iters and --rounds must be positive")
    if args.k < 64 or args.k % 64 or args.n < 64 or args.n % 64:
        p.error("--k and --n must be positive multiples of 64")
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
    ran = _ranks.spawn(run, args, lambda world: jobs(args, world, sms), "GemmAllReduce across ranks")
    if ran is None:
        return 0
    (rows, sizes, failures), world, mode = ran
    print_table(f"GEMM + all-reduce across {world} ranks, fused (one-shot and two-shot) vs torch.matmul + all-reduce, "
                f"{args.dtype}, k {args.k}, n {args.n}; {mode}; GPU us per call", HEADERS, rows)
    print(f"two-shot from bytes at {world} ranks (TWO_SHOT_FROM_BYTES[{world}]): {two_shot_from_bytes(sizes)}")
    return _ranks.verdict(failures, "every column vs the exact float32 sum")

if __name__ == "__main__":
    raise SystemExit(main())
