"""The fused all-reduce + residual + RMSNorm across real ranks (one per GPU) against an all-reduce then torch's ops.

``python -m tilescale_examples.benchmarks.decode_ranks [--ranks 2] [--hidden 8192] [--tokens 1 4
16 64 256] [--dtype bfloat16|float16] [--iters 50] [--rounds 5] [--eps 1e-6] [--out DIR]`` (under
``tilescale-run``: its ranks). Where :mod:`.decode` emulates the peers in one process, this
one spawns ``--ranks`` processes that exchange rows over the GPUs' links: the comparison issue
43 leaves to a machine with several GPUs.

For every token count, in rounds that time each column in turn (the median round, the slowest
rank), GPU time per call of ``--iters`` back-to-back calls:

* ``one-shot us``, ``lamport us``: :class:`~tilescale_examples.decode.allreduce_norm.AllReduceResidualRMSNorm`
  with ``algorithm="one_shot"`` (a flag round) / ``"lamport"`` (the data is its own signal);
* ``AR+torch us``: TileScale's :class:`~tilescale_examples.collectives.allreduce.AllReduce`
  (its default algorithm), then ``add`` and ``torch.nn.functional.rms_norm``;
* ``symm+torch us``: ``x`` copied into a symmetric-memory buffer, torch's
  ``one_shot_all_reduce``, then the same torch ops (``n/a`` where torch or the group lacks it);
* ``NCCL+torch us``: ``torch.distributed.all_reduce`` of a copy of ``x``, then the same torch ops;
* the fastest fused call over each baseline.

The fused calls are checked against the float32 torch reference
(:func:`~tilescale_examples.decode.reference.compare`: ``residual_out`` bit for bit); the
baselines, which round the all-reduced sum before the add, within 2% of it. A failure makes the
exit status 1. Ranks sharing a GPU run the same checks, but their times are no measurement (the
title says so).
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _ranks, _timing
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["HEADERS", "COLUMNS", "TOKENS", "BASELINE_RTOL", "jobs", "run", "main"]

#: The timed columns, in the table's order (the first two fused).
COLUMNS = ("one-shot", "lamport", "AR+torch", "symm+torch", "NCCL+torch")
HEADERS = (["tokens", "one-shot us", "lamport us", "AR+torch us", "symm+torch us", "NCCL+torch us", "best/(AR+torch)",
            "best/(symm+torch)", "best/(NCCL+torch)", "check"])
TOKENS = (1, 4, 16, 64, 256)
#: The baselines' allowance against the reference (relative to the largest ``|y|``): they round
#: the all-reduced sum to the dtype before the add.
BASELINE_RTOL = 2e-2


def jobs(args, world: int) -> list:
    """Precompile jobs of every kernel the ranks build: the fused norm's two exchanges and the
    all-reduce kernels its ``"auto"`` may pick."""
    from tilescale_examples.decode.norm_kernel import norm_jobs
    from tilescale_examples.testing.precompile import reduction_jobs

    return (norm_jobs([args.dtype], [world], [args.hidden], exchanges=["one_shot", "lamport"])
            + reduction_jobs(["one_shot", "two_shot", "lamport"], [args.dtype], [world]))


def _inputs(p: int, tokens: int, hidden: int, dtype, device) -> tuple:
    """Rank ``p``'s ``(x, residual, weight)``: its partial sum, the residual and the norm's
    weight (both replicated in a tensor-parallel model: the same on every rank), on the device."""
    import torch

    g = torch.Generator(device=device).manual_seed(7919 * tokens + p)
    shared = torch.Generator(device=device).manual_seed(104729 * tokens + hidden)
    return (torch.randn((tokens, hidden), generator=g, device=device).to(dtype),
            torch.randn((tokens, hidden), generator=shared, device=device).to(dtype),
            (1 + 0.1 * torch.randn(hidden, generator=shared, device=device)).to(dtype))


def _symm_all_reduce(x, group):
    """A zero-argument call of torch symmetric memory's one-shot all-reduce of ``x`` (copied
    into a symmetric buffer first), or a string saying why there is none."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) != "nccl":
        return "n/a (ranks share a GPU)"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, name)
        fn = torch.ops.symm_mem.one_shot_all_reduce
    except Exception as exc:  # an older torch, a group without symmetric memory
        return f"n/a ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})"

    def call():
        buf.copy_(x)
        return fn(buf, "sum", name)

    return call


