"""The decode path's fused all-reduce + residual + RMSNorm against the unfused sequence, with emulated peers.

``python -m tilescale_examples.benchmarks.decode [--ranks 1 2 4 8] [--hidden 4096 8192]
[--tokens 1 2 4 ... 256] [--dtype bfloat16|float16] [--fp8 none|per_token|per_block]
[--algorithm one_shot|lamport] [--iters 50] [--threads 512] [--max-blocks B] [--eps 1e-6] [--out DIR]``

The method of :mod:`tilescale_examples.benchmarks.emulated`: one process, no process group;
``N`` emulated ranks are ``N`` regions of one device buffer
(:mod:`tilescale_examples.testing.emulated`) whose metadata tables map PE ``p`` to region
``p``, so the unchanged kernels run with local memory standing in for NVLink. Every emulated
rank's calls run alone on the GPU, in turn, with every peer's flags preset so that waits pass
at once: a time is one rank's share of the collective's data movement and compute, without
the flag latency between GPUs.

For every ``N``, hidden size and token count it times, per emulated rank, ``--iters``
back-to-back calls behind a stream hold (the host's launch cost is not counted;
:func:`~tilescale_examples.benchmarks._timing.held_ms_per_launch`), the mean over the ranks:

* ``fused us``: :class:`~tilescale_examples.decode.allreduce_norm.AllReduceResidualRMSNorm`
  (one kernel; with ``--fp8`` its FP8 output; ``--algorithm``: its exchange, ``lamport`` at
  ``--ranks 1`` only, since emulated ranks that run in turn cannot exchange data that is its
  own signal: :mod:`~tilescale_examples.benchmarks.concurrent` runs ranks at once);
* ``unfused us``: TileScale's one-shot :class:`~tilescale_examples.collectives.allreduce.AllReduce`
  (staging ``x`` in its kernel, as the fused kernel does), then torch's ``add`` and
  ``torch.nn.functional.rms_norm`` (with ``--fp8``, then the torch quantisation of
  :func:`~tilescale_examples.decode.reference.quantize_fp8`), back to back on one stream;
* ``fused/unfused``: the ratio (below 1: the fused kernel is faster).

Before timing, one round of fused calls (every emulated rank's, inputs staged beforehand:
rank 0 reads the buffers of ranks that have not run yet) is checked against the float32 torch
reference (:func:`~tilescale_examples.decode.reference.compare`); a failure is printed and
makes the exit status 1. One table per hidden size, x axis the tokens.

The goals (issue 43, one H200): at ``N`` = 2, 4, 8 the fused call takes at most 0.6 of the
unfused sequence, and at most 5 us at 1-16 tokens (printed at the end).
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _fused, _harness
from tilescale_examples.benchmarks._report import print_checked, ratio

__all__ = ["HEADERS", "GOAL_RATIO", "GOAL_US", "GOAL_TOKENS", "rank_inputs", "check_round", "unfused_call", "run_case",
           "goal_lines", "print_results", "run", "main"]

HEADERS = ["ranks", "tokens", "fused us", "unfused us", "fused/unfused", "check"]
#: The goals: fused / unfused at most GOAL_RATIO (N >= 2), fused at most GOAL_US up to GOAL_TOKENS tokens.
GOAL_RATIO, GOAL_US, GOAL_TOKENS = 0.6, 5.0, 16
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def rank_inputs(n: int, tokens: int, hidden: int, dtype, device, seed: int) -> list:
    """Every emulated rank's ``(x, residual, weight)``: normal values from ``seed`` (the weight
    around 1, as a trained norm's)."""
    import torch

    out = []
    for r in range(n):
        g = torch.Generator(device=device).manual_seed(seed * 1009 + r)
        x = torch.randn((tokens, hidden), generator=g, device=device).to(dtype)
        residual = torch.randn((tokens, hidden), generator=g, device=device).to(dtype)
        weight = (1 + 0.1 * torch.randn((hidden,), generator=g, device=device)).to(dtype)
        out.append((x, residual, weight))
    return out


def check_round(ops, inputs) -> list:
    """One call of every emulated rank (rank order, flags preset), each rank's ``x`` staged
    into the buffer its call uses beforehand, compared with the torch reference; returns
    failure messages (empty when every rank matches)."""
    import torch

    from tilescale_examples.decode.reference import compare
    from tilescale_examples.testing.emulated import run_round

    for op, (x, _, _) in zip(ops, inputs):
        if op.algorithm == "one_shot":  # (a Lamport exchange runs at one rank only here: no peers' rows)
            op.stages[(op.epoch + 1) % 2].view(-1).copy_(x.view(-1))  # the peers' rows rank 0 reads
    results = run_round(ops, call=lambda op: op(*inputs[op.rank]))
    torch.cuda.synchronize()
    bad = []
    for op, got in zip(ops, results):
        bad += compare(got, op.reference(inputs, op.rank), f"{op.world_size} ranks {op.shape} rank {op.rank}")
    return bad


def unfused_call(ar, x, residual, weight, eps: float, fp8):
    """The unfused sequence: ``ar(x)`` (TileScale's all-reduce), torch's add and ``rms_norm``,
    and with ``fp8`` the torch quantisation; returns the last result."""
    import torch

    from tilescale_examples.decode.reference import quantize_fp8

    h = ar(x) + residual
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps)
    return y if fp8 is None else quantize_fp8(y.float(), fp8)


