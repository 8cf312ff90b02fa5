"""The library's GEMM kernels against torch.matmul (cuBLAS), one GPU, same run.

``python -m tilescale_examples.benchmarks.gemm [--m 1024 4096] [--n 3584 7168 28672]
[--k 8192] [--dtype bfloat16|float16] [--tiles BMxBNxBK:STAGES:THREADS] [--warp-policy square|row|column]
[--kernels stock stock-tma async async-tma persistent persistent-tma stream-K] [--iters 20] [--rounds 3]
[--sustain SECONDS] [--out DIR]``

For every ``(m, n)``: GPU time per call (``--rounds`` rounds timing each column in turn, the
median round of each; a round's time is the median of ``--iters`` calls, each from an idle
GPU) of

* ``matmul``: ``torch.matmul`` into a preallocated output (cuBLAS);
* ``stock``: :func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`, stock TileLang's
  pipelined GEMM (one block per tile; each ``k`` step's WGMMAs waited for before the next);
* ``stock-tma``: the same kernel storing its output tile through shared memory with a TMA
  store (``build_gemm_kernel(..., store="tma")``, CUTLASS's epilogue) instead of each thread's
  registers straight to global memory;
* ``async``: the same kernel as ``stock`` with ``pipeline="async"``
  (:mod:`~tilescale_examples.overlap.gemm_async`: the warp specialisation written out, one
  WGMMA group in flight);
* ``persistent``: :func:`~tilescale_examples.overlap.gemm_persistent.build_persistent_gemm`
  (one block per SM computing tiles in turn with the async pipeline, the next tile's loads
  issued while the current one is stored; its tile order rasterized likewise);
* ``async-tma``, ``persistent-tma``: those two with the TMA-store epilogue, at no more stages
  than fit beside the output tile (3 for ``128 x 256 x 64`` in 16 bits: printed in a line
  under the table);
* ``stream-K``: :class:`~tilescale_examples.overlap.stream_k.StreamKGemm` (one block per SM,
  the last wave's tiles cut along ``k``);

all with ``--tiles`` and ``--warp-policy`` (how the compute warpgroups split a tile,
:data:`~tilescale_examples.overlap.gemm.WARP_POLICIES`), the one-block-per-tile kernels
rasterized as the library's ops rasterize that width
(:func:`~tilescale_examples.overlap.gemm.default_swizzle`). Printed: the TFLOP/s of each,
``waves`` (tiles / SMs: where a one-block-per-tile grid's last wave is short) and each
kernel's speed over ``torch.matmul`` (``x matmul``; above 1: faster). Before timing every
output is checked against the float32 product (the library's GEMM bound,
:func:`~tilescale_examples.overlap.gemm.count_outside`); a failure is printed and makes the
exit status 1.

``--sustain S`` adds a second table: each column run back to back for ``S`` seconds with the
SM clock and the board power sampled (NVML): TFLOP/s, SM MHz, W and TFLOP/s per GHz, which
tells a kernel slower per cycle from one the power budget clocks lower.

The goal (issue 41, one H200): the library's GEMM at least 0.97 of ``torch.matmul`` at every
shape (printed last, per kernel).
"""

from __future__ import annotations

from typing import Optional

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import collect, print_outcome, print_table, ratio, worst_line

__all__ = ["KERNELS", "GOAL", "DEFAULT_TILES", "STREAM_K_BUILDER", "PERSISTENT_BUILDER", "SPECS", "kernel_tiles",
           "stage_lines", "SUSTAINED_HEADERS", "headers", "kernel_jobs", "run_case", "goal_lines", "main"]

#: The library's GEMM kernels this benchmark can time (``--kernels``), in column order.
KERNELS = ("stock", "stock-tma", "async", "async-tma", "persistent", "persistent-tma", "stream-K")
#: The goal: the library's GEMM at least GOAL of torch.matmul's speed.
GOAL = 0.97
#: ``--tiles`` when not given (the stream-K op's default tiles).
DEFAULT_TILES = "128x256x64:4:256"


