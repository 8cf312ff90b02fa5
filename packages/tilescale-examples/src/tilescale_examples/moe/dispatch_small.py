"""The dispatch kernel's small-batch path (at most one entry per thread: ``NT * K <= threads``).

Every block ranks and plans all entries itself, in shared memory and registers (nothing is
handed between blocks); the row copies are split evenly over every warp of the grid, and each
lane stores the 16-byte vectors it loaded at the kernel's start (so the loads overlap the plan)
straight from registers into the token's rows. :func:`small_batch` runs steps 0-5 of
"Small batch" in ``docs/moe.md``; each step is a macro of its own here, taking the kernel's
:class:`~tilescale_examples.moe._common.Scope` ``k`` (built by
:func:`tilescale_examples.moe.dispatch.dispatch_body`).
"""

# (no `from __future__ import annotations`: TileLang reads the macros' annotations)

from tilescale_examples.moe._common import (T, expert_key, inclusive_warp_scan, lanes_below, lowest_bit, macro,
                                            phase_done, unit_entry, unit_vector, write_status)

__all__ = ["small_batch", "load_part", "warp_units", "first_parts", "small_scan"]


@macro
def small_batch(k):
    """The small batch, steps 0-5 (``pb == 1``: grid-uniform), up to the closing round."""
    k = small_rank(k)
    small_scan(k)
    small_exchange(k)
    small_offsets(k)
    small_routes(k)
    small_data(k)


