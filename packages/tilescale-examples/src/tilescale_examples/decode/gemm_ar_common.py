"""What the kernels of :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce` share:
their signature and grid (:func:`gemm_ar_prim_func`), the tile arithmetic
(:func:`padded_rows`, :func:`tile_count`), the one-shot reduction of a tile over the ranks
(:func:`reduce_tile_macro`) and the float32 sum of a tile's ``k`` splits
(:func:`split_order_sum`)."""

# (no `from __future__ import annotations`: TileLang reads the macros' annotations)

from tilescale_examples.collectives.reduce_kernel import default_unroll, rank_order_sum
from tilescale_examples.overlap.gemm import GemmTiles

__all__ = ["gemm_ar_prim_func", "padded_rows", "tile_count", "reduce_tile_macro", "split_order_sum"]


def gemm_ar_prim_func(T, m: int, k: int, n: int, dtype: str, threads: int, stage_rows: int, stage_dtype: str, body,
                      symbol: str):
    """The ``T.prim_func`` of every GemmAllReduce kernel: the signature of
    :func:`~tilescale_examples.decode.gemm_ar_kernel.build_gemm_ar_kernel` (``Stage:
    (stage_rows, n)`` of ``stage_dtype``), a grid of ``blocks`` blocks of ``threads`` threads,
    each running ``body(A, B, Stage, Out, Flags, State, blocks, iters, bx)`` (a ``T.macro``:
    the kernel's own steps), under the global symbol ``symbol``."""
    nflags, nstate = T.dynamic("nflags"), T.dynamic("nstate")

    @T.prim_func
    def gemm_allreduce(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype),
                       Stage: T.Tensor((stage_rows, n), stage_dtype), Out: T.Tensor((m, n), dtype),
                       Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"),
                       blocks: T.int32, iters: T.int32):
        with T.Kernel(blocks, threads=threads) as bx:
            body(A, B, Stage, Out, Flags, State, blocks, iters, bx)

    return gemm_allreduce.with_attr("global_symbol", symbol)


def padded_rows(m: int, block_m: int) -> int:
    """``m`` rounded up to a multiple of ``block_m``: the rows of one staging buffer."""
    return -(-m // block_m) * block_m


def tile_count(m: int, n: int, tiles: GemmTiles) -> int:
    """Output tiles of an ``(m, n)`` result: ``ceil(m / block_m) * n / block_n``."""
    return padded_rows(m, tiles.block_m) // tiles.block_m * (n // tiles.block_n)


def reduce_tile_macro(T, W: int, TH: int, V: int, BM: int, BN: int, m: int, dtype: str):
    """``(reduce_tile, U)``: ``reduce_tile(Stage, Out, vals, res, lo, row, col, tx)`` reads the
    real rows of the tile at ``(row, col)`` from every rank's ``Stage`` (buffer rows from
    ``lo``) in vectors of ``V`` elements (all ``W`` loads of ``U`` vectors before the first
    add: ``vals`` ``(U, W, V)`` of Stage's dtype, ``res`` ``(U, V)`` of ``dtype``), adds them in
    rank order in float32, rounds once to ``dtype`` and stores into ``Out``."""
    U = default_unroll(W)
    CV = BN // V  # vectors per tile row
    STEPS = -(-BM * CV // (TH * U))
    PEERS, ROWS = list(range(W)), list(range(U))

    @T.macro
    def reduce_tile(Stage, Out, vals, res, lo, row, col, tx):
        nvec = T.min(BM, m - row) * CV
        for j in T.serial(STEPS):
            for u in ROWS:
                v = (j * U + u) * TH + tx
                if v < nvec:
                    for p in PEERS:
                        T.copy(Stage[lo + row + v // CV, col + v % CV * V:col + v % CV * V + V], vals[u, p, 0:V],
                               src_pe=p)
            for u in ROWS:
                v = (j * U + u) * TH + tx
                if v < nvec:
                    for i in T.vectorized(V):
                        res[u, i] = T.Cast(dtype, rank_order_sum(T, vals, u, i, W, "float32"))
                    for i in T.vectorized(V):
                        Out[row + v // CV, col + v % CV * V + i] = res[u, i]

    return reduce_tile, U


def split_order_sum(Stage, mp: int, r, c, S: int):
    """``Stage[0 * mp + r, c] + ... + Stage[(S - 1) * mp + r, c]`` (the ``S`` float32 partials
    of one element), added left to right: an expression."""
    total = Stage[r, c]
    for s in range(1, S):
        total = total + Stage[s * mp + r, c]
    return total