#: The stream-K kernel's builder (``"module:function"``, a :mod:`~tilescale_examples.testing.precompile`
#: job's); the one-block-per-tile kernels are the library GEMM's
#: (:data:`~tilescale_examples.overlap.tuning.GEMM_BUILDER`) with their pipeline.
STREAM_K_BUILDER = "tilescale_examples.overlap.stream_k:build_stream_k_gemm"
#: The persistent GEMM's builder, likewise.
PERSISTENT_BUILDER = "tilescale_examples.overlap.gemm_persistent:build_persistent_gemm"
#: Each kernel but stream-K: name -> (grid: ``"tile"``, one block per output tile, the library
#: GEMM; ``"persistent"``, one block per SM), ``GemmTiles.pipeline``, the builder's ``store``.
SPECS = {"stock": ("tile", "sync", "direct"), "stock-tma": ("tile", "sync", "tma"),
         "async": ("tile", "async", "direct"), "async-tma": ("tile", "async", "tma"),
         "persistent": ("persistent", "async", "direct"), "persistent-tma": ("persistent", "async", "tma")}


def kernel_tiles(name: str, tiles, n: int):
    """The tiles kernel ``name`` (of :data:`SPECS`) runs for an ``n``-column output: ``tiles``
    with its pipeline, the rasterization the library's ops pick for that width
    (:func:`~tilescale_examples.overlap.gemm.default_swizzle`) and, for an async kernel with the
    TMA-store epilogue, no more stages than fit beside its output tile
    (:func:`~tilescale_examples.overlap.gemm.tma_store_stages`)."""
    from dataclasses import replace

    from tilescale_examples.overlap.gemm import default_swizzle, tma_store_stages

    _, pipeline, store = SPECS[name]
    tiles = replace(tiles, swizzle=default_swizzle(n, tiles.block_n), pipeline=pipeline)
    if pipeline == "async" and store == "tma":
        tiles = replace(tiles, num_stages=min(tiles.num_stages, tma_store_stages(tiles)))
    return tiles


