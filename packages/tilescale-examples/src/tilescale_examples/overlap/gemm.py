"""The pipelined TMA + WGMMA GEMM that the overlapped examples share, its tile shape, the
shape checks, and the error bound their tests and benchmarks use.

* :class:`GemmTiles`: the tile program's shape (default ``128 x 256 x 64``, 3 stages, 256
  threads: the shape of stock TileLang's Hopper GEMM example, which reaches about 0.9 of
  cuBLAS on an H200 in bfloat16/float16).
* :func:`default_swizzle` / :func:`default_tiles`: the block rasterization the ops pick when
  the caller names none: a panel of :data:`RASTER_PANEL` row blocks once the output has more
  than :data:`RASTER_MIN_COLUMN_BLOCKS` column blocks (wide outputs, where the grid's own order
  re-reads ``B`` from memory for every row block).
* :func:`gemm_tile`: a ``T.macro`` computing one ``block_m x block_n`` output tile into a
  float32 fragment with the tiles' pipeline (``"sync"``: ``T.Pipelined`` over ``k``, TMA loads
  into shared memory, WGMMA; ``"async"``: :mod:`~tilescale_examples.overlap.gemm_async`), then
  running the kernel's epilogue on the threads that hold it; every one-tile-per-block kernel
  here is a prologue (which rows, what to wait for) and this tile with its epilogue.
  :func:`gemm_mainloop` / :func:`gemm_mainloop_span` are the sync loop alone, over a fixed or a
  run-time number of ``k`` steps (the persistent kernels': stream-K, GemmAllReduce).
* :func:`build_gemm_kernel`: stock TileLang's GEMM with these tiles and no TileScale
  intrinsic, ``C = A @ B``; the benchmarks' "stock TileLang GEMM" and the sequential plans'
  GEMM.
* :func:`check_gemm_dims`: ``ValueError`` naming the argument for a dimension that is not a
  positive multiple of its tile.
* :func:`error_bound` / :func:`count_outside`: the element-wise bound a 16-bit GEMM output
  must meet against a float32 reference (:mod:`~tilescale_examples.overlap.gemm_bounds`,
  re-exported here).
* :class:`OverlappedGemm`: the checks, algorithm (plan), call order across streams and
  :func:`torch_reference` of the overlapped objects; their setup and lifetime are
  :class:`~tilescale_examples.base.SymmetricOp`'s.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from dataclasses import dataclass
from typing import Optional

import torch

from tilescale_core.interface import check_positive_int

from tilescale_examples.base import SymmetricOp, check_aligned, positional_out
from tilescale_examples.overlap.gemm_bounds import ORDER_SLACK, count_outside, error_bound, unit_roundoff  # noqa: F401
from tilescale_examples.overlap.gemm_store import (STORES, default_store, resolve_store, store_tile,  # noqa: F401
                                                   tma_store_stages)

__all__ = ["GemmTiles", "OverlappedGemm", "DTYPES", "PIPELINES", "WARP_POLICIES", "warp_policy", "gemm_mainloop",
           "gemm_mainloop_span", "block_threads", "gemm_tile", "store_tile", "lead_thread", "sync_compute",
           "build_gemm_kernel", "check_gemm_dims", "check_sync_pipeline", "check_positive", "unit_roundoff",
           "error_bound", "count_outside", "MAX_ELEMENTS", "default_swizzle", "default_tiles", "resolve_tiles",
           "STORES", "tma_store_stages", "default_store", "resolve_store", "RASTER_PANEL", "RASTER_MIN_COLUMN_BLOCKS"]

#: The mainloop pipelines :class:`GemmTiles` names (its ``pipeline``).
PIPELINES = ("sync", "async")
#: How the compute warpgroups split a tile (:class:`GemmTiles`' ``warp_policy``) -> TileLang's
#: ``T.GemmWarpPolicy`` member: ``"square"`` (TileLang's default: as square a share as the tile
#: allows; 2 warpgroups on ``128 x 256`` take ``128 x 128`` each, two ``m64n128`` WGMMAs per
#: ``k16``), ``"row"`` (each warpgroup whole rows: ``64 x 256`` each, one ``m64n256`` WGMMA per
#: ``k16``, as CUTLASS's Hopper GEMM) or ``"column"`` (each warpgroup whole columns).
WARP_POLICIES = {"square": "Square", "row": "FullRow", "column": "FullCol"}
#: torch dtype -> TileLang name of the operand dtypes the GEMMs accept (float32 accumulation).
DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: Elements a kernel buffer may hold (the kernels index in ``int32``).
MAX_ELEMENTS = 2**31


def check_positive(name: str, value) -> int:
    """``value`` if it is a positive int (not a bool); else ``ValueError`` naming ``name``
    (:func:`tilescale_core.interface.check_positive_int`)."""
    return check_positive_int(name, value)


@dataclass(frozen=True)
class GemmTiles:
    """Shape of the GEMM tile program.

    Attributes:
        block_m, block_n, block_k: output tile rows and columns, and the ``k`` step (elements).
        num_stages: shared-memory pipeline depth of the TMA loads.
        threads: threads of the compute warpgroups (a multiple of 128; TileLang adds one
            producer warpgroup for the TMA loads).
        swizzle: panel width (row blocks) of the GEMM kernels' block rasterization
            (``T.use_swizzle``: blocks that run together share rows of ``A`` and columns of
            ``B`` in L2); 0, this class's default, keeps the grid's own order. The ops take
            :func:`default_swizzle` of their output width when the caller passes none. The
            peer GEMM of AllGatherGEMM and the remote-epilogue GEMM rasterize their row
            order tables (rows in panels, in table order) the same way; the persistent GEMM of
            GemmAllReduce has a tile order of its own and ignores it.
        pipeline: how the mainloop overlaps loads and WGMMAs (:data:`PIPELINES`): ``"sync"``
            (this class's default) is stock TileLang's (``T.Pipelined`` with ``T.gemm``,
            TileLang's warp specialisation: each ``k`` step's WGMMAs are waited for before the
            next step is issued); ``"async"`` is
            :mod:`~tilescale_examples.overlap.gemm_async`'s (the warp specialisation written
            out, one WGMMA group in flight). The kernels with one output tile per block take
            both (the library GEMM, AllGatherGEMM's peer GEMM, GemmReduceScatter's GEMM); the
            persistent ones (stream-K, GemmAllReduce) only ``"sync"``.
        warp_policy: how the compute warpgroups split the tile (:data:`WARP_POLICIES`):
            ``"square"`` (this class's default, TileLang's), ``"row"`` or ``"column"``.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 3
    threads: int = 256
    swizzle: int = 0
    pipeline: str = "sync"
    warp_policy: str = "square"

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_stages", "threads"):
            check_positive(name, getattr(self, name))
        if not isinstance(self.swizzle, int) or isinstance(self.swizzle, bool) or self.swizzle < 0:
            raise ValueError(f"swizzle must be an int >= 0 (0: no rasterization), got {self.swizzle!r}")
        if self.threads % 128:
            raise ValueError(f"threads must be a multiple of 128 (whole warpgroups), got {self.threads}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        if self.warp_policy not in WARP_POLICIES:
            raise ValueError(f"warp_policy must be one of {tuple(WARP_POLICIES)}, got {self.warp_policy!r}")
        if self.pipeline == "async" and self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2 for the async pipeline (a stage is released one step "
                             f"late), got {self.num_stages}")
        if self.threads + 128 > 1024:  # TileLang adds a 128-thread producer warpgroup; a block has <= 1024
            raise ValueError(f"threads must be at most 896 (with TileLang's producer warpgroup a block has at most "
                             f"1024 threads), got {self.threads}")


#: Row blocks per rasterization panel that :func:`default_swizzle` picks.
RASTER_PANEL = 8
#: Column blocks (``n / block_n``) above which :func:`default_swizzle` rasterizes. At 14 column
#: blocks (n 3584, block_n 256) the two orders run alike; at 112 (n 28672) the grid's own order
#: reaches about half of cuBLAS and a panel of 8 over 0.9 (docs/benchmarks.md, "Block
#: rasterization").
RASTER_MIN_COLUMN_BLOCKS = 16


def default_swizzle(n: int, block_n: int) -> int:
    """The rasterization panel (row blocks; 0: the grid's own order) for an output of ``n``
    columns in tiles of ``block_n``: :data:`RASTER_PANEL` when the grid has more than
    :data:`RASTER_MIN_COLUMN_BLOCKS` column blocks, else 0. In the grid's own order the blocks
    running at once span few row blocks and every column of ``B``, so a wide ``B`` is read from
    memory once per row block; a panel keeps the blocks running at once on a few columns."""
    return RASTER_PANEL if n // block_n > RASTER_MIN_COLUMN_BLOCKS else 0


def default_tiles(n: int) -> GemmTiles:
    """:class:`GemmTiles`' defaults with :func:`default_swizzle` of an ``n``-column output: the
    tiles the ops and the kernel builders use when given none."""
    return GemmTiles(swizzle=default_swizzle(n, GemmTiles.block_n))


def resolve_tiles(n: int, block_m: int, block_n: int, block_k: int, num_stages: int, threads: int,
                  swizzle: Optional[int], pipeline: str = "sync", warp_policy: str = "square") -> GemmTiles:
    """The ops' :class:`GemmTiles` from their keyword arguments: ``swizzle=None`` means
    :func:`default_swizzle` of the ``n``-column output (``ValueError`` naming a bad field)."""
    if swizzle is None:
        check_positive("block_n", block_n)
        swizzle = default_swizzle(n, block_n)
    return GemmTiles(block_m, block_n, block_k, num_stages, threads, swizzle, pipeline, warp_policy)


def warp_policy(tiles: GemmTiles):
    """TileLang's ``T.GemmWarpPolicy`` of ``tiles.warp_policy`` (the ``policy`` of the
    mainloops' ``T.gemm`` / ``T.wgmma_gemm``)."""
    import tilelang.language as T

    return getattr(T.GemmWarpPolicy, WARP_POLICIES[tiles.warp_policy])


def check_sync_pipeline(owner: str, tiles: GemmTiles) -> None:
    """``ValueError`` naming ``owner`` unless ``tiles.pipeline`` is ``"sync"``: the persistent
    kernels (several output tiles per block) run the mainloop more than once, which the async
    pipeline's barrier parities do not allow yet."""
    if tiles.pipeline != "sync":
        raise ValueError(f"{owner}: pipeline={tiles.pipeline!r} is not available for this persistent kernel (several "
                         f"tiles per block); use pipeline='sync'")


def check_gemm_dims(owner: str, tiles: GemmTiles, **dims) -> None:
    """Raise ``ValueError`` naming the argument unless every ``m`` / ``m_local`` / ``k`` /
    ``n`` in ``dims`` is a positive int and a multiple of its tile (``block_m`` / ``block_m``
    / ``block_k`` / ``block_n``). ``owner`` names the class in the message."""
    tile_of = {"m": "block_m", "m_local": "block_m", "k": "block_k", "n": "block_n"}
    for name, value in dims.items():
        check_positive(name, value)
        tile = tile_of[name]
        size = getattr(tiles, tile)
        if value % size:
            raise ValueError(f"{owner}: {name}={value} is not a multiple of {tile}={size} (the GEMM tile); "
                             f"pad {name} to {-(-value // size) * size} or pass a {tile} that divides it")


def block_threads(tiles: GemmTiles) -> int:
    """Threads per block of a kernel running ``tiles``' mainloop: ``tiles.threads`` for the
    sync pipeline (TileLang adds its producer warpgroup), ``tiles.threads + 128`` for the async
    one (its producer warpgroup is the kernel's own)."""
    return tiles.threads + (128 if tiles.pipeline == "async" else 0)


def lead_thread(tiles: GemmTiles) -> int:
    """The thread that signals for the compute threads in an epilogue (``if
    T.get_thread_binding() == lead_thread(tiles):``): 0 for the sync pipeline (TileLang's
    lowering renumbers the compute threads' thread 0), 128 (the first compute thread) for the
    async one."""
    return 0 if tiles.pipeline == "sync" else 128


def sync_compute(tiles: GemmTiles):
    """In a kernel's epilogue, a barrier of the threads that hold the accumulator:
    ``T.sync_threads()`` for the sync pipeline (TileLang's lowering makes it the compute
    threads' barrier), named barrier 1 over the ``tiles.threads`` compute threads for the async
    one (the producer warpgroup has left)."""
    import tilelang.language as T

    return T.sync_threads() if tiles.pipeline == "sync" else T.sync_threads(barrier_id=1, arrive_count=tiles.threads)


def gemm_tile(k: int, dtype: str, tiles: GemmTiles, epilogue):
    """A ``T.macro`` ``tile(A, B, C_f, row, col, *args)``: ``C_f = A[row:row+block_m, :k] @
    B[:k, col:col+block_n]`` in the float32 fragment ``C_f`` (``(block_m, block_n)``) with
    ``tiles.pipeline``'s mainloop, then the ``T.macro`` ``epilogue(C_f, *args)`` on the threads
    that hold ``C_f``: every thread for the sync pipeline (TileLang's lowering places it), the
    compute warpgroups for the async one
    (:func:`~tilescale_examples.overlap.gemm_async.async_gemm_tile`: there the epilogue must
    not be left to every thread, whose producer holds 40 registers). Called once per kernel
    (one output tile per block), in a block of :func:`block_threads` threads; an epilogue
    barrier is :func:`sync_compute`, its signalling thread :func:`lead_thread`."""
    import tilelang.language as T

    if tiles.pipeline == "async":
        from tilescale_examples.overlap.gemm_async import async_gemm_tile

        return async_gemm_tile(k // tiles.block_k, dtype, tiles, epilogue)
    mainloop = gemm_mainloop(k, dtype, tiles)

    @T.macro
    def tile(A, B, C_f, row, col, *args):
        mainloop(A, B, C_f, row, col)
        epilogue(C_f, *args)

    return tile


def gemm_mainloop_span(dtype: str, tiles: GemmTiles):
    """A ``T.macro`` ``mainloop(A, B, C_f, row, col, k0, steps)``: ``C_f = A[row:row+block_m,
    k0:k0+steps*block_k] @ B[k0:k0+steps*block_k, col:col+block_n]`` in the float32 fragment
    ``C_f`` (``(block_m, block_n)``): ``T.Pipelined`` over the ``steps`` ``k`` steps (TMA loads
    into shared memory, WGMMA), every argument a run-time expression or a constant. TileLang's
    warp-specialised lowering keeps its stage and phase counters across the loop's trips, so a
    kernel may run it several times with different ``steps`` (one such loop per kernel). The
    sync pipeline only (``ValueError`` otherwise: the async one is :func:`gemm_tile`'s)."""
    import tilelang.language as T

    check_sync_pipeline("gemm_mainloop_span", tiles)
    BM, BN, BK, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages
    policy = warp_policy(tiles)

    @T.macro
    def mainloop(A, B, C_f, row, col, k0, steps):
        A_s = T.alloc_shared((BM, BK), dtype)
        B_s = T.alloc_shared((BK, BN), dtype)
        T.clear(C_f)
        for kk in T.Pipelined(steps, num_stages=stages):
            T.copy(A[row, k0 + kk * BK], A_s)
            T.copy(B[k0 + kk * BK, col], B_s)
            T.gemm(A_s, B_s, C_f, policy=policy)

    return mainloop


def gemm_mainloop(k: int, dtype: str, tiles: GemmTiles, k_offset: bool = False):
    """A ``T.macro`` ``mainloop(A, B, C_f, row, col)``: ``C_f = A[row:row+block_m, :] @
    B[:, col:col+block_n]`` in the float32 fragment ``C_f`` (``(block_m, block_n)``), with
    ``A`` and ``B`` global ``(*, k)`` / ``(k, *)`` tensors of ``dtype`` and ``row`` / ``col``
    element offsets (run-time expressions are fine: the TMA coordinates take them).

    With ``k_offset``, the macro is ``mainloop(A, B, C_f, row, col, k0)`` and multiplies the
    ``k`` columns ``k0 .. k0 + k`` of ``A`` by the same rows of ``B`` (one split of a split-``k``
    GEMM: ``A`` and ``B`` may then be wider / taller than ``k``). Both are
    :func:`gemm_mainloop_span` with ``k / block_k`` steps."""
    import tilelang.language as T

    span = gemm_mainloop_span(dtype, tiles)
    steps = k // tiles.block_k

    @T.macro
    def mainloop_from(A, B, C_f, row, col, k0):
        span(A, B, C_f, row, col, k0, steps)

    if k_offset:
        return mainloop_from

    @T.macro
    def mainloop(A, B, C_f, row, col):
        span(A, B, C_f, row, col, 0, steps)

    return mainloop


def build_gemm_kernel(m: int, n: int, k: int, dtype: str = "bfloat16", tiles: Optional[GemmTiles] = None,
                      store: str = "direct"):
    """The library's GEMM ``C = A @ B`` (``A: (m, k)``, ``B: (k, n)``, ``C: (m, n)``, all
    ``dtype``, float32 accumulation), one block per output tile, with ``tiles`` (default
    :func:`default_tiles`; their ``swizzle`` rasterizes the block order, their ``pipeline``
    picks the mainloop: ``"sync"``, stock TileLang's GEMM; ``"async"``, one WGMMA group in
    flight, under the symbol ``gemm_async``) and ``store`` the epilogue's writes
    (:data:`STORES`: ``"tma"`` under the symbol ``gemm_tma_store``, or ``gemm_async_tma_store``
    with the async pipeline, which :func:`tma_store_stages` bounds); no TileScale intrinsic, so
    it compiles and runs without a heap."""
    import tilelang.language as T

    tiles = tiles or default_tiles(n)
    check_gemm_dims("build_gemm_kernel", tiles, m=m, k=k, n=n)
    BM, BN = tiles.block_m, tiles.block_n
    tile = gemm_tile(k, dtype, tiles, store_tile(tiles, dtype, store))

    @T.prim_func
    def gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype)):
        with T.Kernel(n // BN, m // BM, threads=block_threads(tiles)) as (bx, by):
            if tiles.swizzle:
                T.use_swizzle(panel_size=tiles.swizzle)
            C_f = T.alloc_fragment((BM, BN), "float32")
            tile(A, B, C_f, by * BM, bx * BN, C, by * BM, bx * BN)

    if store == "tma":
        return gemm.with_attr("global_symbol", "gemm_tma_store" if tiles.pipeline == "sync" else "gemm_async_tma_store")
    return gemm if tiles.pipeline == "sync" else gemm.with_attr("global_symbol", "gemm_async")


# ------------------------------------------------------------------------------ the objects
class OverlappedGemm(SymmetricOp):
    """What :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` and
    :class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter` share besides
    :class:`~tilescale_examples.base.SymmetricOp`: the GEMM checks before anything is
    allocated, the algorithm (``"fused"`` or ``"sequential"``), the call order across streams
    and ``flops()``. Subclasses call ``_setup_gemm(...)`` first, then build their plan; they
    list their buffers (and the collective of the sequential plan) in ``_BUFFERS``."""

    #: Values of the ``algorithm`` argument (:data:`~tilescale_examples.overlap.stream_ops.PLANS`).
    ALGORITHMS = ("auto", "fused", "sequential")
    #: ``"auto"`` probes the devices and peers: heap_bytes of "auto" is the larger plan's.
    _AUTO_PROBES = ("fused", "sequential")
    #: Whether the fused plan needs one GPU per rank (its GEMM waits for copy-engine work).
    FUSED_NEEDS_OWN_GPUS: bool = False

    def _setup_gemm(self, allocator, m_local: int, k: int, n: int, dtype, world_size, group, tiles: GemmTiles,
                    algorithm: str, rows_per_call: int) -> None:
        """Check everything (``ValueError`` / ``TypeError`` naming the argument), then set
        :class:`~tilescale_examples.base.SymmetricOp`'s attributes and ``m_local``, ``k``,
        ``n``, ``tiles``, ``algorithm``, ``algorithm_reason``. ``rows_per_call``: the largest
        row count of a buffer, in units of ``m_local`` (for the ``int32`` indexing check)."""
        from tilescale_examples.overlap.stream_ops import PLANS, CallOrder, resolve_plan

        owner = type(self).__name__
        if algorithm not in PLANS:
            raise ValueError(f"algorithm must be one of {PLANS}, got {algorithm!r}")
        self._setup_op(allocator, dtype, world_size, group, DTYPES)
        check_gemm_dims(owner, tiles, m_local=m_local, k=k, n=n)
        W = self.world_size
        if rows_per_call * W * m_local * max(k, n) >= MAX_ELEMENTS:
            raise ValueError(f"{owner}: {rows_per_call} x {W} x {m_local} x {max(k, n)} elements exceed the "
                             "kernels' int32 indexing (< 2**31); use a smaller m_local")
        self.m_local, self.k, self.n, self.tiles = m_local, k, n, tiles
        if self._dry_run:  # no device to probe: the plan asked for ("auto": see heap_bytes)
            self.algorithm = "sequential" if algorithm == "auto" else algorithm
            self.algorithm_reason = "dry run"
        else:
            self.algorithm, self.algorithm_reason = resolve_plan(owner, algorithm, self.device, self.group, W,
                                                                 type(self).FUSED_NEEDS_OWN_GPUS)
        self._order_calls = CallOrder()
        self._capturing_now = False
        self._lone_gemm = self.algorithm == "fused" and W == 1

    @property
    def plan(self) -> str:
        """The 0.1.0 name of :attr:`algorithm`."""
        return self.algorithm

    @property
    def plan_reason(self) -> str:
        """The 0.1.0 name of :attr:`algorithm_reason`."""
        return self.algorithm_reason

    def _call(self, a: torch.Tensor, b: torch.Tensor, out_0_1: tuple, out: Optional[torch.Tensor]) -> torch.Tensor:
        """A call as :meth:`__call__` documents it: the 0.1.0 positional ``out``, one rank's
        GEMM alone (:meth:`_gemm_alone`), else the checks (:meth:`_check_call`), then the
        plan (:meth:`_run_plan`) between :meth:`_begin_call` and :meth:`_end_call`; returns
        where the call wrote."""
        if out_0_1:  # the 0.1.0 spelling
            out = positional_out(self, 2, out_0_1, out)
        if self._lone_gemm:
            return self._gemm_alone(a, b, out)
        result = self._check_call(a, b, out)
        main = self._begin_call()
        self._run_plan(a, b, main, result, out)
        self._end_call(main)
        return result

    def _run_plan(self, a: torch.Tensor, b: torch.Tensor, main, result: torch.Tensor,
                  out: Optional[torch.Tensor]) -> None:
        """Enqueue the call's plan on stream ``main`` (the caller's ``out``, None or
        ``result``; ``result``: where it writes)."""
        raise NotImplementedError

    def _begin_call(self):
        """Start a call on the current stream: order it after this instance's previous call
        when the caller switched streams (not under CUDA graph capture, where the graph's own
        order holds), count it; returns the stream."""
        main = torch.cuda.current_stream(self.device)
        self._capturing_now = self._capturing()
        if self._capturing_now:
            self._captured = True
        else:
            self._order_calls.before(main)
        self.epoch += 1
        return main

    def _end_call(self, main) -> None:
        """End a call: remember its stream position for the next eager call's ordering."""
        if not self._capturing_now:
            self._order_calls.after(main)

    #: How the GEMMs write their output tiles (:data:`STORES`; the subclasses resolve theirs).
    store = "direct"

    def _check_operands(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """``ValueError`` naming ``a`` or ``b`` unless 16-byte aligned (the GEMMs load them
        with TMA); after their layout checks (``check_inputs``)."""
        check_aligned(a, "a", "the GEMM loads it with TMA")
        check_aligned(b, "b", "the GEMM loads it with TMA")

    def _check_gemm_out(self, out: torch.Tensor) -> None:
        """``ValueError`` naming ``out`` unless aligned as the GEMM's epilogue writes it: 16
        bytes for TMA stores (``store="tma"``), 4 for the direct store's pairs of elements;
        after its layout check."""
        if self.store == "tma":
            check_aligned(out, "out", "the GEMM writes it with TMA stores")
        else:
            check_aligned(out, "out", "the GEMM writes it in 4-byte pairs of elements", 4)

    #: Whether a call is this rank's GEMM alone, ``a @ b`` into the output (one rank, the fused
    #: plan: nothing to communicate; set by :meth:`_setup_gemm`): :meth:`_gemm_alone` makes
    #: such calls.
    _lone_gemm = False

    def _gemm_alone(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        """A call of one rank (:attr:`_lone_gemm`): the GEMM ``a @ b`` into ``out`` (or
        ``self.output``) on the current stream; returns where it wrote. A call without ``out``
        on ``a`` and ``b`` laid out as the last such call's (same addresses, shapes, strides,
        dtypes: every check that call made holds) launches that call's launch again
        (:meth:`~tilescale_examples._launch.Relaunching._relaunch`: from the second repeated call
        on, its frozen launch, whose TMA descriptors were encoded once); the full call keeps its
        launch when two calls in a row read the same ``a``. With nothing shared between calls
        but the output, a repeated call orders itself on the current stream only, as the
        collectives' calls do."""
        if out is None and self._relaunch(a, b):
            return self.output
        result = self._check_call(a, b, out)
        main = self._begin_call()
        args = (a, b, result)
        self._launch_kernel(args, (0, 1, 2))
        self._end_call(main)
        self._keep_launch(out is None, (a, b), args, (0, 1, 2), views=((0, 0), (1, 1)), plain=True)
        return result

    def flops(self) -> float:
        """Floating-point operations of one call's GEMM: ``2 * world_size * m_local * n * k``."""
        return 2.0 * self.world_size * self.m_local * self.n * self.k

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(m_local={self.m_local}, k={self.k}, n={self.n}, dtype={self.dtype}, "
                f"world_size={self.world_size}, algorithm={self.algorithm!r}, epoch={self.epoch}"
                f"{', closed' if self.closed else ''})")
