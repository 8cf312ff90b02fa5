"""A stream-K GEMM ``C = A @ B``: a persistent grid of one block per SM whose last wave of
tiles is cut along ``k`` so that every SM gets the same number of ``k`` steps.

Why
---

A grid of one block per output tile runs in waves of one block per SM. When the tile count
is not a multiple of the SM count, the last wave leaves SMs idle: 112 tiles of ``128 x 256``
(``m`` 1024, ``n`` 3584) use 112 of an H100's 132 SMs, 448 tiles (``m`` 4096) run in 3.39
waves, the last one at 39 %. The GEMM then takes as long as if the tiles filled every wave.
Stream-K (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix
Multiplication on the GPU", 2023) gives every block the same share of the ``k`` steps instead.

The schedule (:class:`StreamKPlan`)
-----------------------------------

The output's ``tiles = (m / block_m) * (n / block_n)`` tiles are numbered column block by
column block (tile ``t`` at row block ``t % (m / block_m)``, column block ``t // (m /
block_m)``: the blocks running at once share columns of ``B`` in L2), each of ``iters = k /
block_k`` steps, over ``blocks`` blocks (the SM count):

* *Data-parallel tiles*: when the tiles fill at least two waves, all but the last full wave
  and the remainder are whole tiles, ``dp_tiles = (tiles // blocks - 1) * blocks``: block
  ``b`` computes tiles ``i * blocks + b``. When the tiles are a whole number of waves, every
  tile is data-parallel.
* *Stream-K tiles*: the other ``sk_tiles`` tiles' ``sk_tiles * iters`` steps are dealt out in
  contiguous ranges, ``q = total // blocks`` each and one more to the first ``total %
  blocks`` blocks. A block's range crosses tile boundaries; each tile it touches is a
  *segment*: a whole tile (stored directly) or a part of one.
* *Order*: a block computes its data-parallel tiles, then its segments **last first**: the
  last segment starts at ``k`` step 0 (the head of a tile), the whole tiles too, the first
  one at some step ``lo`` (the tail of a tile). So the blocks running at once stay close
  along ``k`` (with ``q < iters``: within ``iters - q`` steps of each other) and share the
  ``k`` slabs of ``A`` and ``B`` in L2, as the data-parallel tiles do. In range order the
  blocks would start at scattered ``k`` offsets and read ``A`` and ``B`` from memory tile by
  tile (2.4-3.3x slower per step than the data-parallel tiles, measured on an H200).
* *Fix-up*: a block that computes part of a tile stores its float32 partial into its own slot
  of a workspace (``2 * blocks`` slots of ``block_m x block_n``: a block has at most two
  partial segments, its first and its last) and adds one to the tile's arrival counter. The
  block that arrives last (the counter reaches the tile's number of contributors) adds every
  contributor's partial **in ``k`` order** (so the result does not depend on which block
  arrives last), rounds once into ``C`` and resets the counter to 0 for the next call. No
  block ever waits for another: the schedule is deadlock-free even when the grid's blocks are
  not all resident (other kernels on the GPU), and the counters return to zero at the end of
  every call (CUDA-graph replays and back-to-back calls need nothing else). Two calls must
  not run concurrently on the same workspace (one instance per stream at a time).

The plan is computed on the host (:class:`StreamKPlan`) and handed to the kernel as two small
int32 tables (:func:`schedule_tables`): each block's units, each stream-K tile's contributors.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from dataclasses import dataclass
from typing import Optional

import torch

from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, check_gemm_dims, check_sync_pipeline, gemm_mainloop_span

__all__ = ["StreamKPlan", "Segment", "StreamKGemm", "build_stream_k_gemm", "workspace_shapes", "schedule_tables",
           "default_blocks",
           "DEFAULT_BLOCKS", "STREAM_K_TILES", "MIN_STEPS_PER_BLOCK"]

#: Blocks of the persistent grid when the caller names none and no GPU says otherwise: an
#: H100 / H200 has 132 SMs.
DEFAULT_BLOCKS = 132
#: The tiles :class:`StreamKGemm` uses when given none: the library GEMM's ``128 x 256 x 64``
#: with 4 stages (the autotuner's choice for the library GEMM at k 8192 on an H100).
STREAM_K_TILES = GemmTiles(num_stages=4)
#: ``k`` steps each block gets at least under :func:`default_blocks` (a smaller GEMM runs on
#: fewer blocks rather than cutting its tiles into one-step partials).
MIN_STEPS_PER_BLOCK = 4


def default_blocks(m: int, n: int, k: int, tiles: GemmTiles, sm_count: int) -> int:
    """The grid :class:`StreamKGemm` takes when given none: one block per SM, fewer when the
    GEMM has fewer than :data:`MIN_STEPS_PER_BLOCK` ``k`` steps per SM (``(m / block_m) * (n /
    block_n) * (k / block_k)`` steps in all)."""
    steps = (m // tiles.block_m) * (n // tiles.block_n) * (k // tiles.block_k)
    return max(1, min(sm_count, steps // MIN_STEPS_PER_BLOCK))


@dataclass(frozen=True)
class Segment:
    """One tile a block computes (or part of one): stream-K tile ``tile`` (0-based among the
    stream-K tiles), its ``k`` steps ``lo .. hi`` (of ``block_k``), and the workspace slot of
    its partial (``None`` for a whole tile, stored directly)."""

    tile: int
    lo: int
    hi: int
    slot: Optional[int]


@dataclass(frozen=True)
class StreamKPlan:
    """The stream-K schedule of a ``(row_blocks * block_m, k) @ (k, col_blocks * block_n)``
    GEMM over ``blocks`` blocks (see the module docstring).

    Attributes:
        row_blocks, col_blocks: the output's tile rows and columns.
        iters: ``k`` steps per tile (``k / block_k``).
        blocks: blocks of the persistent grid.
    """

    row_blocks: int
    col_blocks: int
    iters: int
    blocks: int

    def __post_init__(self):
        for name in ("row_blocks", "col_blocks", "iters", "blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def tiles(self) -> int:
        """Output tiles."""
        return self.row_blocks * self.col_blocks

    @property
    def dp_tiles(self) -> int:
        """Tiles computed whole, one block each (a multiple of ``blocks``)."""
        waves, rest = divmod(self.tiles, self.blocks)
        if rest == 0:
            return self.tiles
        return max(waves - 1, 0) * self.blocks

    @property
    def dp_waves(self) -> int:
        """Data-parallel tiles per block."""
        return self.dp_tiles // self.blocks

    @property
    def sk_tiles(self) -> int:
        """Tiles whose ``k`` steps are dealt out over the blocks."""
        return self.tiles - self.dp_tiles

    @property
    def share(self) -> tuple:
        """``(q, r)``: every block gets ``q`` stream-K steps, the first ``r`` one more."""
        return divmod(self.sk_tiles * self.iters, self.blocks)

    def sk_range(self, b):
        """``(start, end)``: block ``b``'s stream-K steps (global step ``x`` is step ``x %
        iters`` of stream-K tile ``x // iters``)."""
        q, r = self.share
        start = b * q + min(b, r)
        return start, start + q + (1 if b < r else 0)

    def owner(self, x):
        """The block whose range holds stream-K step ``x``."""
        q, r = self.share
        if q == 0:  # every step is in the first r blocks' one-step ranges
            return x
        edge = r * (q + 1)
        return x // (q + 1) if x < edge else r + (x - edge) // q

    def segment_count(self, b):
        """Segments (tiles touched) of block ``b``'s stream-K range."""
        start, end = self.sk_range(b)
        return (end - 1) // self.iters - start // self.iters + 1 if end > start else 0

    def segment(self, b, s):
        """``(tile, lo, hi)`` of block ``b``'s segment ``s``."""
        start, end = self.sk_range(b)
        tile = start // self.iters + s
        base = tile * self.iters
        return tile, max(start - base, 0), min(end - base, self.iters)

    def order(self, b: int) -> list:
        """Block ``b``'s stream-K :class:`Segment` s in the order the kernel computes them:
        last first (each starts at a lower ``k`` step than the one before it in range order:
        the module docstring's "Order")."""
        return self.segments(b)[::-1]

    def slot(self, b, s):
        """Workspace slot of block ``b``'s partial segment ``s``: its first, else its last."""
        return 2 * b + (1 if s > 0 else 0)

    def contributors(self, tile):
        """``(first block, count)`` of the blocks whose ranges cover stream-K tile ``tile``."""
        first = self.owner(tile * self.iters)
        return first, self.owner(tile * self.iters + self.iters - 1) - first + 1

    def contributor_slot(self, tile, c):
        """Workspace slot in which block ``c`` keeps its partial of stream-K tile ``tile``."""
        start, _ = self.sk_range(c)
        return 2 * c + (0 if tile == start // self.iters else 1)

    def segments(self, b: int) -> list:
        """Block ``b``'s stream-K :class:`Segment` s, in order (Python ints only)."""
        out = []
        for s in range(self.segment_count(b)):
            tile, lo, hi = self.segment(b, s)
            whole = lo == 0 and hi == self.iters
            out.append(Segment(tile, lo, hi, None if whole else self.slot(b, s)))
        return out

    @property
    def max_units(self) -> int:
        """The most units (data-parallel tiles and stream-K segments) any block computes."""
        return self.dp_waves + max(self.segment_count(b) for b in range(self.blocks))

    @property
    def max_contributors(self) -> int:
        """The most blocks that compute parts of one stream-K tile (at least 1)."""
        return max([1] + [self.contributors(t)[1] for t in range(self.sk_tiles)])

    def tile_position(self, t):
        """``(row block, column block)`` of output tile ``t`` (data-parallel tiles first, then
        the stream-K tiles from ``dp_tiles``)."""
        return t % self.row_blocks, t // self.row_blocks


def workspace_shapes(tiles: GemmTiles, plan: StreamKPlan) -> dict:
    """Shapes of the kernel's scratch and schedule buffers: ``work`` (float32 partials, ``(2 *
    blocks * block_m, block_n)``, any contents), ``counts`` (int32 arrival counters, one per
    stream-K tile, at least one element, zero between calls) and the two tables of
    :func:`schedule_tables`, ``units`` and ``fix``."""
    return {"work": (2 * plan.blocks * tiles.block_m, tiles.block_n), "counts": (max(plan.sk_tiles, 1),),
            "units": (plan.blocks, 1 + plan.max_units, 4), "fix": (max(plan.sk_tiles, 1), 1 + plan.max_contributors)}


def schedule_tables(plan: StreamKPlan) -> tuple:
    """``(units, fix)``: the plan as the kernel reads it (int32 CPU tensors of
    :func:`workspace_shapes`' shapes).

    ``units[b, 0, 0]``: block ``b``'s unit count; ``units[b, 1 + u]``: its unit ``u`` in the
    kernel's order (data-parallel tiles, then :meth:`StreamKPlan.order`) as ``(output tile,
    lo, hi, slot)``: the tile's ``k`` steps ``lo .. hi``, ``slot`` -1 for a whole tile (stored
    directly) else the workspace slot of the partial. ``fix[s, 0]``: stream-K tile ``s``'s
    contributor count; ``fix[s, 1 + j]``: the slot of its ``j``-th contributor's partial, in
    ``k`` order. (Tables, not formulas in the kernel: TileLang inlines scalar bindings, and the
    plan's nested expressions at every use made lowering take minutes.)"""
    units = torch.zeros((plan.blocks, 1 + plan.max_units, 4), dtype=torch.int32)
    for b in range(plan.blocks):
        rows = [(i * plan.blocks + b, 0, plan.iters, -1) for i in range(plan.dp_waves)]
        rows += [(plan.dp_tiles + g.tile, g.lo, g.hi, -1 if g.slot is None else g.slot) for g in plan.order(b)]
        units[b, 0, 0] = len(rows)
        if rows:
            units[b, 1:1 + len(rows)] = torch.tensor(rows, dtype=torch.int32)
    fix = torch.zeros((max(plan.sk_tiles, 1), 1 + plan.max_contributors), dtype=torch.int32)
    for tile in range(plan.sk_tiles):
        first, count = plan.contributors(tile)
        fix[tile, 0] = count
        fix[tile, 1:1 + count] = torch.tensor([plan.contributor_slot(tile, c) for c in range(first, first + count)],
                                              dtype=torch.int32)
    return units, fix


def build_stream_k_gemm(m: int, n: int, k: int, dtype: str = "bfloat16", tiles: Optional[GemmTiles] = None,
                        blocks: int = DEFAULT_BLOCKS):
    """The stream-K GEMM ``T.prim_func`` (module docstring): ``C = A @ B`` with ``A: (m, k)``,
    ``B: (k, n)``, ``C: (m, n)`` of ``dtype`` (float32 accumulation), ``tiles`` (default
    :class:`GemmTiles`' defaults; ``swizzle`` is not used: the tile order is the plan's) and a
    grid of ``blocks`` blocks (one per SM; more only queue behind each other, and are correct:
    no block waits for another). Signature::

        A, B, C        as above
        Work: (2 * blocks * block_m, block_n) float32   partials (any contents)
        Counts: (max(sk_tiles, 1),) int32               arrival counters, zero between calls
        Units, Fix: int32                               :func:`schedule_tables` of the plan

    (:func:`workspace_shapes`). Every dimension must be a multiple of its tile (``ValueError``
    naming it)."""
    import tilelang.language as T

    tiles = tiles or GemmTiles()
    check_gemm_dims("build_stream_k_gemm", tiles, m=m, k=k, n=n)
    check_sync_pipeline("build_stream_k_gemm", tiles)
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        raise ValueError(f"blocks must be a positive int, got {blocks!r}")
    BM, BN, BK, TH = tiles.block_m, tiles.block_n, tiles.block_k, tiles.threads
    plan = StreamKPlan(m // BM, n // BN, k // tiles.block_k, blocks)
    shapes = workspace_shapes(tiles, plan)
    mainloop = gemm_mainloop_span(dtype, tiles)
    DP, MT = plan.dp_tiles, plan.row_blocks

    @T.prim_func
    def stream_k_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype),
                      Work: T.Tensor(shapes["work"], "float32"), Counts: T.Tensor(shapes["counts"], "int32"),
                      Units: T.Tensor(shapes["units"], "int32"), Fix: T.Tensor(shapes["fix"], "int32")):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            C_f = T.alloc_fragment((BM, BN), "float32")
            arrived = T.alloc_shared((1,), "int32")
            # One loop over the block's units (its row of Units: data-parallel tiles, then its
            # stream-K segments, last first) around one mainloop: TileLang's warp-specialised
            # lowering takes one pipelined loop per kernel.
            t = T.alloc_var("int32")
            slot = T.alloc_var("int32")
            for u in T.serial(Units[bx, 0, 0]):
                t = Units[bx, 1 + u, 0]
                slot = Units[bx, 1 + u, 3]
                mainloop(A, B, C_f, t % MT * BM, t // MT * BN, Units[bx, 1 + u, 1] * BK,
                         Units[bx, 1 + u, 2] - Units[bx, 1 + u, 1])
                if slot < 0:  # a whole tile
                    T.copy(C_f, C[t % MT * BM, t // MT * BN])
                else:
                    T.copy(C_f, Work[slot * BM, 0])
                    T.sync_threads()
                    if tx == 0:
                        arrived[0] = T.atomic_add(Counts[t - DP], 1, memory_order="acq_rel", return_prev=True) + 1
                        if arrived[0] == Fix[t - DP, 0]:
                            Counts[t - DP] = 0  # the last arrival: ready for the next call
                    T.sync_threads()
                    if arrived[0] == Fix[t - DP, 0]:
                        T.clear(C_f)
                        for j in T.serial(Fix[t - DP, 0]):
                            for r, c in T.Parallel(BM, BN):
                                C_f[r, c] += Work[Fix[t - DP, 1 + j] * BM + r, c]
                        T.copy(C_f, C[t % MT * BM, t // MT * BN])

    return stream_k_gemm.with_attr("global_symbol", "stream_k_gemm")


class StreamKGemm:
    """``C = A @ B`` on one GPU with the stream-K schedule (module docstring): an op built for
    one shape, holding its compiled kernel and its scratch buffers.

    Args:
        m, n, k: the GEMM's dimensions (multiples of the tiles' ``block_m``, ``block_n``,
            ``block_k``; ``ValueError`` naming the one that is not).
        dtype: ``torch.bfloat16`` or ``torch.float16`` (``A``, ``B``, ``C``; float32
            accumulation).
        tiles: the tile program (default :data:`STREAM_K_TILES`).
        blocks: blocks of the persistent grid (default :func:`default_blocks`: the device's
            SM count, fewer for a small GEMM; more than the SM count only queues blocks behind
            each other).
        device: the CUDA device (default the current one).

    Scratch: ``work`` (float32, ``2 * blocks * block_m * block_n`` elements: 32 MiB for the
    default tiles on 132 SMs) and ``counts`` (int32, one per stream-K tile, zero between
    calls). Calls run on the current stream; two calls of one instance must not run
    concurrently (on two streams without ordering between them). A call is CUDA-graph safe:
    the counters are back at zero when its kernel ends.
    """

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, tiles: Optional[GemmTiles] = None,
                 blocks: Optional[int] = None, device=None):
        from tilescale_examples._contract import sm_count_of
        from tilescale_examples.base import compile_once

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(str(d) for d in DTYPES)}, got {dtype}")
        self.tiles = STREAM_K_TILES if tiles is None else tiles
        if not isinstance(self.tiles, GemmTiles):
            raise TypeError(f"tiles must be a GemmTiles, got {type(self.tiles).__name__}")
        check_sync_pipeline("StreamKGemm", self.tiles)
        check_gemm_dims("StreamKGemm", self.tiles, m=m, n=n, k=k)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.blocks = default_blocks(m, n, k, self.tiles, sm_count_of(self.device)) if blocks is None else blocks
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or self.blocks < 1:
            raise ValueError(f"blocks must be a positive int, got {blocks!r}")
        self.m, self.n, self.k, self.dtype = m, n, k, dtype
        self.plan = StreamKPlan(m // self.tiles.block_m, n // self.tiles.block_n, k // self.tiles.block_k, self.blocks)
        shapes = workspace_shapes(self.tiles, self.plan)
        self.kernel = compile_once(build_stream_k_gemm(m, n, k, DTYPES[dtype], self.tiles, self.blocks))
        self.work = torch.empty(shapes["work"], dtype=torch.float32, device=self.device)
        self.counts = torch.zeros(shapes["counts"], dtype=torch.int32, device=self.device)
        self.units, self.fix = (t.to(self.device) for t in schedule_tables(self.plan))
        self.output = torch.empty((m, n), dtype=dtype, device=self.device)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``a @ b`` (``a``: ``(m, k)``, ``b``: ``(k, n)``, contiguous, the op's dtype and
        device) into ``out`` (a contiguous ``(m, n)`` tensor overlapping neither) or ``self.output`` (overwritten
        by the next call), on the current stream; returns where it wrote. A bad argument is a
        ``TypeError`` / ``ValueError`` naming it, before any kernel runs."""
        from tilescale_examples._checks import check_disjoint, check_tensor

        check_tensor(a, (self.m, self.k), self.dtype, self.device, "a", "(m, k)", "StreamKGemm")
        check_tensor(b, (self.k, self.n), self.dtype, self.device, "b", "(k, n)", "StreamKGemm")
        result = self.output if out is None else out
        if out is not None:
            check_tensor(out, (self.m, self.n), self.dtype, self.device, "out", "(m, n)", "StreamKGemm")
            check_disjoint({"out": out}, {"a": a, "b": b}, "the kernel reads a and b while it writes out")
        self.kernel(a, b, result, self.work, self.counts, self.units, self.fix)
        return result

    def flops(self) -> float:
        """Floating-point operations of one call: ``2 * m * n * k``."""
        return 2.0 * self.m * self.n * self.k

    def __repr__(self) -> str:
        return (f"StreamKGemm(m={self.m}, n={self.n}, k={self.k}, dtype={self.dtype}, blocks={self.blocks}, "
                f"dp_tiles={self.plan.dp_tiles}, sk_tiles={self.plan.sk_tiles})")
