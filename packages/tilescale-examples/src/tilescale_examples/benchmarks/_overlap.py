"""TFLOP/s of the overlapped GEMMs against their baselines, all measured in the same run:
what ``benchmarks.ag_gemm`` and ``benchmarks.gemm_rs`` share.

``python -m tilescale_examples.benchmarks.ag_gemm|gemm_rs [--ranks 2] [--m-local
1024,2048,4096,8192] [--k 8192] [--n 3584] [--dtype bfloat16] [--iters 20] [--rounds 5]
[--tiles ... | --tune] [--pipeline sync|async] [--out DIR]`` spawns ``--ranks``
ranks (one per GPU with an NCCL group when there are enough GPUs, else sharing the GPUs over
gloo; the title says which), or runs under ``tilescale-run -n N -m ...``.

For every ``m_local`` (bfloat16, ``k`` 8192 and ``n`` 3584 columns per rank by default: the
tensor-parallel GEMMs of a 70B-class MLP) it times, back to back with CUDA events (the slowest
rank), on the same inputs, in ``--rounds`` rounds that take every column in turn (each
column's median round is reported;
:func:`tilescale_examples.benchmarks._timing.interleaved_ms`, on ``tilescale_host.bench``):

* **TileScale**: :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` /
  :class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter` (its plan is printed);
* **collective + cuBLAS**: ``all_gather_into_tensor`` then ``torch.matmul`` (resp.
  ``torch.matmul`` then ``reduce_scatter_tensor``) on the host group: NCCL with one rank per
  GPU, gloo when ranks share one (host staging: no stand-in for NCCL);
* **async-TP**: torch's ``torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0,
  group_name=...)`` (resp. ``fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0,
  group_name=...)``); ``n/a`` with the reason where it cannot run (it needs an NCCL group
  with one GPU per rank);
* **matmul alone**: ``torch.matmul`` of the already-gathered operand (resp. of ``a``), no
  communication: the ceiling of a perfect overlap;
* **stock TileLang**: :func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`, stock TileLang's
  GEMM with the same tiles as TileScale's, on the same operand as matmul alone.

TFLOP/s is ``2 * world * m_local * n * k / t`` for every column (the GEMM's work), and each
ratio is TileScale's TFLOP/s over the column's. Before timing, every output is checked
element-wise against a float32 torch reference (:func:`~tilescale_examples.overlap.gemm.error_bound`;
the reduce-scatter baselines, which round their partial sums to the dtype up to ``world``
times, get ``world`` times the partials' term); a failure is printed in the row and makes
the exit status 1. Inputs come from seeded generators, so every rank builds every other
rank's inputs for its reference without communication.
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._collectives import HEAP_SLACK, pick_baseline
from tilescale_examples.benchmarks._report import print_table

__all__ = ["OPS", "main", "run", "tflops", "parser", "heap_for", "entry"]

COLUMNS = ["TileScale", "collective + cuBLAS", "async-TP", "matmul alone", "stock TileLang"]
HEADERS = (["m_local", "M x N x K", "plan"] + [f"{c} TFLOP/s" for c in COLUMNS]
           + [f"x {c}" for c in COLUMNS[1:]] + ["check"])

#: op -> (title, TileScale class module, class, collective of the baseline, async-TP op)
OPS = {
    "ag_gemm": ("all-gather + GEMM", "ag_gemm", "AllGatherGEMM", "allgather", "fused_all_gather_matmul"),
    "gemm_rs": ("GEMM + reduce-scatter", "gemm_rs", "GemmReduceScatter", "reducescatter", "fused_matmul_reduce_scatter"),
}


def tflops(flops: float, milliseconds: float) -> float:
    """TFLOP/s of ``flops`` floating-point operations in ``milliseconds``."""
    return flops / (milliseconds * 1e-3) / 1e12


def _op_class(op: str):
    import importlib

    return getattr(importlib.import_module(f"tilescale_examples.overlap.{OPS[op][1]}"), OPS[op][2])


def heap_for(op: str, world: int, m_local: int, k: int, n: int, dtype, device=None) -> int:
    """Symmetric heap per rank for one op object of this size: what its constructor allocates
    (the class's ``heap_bytes``, a dry run on ``device``'s SM count), plus the collectives'
    :data:`~tilescale_examples.benchmarks._collectives.HEAP_SLACK`."""
    return _op_class(op).heap_bytes(m_local, k, n, dtype, world_size=world, device=device) + HEAP_SLACK


# ------------------------------------------------------------------------------ inputs
def _randn(shape, seed: int, device, scale: float, dtype):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def rank_inputs(op: str, p: int, world: int, m_local: int, k: int, n: int, dtype, device):
    """Rank ``p``'s ``(a, b)`` (any rank can build any rank's): ``a`` standard normal, ``b``
    scaled by ``k**-0.5`` so that every output element is about N(0, 1) per rank."""
    rows = m_local if op == "ag_gemm" else world * m_local
    return (_randn((rows, k), 1_000_003 + 7919 * p, device, 1.0, dtype),
            _randn((k, n), 2_000_006 + 7919 * p, device, k ** -0.5, dtype))


def reference(op: str, rank: int, world: int, m_local: int, k: int, n: int, dtype, device):
    """``(ref, rounded)``: this rank's float32 result and the partials' magnitudes (None for
    the all-gather, which rounds nothing before its output)."""
    if op == "ag_gemm":
        from tilescale_examples.overlap.ag_gemm import torch_reference

        return torch_reference([rank_inputs(op, p, world, m_local, k, n, dtype, device) for p in range(world)], rank), None
    rows = slice(rank * m_local, (rank + 1) * m_local)
    ref = rounded = None
    for p in range(world):  # one rank's inputs at a time: a is world * m_local rows
        a, b = rank_inputs(op, p, world, m_local, k, n, dtype, device)
        part = a[rows].float() @ b.float()
        ref, rounded = (part, part.abs()) if ref is None else (ref + part, rounded + part.abs())
    return ref, rounded


# ------------------------------------------------------------------------------ one size
class _Columns:
    """The callables to time on this rank for one size, each returning its output, and the
    check of each output."""

    def __init__(self, op, rank, world, group, device, m_local, k, n, dtype, obj):
        import dataclasses

        import torch
        import torch.distributed as dist

        from tilescale_examples.base import compile_once
        from tilescale_examples.overlap.gemm import DTYPES, build_gemm_kernel

        self.op, self.world, self.dtype, self.group = op, world, dtype, group
        self.a, self.b = rank_inputs(op, rank, world, m_local, k, n, dtype, device)
        self.ref, self.rounded = reference(op, rank, world, m_local, k, n, dtype, device)
        M = world * m_local
        if op == "ag_gemm":  # the gathered operand, as an all-gather produces it
            self.full_a = torch.cat([rank_inputs(op, p, world, m_local, k, n, dtype, device)[0] for p in range(world)])
            self.local_ref = self.ref
        else:
            self.full_a = self.a
            self.local_ref = self.a.float() @ self.b.float()  # this rank's product, before the reduction
        self.obj = obj
        try:  # the backend's collective (NCCL; gloo may lack it for CUDA tensors of this dtype)
            self._coll_name, self._coll = pick_baseline(OPS[op][3], group, device, dtype)
            self._coll_why = ""
        except RuntimeError as exc:
            self._coll, self._coll_why = None, str(exc)
        self.buf = torch.empty((M, k) if op == "ag_gemm" else (M, n), dtype=dtype, device=device)
        self.out = torch.empty((M, n) if op == "ag_gemm" else (m_local, n), dtype=dtype, device=device)
        self.mm_out = torch.empty((M, n), dtype=dtype, device=device)
        self.stock_out = torch.empty((M, n), dtype=dtype, device=device)
        stock_tiles = dataclasses.replace(obj.tiles, pipeline="sync")  # stock TileLang's mainloop, the op's tiles
        self.stock = compile_once(build_gemm_kernel(M, n, k, DTYPES[dtype], stock_tiles), group)
        self.gname = group.group_name if hasattr(group, "group_name") else dist.group.WORLD.group_name
        self.backend = dist.get_backend(group)

    def tilescale(self):
        return self.obj(self.a, self.b)

    def collective_cublas(self):
        import torch

        if self.op == "ag_gemm":
            self._coll(self.buf.view(-1), self.a.view(-1))
            return torch.matmul(self.buf, self.b, out=self.out)
        torch.matmul(self.a, self.b, out=self.buf)
        self._coll(self.out.view(-1), self.buf.view(-1))
        return self.out

    def available(self, column: str) -> tuple:
        """``(ok, reason)``: whether ``column`` can run here. The collective needs a backend
        that has it; torch's async-TP needs its ops and an NCCL group (one GPU per rank)."""
        import torch

        if column == "collective + cuBLAS":
            return self._coll is not None, self._coll_why
        if column != "async-TP":
            return True, ""
        if self.backend != "nccl":
            return False, f"needs an NCCL group with one GPU per rank (this run: {self.backend}, ranks share a GPU)"
        try:
            import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem.*)
        except ImportError as exc:
            return False, f"torch.distributed._symmetric_memory: {exc}"
        if not hasattr(torch.ops.symm_mem, OPS[self.op][4]):
            return False, f"torch.ops.symm_mem.{OPS[self.op][4]} is missing from torch {torch.__version__}"
        return True, ""

    def async_tp(self):
        import torch

        if self.op == "ag_gemm":
            return torch.ops.symm_mem.fused_all_gather_matmul(self.a, [self.b], gather_dim=0, group_name=self.gname)[1][0]
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(self.a, self.b, "sum", scatter_dim=0, group_name=self.gname)

    def matmul_alone(self):
        import torch

        return torch.matmul(self.full_a, self.b, out=self.mm_out)

    def stock_tilelang(self):
        self.stock(self.full_a, self.b, self.stock_out)
        return self.stock_out

    def check(self, column: str, out) -> int:
        """Elements of ``out`` outside the column's bound."""
        from tilescale_examples.overlap.gemm import count_outside

        if column in ("matmul alone", "stock TileLang"):
            return count_outside(out, self.local_ref, self.dtype)[0]
        rounded = self.rounded
        if rounded is not None and column != "TileScale":
            rounded = self.world * rounded  # baselines may round each partial sum
        return count_outside(out, self.ref, self.dtype, rounded)[0]


