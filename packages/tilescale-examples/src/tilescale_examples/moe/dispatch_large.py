"""The dispatch kernel's large-batch path (more entries than a block has threads).

The first ``pb`` blocks rank every entry within its expert (one batch of 32 entries per warp)
and count per block; block 0 then plans (exchanges the per-expert counts with every rank
through the symmetric heap and computes the offsets; no host involvement) and releases the
plan to the other blocks; then one warp per entry (or per column range of an entry's row)
puts the token row into its row on the owner rank (``T.put_warp``) with the entry's origin.
:func:`large_batch` runs steps 1-6 of "Large batch" in ``docs/moe.md``; each step is a macro
of its own here, taking the kernel's :class:`~tilescale_examples.moe._common.Scope` ``k``
(built by :func:`tilescale_examples.moe.dispatch.dispatch_body`).
"""

# (no `from __future__ import annotations`: TileLang reads the macros' annotations)

from tilescale_examples.moe._common import (CHUNK, MAX_PARTS, PUT_UNROLL, RANK_BITS, T, expert_key,
                                            inclusive_warp_scan, lanes_below, lowest_bit, macro, phase_done,
                                            write_status)

__all__ = ["large_batch"]


@macro
def large_batch(k):
    """The large batch, steps 1-6 (``pb > 1``: grid-uniform), up to the closing round."""
    NW, blocks, Ctr, Prof = k.NW, k.blocks, k.Ctr, k.Prof
    bx, tx, n, pb, epoch = k.bx, k.tx, k.n, k.pb, k.epoch
    nb = T.alloc_var("int32")
    nb = (n + pb * NW * 32 - 1) // (pb * NW * 32)  # 32-entry batches per warp
    k = k.extend(nb=nb)
    if bx < pb:  # block-uniform
        large_rank(k)
        large_block_counts(k)
    # every block but 0 arrives (release, GPU scope: covers the block's Base row and Packed)
    T.sync_threads()
    if bx < pb:
        phase_done(Prof, tx, 2)
    if bx > 0 and tx == 0:
        T.atom_add(Ctr[3], 1, scope="gpu", sem="release")
    if bx == 0:  # block-uniform: the plan
        if tx == 0:  # every ranking block's counts are in Base
            T.wait_eq(Ctr[3], T.uint32(blocks - 1), scope="gpu")
            Ctr[3] = T.uint32(0)  # every arrival of this call is counted
        T.sync_threads()
        large_exchange(k)
        large_offsets(k)
        if tx == 0:  # large 5. the plan is complete: release it to this rank's blocks
            T.st(Ctr[2], T.Cast("uint32", epoch), scope="gpu", sem="release")
    if tx == 0:
        T.wait_eq(Ctr[2], T.Cast("uint32", epoch), scope="gpu")
    T.sync_threads()
    phase_done(Prof, tx, 4)
    large_data(k)


def batch_entry(bx, warp, nb, j, lane, NW):
    """Flat index of entry ``lane`` of batch ``j`` (of ``nb``) of warp ``warp`` of block
    ``bx`` (``NW`` warps per block): step 1's entry ranges."""
    return ((bx * NW + warp) * nb + j) * 32 + lane


