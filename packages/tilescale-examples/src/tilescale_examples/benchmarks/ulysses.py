"""The Ulysses all-to-all (layout change inside the kernel) against a same-bytes copy and the torch path, with emulated peers.

``python -m tilescale_examples.benchmarks.ulysses [--ranks 1 2 4 8] [--seq 4096 16384 65536]
[--batch 1] [--heads 32] [--head-dim 128] [--dtype bfloat16|float16] [--iters 20]
[--max-blocks B] [--threads 512] [--min-chunk-kib 16] [--out DIR]``

The method of :mod:`tilescale_examples.benchmarks.emulated` (one process; ``N`` emulated
ranks are ``N`` regions of one device buffer, every rank's calls run alone on the GPU with
its peers' flags preset): a time is one rank's share of the data movement, local memory
standing in for NVLink. For every ``N``, sequence length and direction it times, per
emulated rank, ``--iters`` back-to-back calls behind a stream hold, the mean over the ranks:

* ``ulysses us``: :class:`~tilescale_examples.sequence.ulysses.UlyssesAllToAll`;
* ``copy us``: ``torch.Tensor.copy_`` of the same bytes (one rank's input);
* ``torch us``: the torch path on one rank's data: the layout change before the exchange
  (``permute(...).contiguous()``), the exchange's bytes (a ``copy_``) and the layout change
  after it, back to back;
* ``copy/ulysses`` and ``torch/ulysses`` (above 1: the Ulysses kernel is faster);
* ``blocks``: the Ulysses kernel's grid (``chunks x ranks``; ``--max-blocks``, ``--threads``
  and ``--min-chunk-kib`` shape it: the grid cap, threads per block, the smallest chunk).

Before timing, one round of calls (every emulated rank's, in rank order) is compared with
:func:`~tilescale_examples.sequence.ulysses.torch_reference`; a failure is printed and makes
the exit status 1.

The goal (issue 44, one H200): ``copy/ulysses`` at least 0.9 everywhere (printed at the end).
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _fused, _harness, _timing
from tilescale_examples.benchmarks._report import print_checked, ratio, worst_line
from tilescale_examples.sequence.ulysses import MIN_CHUNK_BYTES

__all__ = ["HEADERS", "GOAL", "torch_path", "check_round", "run_case", "goal_lines", "run", "main"]

HEADERS = ["ranks", "seq", "direction", "ulysses us", "copy us", "torch us", "copy/ulysses", "torch/ulysses", "blocks",
           "check"]
#: The goal: a same-bytes copy takes at least GOAL of the Ulysses call's time.
GOAL = 0.9


def torch_path(x, world: int, direction: str):
    """What a torch user runs on one rank around an ``all_to_all_single`` of ``x``, with a
    ``copy_`` of the same bytes standing in for the exchange: the pieces for each rank made
    contiguous, exchanged, and put back into the output layout. Returns the output."""
    B, s, h, D = x.shape
    W = world
    if direction == "seq_to_head":  # (B, SP, H, D) -> (W, B, SP, HP, D) -> (B, S, HP, D)
        send = x.view(B, s, W, h // W, D).permute(2, 0, 1, 3, 4).contiguous()
        recv = send.new_empty(send.shape).copy_(send)
        return recv.permute(1, 0, 2, 3, 4).reshape(B, W * s, h // W, D)
    send = x.view(B, W, s // W, h, D).permute(1, 0, 2, 3, 4).contiguous()  # (B, S, HP, D) -> (W, B, SP, HP, D)
    recv = send.new_empty(send.shape).copy_(send)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, s // W, W * h, D)


def _shape(args, n: int, seq: int, direction: str) -> tuple:
    """One rank's input shape."""
    if direction == "seq_to_head":
        return (args.batch, seq // n, args.heads, args.head_dim)
    return (args.batch, seq, args.heads // n, args.head_dim)


def check_round(ops, inputs) -> list:
    """One call of every emulated rank (rank order, flags preset) on ``inputs[rank]``, each
    rank's output compared with the reference; failure messages."""
    import torch

    from tilescale_examples.sequence.ulysses import torch_reference
    from tilescale_examples.testing.emulated import run_round

    run_round(ops, call=lambda op: op(inputs[op.rank]))
    torch.cuda.synchronize()
    bad = []
    for op in ops:
        want = torch_reference(inputs, op.rank, op.direction)
        if not torch.equal(op.output, want):
            bad.append(f"{op.world_size} ranks {op.direction} {op.shape} rank {op.rank}: "
                       f"{int((op.output != want).sum())} elements differ")
    return bad


def run_case(args, n: int, seq: int, direction: str, device) -> tuple:
    """``(row, failures)``: one row of :data:`HEADERS` and the check's failure messages; the
    op built, checked, timed and closed."""
    import torch

    from tilescale_examples.sequence.ulysses import UlyssesAllToAll

    dtype = getattr(torch, args.dtype)
    shape = _shape(args, n, seq, direction)
    g = torch.Generator(device=device).manual_seed(seq * 31 + n)
    inputs = [torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(n)]
    grid = []

    def check(ops):
        grid.append(ops[0].chunks * ops[0].world_size)
        return check_round(ops, inputs)

    ms, bad = _fused.measure(UlyssesAllToAll, n, (shape, dtype), device, lambda op: op(inputs[op.rank]), args.iters,
                             check=check, direction=direction, max_blocks=args.max_blocks, threads=args.threads,
                             min_chunk_bytes=args.min_chunk_kib * 1024)
    src, dst = inputs[0], torch.empty_like(inputs[0])
    copy = _timing.held_ms_per_launch(lambda: dst.copy_(src), args.iters, device)
    path = _timing.held_ms_per_launch(lambda: torch_path(src, n, direction), args.iters, device)
    torch.cuda.empty_cache()
    row = [n, seq, direction, ms * 1e3, copy * 1e3, path * 1e3, ratio(copy, ms), ratio(path, ms), grid[0],
           "ok" if not bad else "FAIL"]
    return row, bad


def goal_lines(tables: dict) -> list:
    """The goal's line: the smallest ``copy/ulysses`` (goal >= :data:`GOAL`)."""
    return [worst_line("worst copy/ulysses", [r[6] for rows in tables.values() for r in rows], GOAL)]


def run(args, device) -> tuple:
    """``({ranks: rows}, failures)`` of the whole sweep."""
    tables, failures = {}, []
    for n in args.ranks:
        for seq in args.seq:
            for direction in ("seq_to_head", "head_to_seq"):
                with _harness.watchdog(args.case_timeout, f"ulysses: {n} ranks, seq {seq}, {direction}"):
                    row, bad = run_case(args, n, seq, direction, device)
                tables.setdefault(n, []).append(row)
                failures += bad
    return tables, failures


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.fused_parser("ulysses", __doc__.splitlines()[0], iters=20)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536], help="sequence lengths (all ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32, help="attention heads (all ranks)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=512, help="threads per block of the Ulysses kernel")
    p.add_argument("--min-chunk-kib", type=int, default=MIN_CHUNK_BYTES // 1024,
                   help="smallest chunk a block is given before the grid grows (KiB)")
    args = _harness.parse_args(p, argv)
    if args.threads < 32 or args.threads > 1024 or args.threads % 32 or args.min_chunk_kib < 1:
        p.error("--threads must be a multiple of 32 in [32, 1024] and --min-chunk-kib >= 1")
    if args.iters < 1 or args.batch < 1 or args.head_dim < 1 or any(
            s < 1 or n >= 1 and (s % n or args.heads % n) for s in args.seq for n in args.ranks):
        p.error("--iters, --batch and --head-dim must be >= 1, and every --seq and --heads a multiple of every --ranks")
    device = _harness.emulated_device(p, args, "ulysses")
    if device is None:
        return 0
    import torch

    tables, failures = run(args, device)
    print_checked(tables, lambda n: f"Ulysses all-to-all vs a same-bytes copy_ and the torch path, {n} rank(s), "
                  f"batch {args.batch}, {args.heads} heads of {args.head_dim}", HEADERS, failures, goal_lines(tables),
                  "the torch reference", args, torch.cuda.get_device_name(device))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
