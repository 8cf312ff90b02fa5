"""The two-shot kernel of :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`
(``reduction="two_shot"``, symbol ``gemm_allreduce_two_shot``): each rank reduces ``1 /
world_size`` of every output tile and pushes it to every rank, so a rank reads ``(W - 1) /
W`` of the output from its peers instead of ``W - 1`` times it (the one-shot kernel), at the
cost of a second flag round per tile.

The GEMM, the tile order, the persistent grid and the call counter are the one-shot kernel's
(:mod:`~tilescale_examples.decode.gemm_ar_kernel`, whose builder assembles this kernel with
the steps of :func:`two_shot_macros`). ``Stage`` (``(2 * mp, n)``, the one-shot
kernel's allocation) holds this rank's rounded partials in rows ``0 .. mp`` and the reduced
tiles in rows ``mp .. 2 mp``: buffer 0 and buffer 1 every call, not by call number (see
"Reuse" below). Rank ``me``, call ``epoch``, tile ``t`` of iteration ``i`` (``v = epoch *
iters + i``):

1. *GEMM* into a float32 fragment; the tile rounded to the dtype into this rank's partials.
2. *Flag round* (the reduction engine's ``signal_and_wait``: barrier, system-scope release of
   ``ready[me, b] = 2 v`` on every rank, wait for every rank's ``>= 2 v``, barrier).
3. *Reduce a shard*: the tile's real rows as ``nvec`` 16-byte vectors, cut into ``W`` shards
   of ``ceil(nvec / W)``; this rank's shard read from every rank's partials (all ``W`` loads
   of a vector before the first add), added in rank order in float32, rounded once (the
   one-shot kernel's bits) and stored into the reduced tile of every rank.
4. *Flag round* with ``2 v + 1``: every rank's shard of the tile is here.
5. *Copy out*: the reduced tile's real rows, local, into ``Out``.

Reuse (one buffer each suffices): a peer writes into this rank's reduced tile ``t`` (step 3)
only after its step 2 for ``t`` saw this rank's flag of the same call, which this rank's
block sets after finishing its previous call (step 5 of every tile included); it reads this
rank's partials of ``t`` only between its steps 2 and 4, and this rank's block waits in step
4 for that before it can move on and overwrite them in a later call. Flags grow by two a
tile, never reset; waits are on same-index blocks only, so the one-shot kernel's deadlock
argument holds (all blocks resident, one block per SM).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from tilescale_examples.collectives.reduce_kernel import default_unroll, rank_order_sum

__all__ = ["two_shot_macros", "shard_bounds", "shard_vectors"]


def shard_bounds(nvec, world_size: int, rank, minimum=min) -> tuple:
    """``(first, end)``: the vectors ``first <= v < end`` that ``rank`` reduces of a tile's
    ``nvec`` real 16-byte vectors, shard ``rank`` of ``world_size`` shards of ``ceil(nvec /
    world_size)`` (the last shards short or empty: ``first >= end``). Ints, or TIR expressions
    with ``minimum=T.min``: the kernel's bounds and the tests' are the same arithmetic."""
    per = (nvec + world_size - 1) // world_size
    return rank * per, minimum(rank * per + per, nvec)


def shard_vectors(rows: int, block_n: int, vector: int, world_size: int, rank: int) -> range:
    """The 16-byte vectors (indices in the tile's row-major order of ``block_n / vector``
    per row) that ``rank`` reduces in a tile of ``rows`` real rows (:func:`shard_bounds`)."""
    return range(*shard_bounds(rows * (block_n // vector), world_size, rank))


def two_shot_macros(T, W: int, TH: int, V: int, BM: int, BN: int, m: int, mp: int, dtype: str):
    """``(reduce_shard, copy_out)``, steps 3 and 5 of the module docstring (the rest of the
    kernel is :func:`~tilescale_examples.decode.gemm_ar_kernel.build_gemm_ar_kernel`'s, with
    ``reduction="two_shot"``): ``reduce_shard(Stage, vals, res, me, row, col, tx)`` (``vals``
    ``(U, W, V)`` and ``res`` ``(U, V)`` of ``dtype``, ``U = default_unroll(W)``) and
    ``copy_out(Stage, Out, row, col, tx)``, for the tile at ``(row, col)``."""
    CV = BN // V  # vectors per tile row
    U = default_unroll(W)
    longest = -(-BM * CV // W)  # vectors of the longest shard
    SHARD_STEPS = -(-longest // (TH * U))
    COPY_STEPS = -(-BM * CV // TH)
    PEERS, ROWS = list(range(W)), list(range(U))

    @T.macro
    def reduce_shard(Stage, vals, res, me, row, col, tx):
        """Step 3: this rank's shard of the tile at ``(row, col)``."""
        shard = shard_bounds(T.min(BM, m - row) * CV, W, me, T.min)  # (first, end): expressions
        for j in T.serial(SHARD_STEPS):
            for u in ROWS:
                v = shard[0] + (j * U + u) * TH + tx
                if v < shard[1]:
                    for p in PEERS:
                        T.copy(Stage[row + v // CV, col + v % CV * V:col + v % CV * V + V], vals[u, p, 0:V], src_pe=p)
            for u in ROWS:
                v = shard[0] + (j * U + u) * TH + tx
                if v < shard[1]:
                    for i in T.vectorized(V):
                        res[u, i] = T.Cast(dtype, rank_order_sum(T, vals, u, i, W, "float32"))
                    for p in PEERS:
                        T.copy(res[u, 0:V], Stage[mp + row + v // CV, col + v % CV * V:col + v % CV * V + V], dst_pe=p)

    @T.macro
    def copy_out(Stage, Out, row, col, tx):
        """Step 5: the reduced tile's real rows into ``Out``."""
        nvec = T.min(BM, m - row) * CV
        for j in T.serial(COPY_STEPS):
            v = j * TH + tx
            if v < nvec:
                for i in T.vectorized(V):
                    Out[row + v // CV, col + v % CV * V + i] = Stage[mp + row + v // CV, col + v % CV * V + i]

    return reduce_shard, copy_out