def _measure(rank: int, world: int, group, device, tokens: int, args) -> tuple:
    """``(row, failures, notes)`` of one token count (every rank makes the same collectives)."""
    import torch
    import torch.distributed as dist

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm
    from tilescale_examples.decode.reference import compare, torch_reference

    dtype, hidden, eps = getattr(torch, args.dtype), args.hidden, args.eps
    shape = (tokens, hidden)
    heap = sum(AllReduceResidualRMSNorm.heap_bytes(shape, dtype, world_size=world, device=device, algorithm=a)
               for a in ("one_shot", "lamport"))
    heap += AllReduce.heap_bytes(shape, dtype, world_size=world, device=device)
    alloc = _ranks.open_heap(rank, world, group, device, heap)
    fused = {a: AllReduceResidualRMSNorm(alloc, shape, dtype, algorithm=a, eps=eps, group=group)
             for a in ("one_shot", "lamport")}
    ar = AllReduce(alloc, shape, dtype, group=group)
    every = [_inputs(p, tokens, hidden, dtype, device) for p in range(world)]
    x, residual, weight = every[rank]

    def torch_tail(total):
        h = total + residual
        return torch.nn.functional.rms_norm(h, (hidden,), weight, eps)

    def nccl():
        total = x.clone()
        dist.all_reduce(total, group=group)
        return torch_tail(total)

    symm = _symm_all_reduce(x, group)
    calls = {"one-shot": lambda: fused["one_shot"](x, residual, weight),
             "lamport": lambda: fused["lamport"](x, residual, weight),
             "AR+torch": lambda: torch_tail(ar(x)),
             "symm+torch": (lambda: torch_tail(symm())) if callable(symm) else None,
             "NCCL+torch": nccl if dist.get_backend(group) == "nccl" else None}
    notes = {} if callable(symm) else {"symm+torch": symm}
    want = torch_reference(every, rank, eps=eps)
    failures = []
    for name, fn in calls.items():
        if fn is None:
            continue
        got = fn()
        torch.cuda.synchronize(device)
        what = f"rank {rank}/{world} tokens {tokens} {name}"
        if name in ("one-shot", "lamport"):
            failures += compare([t.clone() for t in got], want, what)
        else:
            err = (got.float() - want[0].float()).abs().max().item()
            scale = want[0].float().abs().max().item()
            if not err <= BASELINE_RTOL * scale:  # NaN fails
                failures.append(f"{what}: max error {err:.3g} > {BASELINE_RTOL} x max |y| {scale:.3g}")
    times = _timing.interleaved_ms({n: fn for n, fn in calls.items() if fn is not None}, args.iters, args.rounds,
                                   group, device)
    failures = _ranks.close_case((*fused.values(), ar), alloc, failures, group, device)
    us = {name: times[name] * 1e3 if name in times else "n/a" for name in COLUMNS}
    best = min(us["one-shot"], us["lamport"])
    row = [tokens, *(us[c] for c in COLUMNS),
           *(ratio(best, us[c]) if c in times else "n/a" for c in ("AR+torch", "symm+torch", "NCCL+torch")),
           "ok" if not failures else "FAIL"]
    return row, failures, notes


def run(rank: int, world: int, group, device, args):
    """One rank's part: ``(rows, failures, notes)`` on rank 0, None elsewhere."""
    rows, failures, notes = [], [], {}
    for tokens in args.tokens:
        row, bad, why = _measure(rank, world, group, device, tokens, args)
        rows.append(row)
        failures += bad
        notes.update(why)
    return (rows, failures, notes) if rank == 0 else None


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("decode_ranks", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn, one per GPU (ignored under tilescale-run)")
    p.add_argument("--hidden", type=int, default=8192, help="channels per token (a multiple of 8)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per call")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=50, help="timed back-to-back calls per column and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over every column; each column's median counts")
    p.add_argument("--eps", type=float, default=1e-6)
    args = _harness.parse_args(p, argv)
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (one rank has nothing to reduce: see benchmarks.decode)")
    if any(t < 1 for t in args.tokens) or args.iters < 1 or args.rounds < 1:
        p.error("--tokens, --iters and --rounds must be positive")
    if args.hidden < 8 or args.hidden % 8:
        p.error("--hidden must be a positive multiple of 8")
    ran = _ranks.spawn(run, args, lambda world: jobs(args, world), "the fused norm across ranks")
    if ran is None:
        return 0
    (rows, failures, notes), world, mode = ran
    print_table(f"All-reduce + residual + RMSNorm across {world} ranks, fused (one-shot and Lamport) vs an all-reduce "
                f"then torch add + rms_norm, {args.dtype}, hidden {args.hidden}; {mode}; GPU us per call",
                HEADERS, rows)
    for name, why in sorted(notes.items()):
        print(f"{name}: {why}")
    return _ranks.verdict(failures, f"fused: the float32 reference; baselines: within {BASELINE_RTOL} of it")

if __name__ == "__main__":
    raise SystemExit(main())