def kernel_jobs(kernels, shapes, dtype: str, tiles, sm_count: int) -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of the ``kernels`` (names
    of :data:`KERNELS`) this benchmark (and the GEMM GPU tests) compile for every ``(m, n, k)``
    of ``shapes``: ``dtype`` (TileLang's name), ``tiles`` (:func:`kernel_tiles` of each; the
    persistent ones on :func:`~tilescale_examples.overlap.gemm_persistent.persistent_blocks`
    of ``sm_count`` SMs), stream-K on :func:`~tilescale_examples.overlap.stream_k.default_blocks`
    of ``sm_count`` SMs."""
    from tilescale_examples.overlap.gemm_persistent import persistent_blocks
    from tilescale_examples.overlap.stream_k import default_blocks
    from tilescale_examples.overlap.tuning import GEMM_BUILDER

    jobs = []
    for m, n, k in shapes:
        for name in kernels:
            if name not in SPECS:  # stream-K
                jobs.append((STREAM_K_BUILDER, (m, n, k, dtype, tiles, default_blocks(m, n, k, tiles, sm_count)), None))
                continue
            grid, _, store = SPECS[name]
            own = kernel_tiles(name, tiles, n)
            if grid == "tile":
                jobs.append((GEMM_BUILDER, (m, n, k, dtype, own, store), None))
            else:
                jobs.append((PERSISTENT_BUILDER, (m, n, k, dtype, own, persistent_blocks(m, n, own, sm_count), store),
                             None))
    return jobs


def stage_lines(kernels, tiles) -> list:
    """One line per kernel of ``kernels`` that runs fewer stages than ``tiles`` say
    (:func:`kernel_tiles`: an async kernel's TMA-store epilogue), naming the stages it ran."""
    return [f"{name}: {kernel_tiles(name, tiles, tiles.block_n).num_stages} stages (the TMA-store epilogue's output "
            f"tile beside them)" for name in kernels
            if name in SPECS and kernel_tiles(name, tiles, tiles.block_n).num_stages != tiles.num_stages]


def headers(kernels) -> list:
    """The table's columns for ``kernels`` (a subset of :data:`KERNELS`, in that order)."""
    return (["m", "n", "k", "waves", "matmul TFLOP/s"] + [f"{name} TFLOP/s" for name in kernels]
            + [f"{name} x matmul" for name in kernels] + ["check"])


def _kernel_calls(m: int, n: int, k: int, dtype, tiles, kernels, device) -> dict:
    """``{name: fn(a, b, out)}`` of the library kernels in ``kernels``, built (compiled) here
    from :func:`kernel_jobs`' jobs (the same builders and arguments)."""
    from tilescale_examples._contract import sm_count_of
    from tilescale_examples.base import compile_once
    from tilescale_examples.overlap.gemm import DTYPES
    from tilescale_examples.overlap.stream_k import StreamKGemm
    from tilescale_examples.testing.precompile import build_job

    calls = {}
    jobs = kernel_jobs(kernels, [(m, n, k)], DTYPES[dtype], tiles, sm_count_of(device))
    for name, (builder, args, _) in zip(kernels, jobs):
        if name in SPECS:
            calls[name] = compile_once(build_job(builder, args))
        else:
            op = StreamKGemm(m, n, k, dtype, tiles=tiles, device=device)
            calls[name] = lambda a, b, out, op=op: op(a, b, out=out)
    return calls


def run_case(args, m: int, n: int, tiles, device, sustained_rows: Optional[list] = None) -> tuple:
    """``(row, failures)`` of one ``(m, n)`` at ``args.k``: every column checked, then timed;
    with ``args.sustain`` seconds, each column then also runs that long back to back with the
    SM clock and board power sampled (:func:`~tilescale_examples.benchmarks._clocks.sustained`),
    a row per column appended to ``sustained_rows`` (:data:`SUSTAINED_HEADERS`)."""
    import torch

    from tilescale_examples.overlap.gemm import count_outside

    dtype, k = getattr(torch, args.dtype), args.k
    g = torch.Generator(device=device).manual_seed(m * 7 + n)
    a = torch.randn((m, k), generator=g, device=device).to(dtype)
    b = torch.randn((k, n), generator=g, device=device).to(dtype)
    ref = a.float() @ b.float()
    fns = {"matmul": lambda a, b, out: torch.matmul(a, b, out=out)}
    fns.update(_kernel_calls(m, n, k, dtype, tiles, args.kernels, device))
    outs = {name: torch.full((m, n), float("nan"), dtype=dtype, device=device) for name in fns}
    columns = [(name, lambda fn=fn, out=outs[name]: fn(a, b, out)) for name, fn in fns.items()]
    failures = []
    for name, fn in columns:
        fn()
        torch.cuda.synchronize(device)
        bad, worst = count_outside(outs[name], ref, dtype)
        if bad:
            failures.append(f"m {m} n {n} k {k} {name}: {bad} elements outside the bound (worst {worst:.2f}x)")
    ms = _timing.local_rounds(columns, args.rounds, args.iters)
    work = 2.0 * m * n * k
    tile_count = (m // tiles.block_m) * (n // tiles.block_n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row = ([m, n, k, round(tile_count / sms, 2), work / ms["matmul"] / 1e9]
           + [work / ms[name] / 1e9 for name in args.kernels]
           + [ratio(ms["matmul"], ms[name]) for name in args.kernels] + ["ok" if not failures else "FAIL"])
    if args.sustain and sustained_rows is not None:
        from tilescale_examples.benchmarks._clocks import sustained

        for name, fn in columns:
            run = sustained(fn, args.sustain)
            tflops = work / run.ms / 1e9
            sustained_rows.append([m, n, name, tflops, run.sm_mhz, run.watts, tflops / run.sm_mhz * 1e3])
    return row, failures


#: Columns of the sustained table (``--sustain``).
SUSTAINED_HEADERS = ["m", "n", "kernel", "TFLOP/s", "SM MHz", "W", "TFLOP/s per GHz"]


def goal_lines(rows: list, kernels) -> list:
    """One line per kernel of ``kernels`` (the table's columns): its smallest ``x matmul``
    (goal >= :data:`GOAL`)."""
    first = 5 + len(kernels)  # the first "x matmul" column
    return [worst_line(f"worst {name} vs torch.matmul", [r[first + i] for r in rows], GOAL)
            for i, name in enumerate(kernels)]


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    from tilescale_lang.autotune import GEMM_TILE_AXES

    from tilescale_examples.overlap.gemm import WARP_POLICIES, GemmTiles, check_gemm_dims

    p = _harness.parser("gemm", __doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1024, 4096], help="rows of a and of the output")
    p.add_argument("--n", type=int, nargs="+", default=[3584, 7168, 28672], help="columns of b and of the output")
    p.add_argument("--k", type=int, default=8192, help="the reduction dimension")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tiles", default=DEFAULT_TILES, metavar="BMxBNxBK:STAGES:THREADS",
                   help=f"tile program of every TileLang column (default {DEFAULT_TILES})")
    p.add_argument("--warp-policy", default="square", choices=list(WARP_POLICIES),
                   help="how the compute warpgroups split a tile (default square, TileLang's)")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                   help="the library kernels to time beside torch.matmul (default all)")
    p.add_argument("--iters", type=int, default=20, help="calls timed per round (median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds timing each column in turn (median)")
    p.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                   help="also run each column back to back this long with the SM clock and board power "
                        "sampled (NVML), a second table (default 0: not)")
    args = _harness.parse_args(p, argv)
    try:
        fields = _harness.tile_fields(args.tiles, GEMM_TILE_AXES)
        tiles = GemmTiles(**fields, warp_policy=args.warp_policy)
        for m in args.m:
            for n in args.n:
                check_gemm_dims("--m/--n/--k", tiles, m=m, n=n, k=args.k)
    except ValueError as exc:
        p.error(str(exc))
    if args.iters < 1 or args.rounds < 1:
        p.error("--iters and --rounds must be >= 1")
    if not args.sustain >= 0:
        p.error(f"--sustain must be >= 0 seconds, got {args.sustain}")
    args.kernels = [name for name in KERNELS if name in args.kernels]  # column order, no repeats
    if any(name in SPECS and SPECS[name][1] == "async" for name in args.kernels) and tiles.num_stages < 2:
        p.error("--tiles: the async and persistent kernels need at least 2 stages")
    if _harness.visible_gpus("GEMM benchmark") == 0:
        return 0
    import torch

    from tilescale_examples.testing.precompile import precompile

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    precompile(kernel_jobs(args.kernels, [(m, n, args.k) for m in args.m for n in args.n], args.dtype, tiles, sms))
    clock_rows: list = []
    rows, failures = collect(([row], bad) for row, bad in (run_case(args, m, n, tiles, device, clock_rows)
                                                           for m in args.m for n in args.n))
    print_table(f"the library's GEMM kernels vs torch.matmul ({args.tiles}, warp policy {args.warp_policy}), "
                f"{torch.cuda.get_device_name(device)}, {args.dtype}; median GPU time of {args.iters} calls, median of {args.rounds} rounds",
                headers(args.kernels), rows)
    for line in stage_lines(args.kernels, tiles):
        print(line)
    if clock_rows:
        print_table(f"the same kernels run back to back for {args.sustain:g} s each, SM clock and board power sampled "
                    f"every 20 ms (median, first quarter dropped), {torch.cuda.get_device_name(device)}",
                    SUSTAINED_HEADERS, clock_rows)
    return print_outcome(failures, goal_lines(rows, args.kernels), "every column against the float32 product")


if __name__ == "__main__":
    raise SystemExit(main())
