"""The overlapped GEMMs' fused plans with N emulated peers on one GPU, against the same GEMMs alone.

``python -m tilescale_examples.benchmarks.overlap_emulated [--ranks 2 4 8] [--ops ag_gemm gemm_rs]
[--m-local 1024 4096] [--k 8192] [--n 3584] [--dtype bfloat16|float16] [--max-chunks 8]
[--iters 10] [--out DIR]``

One process, no process group: :class:`~tilescale_examples.testing.emulated_overlap.EmulatedOverlap`
builds the op's fused plan on ``N`` emulated ranks (regions of one device buffer), each rank
calling on a stream of its own, so every kernel and stream operation of the real ``N``-rank
call runs at once on the GPU. AllGatherGEMM's pushes go device to host to device through
pinned memory on the copy engines (PCIe: slower than NVLink, so the copies are harder to hide
than on the real machine); GemmReduceScatter's partials are stored by its GEMM's epilogue into
the peers' regions. The table's title says so.

For every op, ``N`` and ``m_local`` (``k`` and ``n`` per rank as in ``benchmarks.ag_gemm``), one
round (every emulated rank's call) is checked first: outputs poisoned, every rank's output
against the float32 reference (:func:`~tilescale_examples.overlap.gemm.error_bound`); a failure
is printed in the row and makes the exit status 1. Then ``--iters`` back-to-back rounds of each
column are timed behind a stream hold (GPU time per round,
:func:`~tilescale_examples.benchmarks._timing.held_ms_per_launch`):

* ``fused``: the round;
* ``GEMM alone``: per rank, the stock TileLang GEMM with the op's tiles on the whole operand
  (all-gather: the gathered ``(N m_local, k)`` rows; reduce-scatter: ``a``), back to back; for
  the reduce-scatter plus the reduction alone (``torch.sum`` of the ``N`` row blocks);
* ``matmul``: the same with ``torch.matmul`` (cuBLAS);
* all-gather only: ``copies`` (every rank's host-staged pushes, no GEMM: the emulated link's
  time) and ``copies, then GEMM`` (the copies, then GEMM alone: the sequential order with the
  same copies, no overlap).

TFLOP/s is ``N * 2 * N m_local * n * k`` per round over its time; ``x`` columns are the fused
round's speed relative to the column (time of the column / time of fused); ``x slower part``
(all-gather) relates it to the longer of ``copies`` and ``GEMM alone``, the bound a perfect
overlap of the two would reach. The goal (printed at the end): the all-gather's fused round at
least 0.95 of GEMM alone at every ``N``, which needs copies no longer than the GEMM.
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import print_outcome, print_table, ratio

__all__ = ["HEADERS", "GOAL", "OPS", "parse", "check_round", "Columns", "run_case", "goal_lines", "run", "main"]

HEADERS = ["ranks", "m_local", "M x N x K", "chunks", "fused ms", "GEMM alone ms", "matmul ms", "copies ms",
           "copies, then GEMM ms", "fused TFLOP/s", "x GEMM alone", "x matmul", "x copies, then GEMM",
           "x slower part", "check"]
#: The goal: the all-gather's fused round at least GOAL of GEMM alone (speed).
GOAL = 0.95
OPS = ("ag_gemm", "gemm_rs")
TITLES = {"ag_gemm": "AllGatherGEMM fused plan (pushes through pinned host memory on the copy engines)",
          "gemm_rs": "GemmReduceScatter fused plan (remote-epilogue stores into the peers' regions)"}


def parse(argv=None):
    """The command line (see the module docstring)."""
    p = _harness.parser("overlap_emulated", "The overlapped GEMMs' fused plans with emulated peers on one GPU.")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="emulated world sizes (>= 2)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--m-local", type=int, nargs="+", default=[1024, 4096], help="rows per rank")
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=3584)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--max-chunks", type=int, default=8, help="all-gather row chunks per rank")
    p.add_argument("--iters", type=int, default=10, help="back-to-back rounds timed per column")
    args = _harness.parse_args(p, argv)
    if any(n < 2 or n > 16 for n in args.ranks):
        p.error("--ranks must be in [2, 16]")
    if args.iters < 1 or args.max_chunks < 1 or args.k < 1 or args.n < 1 or any(m < 1 for m in args.m_local):
        p.error("--iters, --max-chunks, --k, --n and --m-local must be positive")
    return p, args


def check_round(emu, inputs, outs) -> list:
    """One round with poisoned outputs, every rank's output against its float32 reference;
    failure messages (none when every element is within the bound)."""
    import torch

    for out in outs:
        _timing.poison_(out)
    emu.round(inputs, outs)
    torch.cuda.synchronize(emu.device)
    return emu.check(inputs, outs)


class Columns:
    """The callables of one case (each enqueues one round of its column on the current
    stream): ``fused``, ``gemm``, ``matmul`` and, for the all-gather, ``copies`` and
    ``copies_then_gemm``."""

    def __init__(self, emu, inputs, outs):
        import torch

        from tilescale_examples.base import compile_once
        from tilescale_examples.overlap.gemm import DTYPES, build_gemm_kernel

        op = emu.ops[0]
        self.emu, self.inputs, self.outs = emu, inputs, outs
        N, M = emu.ranks, emu.ranks * op.m_local
        if emu.op == "ag_gemm":
            gathered = torch.cat([a for a, _ in inputs])
            self.operands = [gathered] * N
        else:
            self.operands = [a for a, _ in inputs]
        self.products = [torch.empty((M, op.n), dtype=op.dtype, device=emu.device) for _ in range(N)]
        self.stock = compile_once(build_gemm_kernel(M, op.n, op.k, DTYPES[op.dtype], op.tiles, op.store))

    def fused(self) -> None:
        self.emu.round(self.inputs, self.outs)

    def _reduce(self) -> None:
        if self.emu.op == "gemm_rs":
            op = self.emu.ops[0]
            for p in self.products:
                p.view(self.emu.ranks, op.m_local, op.n).sum(dim=0)

    def gemm(self) -> None:
        for x, (_, b), y in zip(self.operands, self.inputs, self.products):
            self.stock(x, b, y)
        self._reduce()

    def matmul(self) -> None:
        import torch

        for x, (_, b), y in zip(self.operands, self.inputs, self.products):
            torch.matmul(x, b, out=y)
        self._reduce()

    def copies(self) -> None:
        """Every rank's host-staged pushes of its ``a`` with the handshake (claims, copies,
        ready flags; then every rank's release), joined: the emulated link's share of a
        round."""
        import torch

        current = torch.cuda.current_stream(self.emu.device)
        for op, (a, _) in zip(self.emu.ops, self.inputs):
            op._push.mark(current)
            op._push.enqueue(a.data_ptr())
        for op in self.emu.ops:
            op._push.release(current)
            op._push.finish(current)

    def copies_then_gemm(self) -> None:
        self.copies()
        self.gemm()


def run_case(op: str, ranks: int, m_local: int, args, device) -> tuple:
    """``(row, failures)``: one row of ``op``'s table (see :data:`HEADERS`) and the check's
    failure messages."""
    import torch

    from tilescale_examples.benchmarks._overlap import tflops
    from tilescale_examples.testing.emulated_overlap import EmulatedOverlap

    dtype = getattr(torch, args.dtype)
    tiles = {"max_chunks": args.max_chunks} if op == "ag_gemm" else {}
    with EmulatedOverlap(op, ranks, m_local, args.k, args.n, dtype, device=device, **tiles) as emu:
        inputs, outs = emu.random_inputs(seed=ranks * 131 + m_local), emu.empty_outputs()
        failures = check_round(emu, inputs, outs)
        cols = Columns(emu, inputs, outs)
        names = ["fused", "gemm", "matmul"] + (["copies", "copies_then_gemm"] if op == "ag_gemm" else [])
        ms = {name: _timing.held_ms_per_launch(getattr(cols, name), args.iters, device) for name in names}
        flops = ranks * emu.ops[0].flops()
        chunks = len(emu.ops[0].chunks) if op == "ag_gemm" else "-"
    fused = ms["fused"]
    return [ranks, m_local, f"{ranks * m_local} x {args.n} x {args.k}", chunks, fused, ms["gemm"], ms["matmul"],
            ms.get("copies", "-"), ms.get("copies_then_gemm", "-"), tflops(flops, fused), ratio(ms["gemm"], fused),
            ratio(ms["matmul"], fused),
            ratio(ms["copies_then_gemm"], fused) if "copies_then_gemm" in ms else "-",
            ratio(max(ms["copies"], ms["gemm"]), fused) if "copies" in ms else "-",
            "; ".join(failures) if failures else "ok"], failures


def goal_lines(rows_by_op: dict) -> list:
    """The goal's verdict lines: the all-gather's ``x GEMM alone`` at least :data:`GOAL` at every row."""
    rows = rows_by_op.get("ag_gemm")
    if not rows:
        return []
    col = HEADERS.index("x GEMM alone")
    worst = min(row[col] for row in rows)
    verdict = "met" if worst >= GOAL else "NOT met"
    return [f"goal: AllGatherGEMM fused >= {GOAL} of GEMM alone at every N: worst {worst:.3f} ({verdict})"]


def run(args) -> int:
    """Every case of ``args``; the tables, the goal and the check verdict; the exit status."""
    if _harness.visible_gpus("overlap_emulated benchmark") == 0:
        return 0
    import torch

    from tilescale_examples.testing.emulated_overlap import precompile_jobs
    from tilescale_examples.testing.precompile import precompile

    precompile([job for op in args.ops for ranks in args.ranks for m_local in args.m_local  # in parallel: hits below
                for job in precompile_jobs(op, ranks, m_local, args.k, args.n, args.dtype, max_chunks=args.max_chunks)])
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    rows_by_op, failures = {}, []
    for op in args.ops:
        rows = rows_by_op.setdefault(op, [])
        for ranks in args.ranks:
            for m_local in args.m_local:
                row, bad = run_case(op, ranks, m_local, args, device)
                rows.append(row)
                failures += bad
        print_table(f"{TITLES[op]}, N emulated ranks on one {name} (each rank on its own stream; the table-reading "
                    f"kernels on one shared stream), {args.dtype}; GPU ms per round of every rank's call, "
                    f"{args.iters} back-to-back rounds", HEADERS, rows)
    return print_outcome(failures, goal_lines(rows_by_op), "every rank's fused output against the float32 reference")


def main(argv=None) -> int:
    _, args = parse(argv)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