@macro
def load_part(vec, X, q, lane, PARTS, VECS):
    """Small 1 / 5: ``vec`` = lane ``lane``'s 16-byte vector of part ``q`` (token ``q //
    PARTS``, vector ``q % PARTS * 32 + lane`` of its row of ``VECS`` vectors); a lane past the
    row's end (the last part of a row that is not a multiple of 32 vectors) loads nothing."""
    if q % PARTS * 32 + lane < VECS:
        for v in T.vectorized(8):
            vec[v] = X[q // PARTS, (q % PARTS * 32 + lane) * 8 + v]


@macro
def warp_units(k):
    """The data phase's units (token part ``q``, slot), ``u = q * K + slot``, split evenly over
    the grid's ``G`` warps: warp ``g`` has units ``[u0, u1)`` (the first ``units % G`` warps one
    more), whose first part is ``qa = u0 // K``. Returns ``k`` with ``units``, ``u0``, ``u1``
    and ``qa``."""
    K, G, PARTS, g = k.K, k.G, k.PARTS, k.g
    units = T.alloc_var("int32")  # at most NT * PARTS * K
    units = k.NT * (PARTS * K)
    u0 = T.alloc_var("int32")
    u0 = g * (units // G) + T.min(g, units % G)
    u1 = T.alloc_var("int32")
    u1 = u0 + units // G + T.if_then_else(g < units % G, 1, 0)
    qa = T.alloc_var("int32")  # the part of the warp's first unit
    qa = u0 // K
    return k.extend(units=units, u0=u0, u1=u1, qa=qa)


@macro
def first_parts(k):
    """The (at most two) token parts the warp's first units need (:func:`warp_units`): ``qa``
    into ``xv``, ``qa + 1`` into ``xv2`` where the warp reaches it. Issued right after the
    warp's indices are loaded (so that those arrive first); nothing reads them before the data
    phase, so they stay in flight while the block ranks."""
    X, K, PARTS, VECS, lane, u0, u1, qa, xv, xv2 = k.X, k.K, k.PARTS, k.VECS, k.lane, k.u0, k.u1, k.qa, k.xv, k.xv2
    if u0 < u1:
        load_part(xv, X, qa, lane, PARTS, VECS)
        if (u1 - 1) // K > qa:
            load_part(xv2, X, qa + 1, lane, PARTS, VECS)


@macro
def small_rank(k):
    """Steps 0-1: the warp's units; thread ``i`` holds entry ``i`` and ranks it within its
    warp's entries of its expert. Returns ``k`` with the variables later steps read."""
    E, K, index_dtype = k.E, k.K, k.index_dtype
    Idx, Wt, Prof = k.Idx, k.Wt, k.Prof
    bx, tx, lane, warp, n = k.bx, k.tx, k.lane, k.warp, k.n
    wcnt, wbad, wfirst, skey_s, srank_s = k.wcnt, k.wbad, k.wfirst, k.skey_s, k.srank_s
    # ---- small 0. the data phase's units, split evenly over the grid's warps; the (at most
    # two) parts a warp's first units need are loaded in step 1 and stay in flight during the
    # plan (nothing reads xv / xv2 before step 5)
    k = warp_units(k)
    # ---- small 1. thread i < n holds entry i: its index and weight (loaded before the
    # parts, so that they arrive first), its key; its rank among the warp's entries of
    # its expert (match_any); the warp's counts in its row of wcnt; key and rank into
    # skey_s / srank_s for the data phase
    sidx = T.alloc_var(index_dtype)
    sidx = -1  # threads past the last entry: an unused slot (skipped)
    sweight = T.alloc_var("float32")
    if tx < n:
        if bx == 0:  # (only block 0 writes Weights: the other blocks read just the indices)
            sweight = Wt[tx // K, tx % K]
        sidx = Idx[tx // K, tx % K]
    first_parts(k)
    skey = T.alloc_var("int32")
    skey = expert_key(sidx, E)
    if sidx != T.max_value(index_dtype):  # (data-dependent: the event waits for the index)
        phase_done(Prof, tx, 1)
    for j in T.serial((E + 33) // 32):
        if j * 32 + lane <= E + 1:
            wcnt[warp, j * 32 + lane] = 0
    T.sync_warp()
    ssame = T.match_any_sync(skey)
    srank = T.alloc_var("int32")
    srank = lanes_below(ssame, lane)
    if srank == 0:
        wcnt[warp, skey] = T.Cast("int32", T.popcount(ssame))
    skey_s[tx] = skey
    srank_s[tx] = srank
    sbad = T.ballot_sync(T.Cast("int32", tx < n and skey == E + 1))
    if lane == 0:
        wbad[warp] = T.Cast("int32", T.popcount(sbad))
        wfirst[warp] = T.if_then_else(sbad != T.uint64(0), warp * 32 + lowest_bit(sbad), -1)
    T.sync_threads()
    phase_done(Prof, tx, 2)
    return k.extend(sweight=sweight, skey=skey, srank=srank)


@macro
def small_scan(k):
    """Step 2: warp ``w`` scans columns ``w, w + NW, ...`` of ``wcnt`` over the warps; the last
    warp sums the bad entries."""
    E, NW, Prof = k.E, k.NW, k.Prof
    tx, lane, warp, wcnt, wbad, wfirst, stot, sc = k.tx, k.lane, k.warp, k.wcnt, k.wbad, k.wfirst, k.stot, k.sc
    run, first = k.run, k.first
    # ---- small 2. warp w scans columns w, w + NW, ... of wcnt over the warps (shuffles:
    # lane l holds warp l's row, lanes >= NW none; exclusive, in place; the totals into
    # stot); the last warp sums the bad entries
    for j in T.unroll((E + NW - 1) // NW):
        if warp + j * NW < E:  # warp-uniform
            scnt = T.if_then_else(lane < NW, wcnt[T.min(lane, NW - 1), warp + j * NW], 0)
            sc[0] = scnt
            inclusive_warp_scan(sc, lane)
            if lane < NW:
                wcnt[lane, warp + j * NW] = sc[0] - scnt
            if lane == 31:
                stot[warp + j * NW] = sc[0]
    if warp == NW - 1:  # warp-uniform; lane 31 is thread threads - 1 (Status below)
        run = T.if_then_else(lane < NW, wbad[T.min(lane, NW - 1)], 0)
        first = T.if_then_else(lane < NW, wfirst[T.min(lane, NW - 1)], -1)
        for d in [16, 8, 4, 2, 1]:
            run = run + T.shfl_xor(run, d)
        has_bad = T.alloc_var("uint64")  # the lanes whose warp saw a bad entry
        has_bad = T.ballot_sync(T.Cast("int32", first >= 0))
        first = T.shfl_sync(first, lowest_bit(has_bad) % 32)  # none: lane 0's -1
    T.sync_threads()
    phase_done(Prof, tx, 3)


@macro
def small_exchange(k):
    """Step 3: block 0 sends this rank's counts to every other rank and signals; every block
    waits for every other rank's counts. Block 0's last thread writes ``Status``."""
    E, K, threads = k.E, k.K, k.threads
    Counts, Sig, Status, Idx = k.Counts, k.Sig, k.Status, k.Idx
    bx, tx, me, W, stot, run, first, epoch, par = k.bx, k.tx, k.me, k.W, k.stot, k.run, k.first, k.epoch, k.par
    # ---- small 3. block 0 sends this rank's counts to every other rank and signals;
    # every block waits for every other rank's counts
    if W > 1:  # grid-uniform
        if bx == 0 and tx < E:
            for p in T.serial(W):
                if p != me:
                    T.st(Counts[par, me, tx], stot[tx], dst_pe=p)
        T.sync_threads()
        if bx == 0 and tx == 0:
            for p in T.serial(W):
                if p != me:
                    T.notify(Sig[0, me], p, epoch)  # release: after bar.sync, the block's counts
        if tx < W and tx != me:
            T.wait_ge(Sig[0, tx], epoch)
        T.sync_threads()
    if bx == 0 and tx == threads - 1:
        write_status(Status, Idx, T.Cast("int64", run), first, K)


@macro
def small_offsets(k):
    """Step 4: warp 0 alone turns the expert totals into where this rank's entries of each
    expert start on its owner (``eoff``) and the owner (``edst``)."""
    E, NWE, Counts, RecvCounts, RecvOffsets, Prof = k.E, k.NWE, k.Counts, k.RecvCounts, k.RecvOffsets, k.Prof
    bx, tx, lane, warp, me, W, EL, par = k.bx, k.tx, k.lane, k.warp, k.me, k.W, k.EL, k.par
    stot, erow, eoff, edst, etot, ebefore, sc = k.stot, k.erow, k.eoff, k.edst, k.etot, k.ebefore, k.sc
    # ---- small 4. warp 0 alone: lane l holds experts l, l + 32, ... (totals over the
    # ranks, rows of the ranks before this one) and scans the totals over the experts
    # into erow (rows of the experts before x over all ranks; erow[E]: all rows); then
    # where this rank's entries of expert x start on its owner (eoff) and the owner
    # (edst); block 0's warp 0 also writes RecvCounts and RecvOffsets
    carry = T.alloc_var("int32")  # the totals of the experts held in the lower slots
    if warp == 0:  # warp-uniform
        carry = 0
        for j in T.unroll(NWE):
            etot[j] = 0
            ebefore[j] = 0
            if j * 32 + lane < E:
                for s in T.serial(W):
                    scnt = T.if_then_else(s == me, stot[j * 32 + lane], Counts[par, s, j * 32 + lane])
                    etot[j] = etot[j] + scnt
                    if s < me:
                        ebefore[j] = ebefore[j] + scnt
            sc[0] = etot[j]
            inclusive_warp_scan(sc, lane)
            if j * 32 + lane < E:
                erow[j * 32 + lane] = carry + sc[0] - etot[j]
            carry = carry + T.shfl_sync(sc[0], 31)
        if lane == 0:
            erow[E] = carry
        T.sync_warp()
        for j in T.unroll(NWE):
            if j * 32 + lane < E:
                owner = (j * 32 + lane) * W // E  # = x // EL (EL * W = E), no run-time division
                eoff[j * 32 + lane] = erow[j * 32 + lane] - erow[owner * EL] + ebefore[j]
                edst[j * 32 + lane] = owner
        if bx == 0:
            for c in T.serial((EL + 32) // 32):
                if c * 32 + lane <= EL:
                    RecvOffsets[c * 32 + lane] = erow[me * EL + c * 32 + lane] - erow[me * EL]
                if c * 32 + lane < EL:
                    RecvCounts[c * 32 + lane] = (erow[me * EL + c * 32 + lane + 1]
                                                 - erow[me * EL + c * 32 + lane])
    T.sync_threads()
    phase_done(Prof, tx, 4)


@macro
def small_routes(k):
    """Block 0: the routes of the combine and each entry's origin on its owner (no barrier:
    nothing in the kernel reads them)."""
    E, TK, RecvSrc, RouteRank, RouteRow, Weights = k.E, k.TK, k.RecvSrc, k.RouteRank, k.RouteRow, k.Weights
    bx, tx, warp, me, n, wcnt, eoff, edst = k.bx, k.tx, k.warp, k.me, k.n, k.wcnt, k.eoff, k.edst
    skey, srank, sweight = k.skey, k.srank, k.sweight
    # block 0: the routes of the combine and each entry's origin on its owner
    if bx == 0 and tx < n:
        if skey < E:
            srow_v = eoff[skey] + wcnt[warp, skey] + srank
            T.st(RecvSrc[srow_v], me * TK + tx, dst_pe=edst[skey])
            RouteRank[tx] = edst[skey]
            RouteRow[tx] = srow_v
        else:
            RouteRank[tx] = -1
            RouteRow[tx] = -1
        Weights[tx] = sweight


@macro
def small_data(k):
    """Step 5: warp ``g`` stores its units ``u0 .. u1 - 1``, 32 at a time, from registers."""
    E, K, G, PARTS, VECS, X, RecvX = k.E, k.K, k.G, k.PARTS, k.VECS, k.X, k.RecvX
    lane, skey_s, srank_s, wcnt, eoff, edst, xv, xv2 = k.lane, k.skey_s, k.srank_s, k.wcnt, k.eoff, k.edst, k.xv, k.xv2
    units, u0, u1, qa = k.units, k.u0, k.u1, k.qa
    # ---- small 5. data: warp g stores units u0 .. u1 - 1 (part q = u // K of token q //
    # PARTS into the row of entry q // PARTS * K + u % K), 32 at a time: lane j first
    # finds the row, owner and first column of unit j (one pass for the whole warp),
    # then every unit takes them with three shuffles and each lane stores its 16-byte
    # vector of the part straight from registers (one st.global.v4 per unit and lane),
    # so a warp reads a token part once however many of the token's rows it writes
    staged = T.alloc_var("int32")  # the part in xv2 beyond qa + 1 (warps with more than K + 1 units)
    staged = qa + 1
    for c in T.serial((units // G + 32) // 32):  # 32-unit rounds: one unless the grid is small
        urow = T.alloc_var("int32")  # lane j: the row of unit u0 + 32c + j (-1: skipped),
        urow = -1
        udst = T.alloc_var("int32")  # its owner and its part's first column
        udst = 0
        ucol = T.alloc_var("int32")
        ucol = 0
        if u0 + c * 32 + lane < u1:
            ue = unit_entry(u0 + c * 32 + lane, K, PARTS)
            ukey = skey_s[ue]
            ucol = unit_vector(u0 + c * 32 + lane, K, PARTS)
            if ukey < E:
                urow = eoff[ukey] + wcnt[ue // 32, ukey] + srank_s[ue]
                udst = edst[ukey]
        for j in T.serial(T.min(32, u1 - u0 - c * 32)):  # warp-uniform (none past u1)
            u = u0 + c * 32 + j
            q = u // K
            if q != staged and q > qa + 1:  # warp-uniform
                load_part(xv2, X, q, lane, PARTS, VECS)
                staged = q
            row = T.shfl_sync(urow, j)
            dst = T.shfl_sync(udst, j)
            vec = T.shfl_sync(ucol, j) + lane  # this lane's 16-byte vector of the row
            if row >= 0 and vec < VECS:
                # (clamped where it is already in range: lets TileLang prove the store
                # in bounds and emit one 16-byte store)
                col = T.max(0, T.min(vec, VECS - 1)) * 8
                if q == qa:
                    T.copy(xv[0:8], RecvX[row, col:col + 8], dst_pe=dst)
                else:
                    T.copy(xv2[0:8], RecvX[row, col:col + 8], dst_pe=dst)
