"""The stream-K GEMM against torch.matmul (cuBLAS) and stock TileLang's GEMM of the same tiles, one GPU, same run.

``python -m tilescale_examples.benchmarks.stream_k [--m 1024 4096] [--n 3584 7168 28672]
[--k 8192] [--dtype bfloat16|float16] [--tiles BMxBNxBK:STAGES:THREADS] [--iters 20]
[--rounds 3] [--out DIR]``

For every ``(m, n)``: GPU time per call (``--rounds`` rounds timing each column in turn, the
median round of each; a round's time is the median of ``--iters`` calls, each from an idle GPU)
of

* ``matmul``: ``torch.matmul`` into a preallocated output (cuBLAS);
* ``stock``: :func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`, stock TileLang's
  GEMM (one block per tile) with the same tiles, rasterized as the library's ops rasterize
  that width (:func:`~tilescale_examples.overlap.gemm.default_swizzle`);
* ``stream-K``: :class:`~tilescale_examples.overlap.stream_k.StreamKGemm` (one block per SM,
  the last wave's tiles cut along ``k``);

the TFLOP/s of each, ``waves`` (tiles / SMs: where the stock grid's last wave is short), and
``x matmul`` / ``x stock``: stream-K's speed over each (above 1: stream-K is faster). Before
timing every output is checked against the float32 product (the library's GEMM bound,
:func:`~tilescale_examples.overlap.gemm.count_outside`); a failure is printed and makes the
exit status 1.

The goal (issue 41, one H200): the library's GEMM at least 0.97 of ``torch.matmul`` at every
shape (printed last, for the stream-K column).
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import collect, print_outcome, print_table, ratio, worst_line

__all__ = ["HEADERS", "GOAL", "DEFAULT_TILES", "run_case", "goal_lines", "main"]

HEADERS = ["m", "n", "k", "waves", "matmul TFLOP/s", "stock TFLOP/s", "stream-K TFLOP/s", "x matmul", "x stock",
           "check"]
#: The goal: the library's GEMM at least GOAL of torch.matmul's speed.
GOAL = 0.97
#: ``--tiles`` when not given (the stream-K op's default tiles).
DEFAULT_TILES = "128x256x64:4:256"


def run_case(args, m: int, n: int, tiles, device) -> tuple:
    """``(row, failures)`` of one ``(m, n)`` at ``args.k``: every column checked, then timed."""
    import torch

    from tilescale_examples.base import compile_once
    from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, build_gemm_kernel, count_outside, default_swizzle
    from tilescale_examples.overlap.stream_k import StreamKGemm

    dtype, k = getattr(torch, args.dtype), args.k
    g = torch.Generator(device=device).manual_seed(m * 7 + n)
    a = torch.randn((m, k), generator=g, device=device).to(dtype)
    b = torch.randn((k, n), generator=g, device=device).to(dtype)
    ref = a.float() @ b.float()
    stock_tiles = GemmTiles(tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages, tiles.threads,
                            default_swizzle(n, tiles.block_n))
    stock = compile_once(build_gemm_kernel(m, n, k, DTYPES[dtype], stock_tiles))
    op = StreamKGemm(m, n, k, dtype, tiles=tiles, device=device)
    outs = {name: torch.full((m, n), float("nan"), dtype=dtype, device=device) for name in ("matmul", "stock", "stream-K")}
    columns = [("matmul", lambda: torch.matmul(a, b, out=outs["matmul"])),
               ("stock", lambda: stock(a, b, outs["stock"])),
               ("stream-K", lambda: op(a, b, out=outs["stream-K"]))]
    failures = []
    for name, fn in columns:
        fn()
        torch.cuda.synchronize(device)
        bad, worst = count_outside(outs[name], ref, dtype)
        if bad:
            failures.append(f"m {m} n {n} k {k} {name}: {bad} elements outside the bound (worst {worst:.2f}x)")
    ms = _timing.local_rounds(columns, args.rounds, args.iters)
    work = 2.0 * m * n * k
    tflops = {name: work / ms[name] / 1e9 for name, _ in columns}
    tile_count = (m // tiles.block_m) * (n // tiles.block_n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row = [m, n, k, round(tile_count / sms, 2), tflops["matmul"], tflops["stock"], tflops["stream-K"],
           ratio(ms["matmul"], ms["stream-K"]), ratio(ms["stock"], ms["stream-K"]), "ok" if not failures else "FAIL"]
    return row, failures


def goal_lines(rows: list) -> list:
    """The goal's line: stream-K's smallest ``x matmul`` (goal >= :data:`GOAL`)."""
    return [worst_line("worst stream-K vs torch.matmul", [r[7] for r in rows], GOAL)]


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    from tilescale_examples.overlap.gemm import GemmTiles, check_gemm_dims

    p = _harness.parser("stream_k", __doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1024, 4096], help="rows of a and of the output")
    p.add_argument("--n", type=int, nargs="+", default=[3584, 7168, 28672], help="columns of b and of the output")
    p.add_argument("--k", type=int, default=8192, help="the reduction dimension")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tiles", default=DEFAULT_TILES, metavar="BMxBNxBK:STAGES:THREADS",
                   help=f"tile program of both TileLang columns (default {DEFAULT_TILES})")
    p.add_argument("--iters", type=int, default=20, help="calls timed per round (median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds timing each column in turn (median)")
    args = _harness.parse_args(p, argv)
    try:
        fields = _harness.tile_fields(args.tiles, ("block_m", "block_n", "block_k", "num_stages", "threads"))
        tiles = GemmTiles(**fields)
        for m in args.m:
            for n in args.n:
                check_gemm_dims("--m/--n/--k", tiles, m=m, n=n, k=args.k)
    except ValueError as exc:
        p.error(str(exc))
    if args.iters < 1 or args.rounds < 1:
        p.error("--iters and --rounds must be >= 1")
    if _harness.visible_gpus("stream-K GEMM benchmark") == 0:
        return 0
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    rows, failures = collect(([row], bad) for row, bad in (run_case(args, m, n, tiles, device)
                                                           for m in args.m for n in args.n))
    print_table(f"stream-K GEMM vs torch.matmul and stock TileLang ({args.tiles}), "
                f"{torch.cuda.get_device_name(device)}, {args.dtype}; median GPU time of {args.iters} calls, "
                f"median of {args.rounds} rounds", HEADERS, rows)
    return print_outcome(failures, goal_lines(rows), "every column against the float32 product")


if __name__ == "__main__":
    raise SystemExit(main())