def _measure_size(op, rank, world, group, device, m_local, args):
    """``(row, failures)`` for one ``m_local`` (every rank makes the same collectives)."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_examples.base import all_ranks_agree, collective_device
    from tilescale_examples.overlap.stream_ops import log

    dtype = getattr(torch, args.dtype)
    title = OPS[op][0]
    alloc = tilelang.get_allocator(size=heap_for(op, world, m_local, args.k, args.n, dtype, device), device=device,
                                   is_distributed=True, local_rank=rank, num_local_ranks=world, group=group)
    tiles, tiles_text = dict(args.tiles or {}, pipeline=args.pipeline), None
    if args.tiles:  # fixed by --tiles (parsed by main)
        tiles_text = TILES_FORMAT.format(**tiles) + " (--tiles)"
    elif args.tune:  # the library GEMM's tiles for this shape, the same on every rank (cached on disk)
        import dataclasses

        from tilescale_lang.autotune import gemm_space

        from tilescale_examples.overlap.tuning import SWIZZLES, tune_tiles

        space = gemm_space(world * m_local, args.n, args.k, args.dtype, swizzle=SWIZZLES, pipeline=(args.pipeline,),
                           valid=lambda config: m_local % config["block_m"] == 0)  # the op's rows per rank too
        tuned, result = tune_tiles(world * m_local, args.n, args.k, dtype, device=device, group=group, space=space)
        tiles = dataclasses.asdict(tuned)
        tiles_text = TILES_FORMAT.format(**tiles) + f" ({result.source})"
    obj = _op_class(op)(alloc, m_local, args.k, args.n, dtype, group=group, **tiles)
    cols = _Columns(op, rank, world, group, device, m_local, args.k, args.n, dtype, obj)
    calls = {"TileScale": cols.tilescale, "collective + cuBLAS": cols.collective_cublas,
             "async-TP": cols.async_tp, "matmul alone": cols.matmul_alone, "stock TileLang": cols.stock_tilelang}
    notes, bad = {}, {}
    for name, fn in calls.items():
        ok, why = True, ""
        if name in ("collective + cuBLAS", "async-TP"):  # optional: the backend or torch may lack them
            ok, why = cols.available(name)
            if ok:
                try:
                    out = fn()
                    torch.cuda.synchronize(device)
                except Exception as exc:
                    ok, why = False, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            if not all_ranks_agree(ok, group, device):  # time it only if it ran on every rank
                notes[name] = why or "failed on another rank"
                continue
        else:
            out = fn()
            torch.cuda.synchronize(device)
        bad[name] = cols.check(name, out)
    times = _timing.interleaved_ms({name: fn for name, fn in calls.items() if name not in notes},
                                   args.iters, args.rounds, group, device)
    for name, note in notes.items():
        if rank == 0:
            log.warning("%s m_local=%d: %s n/a: %s", title, m_local, name, note)
    flag = torch.tensor([sum(bad.values())], dtype=torch.int64,
                        device=collective_device(group, device))
    dist.all_reduce(flag, group=group)
    failed = [name for name, count in bad.items() if count]
    failed = _gather_names(failed, group)
    flops = obj.flops()
    ts = {name: tflops(flops, ms) for name, ms in times.items()}
    row = [m_local, f"{world * m_local}x{args.n}x{args.k}", obj.plan]
    row += [ts.get(c, "n/a") for c in COLUMNS]
    row += [ts["TileScale"] / ts[c] if c in ts else "n/a" for c in COLUMNS[1:]]
    row.append("ok" if int(flag.item()) == 0 else "FAIL: " + ", ".join(failed))
    if tiles_text is not None:
        row.append(tiles_text)
    obj.close()
    del cols
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return row, int(flag.item()), notes


#: How the tiles column prints a GemmTiles' fields.
TILES_FORMAT = "{block_m}x{block_n}x{block_k} s{num_stages} t{threads} w{swizzle} {pipeline}"


def parse_tiles(text: str) -> dict:
    """``--tiles BMxBNxBK[:STAGES[:THREADS[:SWIZZLE]]]`` as GemmTiles keyword arguments, every
    integer field (those left out: GemmTiles' defaults; the pipeline is ``--pipeline``'s, the
    warp policy GemmTiles' default); ``ValueError`` naming the argument on a malformed or invalid
    value."""
    import dataclasses

    from tilescale_lang.autotune import GEMM_TILE_AXES

    from tilescale_examples.overlap.gemm import GemmTiles

    names = GEMM_TILE_AXES + ("swizzle",)  # the string's order: GemmTiles' integer fields
    return {name: value for name, value in dataclasses.asdict(GemmTiles(**_harness.tile_fields(text, names))).items()
            if name in names}


def _gather_names(names, group):
    """The union over ranks of ``names`` (sorted), via ``all_gather_object``."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(names), group=group)
    return sorted({n for part in gathered for n in part})


def run(op: str, rank: int, world: int, group, device, args) -> list | None:
    """One rank's part; returns ``[rows, failures, notes]`` on rank 0 (None elsewhere)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references in float32
    rows, failures, notes = [], 0, {}
    for m_local in args.sizes:
        row, bad, why = _measure_size(op, rank, world, group, device, m_local, args)
        rows.append(row)
        failures += bad
        notes.update(why)
    return [rows, failures, notes] if rank == 0 else None


def _run_op(rank, world, group, device, op, args):
    return run(op, rank, world, group, device, args)


def parser(op: str):
    """The benchmark's command line (``--out DIR`` included, :func:`_harness.parser`)."""
    p = _harness.parser(op, f"{OPS[op][0]}: TileScale's {OPS[op][2]} against the collective + cuBLAS, torch "
                            "async-TP, matmul alone and stock TileLang, same run.")
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn (ignored under tilescale-run)")
    p.add_argument("--m-local", default="1024,2048,4096,8192", help="comma-separated rows per rank (a subset)")
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=3584, help="output columns per rank")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--iters", type=int, default=20, help="timed back-to-back calls per column and round")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds over all columns; each column's median round is reported")
    p.add_argument("--tune", action="store_true",
                   help="tiles from the autotuner for the GEMM of world_size * m_local rows (cached on disk; "
                        "TILESCALE_AUTOTUNE=cache_only reads the cache only), shown in a tiles column")
    p.add_argument("--tiles", default=None, metavar="BMxBNxBK[:STAGES[:THREADS[:SWIZZLE]]]",
                   help="the library GEMM's tiles for every size (the stock TileLang column uses them too), "
                        "e.g. 128x256x64:3:256:8 for a rasterized block order of panel 8; shown in a tiles column")
    p.add_argument("--pipeline", default="sync", choices=["sync", "async"],
                   help="the library GEMM's mainloop (GemmTiles.pipeline; with --tune, the one the tuner tries): "
                        "sync (stock TileLang's) or async (one WGMMA group in flight); the stock TileLang column "
                        "stays sync")
    return p


