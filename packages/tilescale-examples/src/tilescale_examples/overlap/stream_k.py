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

The plan's arithmetic is written once (:meth:`StreamKPlan.sk_range`, :meth:`StreamKPlan.owner`,
...) on values that are either Python ints (the CPU tests walk the whole schedule) or TIR
expressions (the kernel).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from dataclasses import dataclass
from typing import Optional

import torch

from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, check_gemm_dims, gemm_mainloop_span

__all__ = ["StreamKPlan", "Segment", "StreamKGemm", "build_stream_k_gemm", "workspace_shapes", "default_blocks",
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


def _is_int(*values) -> bool:
    return all(isinstance(v, int) for v in values)


def _min(a, b):
    if _is_int(a, b):
        return min(a, b)
    import tilelang.language as T
    return T.min(a, b)


def _max(a, b):
    if _is_int(a, b):
        return max(a, b)
    import tilelang.language as T
    return T.max(a, b)


def _select(cond, a, b):
    if isinstance(cond, bool):
        return a if cond else b
    import tilelang.language as T
    return T.if_then_else(cond, a, b)


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
        start = b * q + _min(b, r)
        return start, start + q + _select(b < r, 1, 0)

    def owner(self, x):
        """The block whose range holds stream-K step ``x``."""
        q, r = self.share
        if q == 0:  # every step is in the first r blocks' one-step ranges
            return x
        edge = r * (q + 1)
        return _select(x < edge, x // (q + 1), r + (x - edge) // q)

    def segment_count(self, b):
        """Segments (tiles touched) of block ``b``'s stream-K range."""
        start, end = self.sk_range(b)
        return _select(end > start, (end - 1) // self.iters - start // self.iters + 1, 0)

    def segment(self, b, s):
        """``(tile, lo, hi)`` of block ``b``'s segment ``s``."""
        start, end = self.sk_range(b)
        tile = start // self.iters + s
        base = tile * self.iters
        return tile, _max(start - base, 0), _min(end - base, self.iters)

    def slot(self, b, s):
        """Workspace slot of block ``b``'s partial segment ``s``: its first, else its last."""
        return 2 * b + _select(s > 0, 1, 0)

    def contributors(self, tile):
        """``(first block, count)`` of the blocks whose ranges cover stream-K tile ``tile``."""
        first = self.owner(tile * self.iters)
        return first, self.owner(tile * self.iters + self.iters - 1) - first + 1

    def contributor_slot(self, tile, c):
        """Workspace slot in which block ``c`` keeps its partial of stream-K tile ``tile``."""
        start, _ = self.sk_range(c)
        return 2 * c + _select(tile == start // self.iters, 0, 1)

    def segments(self, b: int) -> list:
        """Block ``b``'s stream-K :class:`Segment` s, in order (Python ints only)."""
        out = []
        for s in range(self.segment_count(b)):
            tile, lo, hi = self.segment(b, s)
            whole = lo == 0 and hi == self.iters
            out.append(Segment(tile, lo, hi, None if whole else self.slot(b, s)))
        return out

    def tile_position(self, t):
        """``(row block, column block)`` of output tile ``t`` (data-parallel tiles first, then
        the stream-K tiles from ``dp_tiles``)."""
        return t % self.row_blocks, t // self.row_blocks


def workspace_shapes(tiles: GemmTiles, plan: StreamKPlan) -> dict:
    """Shapes of the kernel's two scratch buffers: ``work`` (float32 partials, ``(2 * blocks *
    block_m, block_n)``) and ``counts`` (int32 arrival counters, one per stream-K tile, at
    least one element); both must start zeroed (``counts``) / may hold anything (``work``)."""
    return {"work": (2 * plan.blocks * tiles.block_m, tiles.block_n), "counts": (max(plan.sk_tiles, 1),)}


def build_stream_k_gemm(m: int, n: int, k: int, dtype: str = "bfloat16", tiles: Optional[GemmTiles] = None,
                        blocks: int = DEFAULT_BLOCKS):
    """The stream-K GEMM ``T.prim_func`` (module docstring): ``C = A @ B`` with ``A: (m, k)``,
    ``B: (k, n)``, ``C: (m, n)`` of ``dtype`` (float32 accumulation), ``tiles`` (default
    :class:`GemmTiles`' defaults; ``swizzle`` is not used: the tile order is the plan's) and a
    grid of ``blocks`` blocks (at most one per SM, so that a block's partials are fixed up
    while the others still compute). Signature::

        A, B, C        as above
        Work: (2 * blocks * block_m, block_n) float32   partials (any contents)
        Counts: (max(sk_tiles, 1),) int32               arrival counters, zero between calls

    (:func:`workspace_shapes`). Every dimension must be a multiple of its tile (``ValueError``
    naming it)."""
    import tilelang.language as T

    tiles = tiles or GemmTiles()
    check_gemm_dims("build_stream_k_gemm", tiles, m=m, k=k, n=n)
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        raise ValueError(f"blocks must be a positive int, got {blocks!r}")
    BM, BN, BK, TH = tiles.block_m, tiles.block_n, tiles.block_k, tiles.threads
    plan = StreamKPlan(m // BM, n // BN, k // tiles.block_k, blocks)
    shapes = workspace_shapes(tiles, plan)
    mainloop = gemm_mainloop_span(dtype, tiles)
    DPW, DP, I = plan.dp_waves, plan.dp_tiles, plan.iters

    @T.prim_func
    def stream_k_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype),
                      Work: T.Tensor(shapes["work"], "float32"), Counts: T.Tensor(shapes["counts"], "int32")):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            C_f = T.alloc_fragment((BM, BN), "float32")
            arrived = T.alloc_shared((1,), "int32")
            # One loop over the block's units (its data-parallel tiles, then its stream-K
            # segments) around one mainloop: TileLang's warp-specialised lowering takes one
            # pipelined loop per kernel.
            for u in T.serial(DPW + plan.segment_count(bx)):
                tile, lo, hi = plan.segment(bx, u - DPW)
                whole = u < DPW or (lo == 0 and hi == I)
                t = T.if_then_else(u < DPW, u * blocks + bx, DP + tile)
                row, col = plan.tile_position(t)
                mainloop(A, B, C_f, row * BM, col * BN, T.if_then_else(u < DPW, 0, lo) * BK,
                         T.if_then_else(u < DPW, I, hi - lo))
                if whole:
                    T.copy(C_f, C[row * BM, col * BN])
                else:
                    first, count = plan.contributors(tile)
                    T.copy(C_f, Work[plan.slot(bx, u - DPW) * BM, 0])
                    T.sync_threads()
                    if tx == 0:
                        arrived[0] = T.atomic_add(Counts[tile], 1, memory_order="acq_rel", return_prev=True) + 1
                        if arrived[0] == count:
                            Counts[tile] = 0  # the last arrival: ready for the next call
                    T.sync_threads()
                    if arrived[0] == count:
                        T.clear(C_f)
                        for j in T.serial(count):
                            slot = plan.contributor_slot(tile, first + j)
                            for r, c in T.Parallel(BM, BN):
                                C_f[r, c] += Work[slot * BM + r, c]
                        T.copy(C_f, C[row * BM, col * BN])

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
        self.kernel(a, b, result, self.work, self.counts)
        return result

    def flops(self) -> float:
        """Floating-point operations of one call: ``2 * m * n * k``."""
        return 2.0 * self.m * self.n * self.k

    def __repr__(self) -> str:
        return (f"StreamKGemm(m={self.m}, n={self.n}, k={self.k}, dtype={self.dtype}, blocks={self.blocks}, "
                f"dp_tiles={self.plan.dp_tiles}, sk_tiles={self.plan.sk_tiles})")
