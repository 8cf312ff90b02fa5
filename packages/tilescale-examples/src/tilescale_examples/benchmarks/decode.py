"""The decode path's fused all-reduce + residual + RMSNorm against the unfused sequence, with emulated peers.

``python -m tilescale_examples.benchmarks.decode [--ranks 1 2 4 8] [--hidden 4096 8192]
[--tokens 1 2 4 ... 256] [--dtype bfloat16|float16] [--fp8 none|per_token|per_block]
[--iters 50] [--threads 512] [--max-blocks B] [--eps 1e-6] [--out DIR]``

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
  (one kernel; with ``--fp8`` its FP8 output);
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

import os
import statistics

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["HEADERS", "GOAL_RATIO", "GOAL_US", "GOAL_TOKENS", "build", "rank_inputs", "check_round", "unfused_call",
           "time_ranks", "run_case", "goal_lines", "print_results", "run", "main"]

HEADERS = ["ranks", "tokens", "fused us", "unfused us", "fused/unfused", "check"]
#: The goals: fused / unfused at most GOAL_RATIO (N >= 2), fused at most GOAL_US up to GOAL_TOKENS tokens.
GOAL_RATIO, GOAL_US, GOAL_TOKENS = 0.6, 5.0, 16
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def build(cls, n: int, shape: tuple, dtype, device, **kwargs) -> tuple:
    """``(peers, ops)``: :class:`~tilescale_examples.testing.emulated.EmulatedPeers` of ``n``
    ranks sized by ``cls.heap_bytes`` and ``cls(rank, shape, dtype, **kwargs)`` on each of
    them, rank order."""
    from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers

    region = cls.heap_bytes(shape, dtype, world_size=n, device=device, **kwargs) + ALIGNMENT
    peers = EmulatedPeers(n, region, device)
    return peers, [cls(peers.rank(r), shape, dtype, **kwargs) for r in range(n)]


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


def time_ranks(ops, launch, iters: int, device) -> float:
    """Milliseconds of GPU time per call of ``launch(op)``, the mean over the emulated ranks:
    for each rank, flags preset and its table bound, ``iters`` calls behind a stream hold."""
    from tilescale_examples.benchmarks.emulated import preset_flags

    per_rank = []
    for op in ops:
        preset_flags(ops)
        op.bind_table()
        per_rank.append(_timing.held_ms_per_launch(lambda: launch(op), iters, device))
    return statistics.fmean(per_rank)


def run_case(args, n: int, tokens: int, hidden: int, device) -> tuple:
    """``(fused ms, unfused ms, failures)`` of one case (the ops built, checked, timed, closed)."""
    import torch

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    dtype, fp8 = getattr(torch, args.dtype), args.fp8
    inputs = rank_inputs(n, tokens, hidden, dtype, device, seed=tokens * 31 + hidden + n)
    kw = dict(threads=args.threads, max_blocks=args.max_blocks)
    peers, ops = build(AllReduceResidualRMSNorm, n, (tokens, hidden), dtype, device, eps=args.eps, fp8=fp8, **kw)
    try:
        bad = check_round(ops, inputs)
        fused = time_ranks(ops, lambda op: op(*inputs[op.rank]), args.iters, device)
    finally:
        for op in ops:
            op.close()
        peers.close()
    peers, ars = build(AllReduce, n, (tokens, hidden), dtype, device, algorithm="one_shot", **kw)
    try:
        unfused = time_ranks(ars, lambda ar: unfused_call(ar, *inputs[ar.rank], args.eps, fp8), args.iters, device)
    finally:
        for ar in ars:
            ar.close()
        peers.close()
    torch.cuda.empty_cache()
    return fused, unfused, bad


def run(args, device) -> tuple:
    """``({hidden: rows}, failures)`` of the whole sweep; a row is :data:`HEADERS`."""
    tables, failures = {}, []
    for hidden in args.hidden:
        rows = tables.setdefault(hidden, [])
        for n in args.ranks:
            for tokens in args.tokens:
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
    for hidden, rows in tables.items():
        print_table(f"all-reduce + residual + RMSNorm{'' if args.fp8 is None else f' + FP8 {args.fp8}'}, fused "
                    f"(one TileScale kernel) vs unfused (TileScale one-shot all-reduce, torch add, torch rms_norm"
                    f"{'' if args.fp8 is None else ', torch quantisation'}), emulated peers (one {device_name}), "
                    f"hidden {hidden}, {args.dtype}; GPU time per call of {args.iters} back-to-back calls, mean "
                    "over the emulated ranks", HEADERS, rows)
    for f in failures[:20]:
        print("FAILED:", f)
    for line in goal_lines(tables):
        print(line)
    print(f"correctness (every rank's fused output against the float32 torch reference): "
          f"{'ok' if not failures else f'{len(failures)} FAILURE(S)'}")


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("decode", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="emulated world sizes")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192], help="hidden sizes (elements per token)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--fp8", default="none", choices=["none", "per_token", "per_block"], help="FP8 output")
    p.add_argument("--iters", type=int, default=50, help="back-to-back calls timed per rank and case")
    p.add_argument("--threads", type=int, default=512, help="threads per block of the kernels")
    p.add_argument("--max-blocks", type=int, default=None, help="grid limit (default: the SM count)")
    p.add_argument("--eps", type=float, default=1e-6)
    args = _harness.parse_args(p, argv)
    if any(n < 1 or n > 64 for n in args.ranks):
        p.error("--ranks must be in [1, 64]")
    if any(t < 1 for t in args.tokens) or any(h < 8 or h % 8 for h in args.hidden) or args.iters < 1:
        p.error("--tokens and --iters must be >= 1 and --hidden a positive multiple of 8")
    args.fp8 = None if args.fp8 == "none" else args.fp8
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    import torch

    if not torch.cuda.is_available():
        print("decode benchmark: no CUDA GPU visible, nothing to measure")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    from tilescale_examples.decode.norm_kernel import norm_jobs
    from tilescale_examples.testing.precompile import precompile, reduction_jobs

    precompile(norm_jobs([args.dtype], args.ranks, args.hidden, [args.fp8], args.threads)
               + reduction_jobs(["one_shot"], [args.dtype], args.ranks, args.threads))  # in parallel: cache hits below
    tables, failures = run(args, device)
    print_results(tables, failures, args, torch.cuda.get_device_name(device))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
