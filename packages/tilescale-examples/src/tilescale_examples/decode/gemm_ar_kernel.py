"""The kernel of :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`: a
persistent GEMM whose epilogue hands every output tile to a one-shot all-reduce of that tile,
one launch per call (``out = all_reduce(a @ b)``).

The algorithm
-------------

The output ``(m, n)`` is cut into ``(block_m, block_n)`` tiles (rows padded to ``mp``, a
multiple of ``block_m``): ``tiles = mp / block_m * n / block_n``, tile ``t`` at row block ``t
% (mp / block_m)`` and column block ``t // (mp / block_m)`` (the row blocks of one column
block are neighbours: they share ``b``'s columns in L2). A persistent grid of ``blocks =
min(tiles, max_blocks)`` blocks (the same on every rank); block ``b`` computes the tiles ``t
= i * blocks + b`` (``i < iters = ceil(tiles / blocks)``), in that order on every rank.
Rank ``me``, call ``epoch`` (``State[b] + 1``, read on the device), for each of its tiles:

1. *GEMM*: the mainloop of the overlapped GEMMs
   (:func:`~tilescale_examples.overlap.gemm.gemm_mainloop`: TMA loads, WGMMA, float32
   accumulation) into a float32 fragment.
2. *Epilogue*: the tile rounded to the dtype and stored into buffer ``epoch % 2`` of this
   rank's symmetric ``Stage`` (``(2 * mp, n)``, double-buffered by call number as the
   reduction engine's one-shot).
3. *Flag round*: the reduction engine's release round
   (:func:`~tilescale_examples.collectives.reduce_kernel.step_macros`' ``signal_and_wait``):
   barrier, ``ready[me, b] = epoch * iters + i`` on every rank with a system-scope release,
   wait ``ready[p, b] >= epoch * iters + i`` here for every rank ``p``, barrier. The flag
   value grows with every tile of every call, so flags are never reset.
4. *Reduce*: the tile's real rows (``min(block_m, m - row)``) read from every rank's
   ``Stage`` in 16-byte vectors (all ``W`` loads of a vector issued before the first add),
   added in rank order ``0 .. W-1`` in float32
   (:func:`~tilescale_examples.collectives.reduce_kernel.rank_order_sum`), rounded once and
   stored into ``Out``.

Split ``k``
-----------

At decode a few rows make few tiles (``m = 1``, ``n = 8192``, 64 x 128 tiles: 64 blocks),
and a memory-bound GEMM on half the SMs cannot draw the whole memory bandwidth. With
``split_k = S > 1`` (:func:`build_gemm_ar_kernel`'s argument) every tile is cut along ``k``
into ``S`` units of ``k / S`` columns, unit ``u`` of tile ``u // S`` and split ``s = u %
S``; the grid is a multiple of ``S``, so the ``S`` units of a tile run in the same iteration
on the neighbouring blocks ``g .. g + S - 1`` (a *group*, ``g = bx - s``). Each unit stores its
float32 partial (the real rows only) into split ``s`` of the call's ``Stage`` buffer
(``(2, S, mp, n)`` float32), then the group's flag round: ``ready[me, bx]`` on every rank, and
a wait for ``ready[p, g + j]`` of every rank ``p`` and every member ``j`` (one thread each).
Block ``g + s`` then reduces columns ``s * block_n / S ..`` of the tile: for every rank ``p``
in rank order, its ``S`` partials added in split order in float32 and rounded to the dtype
(``c_p``: a float32 accumulation of the same products in another order), then the rank-order
float32 sum of the ``c_p``, rounded once: the module's semantics, bit-identical on every rank.
Buffer reuse is the same argument as above: a rank's call ``e + 1`` completes only after each
of its blocks saw a flag of call ``e + 1`` from every rank, which every peer writes after its
call ``e`` (and so every read of this rank's buffer ``e % 2``) completed.

So the reduction of the first tiles runs while the later tiles' GEMMs are still running on
other SMs (and, with more tiles than blocks, on this block's next iterations): the reduction
starts before the GEMM ends, with no second launch and no host round trip.

Call numbers, buffer reuse and deadlock freedom are the reduction engine's
(:mod:`tilescale_examples.collectives.reduce_engine`, "Call numbers", "Reuse under
back-to-back calls", "Deadlock freedom"): tile ``t`` is computed by block ``b`` on every rank,
so a block waits only for the blocks of its own index on the peers; the grid is at most the SM
count and a block fits on an SM (checked by the CPU tests), so all blocks are resident at once
and every awaited flag is eventually written. Block ``b`` rewrites a tile of buffer ``e % 2``
in call ``e + 2`` only after its call ``e + 1`` saw every peer's block ``b`` start call ``e + 1``
(its first tile's flag), i.e. finish reading its tiles of call ``e``. ``State[b] = epoch`` is
written after the block's last barrier, so CUDA-graph replays are new calls.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional

import torch

from tilescale_examples.collectives.reduce_kernel import (FLAG_STRIDE, default_unroll, rank_order_sum, step_macros,
                                                          vector_elems)
from tilescale_examples.decode.gemm_ar_solo import build_solo_kernel
from tilescale_examples.decode.gemm_ar_two_shot import build_two_shot_kernel
from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, check_positive, check_sync_pipeline, gemm_mainloop

__all__ = ["GEMM_AR_DTYPES", "PASS_CONFIGS", "FLAG_STRIDE", "MAX_SPLIT_READS", "REDUCTIONS", "kernel_args",
           "padded_rows", "tile_count",
           "check_split_k", "build_gemm_ar_kernel", "gemm_ar_jobs"]

#: torch dtypes of ``a``, ``b`` and the output, with their TileLang names (float32 accumulation).
GEMM_AR_DTYPES = DTYPES
#: TileLang pass configs of the kernel (none: the GEMM's stock lowering, warp specialisation on).
PASS_CONFIGS: dict = {}
#: Values of the kernel's ``reduction``: ``one_shot`` (every rank reads every rank's tile) and
#: ``two_shot`` (each rank reduces a shard of every tile and pushes it to every rank).
REDUCTIONS = ("one_shot", "two_shot")
#: The most 16-byte partial vectors (``world_size * split_k``) one thread of the split-``k``
#: reduction loads before adding them (``4 *`` this float32 registers).
MAX_SPLIT_READS = 32


def padded_rows(m: int, block_m: int) -> int:
    """``m`` rounded up to a multiple of ``block_m``: the rows of one staging buffer."""
    return -(-m // block_m) * block_m


def tile_count(m: int, n: int, tiles: GemmTiles) -> int:
    """Output tiles of an ``(m, n)`` result: ``ceil(m / block_m) * n / block_n``."""
    return padded_rows(m, tiles.block_m) // tiles.block_m * (n // tiles.block_n)


def check_split_k(split_k, k: int, world_size: int, tiles: GemmTiles) -> int:
    """``split_k`` checked against the problem (``ValueError`` naming it): an int >= 1 with
    ``k / split_k`` a multiple of ``block_k``, ``block_n / split_k`` a multiple of 4 (whole
    float32 vectors per group member) and ``world_size * split_k`` at most
    :data:`MAX_SPLIT_READS`."""
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
    if split_k == 1:
        return 1
    if k % (split_k * tiles.block_k):
        raise ValueError(f"split_k={split_k}: k ({k}) must be a multiple of split_k * block_k "
                         f"({split_k * tiles.block_k})")
    if tiles.block_n % (4 * split_k):
        raise ValueError(f"split_k={split_k}: block_n ({tiles.block_n}) must be a multiple of 4 * split_k")
    if world_size * split_k > MAX_SPLIT_READS:
        raise ValueError(f"split_k={split_k}: world_size * split_k ({world_size * split_k}) must be at most "
                         f"{MAX_SPLIT_READS} (the partials one thread adds)")
    return split_k


def _group_round(T, W: int, S: int):
    """``group_round(Flags, tx, me, bx, blocks, value)``: the split-``k`` flag round (a barrier,
    ``ready[me, bx] = value`` on every rank with a system-scope release, then one thread per
    rank and group member waits for that member's flag there to reach ``value``, a barrier)."""

    @T.macro
    def group_round(Flags, tx, me, bx, blocks, value):
        T.sync_threads()
        if tx < W:
            T.notify(Flags[(me * blocks + bx) * FLAG_STRIDE], tx, value)
        if tx < W * S:
            T.wait_ge(Flags[(tx // S * blocks + bx - bx % S + tx % S) * FLAG_STRIDE], value)
        T.sync_threads()

    return group_round


def _split_sum(T, vals, i, W: int, S: int, dtype: str):
    """For each rank ``p`` in rank order, its ``S`` float32 partials ``vals[p * S + s, i]``
    added in split order and rounded to ``dtype``; those added in float32 (an expression)."""
    total = None
    for p in range(W):
        part = vals[p * S, i]
        for j in range(1, S):
            part = part + vals[p * S + j, i]
        rounded = T.Cast("float32", T.Cast(dtype, part))
        total = rounded if total is None else total + rounded
    return total


def _split_reduce_macro(T, W: int, S: int, TH: int, BM: int, BN: int, m: int, mp: int, dtype: str):
    """``reduce_columns(Stage, Out, vals, res, lo, row, col, tx)``: the rows of the tile at
    ``(row, col)``, columns ``col .. col + block_n / S``: every rank's ``S`` partials (float32
    vectors of 4) from its ``Stage``, :func:`_split_sum`, into ``Out``."""
    CV = BN // S // 4  # float32 vectors per row of a member's columns
    STEPS = -(-BM * CV // TH)
    READS = [(p, j) for p in range(W) for j in range(S)]

    @T.macro
    def reduce_columns(Stage, Out, vals, res, lo, row, col, tx):
        nvec = T.min(BM, m - row) * CV
        for step in T.serial(STEPS):
            v = step * TH + tx
            if v < nvec:
                for p, j in READS:
                    T.copy(Stage[lo + j * mp + row + v // CV, col + v % CV * 4:col + v % CV * 4 + 4],
                           vals[p * S + j, 0:4], src_pe=p)
                for i in T.vectorized(4):
                    res[i] = T.Cast(dtype, _split_sum(T, vals, i, W, S, dtype))
                for i in T.vectorized(4):
                    Out[row + v // CV, col + v % CV * 4 + i] = res[i]

    return reduce_columns


def _build_split_kernel(m: int, k: int, n: int, W: int, dtype: str, tiles: GemmTiles, S: int):
    """The split-``k`` ``T.prim_func`` (the module docstring's "Split k"); the signature of
    :func:`build_gemm_ar_kernel` with ``Stage: (2 * S * mp, n)`` float32."""
    import tilelang.language as T

    TH, BM, BN = tiles.threads, tiles.block_m, tiles.block_n
    mp = padded_rows(m, BM)
    MT, NU = mp // BM, tile_count(m, n, tiles) * S
    mainloop = gemm_mainloop(k // S, dtype, tiles, k_offset=True)
    group_round = _group_round(T, W, S)
    reduce_columns = _split_reduce_macro(T, W, S, TH, BM, BN, m, mp, dtype)
    count_call = step_macros(T, W, TH, 1, 4, 1).count_call
    nflags, nstate = T.dynamic("nflags"), T.dynamic("nstate")

    @T.prim_func
    def gemm_allreduce_split(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype),
                             Stage: T.Tensor((2 * S * mp, n), "float32"), Out: T.Tensor((m, n), dtype),
                             Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"),
                             blocks: T.int32, iters: T.int32):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            C_f = T.alloc_fragment((BM, BN), "float32")
            vals = T.alloc_local((W * S, 4), "float32")
            res = T.alloc_local((4,), dtype)
            epoch = T.alloc_var("int64")
            epoch = State[bx] + 1
            lo = T.alloc_var("int32")
            lo = T.Cast("int32", epoch % 2) * (S * mp) + bx % S * mp  # this call's buffer, this unit's split
            for i in T.serial((NU - bx + blocks - 1) // blocks):
                t = (i * blocks + bx) // S  # the output tile of this unit
                mainloop(A, B, C_f, t % MT * BM, t // MT * BN, bx % S * (k // S))
                for r, c in T.Parallel(BM, BN):
                    if r < m - t % MT * BM:  # the real rows only
                        Stage[lo + t % MT * BM + r, t // MT * BN + c] = C_f[r, c]
                group_round(Flags, tx, me, bx, blocks, epoch * iters + i)
                reduce_columns(Stage, Out, vals, res, lo - bx % S * mp, t % MT * BM,
                               t // MT * BN + bx % S * (BN // S), tx)
            count_call(State, bx, tx, epoch)

    return gemm_allreduce_split.with_attr("global_symbol", "gemm_allreduce_split")


def _reduce_macro(T, W: int, TH: int, V: int, BM: int, BN: int, m: int, dtype: str):
    """``reduce_tile(Stage, Out, vals, res, lo, row, col, tx)``: step 4 for the tile at
    ``(row, col)``: its real rows from every rank's ``Stage`` (buffer rows from ``lo``),
    rank-order float32 sum, one rounding, into ``Out``."""
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


def build_gemm_ar_kernel(m: int, k: int, n: int, world_size: int, dtype: str = "bfloat16",
                         tiles: Optional[GemmTiles] = None, split_k: int = 1, reduction: str = "one_shot"):
    """The fused GEMM + all-reduce ``T.prim_func`` (see the module docstring; ``split_k > 1``:
    its "Split k", checked by :func:`check_split_k`, with ``Stage: (2 * split_k * mp, n)``
    float32 and a grid that is a multiple of ``split_k``).

    ``m`` (any positive int), ``k`` (a multiple of ``block_k``), ``n`` (a multiple of
    ``block_n``) and the tiles are trace-time constants; the grid is a run-time argument.
    Signature (``mp = ceil(m / block_m) * block_m``)::

        A: (m, k)             this rank's a (dtype)
        B: (k, n)             this rank's b (dtype)
        Stage: (2 * mp, n)    this rank's symmetric staging buffers (call e: rows e % 2 * mp ..)
        Out: (m, n)           the all-reduced result (dtype)
        Flags: (n,) uint64    ready[p, b] = Flags[(p * blocks + b) * FLAG_STRIDE]
        State: (blocks,) int64  block b's count of the calls made so far
        blocks: int32         grid size (<= tiles, the same on every rank)
        iters: int32          ceil(tiles / blocks)

    Needs ``kernel.initialize`` (it reads its rank and the peers' heap bases from the table).
    ``reduction="two_shot"`` (:data:`REDUCTIONS`; ``split_k = 1`` only) builds the kernel of
    :mod:`~tilescale_examples.decode.gemm_ar_two_shot` (same signature). With ``world_size = 1``
    it is the one-rank kernel of
    :mod:`~tilescale_examples.decode.gemm_ar_solo` (same signature and results; no flag round,
    no wait; with ``split_k > 1`` ``Flags`` holds :func:`~tilescale_examples.decode.
    gemm_ar_solo.solo_flag_words` words).
    """
    import tilelang.language as T

    tiles = tiles or GemmTiles()
    check_sync_pipeline("build_gemm_ar_kernel", tiles)
    if dtype not in GEMM_AR_DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(GEMM_AR_DTYPES.values())}, got {dtype!r}")
    for name, value in (("m", m), ("k", k), ("n", n)):
        check_positive(name, value)
    if k % tiles.block_k or n % tiles.block_n:
        raise ValueError(f"k ({k}) must be a multiple of block_k ({tiles.block_k}) and n ({n}) of block_n "
                         f"({tiles.block_n})")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= tiles.threads:
        raise ValueError(f"world_size must be an int in [1, threads={tiles.threads}], got {world_size!r}")
    W, TH, BM, BN = world_size, tiles.threads, tiles.block_m, tiles.block_n
    V = vector_elems(torch.empty((), dtype=getattr(torch, dtype)).element_size())
    if BN % V:
        raise ValueError(f"block_n ({BN}) must be a multiple of {V} (16-byte vectors)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if W == 1:  # nothing to exchange: the one-rank kernels
        return build_solo_kernel(m, k, n, dtype, tiles, check_split_k(split_k, k, W, tiles))
    if reduction == "two_shot":
        if split_k != 1:
            raise ValueError(f"split_k={split_k!r}: the two-shot kernel keeps every tile's k whole (split_k=1)")
        return build_two_shot_kernel(m, k, n, W, dtype, tiles)
    if check_split_k(split_k, k, W, tiles) > 1:
        return _build_split_kernel(m, k, n, W, dtype, tiles, split_k)
    mp = padded_rows(m, BM)
    MT, NT = mp // BM, tile_count(m, n, tiles)
    mainloop = gemm_mainloop(k, dtype, tiles)
    steps = step_macros(T, W, TH, 1, V, 1)
    reduce_tile, U = _reduce_macro(T, W, TH, V, BM, BN, m, dtype)
    nflags, nstate = T.dynamic("nflags"), T.dynamic("nstate")

    @T.prim_func
    def gemm_allreduce(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), Stage: T.Tensor((2 * mp, n), dtype),
                       Out: T.Tensor((m, n), dtype), Flags: T.Tensor((nflags,), "uint64"),
                       State: T.Tensor((nstate,), "int64"), blocks: T.int32, iters: T.int32):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            C_f = T.alloc_fragment((BM, BN), "float32")
            vals = T.alloc_local((U, W, V), dtype)
            res = T.alloc_local((U, V), dtype)
            epoch = T.alloc_var("int64")
            epoch = State[bx] + 1  # this call's number: block bx's count of earlier calls + 1
            lo = T.alloc_var("int32")
            lo = T.Cast("int32", epoch % 2) * mp  # first row of this call's staging buffer
            for i in T.serial((NT - bx + blocks - 1) // blocks):
                t = i * blocks + bx
                mainloop(A, B, C_f, t % MT * BM, t // MT * BN)
                T.copy(C_f, Stage[lo + t % MT * BM, t // MT * BN])  # rounded to dtype, this rank's copy
                steps.signal_and_wait(Flags, tx, me, bx, blocks, epoch * iters + i, 0)
                reduce_tile(Stage, Out, vals, res, lo, t % MT * BM, t // MT * BN, tx)
            steps.count_call(State, bx, tx, epoch)

    return gemm_allreduce.with_attr("global_symbol", "gemm_allreduce")


def kernel_args(m: int, k: int, n: int, world_size: int, dtype: str, tiles: Optional[GemmTiles], split_k: int = 1,
                reduction: str = "one_shot") -> tuple:
    """The positional arguments of :func:`build_gemm_ar_kernel` for this kernel, the defaults
    left out (the op's compile key and the precompile jobs name a kernel the same way)."""
    tail = (split_k, reduction) if reduction != "one_shot" else (split_k,) if split_k != 1 else ()
    return (m, k, n, world_size, dtype, tiles) + tail


def gemm_ar_jobs(shapes, dtypes, world_sizes, tiles: Optional[GemmTiles] = None, split_k: int = 1,
                 reduction: str = "one_shot") -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of every kernel
    :func:`build_gemm_ar_kernel` makes for ``(m, k, n)`` in ``shapes`` x dtype name x world
    size (``tiles`` default: :class:`~tilescale_examples.overlap.gemm.GemmTiles`'s)."""
    return [("tilescale_examples.decode.gemm_ar_kernel:build_gemm_ar_kernel",
             kernel_args(m, k, n, w, d, tiles, split_k, reduction), PASS_CONFIGS)
            for (m, k, n) in shapes for d in dtypes for w in world_sizes]