def run_case(args, n: int, tokens: int, hidden: int, device) -> tuple:
    """``(fused ms, unfused ms, failures)`` of one case (the ops built, checked, timed, closed)."""
    import torch

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    dtype, fp8 = getattr(torch, args.dtype), args.fp8
    inputs = rank_inputs(n, tokens, hidden, dtype, device, seed=tokens * 31 + hidden + n)
    kw = dict(threads=args.threads, max_blocks=args.max_blocks)
    fused, bad = _fused.measure(AllReduceResidualRMSNorm, n, ((tokens, hidden), dtype), device,
                                lambda op: op(*inputs[op.rank]), args.iters, check=lambda ops: check_round(ops, inputs),
                                eps=args.eps, fp8=fp8, algorithm=args.algorithm, **kw)
    unfused, _ = _fused.measure(AllReduce, n, ((tokens, hidden), dtype), device,
                                lambda ar: unfused_call(ar, *inputs[ar.rank], args.eps, fp8), args.iters,
                                algorithm="one_shot", **kw)
    torch.cuda.empty_cache()
    return fused, unfused, bad


def run(args, device) -> tuple:
    """``({hidden: rows}, failures)`` of the whole sweep; a row is :data:`HEADERS`."""
    tables, failures = {}, []
    for hidden in args.hidden:
        rows = tables.setdefault(hidden, [])
        for n in args.ranks:
            for tokens in args.tokens:
                with _harness.watchdog(args.case_timeout, f"decode: {n} ranks, {tokens} tokens, hidden {hidden}"):
                    fused, unfused, bad = run_case(args, n, tokens, hidden, device)
                failures += bad
                rows.append([n, tokens, fused * 1e3, unfused * 1e3, ratio(fused, unfused), "ok" if not bad else "FAIL"])
    return tables, failures


def goal_lines(tables: dict) -> list:
    """The goals' lines: the worst ratio at ``N >= 2`` (goal <= :data:`GOAL_RATIO`) and the
    slowest fused call up to :data:`GOAL_TOKENS` tokens (goal <= :data:`GOAL_US`)."""
    rows = [r for rows in tables.values() for r in rows]
    ratios = [r[4] for r in rows if r[0] >= 2]
    small = [r[2] for r in rows if r[1] <= GOAL_TOKENS]
    worst = f"{max(ratios):.3f}" if ratios else "not measured"
    slowest = f"{max(small):.2f} us" if small else "not measured"
    return [f"worst fused/unfused at 2+ ranks: {worst} (goal <= {GOAL_RATIO})",
            f"slowest fused call at 1-{GOAL_TOKENS} tokens: {slowest} (goal <= {GOAL_US} us)"]


def print_results(tables: dict, failures: list, args, device_name: str) -> None:
    """One table per hidden size, the failures, the goals and the verdict."""
    fp8 = "" if args.fp8 is None else f" + FP8 {args.fp8}"
    quantise = "" if args.fp8 is None else ", torch quantisation"
    unfused = f"TileScale one-shot all-reduce, torch add, torch rms_norm{quantise}"
    exchange = "" if args.algorithm == "one_shot" else f", {args.algorithm} exchange"
    print_checked(tables, lambda hidden: f"all-reduce + residual + RMSNorm{fp8}, fused (one TileScale "
                  f"kernel{exchange}) vs "
                  f"unfused ({unfused}), hidden {hidden}", HEADERS, failures, goal_lines(tables),
                  "the float32 torch reference", args, device_name)


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.fused_parser("decode", __doc__.splitlines()[0], iters=50)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192], help="hidden sizes (elements per token)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts")
    p.add_argument("--fp8", default="none", choices=["none", "per_token", "per_block"], help="FP8 output")
    p.add_argument("--threads", type=int, default=512, help="threads per block of the kernels")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--algorithm", default="one_shot", choices=["one_shot", "lamport"],
                   help="the fused kernel's exchange (lamport: --ranks 1 only)")
    args = _harness.parse_args(p, argv)
    if any(t < 1 for t in args.tokens) or any(h < 8 or h % 8 for h in args.hidden) or args.iters < 1:
        p.error("--tokens and --iters must be >= 1 and --hidden a positive multiple of 8")
    if args.algorithm == "lamport" and args.ranks != [1]:
        p.error("--algorithm lamport runs with --ranks 1 only (emulated ranks run in turn here; "
                "benchmarks.concurrent runs them at once)")
    args.fp8 = None if args.fp8 == "none" else args.fp8
    device = _harness.emulated_device(p, args, "decode")
    if device is None:
        return 0
    import torch

    from tilescale_examples.decode.norm_kernel import norm_jobs
    from tilescale_examples.testing.precompile import precompile, reduction_jobs

    precompile(norm_jobs([args.dtype], args.ranks, args.hidden, [args.fp8], args.threads, [args.algorithm])
               + reduction_jobs(["one_shot"], [args.dtype], args.ranks, args.threads))  # in parallel: cache hits below
    tables, failures = run(args, device)
    print_results(tables, failures, args, torch.cuda.get_device_name(device))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