def prefix_rows(escan, wsum, x, NWE):
    """Rows of experts ``< x`` over all ranks (``0 <= x <= E``): the warp-exclusive scan at
    ``x`` plus the sums of the warps before ``x``'s (static unroll over the ``NWE`` warps)."""
    total = T.if_then_else(x < NWE * 32, escan[T.min(x, NWE * 32 - 1)], 0)
    for w in range(NWE):
        total = total + T.if_then_else(w < x // 32, wsum[w], 0)
    return total


@macro
def rank_within_block(buf, wcnt, i, warp, E):
    """Large step 2: entry ``i``'s packed rank within its warp's batch becomes its rank
    within the ranking block (``buf``: ``Packed``; ``wcnt``: the block's count table,
    scanned over its warps)."""
    pk = buf[i]
    if pk >> RANK_BITS < E:
        buf[i] = pk + wcnt[warp, pk >> RANK_BITS]


@macro
def large_rank(k):
    """Step 1, in ranking block ``b``: warp ``w`` ranks its entries within their experts."""
    E, K, NW, Idx, Wt, Packed, Weights = k.E, k.K, k.NW, k.Idx, k.Wt, k.Packed, k.Weights
    bx, lane, warp, n, nb, wcnt, wbad, wfirst, keys, wts = (k.bx, k.lane, k.warp, k.n, k.nb, k.wcnt, k.wbad,
                                                            k.wfirst, k.keys, k.wts)
    # ---- large 1. warp w of block b ranks the entries [(b*NW + w)*R, (b*NW + w +
    # 1)*R) within their experts (R = 32 * nb), CHUNK batches of 32 at a time: the
    # chunk's indices and weights are loaded first (in flight together), then each
    # batch is ranked. Only the warp's own row of the count table is touched, so a
    # warp barrier orders its zeroing.
    for j in T.serial((E + 33) // 32):
        if j * 32 + lane <= E + 1:
            wcnt[warp, j * 32 + lane] = 0
    if lane == 0:
        wbad[warp] = 0
        wfirst[warp] = -1
    T.sync_warp()
    for c in T.serial((nb + CHUNK - 1) // CHUNK):
        for u in T.unroll(CHUNK):
            i = batch_entry(bx, warp, nb, c * CHUNK + u, lane, NW)
            keys[u] = E  # lanes past the last entry: skipped
            if c * CHUNK + u < nb and i < n:
                v = Idx[i // K, i % K]
                wts[u] = Wt[i // K, i % K]
                keys[u] = expert_key(v, E)
        for u in T.unroll(CHUNK):
            if c * CHUNK + u < nb:  # warp-uniform: every lane takes part in the votes
                i = batch_entry(bx, warp, nb, c * CHUNK + u, lane, NW)
                key = keys[u]
                same = T.match_any_sync(key)
                below_lanes = lanes_below(same, lane)
                prev = wcnt[warp, key]
                bad = T.ballot_sync(T.Cast("int32", i < n and key == E + 1))
                T.sync_warp()
                if below_lanes == 0:
                    wcnt[warp, key] = prev + T.Cast("int32", T.popcount(same))
                if lane == 0 and bad != T.uint64(0):
                    wbad[warp] = wbad[warp] + T.Cast("int32", T.popcount(bad))
                    if wfirst[warp] < 0:
                        wfirst[warp] = batch_entry(bx, warp, nb, c * CHUNK + u, 0, NW) + lowest_bit(bad)
                T.sync_warp()
                if i < n:
                    Weights[i] = wts[u]
                    Packed[i] = (key << RANK_BITS) | (prev + below_lanes)
    T.sync_threads()


@macro
def large_block_counts(k):
    """Step 2, in ranking block ``b``: the block's counts into row ``b`` of ``Base``; each
    warp's ranks become ranks within the block."""
    E, NW, threads, Base, Packed = k.E, k.NW, k.threads, k.Base, k.Packed
    bx, tx, lane, warp, n, nb, wcnt, wbad, wfirst = k.bx, k.tx, k.lane, k.warp, k.n, k.nb, k.wcnt, k.wbad, k.wfirst
    run, first = k.run, k.first
    # ---- large 2. the block's counts: an exclusive scan over its warps (thread g <
    # E, in shared memory), the block's totals into row b of Base (columns E + 1, E +
    # 2: bad entries, first bad flat index or -1); then each warp turns its ranks
    # into ranks within the block
    if tx < E:
        run = 0
        for w in T.serial(NW):
            cw = wcnt[w, tx]
            wcnt[w, tx] = run
            run = run + cw
        Base[bx, tx] = run
    if tx == threads - 1:
        run = 0
        first = -1
        for w in T.serial(NW):
            run = run + wbad[w]
            if first < 0:
                first = wfirst[w]
        Base[bx, E + 1] = run
        Base[bx, E + 2] = first
    T.sync_threads()
    for b in T.serial(nb):
        i = batch_entry(bx, warp, nb, b, lane, NW)
        if i < n:
            rank_within_block(Packed, wcnt, i, warp, E)


@macro
def large_exchange(k):
    """Step 3, block 0: this rank's counts to every other rank, ``Status``, and the wait for
    every other rank's counts."""
    E, K, threads, Base, Counts, Sig, Status, Idx = k.E, k.K, k.threads, k.Base, k.Counts, k.Sig, k.Status, k.Idx
    tx, me, W, pb, run, first, nbad, epoch, par = k.tx, k.me, k.W, k.pb, k.run, k.first, k.nbad, k.epoch, k.par
    # ---- large 3. this rank's count of expert g (thread g), the sum over the
    # ranking blocks, written into row `me` of Counts on every other rank; after
    # the block barrier thread 0 signals every other rank (release: the barrier
    # puts the block's stores before it)
    if tx < E:
        run = 0
        for b in T.serial(pb):
            run = run + Base[b, tx]
        for p in T.serial(W):
            if p != me:  # this rank's own counts stay in `run`
                T.st(Counts[par, me, tx], run, dst_pe=p)
    T.sync_threads()
    if tx == 0:
        for p in T.serial(W):
            if p != me:
                T.notify(Sig[0, me], p, epoch)  # release: my counts of call `epoch` are on p
    if tx == threads - 1:  # not a waiter below (W <= E < threads): off the critical path
        nbad = 0
        first = -1
        for b in T.serial(pb):
            nbad = nbad + T.Cast("int64", Base[b, E + 1])
            if first < 0:
                first = Base[b, E + 2]
        write_status(Status, Idx, nbad, first, K)
    if tx < W and tx != me:  # every other rank's counts of this call are here
        T.wait_ge(Sig[0, tx], epoch)
    T.sync_threads()


@macro
def large_offsets(k):
    """Step 4, block 0: the offsets from the count matrix into ``Base``, ``RecvCounts`` and
    ``RecvOffsets``."""
    E, NWE, Base, Counts, RecvCounts, RecvOffsets = k.E, k.NWE, k.Base, k.Counts, k.RecvCounts, k.RecvOffsets
    tx, lane, warp, me, W, EL, pb, par = k.tx, k.lane, k.warp, k.me, k.W, k.EL, k.pb, k.par
    escan, wsum, sc, run, every, before = k.escan, k.wsum, k.sc, k.run, k.every, k.before
    # ---- large 4. offsets. Thread g < E sums column g of the count matrix (W - 1
    # loads; row `me` is its own `run`) into its expert's total and the rows of
    # ranks before this one; the warps holding experts scan the totals (shuffles)
    # into escan and their warp sums into wsum, so that the rows of experts < x
    # over all ranks are escan[x] plus at most E / 32 warp sums (prefix_rows)
    if warp < NWE:  # warp-uniform
        every = 0
        if tx < E:
            for s in T.serial(W):
                cnt = T.if_then_else(s == me, run, Counts[par, s, tx])
                every = every + cnt
                if s < me:
                    before = before + cnt
        sc[0] = every
        inclusive_warp_scan(sc, lane)
        escan[tx] = sc[0] - every
        if lane == 31:
            wsum[warp] = sc[0]
    T.sync_threads()
    if tx < E:  # Base[b, g]: where ranking block b's entries of expert g start on the owner
        run = before + prefix_rows(escan, wsum, tx, NWE) - prefix_rows(escan, wsum, tx // EL * EL, NWE)
        for b in T.serial(pb):
            cb = Base[b, tx]
            Base[b, tx] = run
            run = run + cb
    if tx <= EL:  # this rank's local experts
        RecvOffsets[tx] = prefix_rows(escan, wsum, me * EL + tx, NWE) - prefix_rows(escan, wsum, me * EL, NWE)
        if tx < EL:
            RecvCounts[tx] = (prefix_rows(escan, wsum, me * EL + tx + 1, NWE)
                              - prefix_rows(escan, wsum, me * EL + tx, NWE))
    T.sync_threads()


@macro
def large_data(k):
    """Step 6, every block: ``P`` column ranges per entry when there are fewer entries than
    warps; warp ``g`` puts its items' columns into their rows on the owners."""
    K, NW, G, VECS, TK, X, RecvX = k.K, k.NW, k.G, k.VECS, k.TK, k.X, k.RecvX
    RecvSrc, RouteRank, RouteRow, Packed, Base = k.RecvSrc, k.RouteRank, k.RouteRow, k.Packed, k.Base
    E, lane, g, me, EL, n, nb = k.E, k.lane, k.g, k.me, k.EL, k.n, k.nb
    # ---- large data: P column ranges per entry when there are fewer entries than warps
    cuts = T.alloc_var("int32")
    cuts = T.max(1, T.min(MAX_PARTS, G // n))
    chunk = T.alloc_var("int32")  # 16-byte vectors per part
    chunk = (VECS + cuts - 1) // cuts
    for j in T.serial((n * cuts + G - 1) // G):
        q = g + j * G
        if q < n * cuts:
            i = q // cuts
            v0 = q % cuts * chunk
            packed = Packed[i]
            ekey = packed >> RANK_BITS
            if ekey < E:
                # NW * nb * 32: the entries each ranking block ranked
                row = Base[i // (NW * nb * 32), ekey] + (packed & ((1 << RANK_BITS) - 1))
                if v0 < VECS:
                    T.put_warp(T.address_of(X[i // K, v0 * 8]),
                               T.address_of(RecvX[T.Cast("int64", row), v0 * 8]),
                               (T.min(VECS, v0 + chunk) - v0) * 8, dst_pe=ekey // EL,
                               unroll_factor=PUT_UNROLL)
                if lane == 0 and v0 == 0:
                    T.st(RecvSrc[row], me * TK + i, dst_pe=ekey // EL)
                    RouteRank[i] = ekey // EL
                    RouteRow[i] = row
            elif lane == 0 and v0 == 0:
                RouteRank[i] = -1
                RouteRow[i] = -1