def title(op: str, world: int, backend: str, gpus: int, args) -> str:
    """The table title: op, ranks, dtype, shapes and the GPU mode (shared GPUs say so)."""
    name = OPS[op][0]
    mode = _harness.gpu_mode(world, backend, gpus, "collective")
    pipeline = ", TileScale's GEMM with the async pipeline" if getattr(args, "pipeline", "sync") == "async" else ""
    return (f"{name}, {world} rank(s), {args.dtype}, k={args.k}, n={args.n} per rank{pipeline}; {mode}; "
            f"TFLOP/s = 2*M*N*K/t; x col = TileScale TFLOP/s / col TFLOP/s")


def main(op: str, argv=None) -> int:
    """0 when every check passed (or there is no GPU to measure on), 1 otherwise."""
    p = parser(op)
    args = _harness.parse_args(p, argv)
    if args.ranks < 1:
        p.error("--ranks must be >= 1")
    try:
        args.sizes = [int(m) for m in args.m_local.split(",")]
    except ValueError:
        p.error(f"--m-local must be comma-separated ints, got {args.m_local!r}")
    if any(m < 1 for m in args.sizes) or args.k < 1 or args.n < 1 or args.iters < 1 or args.rounds < 1:
        p.error("--m-local, --k, --n, --iters and --rounds must be positive")
    from tilescale_examples.overlap.gemm import GemmTiles, check_gemm_dims

    if args.tiles is not None and args.tune:
        p.error("--tiles and --tune pick the tiles two ways; pass one")
    try:  # before any rank starts: a clear message naming the argument
        args.tiles = parse_tiles(args.tiles) if args.tiles is not None else None
        for m in args.sizes:
            check_gemm_dims(OPS[op][2], GemmTiles(**(args.tiles or {}), pipeline=args.pipeline), m_local=m, k=args.k,
                            n=args.n)
    except ValueError as exc:
        p.error(str(exc))
    gpus = _harness.visible_gpus(f"{OPS[op][0]} benchmark")
    if gpus == 0:
        return 0
    result, backend, world = _harness.run_on_ranks(_run_op, args.ranks, op, args)
    if result is None:
        return 0
    rows, failures, notes = result
    headers = HEADERS + (["tiles"] if args.tune or args.tiles else [])
    print_table(title(op, world, backend, min(gpus, world), args), headers, rows)
    for name, why in sorted(notes.items()):
        print(f"n/a {name}: {why}")
    print(f"\ncorrectness (every column's output vs a float32 torch reference, element-wise bound): "
          f"{'ok' if failures == 0 else f'{failures} element(s) outside'}")
    return 0 if failures == 0 else 1


def entry(op: str):
    """``(main, run)`` of one op (a key of :data:`OPS`), for its entry module."""
    import functools

    return functools.partial(main, op), functools.partial(run, op)
