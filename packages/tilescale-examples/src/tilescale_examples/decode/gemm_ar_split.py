"""The split-``k`` kernel of :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`
(``split_k = S > 1``, symbols ``gemm_allreduce_split`` and, on one rank,
``gemm_allreduce_solo_split``).

At decode a few rows make few tiles (``m = 1``, ``n = 8192``, 64 x 128 tiles: 64 blocks), and
a memory-bound GEMM on half the SMs cannot draw the whole memory bandwidth. So every tile is
cut along ``k`` into ``S`` units of ``k / S`` columns, unit ``u`` of tile ``u // S`` and split
``s = u % S``; the persistent grid is a multiple of ``S`` (the units of a tile run in the same
iteration on neighbouring blocks). Rank ``me``, call ``epoch`` (``State[b] + 1``), per unit:

1. *GEMM* over its ``k / S`` columns into a float32 fragment, stored (the real rows) into
   split ``s`` of this rank's partials (``Stage`` rows ``s * mp ..``; local, every call).
2. *Arrive*: a barrier of the block, then one thread adds 1 to the tile's counter
   ``count[t]`` (``atom.add.acq_rel.gpu``: the partial's release, and the acquire of the
   others' for the last), a barrier. Every call adds ``S`` to every tile's counter, so the
   unit that read ``count % S == S - 1`` is the tile's last; the others go on to their next
   unit without waiting.
3. *Combine* (the last unit): the ``S`` partials added in split order in float32. One rank:
   rounded once into ``Out``, done. Several: rounded to the dtype (``c_me``, the rank's
   product as a GEMM hands it over) and kept as float32 in this call's buffer (``Stage`` rows
   ``S * mp + epoch % 2 * mp ..``, symmetric).
4. *Flag round* on the tile's flag (the reduction engine's ``signal_and_wait``: barrier,
   system-scope release of ``ready[me, t] = epoch`` on every rank, wait for every rank's
   ``>= epoch``, barrier).
5. *Reduce*: the tile's real rows from every rank's buffer (16-byte vectors, all ``W`` loads
   before the first add), added in rank order in float32, rounded once into ``Out``.

Every rank adds the same float32 values in the same order, so ``Out`` is bit-identical on
every rank and equals the module semantics of ``GemmAllReduce`` (each rank's product rounded,
then the rank-order sum rounded once). A rank's peers read ``S``-fold less than the partials
themselves would be (one rounded tile per rank instead of ``S`` float32 ones), and one unit a
tile, not ``S``, takes part in the round.

Deadlock freedom: a waiting unit waits only for the same tile's flag on the peers; a tile's
units run in the same iteration on every rank, and every unit of iteration ``i`` reaches its
arrive without waiting on anything but earlier iterations' rounds, so by induction on ``i``
every tile's last unit releases its flag (before it waits); all blocks are resident (grid at
most the SM count, one block per SM). Reuse: a rank's call ``e + 2`` writes buffer ``e % 2``
after its call ``e + 1`` saw every rank's flag of call ``e + 1`` for every tile, which a peer
sets only after its call ``e`` (its reads of buffer ``e % 2`` among them) completed; the
partials are local and the next call starts after this one ends. Flags:
:func:`split_flag_words` words, ``ready[p, t]`` at ``(p * 2 * tiles + t) * FLAG_STRIDE`` and
this rank's ``count[t]`` at ``(me * 2 * tiles + tiles + t) * FLAG_STRIDE`` (a rank's row holds
both, so its own row is the part no peer writes). Counters and flags only grow: graph
replays are calls like any other.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from tilescale_examples.collectives.reduce_kernel import FLAG_STRIDE, step_macros
from tilescale_examples.decode.gemm_ar_common import (gemm_ar_prim_func, padded_rows, reduce_tile_macro,
                                                      split_order_sum)
from tilescale_examples.overlap.gemm import GemmTiles, gemm_mainloop

__all__ = ["build_split_kernel", "split_flag_words"]


def split_flag_words(world_size: int, tiles: int) -> int:
    """``Flags`` words of the split-``k`` kernel with ``tiles`` output tiles: a row of ``2 *
    tiles`` flags per rank (the tiles' ready flags, then the tiles' counters),
    :data:`FLAG_STRIDE` words apart."""
    return world_size * 2 * tiles * FLAG_STRIDE


def build_split_kernel(m: int, k: int, n: int, world_size: int, dtype: str, tiles: GemmTiles, split_k: int):
    """The split-``k`` ``T.prim_func`` (see the module docstring): the signature of
    :func:`~tilescale_examples.decode.gemm_ar_kernel.build_gemm_ar_kernel` with ``Stage: (2 *
    split_k * mp, n)`` float32, the arguments already checked there."""
    import tilelang.language as T

    W, TH, BM, BN, S = world_size, tiles.threads, tiles.block_m, tiles.block_n, split_k
    mp = padded_rows(m, BM)
    MT = mp // BM
    TILES = MT * (n // BN)
    NU = TILES * S
    mainloop = gemm_mainloop(k // S, dtype, tiles, k_offset=True)
    steps = step_macros(T, W, TH, 1, 4, 1)
    reduce_tile, U = reduce_tile_macro(T, W, TH, 4, BM, BN, m, dtype)
    alone = W == 1

    @T.macro
    def body(A, B, Stage, Out, Flags, State, blocks, iters, bx):
        tx = T.get_thread_binding()
        me = T.get_rank()
        C_f = T.alloc_fragment((BM, BN), "float32")
        before = T.alloc_shared((1,), "uint64")  # the tile counter's value before this unit's add
        vals = T.alloc_local((U, W, 4), "float32")
        res = T.alloc_local((U, 4), dtype)
        epoch = T.alloc_var("int64")
        epoch = State[bx] + 1
        lo = T.alloc_var("int32")
        lo = S * mp + T.Cast("int32", epoch % 2) * mp  # this call's buffer of rounded products
        for i in T.serial((NU - bx + blocks - 1) // blocks):
            t = (i * blocks + bx) // S  # the output tile of this unit
            mainloop(A, B, C_f, t % MT * BM, t // MT * BN, bx % S * (k // S))
            for r, c in T.Parallel(BM, BN):
                if r < m - t % MT * BM:  # the real rows only
                    Stage[bx % S * mp + t % MT * BM + r, t // MT * BN + c] = C_f[r, c]
            T.sync_threads()
            if tx == 0:
                before[0] = T.atomic_add(Flags[(me * 2 * TILES + TILES + t) * FLAG_STRIDE], 1,
                                         memory_order="acq_rel", return_prev=True)
            T.sync_threads()
            if before[0] % S == S - 1:  # the tile's last unit: every partial is in Stage
                for r, c in T.Parallel(BM, BN):
                    if r < m - t % MT * BM:
                        if alone:
                            Out[t % MT * BM + r, t // MT * BN + c] = T.Cast(
                                dtype, split_order_sum(Stage, mp, t % MT * BM + r, t // MT * BN + c, S))
                        else:
                            Stage[lo + t % MT * BM + r, t // MT * BN + c] = T.Cast("float32", T.Cast(
                                dtype, split_order_sum(Stage, mp, t % MT * BM + r, t // MT * BN + c, S)))
                if not alone:
                    steps.signal_and_wait(Flags, tx, me, t, 2 * TILES, epoch, 0)
                    reduce_tile(Stage, Out, vals, res, lo, t % MT * BM, t // MT * BN, tx)
        steps.count_call(State, bx, tx, epoch)

    symbol = "gemm_allreduce_solo_split" if alone else "gemm_allreduce_split"
    return gemm_ar_prim_func(T, m, k, n, dtype, TH, 2 * S * mp, "float32", body, symbol)
