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

So the reduction of the first tiles runs while the later tiles' GEMMs are still running on
other SMs (and, with more tiles than blocks, on this block's next iterations): the reduction
starts before the GEMM ends, with no second launch and no host round trip.

Split ``k``
-----------

With ``split_k = S > 1`` (:func:`build_gemm_ar_kernel`'s argument) every tile is cut along
``k`` into ``S`` units that run at once on neighbouring blocks, so that the few tiles of a
decode output keep every SM busy; the tile's last unit adds the partials and takes part in
the flag round alone: the kernel of :mod:`~tilescale_examples.decode.gemm_ar_split`.

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

from tilescale_examples.collectives.reduce_kernel import FLAG_STRIDE, step_macros, vector_elems
from tilescale_examples.decode.gemm_ar_common import gemm_ar_prim_func, padded_rows, reduce_tile_macro, tile_count
from tilescale_examples.decode.gemm_ar_solo import build_solo_kernel
from tilescale_examples.decode.gemm_ar_split import build_split_kernel, split_flag_words
from tilescale_examples.decode.gemm_ar_two_shot import two_shot_macros
from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, check_positive, check_sync_pipeline, gemm_mainloop

__all__ = ["GEMM_AR_DTYPES", "PASS_CONFIGS", "FLAG_STRIDE", "REDUCTIONS", "kernel_args", "flag_words", "reads_table",
           "padded_rows", "tile_count",
           "check_split_k", "build_gemm_ar_kernel", "gemm_ar_jobs"]

#: torch dtypes of ``a``, ``b`` and the output, with their TileLang names (float32 accumulation).
GEMM_AR_DTYPES = DTYPES
#: TileLang pass configs of the kernel (none: the GEMM's stock lowering, warp specialisation on).
PASS_CONFIGS: dict = {}
#: Values of the kernel's ``reduction``: ``one_shot`` (every rank reads every rank's tile) and
#: ``two_shot`` (each rank reduces a shard of every tile and pushes it to every rank).
REDUCTIONS = ("one_shot", "two_shot")


def check_split_k(split_k, k: int, world_size: int, tiles: GemmTiles) -> int:
    """``split_k`` checked against the problem (``ValueError`` naming it): an int >= 1 with
    ``k / split_k`` a multiple of ``block_k``. (``world_size`` sets no limit: the split
    kernel's reduction reads one rounded tile per rank, whatever the split.)"""
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
    if split_k > 1 and k % (split_k * tiles.block_k):
        raise ValueError(f"split_k={split_k}: k ({k}) must be a multiple of split_k * block_k "
                         f"({split_k * tiles.block_k})")
    return split_k


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
    ``split_k > 1`` builds the kernel of :mod:`~tilescale_examples.decode.gemm_ar_split`
    (``Flags`` of :func:`flag_words` words), ``reduction="two_shot"`` (:data:`REDUCTIONS`;
    ``split_k = 1`` only) the kernel :mod:`~tilescale_examples.decode.gemm_ar_two_shot`
    describes (this builder, with its steps) and one rank unsplit that of
    :mod:`~tilescale_examples.decode.gemm_ar_solo`: the same signature and results.
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
    split_k = check_split_k(split_k, k, W, tiles)
    if split_k > 1:
        if reduction == "two_shot" and W > 1:
            raise ValueError(f"split_k={split_k!r}: the two-shot kernel keeps every tile's k whole (split_k=1)")
        return build_split_kernel(m, k, n, W, dtype, tiles, split_k)
    if W == 1:  # nothing to exchange: the one-rank kernel
        return build_solo_kernel(m, k, n, dtype, tiles)
    two_shot = reduction == "two_shot"
    mp = padded_rows(m, BM)
    MT, NT = mp // BM, tile_count(m, n, tiles)
    mainloop = gemm_mainloop(k, dtype, tiles)
    steps = step_macros(T, W, TH, 1, V, 1)
    reduce_tile, U = reduce_tile_macro(T, W, TH, V, BM, BN, m, dtype)
    reduce_shard, copy_out = two_shot_macros(T, W, TH, V, BM, BN, m, mp, dtype) if two_shot else (None, None)

    @T.macro
    def body(A, B, Stage, Out, Flags, State, blocks, iters, bx):
        tx = T.get_thread_binding()
        me = T.get_rank()
        C_f = T.alloc_fragment((BM, BN), "float32")
        vals = T.alloc_local((U, W, V), dtype)
        res = T.alloc_local((U, V), dtype)
        epoch = T.alloc_var("int64")
        epoch = State[bx] + 1  # this call's number: block bx's count of earlier calls + 1
        if not two_shot:  # one-shot: the staging buffers by call parity
            lo = T.alloc_var("int32")
            lo = T.Cast("int32", epoch % 2) * mp  # first row of this call's staging buffer
        for i in T.serial((NT - bx + blocks - 1) // blocks):
            t = i * blocks + bx
            mainloop(A, B, C_f, t % MT * BM, t // MT * BN)
            if two_shot:  # the gemm_ar_two_shot module's steps
                T.copy(C_f, Stage[t % MT * BM, t // MT * BN])  # this rank's partial, rounded
                steps.signal_and_wait(Flags, tx, me, bx, blocks, 2 * (epoch * iters + i), 0)
                reduce_shard(Stage, vals, res, me, t % MT * BM, t // MT * BN, tx)
                steps.signal_and_wait(Flags, tx, me, bx, blocks, 2 * (epoch * iters + i) + 1, 0)
                copy_out(Stage, Out, t % MT * BM, t // MT * BN, tx)
            else:
                T.copy(C_f, Stage[lo + t % MT * BM, t // MT * BN])  # rounded to dtype, this rank's copy
                steps.signal_and_wait(Flags, tx, me, bx, blocks, epoch * iters + i, 0)
                reduce_tile(Stage, Out, vals, res, lo, t % MT * BM, t // MT * BN, tx)
        steps.count_call(State, bx, tx, epoch)

    symbol = "gemm_allreduce_two_shot" if two_shot else "gemm_allreduce"
    return gemm_ar_prim_func(T, m, k, n, dtype, TH, 2 * mp, dtype, body, symbol)


def reads_table(world_size: int, split_k: int) -> bool:
    """Whether the kernel reads TileScale's rank table (its rank, the peers' heap bases), so
    that its op binds the table before a launch: every kernel but the one-rank unsplit one
    (:mod:`~tilescale_examples.decode.gemm_ar_solo`, a GEMM with no TileScale intrinsic)."""
    return world_size > 1 or split_k > 1


def flag_words(world_size: int, blocks: int, tiles: int, split_k: int) -> int:
    """``Flags`` words (uint64) the kernel of this problem needs: ``world_size * blocks *
    FLAG_STRIDE`` (one flag per rank and block) without a split, the split kernel's
    :func:`~tilescale_examples.decode.gemm_ar_split.split_flag_words` with one."""
    return split_flag_words(world_size, tiles) if split_k > 1 else world_size * blocks * FLAG_STRIDE


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
