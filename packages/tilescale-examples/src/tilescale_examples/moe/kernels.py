"""The two TileLang kernels behind :class:`tilescale_examples.moe.dispatcher.MoEDispatcher`.

Notation: compile-time constants ``E`` experts, top-``K`` slots per token, hidden size
``H`` (a multiple of 8, so a row is a whole number of 16-byte vectors) and ``TMAX`` tokens
per rank at most; run-time values ``W`` ranks (``T.get_num_ranks()``, so one binary serves
every world size), ``EL = E / W`` experts per rank (rank ``d`` owns experts ``[d * EL, (d +
1) * EL)``), ``CAP = W * TMAX * K`` receive rows, and the token count ``NT`` (the rows of
``x``), which are run-time dimensions of the tensors. An *entry* is one ``(token t, slot k)``
pair, flat index ``i = t * K + k``; entries with an expert index of ``-1`` or out of range
are *skipped* (not sent, weight 0 in the combine).

Receive layout on rank ``d`` (what the torch reference in :mod:`tilescale_examples.moe.dispatcher`
builds): rows grouped by local expert ``0 .. EL-1``; inside an expert by source rank
``0 .. W-1``; inside a source by entry index ``i``. The row of entry ``i`` of rank ``s``
whose expert ``g`` lives on ``d``::

    row = sum_{j < g % EL} total[d * EL + j]  +  sum_{s' < s} count[s', g]  +  rank_s(i)

where ``count[s, g]`` is how many entries of rank ``s`` chose ``g``, ``total[g]`` its sum
over ranks, and ``rank_s(i)`` how many entries of rank ``s`` before ``i`` chose ``g``.

* :func:`build_dispatch_kernel` (``blocks`` blocks of 1024 threads, at most one per SM, one
  launch), on one of two paths chosen by the batch. A *large* batch (more entries than a
  block has threads): the blocks rank every entry within its expert (one batch of 32 entries
  per warp) and count per block; block 0 then plans (exchanges the per-expert counts with
  every rank through the symmetric heap, computes the offsets above; no host involvement)
  and releases the plan to the other blocks; then one warp per entry (or per column range of
  an entry's row) puts the token row into its row on the owner rank (``T.put_warp``) with the
  entry's origin. A *small* batch (at most one entry per thread: 128 tokens of top-8): every
  block ranks and plans all entries itself, in shared memory and registers (nothing is
  handed between blocks); the row copies are split evenly over every warp of the grid, and
  each lane stores the 16-byte vectors it loaded at the kernel's start (so the loads overlap
  the plan) straight from registers into the token's rows. On both paths
  every block then signals every other rank and waits until all blocks of all other ranks
  have signalled it (a rank never signals itself: the kernel's end orders its own writes).
* :func:`build_combine_kernel` (same grid): with several ranks, pushes each received row back
  to its source rank (unless the source is this rank), signals the other ranks and waits for
  them; then sums each token's ``K`` rows weighted by ``topk_weights`` in float32 (in slot
  order), reading rows that stayed on this rank directly from ``y``. With one rank it only
  sums.

The synchronisation protocol and the deadlock-freedom argument are in the module docstring
of :mod:`tilescale_examples.moe.dispatcher`. The four counter words ``Ctr`` (symmetric ``uint32``): ``0``
the dispatch's closing round (adds from the other ranks' blocks), ``1`` the combine's, ``2``
the plan's release to this rank's blocks, ``3`` this rank's ranking blocks arriving in a
dispatch with several of them (local; block 0 resets it once it has seen them all). The call
numbers ``State`` (``(3, blocks)`` int64, local), one copy per block ``b`` of each kernel,
which only block ``b`` reads and advances (so neither kernel needs a cross-block round to know
that its blocks have read them; both grids have ``blocks`` blocks): ``State[0, b]`` the
dispatch calls, ``State[1, b]`` and ``State[2, b]`` the combine calls and the dispatch call
the latest combine followed.
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

__all__ = ["PLAN_THREADS", "PLAN_WARPS", "PASS_CONFIGS", "MAX_EXPERTS", "MAX_PARTS", "DISPATCH_PHASES",
           "build_dispatch_kernel", "build_combine_kernel"]

#: Threads (and warps) per block of the dispatch kernel, whose block 0 plans: each of its
#: warps ranks one contiguous range of entries.
PLAN_THREADS = 1024
PLAN_WARPS = PLAN_THREADS // 32
#: Most column ranges one entry's row is cut into when a large batch has fewer entries than the
#: dispatch grid has warps (a 7168-element row in 8 parts: 112 16-byte vectors each).
MAX_PARTS = 8
#: 32-entry batches whose indices and weights a ranking warp loads at once before ranking them
#: (a warp has one batch unless the grid has fewer than ``NT * K / threads`` blocks).
CHUNK = 4
#: 16-byte vectors each lane loads before storing in the row copies (``T.put_warp``; a last,
#: shorter round takes the rest): a 7168-element bfloat16 row is 28 vectors per lane, seven
#: rounds. Four: seven or eight (which also fit the 64 registers of a 1024-thread block
#: without spills) made the dispatch slower (see docs/benchmarks.md).
PUT_UNROLL = 4
#: Largest supported expert count: each ranking block keeps a ``(PLAN_WARPS, E + 2)`` int32 count
#: table in shared memory (33 KiB at 256).
MAX_EXPERTS = 256
#: Every ``__syncthreads`` in these kernels is written out by hand (TileLang would otherwise
#: insert its own around shared-memory accesses, some of them inside warp-divergent code),
#: and every shared buffer keeps its own bytes (no reuse across phases that only the hand-
#: written barriers separate).
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True, "tl.disable_shared_memory_reuse": True}
#: The points a profiled dispatch kernel (``build_dispatch_kernel(..., profile=True)``) records,
#: in order; event ``p`` (task and slot ``p``) is thread 0 of a block reaching the end of
#: phase ``p``: the call number read (``start``), its entry's index arrived (small batches),
#: the entries ranked (the small path's first barrier; a large batch's ranking blocks), the
#: warps' counts scanned (small), the plan complete (a large batch: released to the block),
#: the block's rows issued (the closing barrier), and the closing round done.
DISPATCH_PHASES = ("start", "index loaded", "ranked", "scanned", "planned", "data issued", "end")
#: Bits of a packed plan entry below the expert key: the entry's rank within its ranking
#: block's range of entries (fewer than ``TMAX * K + threads <= 2**16``).
RANK_BITS = 16


def _check(num_experts: int, topk: int, hidden: int, max_tokens: int, threads: int = PLAN_THREADS) -> None:
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if hidden < 8 or hidden % 8:
        raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
    if threads % 32 or not num_experts < threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in ({num_experts}, 1024] (the plan gives each of "
                         f"the {num_experts} experts a thread, plus one), got {threads}")
    if not 1 <= max_tokens * topk <= (1 << RANK_BITS) - threads:
        raise ValueError(f"max_tokens * topk must be in [1, {(1 << RANK_BITS) - threads}] (an entry's rank within "
                         f"its ranking block is a {RANK_BITS}-bit field), got {max_tokens * topk}")


def _grid_ids(T, bx, threads: int, num_experts: int):
    """``(tx, lane, global warp, rank, world size, experts per rank)`` inside a kernel whose
    blocks have ``threads`` threads (block ``bx``); the last is an ``int32`` variable."""
    tx = T.get_thread_binding()
    world = T.get_num_ranks()
    return (tx, tx % 32, bx * (threads // 32) + tx // 32, T.get_rank(), world,
            T.alloc_var("int32", init=num_experts // world))


def build_dispatch_kernel(num_experts: int, topk: int, hidden: int, max_tokens: int,
                          dtype: str = "bfloat16", index_dtype: str = "int64", blocks: int = 132,
                          threads: int = PLAN_THREADS, profile: bool = False):
    """The dispatch ``T.prim_func``: plan and data movement in one launch (grid: ``blocks``
    blocks of ``threads`` threads; block 0 also plans).

    Signature: ``(Idx: (NT, K) index_dtype, Wt: (NT, K) float32, X: (NT, H) dtype, Packed:
    (TMAX*K,) int32, Base: (blocks, E + 3) int32, Weights: (TMAX*K,) float32, Counts: (2, W,
    E) int32 [symmetric], Sig: (2, W) uint64 [symmetric], RecvX: (CAP, H) dtype [symmetric],
    RecvSrc: (CAP,) int32 [symmetric], RouteRank: (TMAX*K,) int32, RouteRow: (TMAX*K,)
    int32, RecvCounts: (E,) int32, RecvOffsets: (E + 1,) int32, Status: (3,) int64, Ctr: (4,)
    uint32 [symmetric], State: (3, blocks) int64)``; only the first ``EL`` (``EL + 1``) entries of
    ``RecvCounts`` (``RecvOffsets``) are written.

    Block ``b``'s call number ``e = State[0, b] + 1`` (its own copy, read by all its threads
    at its start; every block runs every call, so all copies agree), count buffer
    ``e % 2``. ``NW = threads / 32`` warps per block, ``G = blocks * NW`` warps in the grid;
    ``PB = clamp(ceil(NT*K / (NW * 32)), 1, blocks)`` *ranking blocks*. With ``PB = 1`` (at
    most ``threads`` entries) the kernel takes the small-batch path, otherwise the
    large-batch path; both end in the same closing round.

    **Small batch** (every block, on its own; thread ``i`` holds entry ``i``; a row is ``P =
    ceil(H / 256)`` parts of 32 16-byte vectors, one per lane). The data phase's *units* are
    the pairs (part ``q``, slot ``k``), ``u = q * K + k`` (part ``q`` of token ``q // P`` into
    the row of entry ``q // P * K + k``), ``U = NT * P * K`` of them, split evenly over the
    grid's warps: warp ``g`` has ``[u0, u1)``, ``U // G`` units or one more. With 1024 threads
    every warp of every block has about as many bytes to store, because the kernel's time in
    this phase is bound by the instructions its 32 warps per SM issue, not by one warp's loads.

    0. Warp ``g`` works out ``u0`` and ``u1`` (one division by the constant ``G``).
    1. Thread ``i`` loads its index (in block 0 also its weight: every block reads the
       indices, so the others leave the weights alone), then each lane loads its vectors of
       the (at most two) parts its warp's units start with into registers (``xv``, ``xv2``;
       each part guarded by its own row end): nothing reads them before step 5, so those
       loads overlap steps 1-4. The index becomes a key
       (the expert; ``E`` for ``-1``, ``E + 1`` for an index out of range: both are skipped);
       ``T.match_any_sync`` on the key gives the warp's lanes with the same expert: the
       popcount of the lower ones is the entry's rank among them, and the lowest writes their
       count into the warp's row of the ``(NW, E + 2)`` shared table. Key and rank go to
       shared memory for step 5; the bad entries are counted per warp (``T.ballot_sync``;
       first flat index kept). Block barrier.
    2. Warp ``w`` scans the table's columns ``w, w + NW, ...`` over the warps with shuffles
       (exclusive, in place; the expert's total, this rank's count, into ``stot``); the last
       warp sums the bad entries with shuffles. Block barrier.
    3. With several ranks: block 0's thread ``x < E`` writes ``stot[x]`` into row ``me`` of
       ``Counts[e % 2]`` on every other rank; after a block barrier its thread 0 signals every
       other rank (``T.notify(Sig[0, me], p, e)``, a release store); threads ``p < W``, ``p !=
       me``, of every block wait ``T.wait_ge(Sig[0, p], e)``; block barrier. Block 0's last
       thread writes ``Status`` (``[bad entries, first bad flat index or -1, its value]``).
    4. Warp 0 alone: lane ``l`` holds experts ``l, l + 32, ...``: their totals over the ranks
       (``W - 1`` loads of ``Counts`` each) and the rows of the ranks before this one; an
       exclusive scan of the totals over the experts (shuffles) goes to ``erow`` (``erow[E]``:
       all rows); then per expert ``x`` its owner ``d = x * W // E`` (``= x // EL``, without a
       run-time division) into ``edst`` and where this rank's entries of ``x`` start on ``d``,
       ``erow[x] - erow[d * EL]`` plus the rows of the ranks before this one, into ``eoff``;
       in block 0 also ``RecvCounts`` and ``RecvOffsets``. Block barrier. Entry ``i``'s row is
       ``eoff[k] + (its warp's column scan at k) + (its rank)``; block 0 writes the origin ``me
       * TMAX * K + i`` into ``RecvSrc[row]`` on its owner, ``RouteRank``, ``RouteRow`` and
       ``Weights`` (no barrier: nothing in the kernel reads them).
    5. Warp ``g``, 32 units at a time: lane ``j`` finds the row, owner and first column of
       unit ``u0 + j`` from the shared tables (one pass for the whole warp); then for each
       unit every lane takes them with three shuffles and stores its 16-byte vector of the
       part from ``xv`` or ``xv2`` into the row on its owner (a remote ``T.copy`` of 8
       elements: one ``st.global.v4``). A warp with more than ``K + 1`` units (only on small
       grids) loads each further part when it reaches it. A token part is read once by each
       warp that writes any of its rows, however many of them it writes.

    Every block reading ``Counts`` keeps the two-buffer argument below: each of a rank's
    blocks reads buffer ``e % 2`` of call ``e - 2`` before that rank's call ``e - 1`` starts
    and sends its counts. Ranks whose token counts put them on different paths in the same
    call still agree: what crosses ranks (the counts, ``Sig``, rows sent only after the
    owner's counts arrived, the closing counter) is the same on both paths.

    **Large batch** (``R = 32 * ceil(NT*K / (PB * NW * 32))`` entries per warp, so that every
    warp ranks one batch of 32 entries when the grid is large enough):

    1. In each ranking block ``b``, warp ``w`` ranks the entries ``[(b*NW + w)*R, (b*NW + w +
       1)*R)`` in chunks of :data:`CHUNK` batches of 32: it loads the chunk's indices and
       weights first (all in flight together), turning each index into a key as above, then
       ranks each batch: ``T.match_any_sync`` on the key gives the lanes with the same
       expert, the popcount of the lower ones is the rank within the batch, and the warp's row
       of the count table carries the running count. ``Packed[i] = key << 16 | rank`` and
       ``Weights[i]`` (a copy of ``Wt``). Out-of-range indices are counted per warp.
    2. Still in block ``b``: thread ``g < E`` scans column ``g`` of the count table over the
       warps (exclusive, in shared memory) and writes the block's total into ``Base[b, g]``;
       the last thread writes the block's bad-entry count and first bad index into ``Base[b,
       E + 1]`` and ``Base[b, E + 2]``; after a block barrier each warp adds its prefix to its
       entries' ranks in ``Packed`` (ranks within the block). Then every block but block 0
       arrives: a ``__syncthreads`` and a GPU-scope release add of 1 to ``Ctr[3]`` (local).
    3. Block 0 waits until ``Ctr[3] == blocks - 1`` (acquire): every ranking block's row is in
       ``Base``; then it resets ``Ctr[3]`` to 0 (no block adds to it again before the next
       call, which starts after this kernel ends). Thread ``g < E`` sums column ``g`` over
       the ranking blocks (this rank's count of expert ``g``, kept in a register) and writes
       it into row ``me`` of ``Counts[e % 2]`` on every other rank (``T.st``); after the block
       barrier thread 0 signals every other rank ``p`` with the system-scope release store
       ``T.notify(Sig[0, me], p, e)`` (after a ``bar.sync`` a release covers the whole
       block's earlier stores, so no separate fence), while the block's last thread writes
       ``Status``. Threads ``p < W``, ``p != me``, wait ``T.wait_ge(Sig[0, p], e)``: every
       other rank's counts are here. A rank never signals or waits for itself (with one rank
       there is no count exchange at all).
    4. Offsets from the count matrix: thread ``g < E`` sums column ``g`` over the ranks (its
       own count for row ``me``; the expert's total, and the rows of ranks before this one);
       the warps holding the experts scan the totals with shuffles, so the rows of experts
       ``< x`` are a scanned value plus at most ``E / 32`` warp sums (no thread runs a chain
       of ``E`` loads). From them ``Base[b, g]`` becomes where ranking block ``b``'s entries
       of expert ``g`` start on its owner (a running sum over the blocks); ``RecvCounts`` and
       ``RecvOffsets`` of the local experts.
    5. ``__syncthreads``, then thread 0 publishes the plan to the other blocks of this rank:
       a GPU-scope release store of ``e`` to ``Ctr[2]`` (local).
    6. Every block, once thread 0 saw ``Ctr[2] == e`` (acquire) and after a
       ``__syncthreads``: the ``NT*K`` entries are cut into ``P = clamp(G / (NT*K), 1, 8)``
       column ranges each, and global warp ``g`` takes work items ``g, g + G, ...``. For item
       ``(i, part)`` of entry ``i`` with expert key ``k < E``: owner ``d = k // EL``, row
       ``Base[i // (NW * R), k] + rank``; the warp puts its columns of ``X[i // K]`` into
       ``RecvX[row]`` on ``d`` (``T.put_warp``) and, for part 0, lane 0 stores the origin
       ``me * TMAX * K + i`` into ``RecvSrc[row]`` on ``d`` and the route into
       ``RouteRank[i]`` / ``RouteRow[i]`` (``-1`` for a skipped entry).

    **Closing round** (both paths): each block: ``__syncthreads``, a release add of 1 to
    ``Ctr[0]`` on every other rank (system scope), and thread 0 waits until ``Ctr[0] == e *
    (W - 1) * blocks`` (mod 2**32): every block of every other rank has finished writing to
    this rank (this rank's own rows are ordered before any later work on its stream by the
    kernel's end). Thread 0 then sets ``State[0, b] = e`` (after the block barrier: every
    thread of the block has read it).

    Two count buffers suffice: rank ``s`` writes buffer ``e % 2`` on rank ``d != s`` only
    after its call ``e - 1`` received every other rank's counts of ``e - 1``, so ``d`` has
    finished call ``e - 2``, the last reader of that buffer there.

    ``profile=True`` builds the same kernel with one more parameter, ``Prof: (blocks, 1 + 2 *
    len(DISPATCH_PHASES)) uint64`` (a :class:`tilescale_lang.profiler.EventProfiler` buffer
    with that capacity), into which thread 0 of every block records the end of each of
    :data:`DISPATCH_PHASES` (``%globaltimer``, one slot per phase, no atomics); with the
    default ``False`` the kernel has no profiling code at all.
    """
    import tilelang.language as T

    E, K, H, TMAX = num_experts, topk, hidden, max_tokens
    _check(E, K, H, TMAX, threads)
    NW = threads // 32
    NWE = (E + 31) // 32  # warps of block 0 that hold one expert per lane in step 4
    TK = TMAX * K
    G = blocks * NW
    VECS = H // 8  # 16-byte vectors per row
    PARTS = (VECS + 31) // 32  # a small batch's parts of a row: one 16-byte vector per lane
    NT = T.dynamic("num_tokens")
    NR = T.dynamic("num_ranks")
    CAP = T.dynamic("capacity")

    @T.macro
    def inclusive_warp_scan(acc, lane):
        """``acc[0]`` becomes the sum of ``acc[0]`` over lanes ``0 .. lane`` of the warp (five
        shuffle steps; every lane of the warp must call it)."""
        for d in [1, 2, 4, 8, 16]:
            up = T.shfl_up(acc[0], d)
            if lane >= d:
                acc[0] = acc[0] + up

    @T.macro
    def rank_within_block(buf, wcnt, i, warp):
        """Large step 2: entry ``i``'s packed rank within its warp's batch becomes its rank
        within the ranking block (``buf``: ``Packed``; ``wcnt``: the block's count table,
        scanned over its warps)."""
        pk = buf[i]
        if pk >> RANK_BITS < E:
            buf[i] = pk + wcnt[warp, pk >> RANK_BITS]

    @T.macro
    def load_part(vec, X, q, lane):
        """Small 1 / 5: ``vec`` = lane ``lane``'s 16-byte vector of part ``q`` (token ``q //
        PARTS``, vector ``q % PARTS * 32 + lane`` of its row); a lane past the row's end (the
        last part of a row that is not a multiple of 32 vectors) loads nothing."""
        if q % PARTS * 32 + lane < VECS:
            for v in T.vectorized(8):
                vec[v] = X[q // PARTS, (q % PARTS * 32 + lane) * 8 + v]

    @T.macro
    def write_status(Status, Idx, nbad, first):
        """``Status = [bad entries, first bad flat index or -1, its value (0 if none)]``."""
        Status[0] = nbad
        Status[1] = T.Cast("int64", first)
        Status[2] = 0
        if first >= 0:
            Status[2] = T.Cast("int64", Idx[first // K, first % K])

    def expert_key(v):
        """An index's key: the expert ``v`` when ``0 <= v < E``, ``E`` for ``-1`` (an unused
        slot), ``E + 1`` for any other value (out of range); both of the last are skipped."""
        return T.if_then_else(T.And(v >= 0, v < E), T.Cast("int32", v), T.if_then_else(v == -1, E, E + 1))

    def lanes_below(mask, lane):
        """How many of the lanes below ``lane`` are set in the ``uint32`` lane ``mask`` (int32)."""
        return T.Cast("int32", T.popcount(mask & ((T.uint32(1) << T.Cast("uint32", lane)) - T.uint32(1))))

    def lowest_bit(mask):
        """Index of the lowest set bit of a non-zero ``uint64`` ballot ``mask`` (int32): the
        popcount of the ones below it."""
        return T.Cast("int32", T.popcount((mask & (~mask + T.uint64(1))) - T.uint64(1)))

    def batch_entry(bx, warp, nb, j, lane):
        """Flat index of entry ``lane`` of batch ``j`` (of ``nb``) of warp ``warp`` of block
        ``bx``: step 1's entry ranges."""
        return ((bx * NW + warp) * nb + j) * 32 + lane

    def prefix_rows(escan, wsum, x):
        """Rows of experts ``< x`` over all ranks (``0 <= x <= E``): the warp-exclusive scan at
        ``x`` plus the sums of the warps before ``x``'s (static unroll over ``NWE``)."""
        total = T.if_then_else(x < NWE * 32, escan[T.min(x, NWE * 32 - 1)], 0)
        for w in range(NWE):
            total = total + T.if_then_else(w < x // 32, wsum[w], 0)
        return total

    @T.macro
    def phase_done(Prof, tx, phase):
        """With profiling: thread 0 of the block records the end of ``DISPATCH_PHASES[phase]``."""
        if Prof is not None:
            if tx == 0:
                T.profile_event(Prof, phase, slot=phase)

    @T.macro
    def dispatch_body(Idx, Wt, X, Packed, Base, Weights, Counts, Sig, RecvX, RecvSrc, RouteRank, RouteRow,
                      RecvCounts, RecvOffsets, Status, Ctr, State, Prof):
        """The kernel (the signature below); ``Prof`` is None or the profiler buffer."""
        with T.Kernel(blocks, threads=threads) as bx:
            tx, lane, g, me, W, EL = _grid_ids(T, bx, threads, E)
            warp = tx // 32
            wcnt = T.alloc_shared((NW, E + 2), "int32")  # columns E: skipped, E + 1: bad
            escan = T.alloc_shared((NWE * 32,), "int32")  # large 4: exclusive scan of the totals per warp
            wsum = T.alloc_shared((NWE,), "int32")  # large 4: those warps' sums
            wbad = T.alloc_shared((NW,), "int32")
            wfirst = T.alloc_shared((NW,), "int32")
            stot = T.alloc_shared((E,), "int32")  # small: this rank's count of each expert
            skey_s = T.alloc_shared((NW * 32,), "int32")  # small: each entry's expert key
            srank_s = T.alloc_shared((NW * 32,), "int32")  # small: its rank among its warp's entries of that expert
            erow = T.alloc_shared((E + 1,), "int32")  # small 4: rows of the experts before x over all ranks
            eoff = T.alloc_shared((E,), "int32")  # small 4: where this rank's entries of expert x start on its owner
            edst = T.alloc_shared((E,), "int32")  # small 4: expert x's owner
            keys = T.alloc_local((CHUNK,), "int32")  # large 1: one chunk's expert keys and weights
            wts = T.alloc_local((CHUNK,), "float32")
            sc = T.alloc_local((1,), "int32")  # the running value of inclusive_warp_scan
            xv = T.alloc_local((8,), dtype)  # small: this lane's 16-byte vectors of the warp's first two parts
            xv2 = T.alloc_local((8,), dtype)
            etot = T.alloc_local((NWE,), "int32")  # small 4: per lane, experts lane, lane + 32, ...:
            ebefore = T.alloc_local((NWE,), "int32")  # totals over ranks, rows of the ranks before this one
            run = T.alloc_var("int32")
            first = T.alloc_var("int32")
            nbad = T.alloc_var("int64")
            every = T.alloc_var("int32")  # large 4: thread g's expert total over ranks and the
            before = T.alloc_var("int32", init=0)  # rows of ranks before this one
            epoch = T.alloc_var("int64")
            epoch = State[0, bx] + 1  # this block's own copy of the call number
            par = T.alloc_var("int32")
            par = T.Cast("int32", epoch % 2)
            n = NT * K
            pb = T.alloc_var("int32")  # ranking blocks: one 32-entry batch per warp when the grid allows
            pb = T.max(1, T.min(blocks, (n + NW * 32 - 1) // (NW * 32)))
            phase_done(Prof, tx, 0)
            if pb == 1:  # grid-uniform: a small batch (n <= threads entries), planned by every block alone
                # ---- small 0. the data phase's units (token part q, slot k), u = q * K + k, split
                # evenly over the grid's warps: warp g has units [u0, u1) (the first units % G
                # warps one more). The (at most two) parts its first units need are loaded now
                # (step 1) and stay in flight during the plan (nothing reads xv / xv2 before step 5)
                units = T.alloc_var("int32")  # at most threads * PARTS
                units = NT * (PARTS * K)
                u0 = T.alloc_var("int32")
                u0 = g * (units // G) + T.min(g, units % G)
                u1 = T.alloc_var("int32")
                u1 = u0 + units // G + T.if_then_else(g < units % G, 1, 0)
                qa = T.alloc_var("int32")  # the part of the warp's first unit
                qa = u0 // K
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
                if u0 < u1:
                    load_part(xv, X, qa, lane)
                    if (u1 - 1) // K > qa:
                        load_part(xv2, X, qa + 1, lane)
                skey = T.alloc_var("int32")
                skey = expert_key(sidx)
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
                    write_status(Status, Idx, T.Cast("int64", run), first)
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
                        ue = (u0 + c * 32 + lane) // (PARTS * K) * K + (u0 + c * 32 + lane) % K
                        ukey = skey_s[ue]
                        ucol = (u0 + c * 32 + lane) // K % PARTS * 32
                        if ukey < E:
                            urow = eoff[ukey] + wcnt[ue // 32, ukey] + srank_s[ue]
                            udst = edst[ukey]
                    for j in T.serial(T.min(32, u1 - u0 - c * 32)):  # warp-uniform (none past u1)
                        u = u0 + c * 32 + j
                        q = u // K
                        if q != staged and q > qa + 1:  # warp-uniform
                            load_part(xv2, X, q, lane)
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
            else:
                nb = T.alloc_var("int32")
                nb = (n + pb * NW * 32 - 1) // (pb * NW * 32)  # 32-entry batches per warp
                if bx < pb:  # block-uniform
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
                            i = batch_entry(bx, warp, nb, c * CHUNK + u, lane)
                            keys[u] = E  # lanes past the last entry: skipped
                            if c * CHUNK + u < nb and i < n:
                                v = Idx[i // K, i % K]
                                wts[u] = Wt[i // K, i % K]
                                keys[u] = expert_key(v)
                        for u in T.unroll(CHUNK):
                            if c * CHUNK + u < nb:  # warp-uniform: every lane takes part in the votes
                                i = batch_entry(bx, warp, nb, c * CHUNK + u, lane)
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
                                        wfirst[warp] = batch_entry(bx, warp, nb, c * CHUNK + u, 0) + lowest_bit(bad)
                                T.sync_warp()
                                if i < n:
                                    Weights[i] = wts[u]
                                    Packed[i] = (key << RANK_BITS) | (prev + below_lanes)
                    T.sync_threads()
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
                        i = batch_entry(bx, warp, nb, b, lane)
                        if i < n:
                            rank_within_block(Packed, wcnt, i, warp)
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
                        write_status(Status, Idx, nbad, first)
                    if tx < W and tx != me:  # every other rank's counts of this call are here
                        T.wait_ge(Sig[0, tx], epoch)
                    T.sync_threads()
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
                        run = before + prefix_rows(escan, wsum, tx) - prefix_rows(escan, wsum, tx // EL * EL)
                        for b in T.serial(pb):
                            cb = Base[b, tx]
                            Base[b, tx] = run
                            run = run + cb
                    if tx <= EL:  # this rank's local experts
                        RecvOffsets[tx] = prefix_rows(escan, wsum, me * EL + tx) - prefix_rows(escan, wsum, me * EL)
                        if tx < EL:
                            RecvCounts[tx] = prefix_rows(escan, wsum, me * EL + tx + 1) - prefix_rows(escan, wsum, me * EL + tx)
                    T.sync_threads()
                    if tx == 0:  # large 5. the plan is complete: release it to this rank's blocks
                        T.st(Ctr[2], T.Cast("uint32", epoch), scope="gpu", sem="release")
                if tx == 0:
                    T.wait_eq(Ctr[2], T.Cast("uint32", epoch), scope="gpu")
                T.sync_threads()
                phase_done(Prof, tx, 4)
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
            # ---- the closing round (both paths)
            T.sync_threads()
            phase_done(Prof, tx, 5)
            if tx == 0:
                for p in T.serial(W):
                    if p != me:  # this rank's own rows are ordered by the kernel's end
                        T.notify(Ctr[0], p, 1, sig_op="add")  # release: my rows for p are there
                T.wait_eq(Ctr[0], T.Cast("uint32", epoch * (W - 1) * blocks))
                State[0, bx] = epoch  # after the block barrier: the block's threads have read it
                phase_done(Prof, tx, 6)

    # The parameters' annotations, shared by the two signatures below. Each parameter needs an
    # annotation object of its own: TileLang binds parameters annotated with the same object to
    # the same buffer.
    idx_t, wt_t, x_t = T.Tensor((NT, K), index_dtype), T.Tensor((NT, K), "float32"), T.Tensor((NT, H), dtype)
    packed_t, base_t, weights_t = T.Tensor((TK,), "int32"), T.Tensor((blocks, E + 3), "int32"), T.Tensor((TK,), "float32")
    counts_t, sig_t = T.Tensor((2, NR, E), "int32"), T.Tensor((2, NR), "uint64")
    recv_x_t, recv_src_t = T.Tensor((CAP, H), dtype), T.Tensor((CAP,), "int32")
    route_rank_t, route_row_t = T.Tensor((TK,), "int32"), T.Tensor((TK,), "int32")
    recv_counts_t, recv_offsets_t = T.Tensor((E,), "int32"), T.Tensor((E + 1,), "int32")
    status_t, ctr_t, state_t = T.Tensor((3,), "int64"), T.Tensor((4,), "uint32"), T.Tensor((3, blocks), "int64")
    if not profile:
        @T.prim_func
        def moe_dispatch(Idx: idx_t, Wt: wt_t, X: x_t, Packed: packed_t, Base: base_t, Weights: weights_t,
                         Counts: counts_t, Sig: sig_t, RecvX: recv_x_t, RecvSrc: recv_src_t, RouteRank: route_rank_t,
                         RouteRow: route_row_t, RecvCounts: recv_counts_t, RecvOffsets: recv_offsets_t,
                         Status: status_t, Ctr: ctr_t, State: state_t):
            T.annotate_pass_configs(PASS_CONFIGS)
            dispatch_body(Idx, Wt, X, Packed, Base, Weights, Counts, Sig, RecvX, RecvSrc, RouteRank, RouteRow,
                          RecvCounts, RecvOffsets, Status, Ctr, State, None)

        return moe_dispatch

    @T.prim_func
    def moe_dispatch_profiled(Idx: idx_t, Wt: wt_t, X: x_t, Packed: packed_t, Base: base_t, Weights: weights_t,
                              Counts: counts_t, Sig: sig_t, RecvX: recv_x_t, RecvSrc: recv_src_t, RouteRank: route_rank_t,
                              RouteRow: route_row_t, RecvCounts: recv_counts_t, RecvOffsets: recv_offsets_t,
                              Status: status_t, Ctr: ctr_t, State: state_t,
                              Prof: T.Tensor((blocks, 1 + 2 * len(DISPATCH_PHASES)), "uint64")):
        T.annotate_pass_configs(PASS_CONFIGS)
        dispatch_body(Idx, Wt, X, Packed, Base, Weights, Counts, Sig, RecvX, RecvSrc, RouteRank, RouteRow,
                      RecvCounts, RecvOffsets, Status, Ctr, State, Prof)

    return moe_dispatch_profiled


def build_combine_kernel(num_experts: int, topk: int, hidden: int, max_tokens: int,
                         dtype: str = "bfloat16", blocks: int = 132, threads: int = 1024):
    """The combine ``T.prim_func`` (grid: ``blocks`` blocks of ``threads`` threads).

    Signature: ``(Y: (CAP, H) dtype, Out: (NT, H) dtype, CombBuf: (TMAX*K, H) dtype
    [symmetric], RecvSrc: (CAP,) int32 [symmetric], RecvOffsets: (E + 1,) int32, RouteRank:
    (TMAX*K,) int32, RouteRow: (TMAX*K,) int32, Weights: (TMAX*K,) float32, Sig: (2, W)
    uint64 [symmetric], Ctr: (4,) uint32 [symmetric], State: (3, blocks) int64)``.

    Block ``b``'s call number ``e = State[1, b] + 1``; ``State[2, b]`` is the dispatch call the
    previous combine followed (``State[0, b]``: the latest dispatch call, the copy of the
    dispatch's block ``b``). Each block keeps its own copies: every block runs every call, so
    all copies agree.

    Steps 1-3 run only with more than one rank (grid-uniform); with one rank every row is
    already here and nobody is waited for.

    1. Ready handshake, only when no dispatch ran since the previous combine (``State[0, b]
       == State[2, b]``: the same routing combined again): block 0's thread 0 tells every
       other rank that this rank has started combine ``e`` (``T.notify(Sig[1, me], p, e)``:
       its ``CombBuf`` is free, since the previous combine's sums ran before on this stream);
       threads ``p < W``, ``p != me``, of every block wait for the same word from every
       other rank. After a dispatch it is not needed: that dispatch received every other
       rank's counts, which each rank sent from its dispatch kernel, so after its previous
       combine (every rank makes the same sequence of calls, each in stream order);
    2. global warp ``g`` takes received rows ``g, g + G, ...`` below ``RecvOffsets[EL]``
       and puts row ``r`` of ``Y`` into ``CombBuf[i]`` on source rank ``s`` (origin
       ``RecvSrc[r] = s * TMAX * K + i``) unless ``s`` is this rank;
    3. ``__syncthreads``; thread 0 adds 1 to ``Ctr[1]`` on every other rank (system-scope
       release, which after the barrier covers the block's rows) and waits until ``Ctr[1] ==
       e * (W - 1) * blocks`` (mod 2**32): every other rank's rows are here;
    4. warp ``g`` takes work items ``g, g + G, ...``, item ``(t, c)`` being columns ``[256c,
       256(c + 1))`` of token ``t`` (so a few tokens still keep every warp busy); each lane
       owns 8 columns, loads the token's ``K`` routes and weights, then the ``K`` rows' 16-byte
       vectors (all before the first add: ``Y[RouteRow]`` when the entry's owner is this
       rank, ``CombBuf[t * K + k]`` otherwise, zeros for a skipped entry), then sums
       ``Weights[t*K+k] * row`` in float32 in slot order and rounds once to ``dtype``;
    5. ``__syncthreads`` (every thread of the block has read its ``State`` copies), then
       thread 0 sets ``State[1, b] = e`` and ``State[2, b] = State[0, b]``.

    The default 1024 threads (64 registers each, no spills) give a 4096-token combine twice
    the warps of 512 threads, which use 95 registers and so also fit one block per SM.
    """
    import tilelang.language as T

    E, K, H, TMAX = num_experts, topk, hidden, max_tokens
    _check(E, K, H, TMAX)
    TK = TMAX * K
    WPB = threads // 32
    G = blocks * WPB
    VEC = 8  # elements per 16-byte vector
    COLS = -(-H // (VEC * 32))  # 256-column groups per row
    NT = T.dynamic("num_tokens")
    CAP = T.dynamic("capacity")
    NR = T.dynamic("num_ranks")

    @T.prim_func
    def moe_combine(Y: T.Tensor((CAP, H), dtype), Out: T.Tensor((NT, H), dtype),
                    CombBuf: T.Tensor((TK, H), dtype), RecvSrc: T.Tensor((CAP,), "int32"),
                    RecvOffsets: T.Tensor((E + 1,), "int32"), RouteRank: T.Tensor((TK,), "int32"),
                    RouteRow: T.Tensor((TK,), "int32"), Weights: T.Tensor((TK,), "float32"),
                    Sig: T.Tensor((2, NR), "uint64"), Ctr: T.Tensor((4,), "uint32"),
                    State: T.Tensor((3, blocks), "int64")):
        T.annotate_pass_configs(PASS_CONFIGS)
        with T.Kernel(blocks, threads=threads) as bx:
            tx, lane, g, me, W, EL = _grid_ids(T, bx, threads, E)
            epoch = T.alloc_var("int64")
            epoch = State[1, bx] + 1  # this block's own copies of the call numbers
            routing = T.alloc_var("int64")  # the latest dispatch call
            routing = State[0, bx]  # the dispatch's block bx's copy
            again = T.alloc_var("int32")  # 1: no dispatch since the previous combine
            again = T.Cast("int32", routing == State[2, bx])
            rk = T.alloc_local((K,), "int32")
            rw = T.alloc_local((K,), "int32")
            wk = T.alloc_local((K,), "float32")
            vals = T.alloc_local((K * VEC,), dtype)
            acc = T.alloc_local((VEC,), "float32")
            if W > 1:  # grid-uniform; with one rank there is nobody to hand rows to or wait for
                # ---- 1. ready handshake (the same routing combined again): every other rank has
                # started this combine. After a dispatch, its count exchange already showed that.
                if again == 1:  # grid-uniform
                    if bx == 0 and tx == 0:
                        for p in T.serial(W):
                            if p != me:
                                T.notify(Sig[1, me], p, epoch)
                    if tx < W and tx != me:
                        T.wait_ge(Sig[1, tx], epoch)
                    T.sync_threads()
                # ---- 2. rows computed here for other ranks' tokens go back to their source
                total = T.alloc_var("int32")
                total = RecvOffsets[EL]
                for j in T.serial((total + G - 1) // G):
                    r = g + j * G
                    if r < total:
                        origin = RecvSrc[r]
                        if origin // TK != me:
                            T.put_warp(T.address_of(Y[r, 0]), T.address_of(CombBuf[origin % TK, 0]), H,
                                       dst_pe=origin // TK, unroll_factor=PUT_UNROLL)
                # ---- 3. signal every other rank, wait for every other rank's rows
                T.sync_threads()
                if tx == 0:
                    for p in T.serial(W):
                        if p != me:
                            T.notify(Ctr[1], p, 1, sig_op="add")
                    T.wait_eq(Ctr[1], T.Cast("uint32", epoch * (W - 1) * blocks))
                T.sync_threads()
            # ---- 4. weighted sum, float32, slot order; a work item is one token's 32 * 8
            # columns, so few tokens still spread over many warps
            for j in T.serial((NT * COLS + G - 1) // G):
                item = g + j * G
                if item < NT * COLS:
                    t = item // COLS
                    col = (item % COLS * 32 + lane) * VEC
                    for k in T.unroll(K):
                        rk[k] = RouteRank[t * K + k]
                        rw[k] = RouteRow[t * K + k]
                        wk[k] = Weights[t * K + k]
                    if col < H:
                        for k in T.unroll(K):  # all K loads first, then the sums
                            if rk[k] == me:
                                for v in T.vectorized(VEC):
                                    vals[k * VEC + v] = Y[rw[k], col + v]
                            elif rk[k] >= 0:
                                for v in T.vectorized(VEC):
                                    vals[k * VEC + v] = CombBuf[t * K + k, col + v]
                            else:
                                for v in T.vectorized(VEC):
                                    vals[k * VEC + v] = T.Cast(dtype, 0)
                        for v in T.vectorized(VEC):
                            acc[v] = 0.0
                        for k in T.unroll(K):
                            for v in T.unroll(VEC):
                                acc[v] = acc[v] + wk[k] * T.Cast("float32", vals[k * VEC + v])
                        for v in T.vectorized(VEC):
                            Out[t, col + v] = T.Cast(dtype, acc[v])
            # ---- 5. the block records the call in its own copies, once all its threads read them
            T.sync_threads()
            if tx == 0:
                State[1, bx] = epoch
                State[2, bx] = routing

    return moe_combine
