"""The low-latency dispatch kernels of :class:`tilescale_examples.moe.low_latency.MoELowLatency`:
:func:`build_ll_dispatch_kernel` (``phase="fused"``: send and receive in one launch; ``"send"``:
the sends alone, for ``return_recv_hook=True``) and :func:`build_ll_recv_kernel` (the hook's
receive wait). The protocol, step by step: "Low-latency mode" in ``docs/moe.md``.

Receive layout (expert-major, masked): rank ``d``'s ``RecvX`` has one fixed segment of ``TMAX``
rows per (local expert ``j``, source rank ``s``), flat row ``f = (j * W + s) * TMAX + r``; a
sender ranks its own entries per expert (token order) and owns its segments, so no entry waits
for another rank's count. After its rows, the grid's last block writes ``epoch << 32 | count``
into the owner's signal word of each (expert, source) (a system-scope release); the receiver
waits for the words of its ``E = EL * W`` segments and keeps the counts.
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

from tilescale_examples.decode.norm_kernel import FP8_BLOCK, FP8_MAX
from tilescale_examples.moe._common import (MAX_EXPERTS, PASS_CONFIGS, Scope, T, expert_key, grid_ids, lanes_below,
                                            lowest_bit, macro, unit_entry, unit_vector, write_status)
from tilescale_examples.moe.dispatch_small import first_parts, load_part, small_scan, warp_units

__all__ = ["LL_THREADS", "LL_MAX_TOKENS", "LL_SHARED_LIMIT", "LL_PHASES", "ll_shared_bytes", "check_ll_sizes",
           "build_ll_dispatch_kernel", "build_ll_recv_kernel", "last_block", "ready_handshake"]

#: Threads per block of the low-latency dispatch and combine (one block per SM).
LL_THREADS = 1024
#: Most tokens per rank of one low-latency call (every block ranks all ``max_tokens * topk``
#: entries in shared memory).
LL_MAX_TOKENS = 1024
#: Shared memory one dispatch block may use (bytes): the static limit, no opt-in needed.
LL_SHARED_LIMIT = 48 * 1024
#: ``phase`` of :func:`build_ll_dispatch_kernel`.
LL_PHASES = ("fused", "send")


def ll_shared_bytes(num_experts: int, topk: int, max_tokens: int, threads: int = LL_THREADS) -> int:
    """Shared-memory bytes of one dispatch block: the packed entries (``max_tokens * topk``
    int32), the per-warp count table (``(threads / 32, E + 2)`` int32), the totals and the
    per-warp bad-entry words."""
    warps = threads // 32
    return 4 * (max_tokens * topk + warps * (num_experts + 2) + num_experts + 2 * warps + 1)


def check_ll_sizes(num_experts: int, topk: int, hidden: int, max_tokens: int, threads: int = LL_THREADS,
                   fp8: bool = False) -> None:
    """``ValueError`` naming the argument unless the low-latency kernels support these sizes."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    step = FP8_BLOCK if fp8 else 8
    if hidden < step or hidden % step:
        raise ValueError(f"hidden must be a positive multiple of {step}{' with fp8=True' if fp8 else ''}, got {hidden}")
    if threads % 32 or not num_experts <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [{num_experts}, 1024], got {threads}")
    if not 1 <= max_tokens <= LL_MAX_TOKENS:
        raise ValueError(f"max_tokens must be in [1, {LL_MAX_TOKENS}] in low-latency mode, got {max_tokens}")
    need = ll_shared_bytes(num_experts, topk, max_tokens, threads)
    if need > LL_SHARED_LIMIT:
        raise ValueError(f"max_tokens={max_tokens} * topk={topk} entries with {num_experts} experts need {need} bytes "
                         f"of shared memory per block, more than {LL_SHARED_LIMIT}: lower max_tokens (or threads)")


@macro
def ll_rank(k):
    """Step 1: warp ``w`` ranks entries ``[w * RW, (w + 1) * RW)`` (``RW = 32 * nbw``) batch by
    batch: ``packed[i] = key << 16 | rank among the warp's entries of key``; its counts in its
    row of ``wcnt``, its bad entries in ``wbad`` / ``wfirst``. After the first batch's indices
    are loaded, :func:`~tilescale_examples.moe.dispatch_small.first_parts` issues the warp's
    first token parts."""
    E, K, index_dtype, Idx = k.E, k.K, k.index_dtype, k.Idx
    lane, warp, n, nbw, wcnt, wbad, wfirst, packed = k.lane, k.warp, k.n, k.nbw, k.wcnt, k.wbad, k.wfirst, k.packed
    for j in T.serial((E + 33) // 32):
        if j * 32 + lane <= E + 1:
            wcnt[warp, j * 32 + lane] = 0
    nwbad = T.alloc_var("int32", init=0)
    fbad = T.alloc_var("int32", init=-1)
    lidx = T.alloc_var(index_dtype)
    T.sync_warp()
    for b in T.serial(nbw):
        i = (warp * nbw + b) * 32 + lane
        lidx = -1  # past the last entry: an unused slot (skipped)
        if i < n:
            lidx = Idx[i // K, i % K]
        if b == 0:
            first_parts(k)
        lkey = expert_key(lidx, E)
        lsame = T.match_any_sync(lkey)
        lbelow = lanes_below(lsame, lane)
        lrun = wcnt[warp, lkey]
        T.sync_warp()
        if lbelow == 0:
            wcnt[warp, lkey] = lrun + T.Cast("int32", T.popcount(lsame))
        if i < n:
            packed[i] = lkey * 65536 + lrun + lbelow
        lbad = T.ballot_sync(T.Cast("int32", i < n and lkey == E + 1))
        if fbad < 0 and lbad != T.uint64(0):
            fbad = (warp * nbw + b) * 32 + lowest_bit(lbad)
        nwbad = nwbad + T.Cast("int32", T.popcount(lbad))
        T.sync_warp()
    if lane == 0:
        wbad[warp] = nwbad
        wfirst[warp] = fbad
    T.sync_threads()


@macro
def segment_row(k, i, key, owner):
    """Flat row ``(j * W + me) * TMAX + slot`` of entry ``i`` (expert ``key``, local expert ``j =
    key - owner * EL`` on ``owner``); ``slot``: the entries of ``key`` in the warps before its
    ranking warp plus its rank there (its place in this rank's segment of ``key``)."""
    wcnt, packed, nbw, EL, W, me = k.wcnt, k.packed, k.nbw, k.EL, k.W, k.me
    return ((key - owner * EL) * W + me) * k.TMAX + wcnt[i // (nbw * 32), key] + packed[i] % 65536


@macro
def ll_status(k):
    """Block 0's last thread writes ``Status`` (the bad entries, as the normal mode)."""
    bx, tx, run, first = k.bx, k.tx, k.run, k.first
    if bx == 0 and tx == k.threads - 1:
        write_status(k.Status, k.Idx, T.Cast("int64", run), first, k.K)


@macro
def ready_handshake(Flags, which, bx, tx, me, W, epoch):
    """Every other rank has started this call: block 0's thread 0 writes ``epoch`` into
    ``Flags[which, me]`` on every other rank (a release); threads ``p < W``, ``p != me`` of every
    block wait for ``Flags[which, p]``; block barrier."""
    if bx == 0 and tx == 0:
        for p in T.serial(W):
            if p != me:
                T.notify(Flags[which, me], p, epoch)
    if tx < W and tx != me:
        T.wait_ge(Flags[which, tx], epoch)
    T.sync_threads()


@macro
def last_block(Arrive, which, lastb, tx, epoch, blocks):
    """Block barrier, then thread 0 adds 1 to the local ``Arrive[which]`` (GPU-scope acq_rel);
    ``lastb[0]`` is 1 in the block whose add completed the call's ``epoch * blocks`` (mod
    2**32): every block of the grid has issued its stores. Block barrier."""
    T.sync_threads()
    if tx == 0:
        prev = T.atom_add(Arrive[which], 1, scope="gpu", sem="acq_rel")
        lastb[0] = T.Cast("int32", prev + T.uint32(1) == T.Cast("uint32", epoch * blocks))
    T.sync_threads()


def arrived(Arrive, which, epoch, blocks):
    """The acquire load of ``Arrive[which]`` a signalling thread makes itself (true in the last
    block), so that its release covers every block's stores."""
    return T.ld(Arrive[which], scope="gpu", sem="acquire") == T.Cast("uint32", epoch * blocks)


@macro
def quantise(k, xv, xq, qscale, q):
    """FP8: lane ``l``'s 8 values of part ``q`` into e4m3 ``xq`` with the scale ``qscale[0]`` of
    its 128-channel group (16 lanes): ``amax / 448`` (float32), ``xq = e4m3(clamp(x / scale,
    -448, 448))``, 0 where the scale is 0."""
    lane, VECS = k.lane, k.VECS
    qmax = T.alloc_var("float32", init=0.0)
    if q % k.PARTS * 32 + lane < VECS:
        for v in T.unroll(8):
            qmax = T.max(qmax, T.abs(T.Cast("float32", xv[v])))
    for d in [8, 4, 2, 1]:
        qmax = T.max(qmax, T.shfl_xor(qmax, d))
    qscale[0] = qmax / T.float32(FP8_MAX)
    for v in T.unroll(8):
        scaled = T.if_then_else(qscale[0] > T.float32(0), T.Cast("float32", xv[v]) / qscale[0], T.float32(0))
        xq[v] = T.Cast("float8_e4m3", T.clamp(scaled, T.float32(-FP8_MAX), T.float32(FP8_MAX)))


@macro
def ll_data(k):
    """Step 4: warp ``g`` stores its units ``u0 .. u1 - 1``, 32 at a time: lane ``j`` first finds
    the row, owner and first column of unit ``j`` (for its part 0, it stores the entry's origin
    into ``RecvSrc`` on the owner and its route for the combine: owner and flat row, ``-1``,
    ``-1`` when skipped), then every unit takes them with three shuffles and each lane
    stores its 16-byte vector of the part (FP8: 8 bytes, and lane ``16 m`` the group's scale)
    from registers into the entry's row on its owner. ``xv`` holds the current part (the
    prefetched ``qa``, then ``xv2``'s ``qa + 1``, then each later part loaded when reached)."""
    E, K, G, PARTS, VECS, fp8, X, RecvX, RecvScales, RecvSrc = (k.E, k.K, k.G, k.PARTS, k.VECS, k.fp8, k.X,
                                                                k.RecvX, k.RecvScales, k.RecvSrc)
    RouteRank, RouteRow = k.RouteRank, k.RouteRow
    lane, W, packed, xv, xv2, xq, qscale = k.lane, k.W, k.packed, k.xv, k.xv2, k.xq, k.qscale
    units, u0, u1, qa = k.units, k.u0, k.u1, k.qa
    cur = T.alloc_var("int32", init=-1)  # the part in xv (and, FP8, quantised in xq)
    for c in T.serial((units // G + 32) // 32):  # 32-unit rounds: one unless the grid is small
        # lane j: the row of unit u = u0 + 32c + j (-1: skipped), its owner, its part's first vector
        urow, udst, ucol = T.alloc_var("int32", init=-1), T.alloc_var("int32", init=0), T.alloc_var("int32", init=0)
        u = u0 + c * 32 + lane
        if u < u1:
            ue = unit_entry(u, K, PARTS)
            ukey = packed[ue] // 65536
            ucol = unit_vector(u, K, PARTS)
            if ukey < E:
                udst = ukey * W // E  # = key // EL, no run-time division
                urow = segment_row(k, ue, ukey, udst)
                if ucol == 0:
                    T.st(RecvSrc[urow], ue, dst_pe=udst)
            if ucol == 0:  # each entry's part 0 is one unit of the grid: its route, once
                RouteRank[ue] = T.if_then_else(ukey < E, udst, -1)
                RouteRow[ue] = urow
        for j in T.serial(T.min(32, u1 - u0 - c * 32)):  # warp-uniform (none past u1)
            q = (u0 + c * 32 + j) // K
            if q != cur:  # warp-uniform
                if q == qa + 1:
                    for v in T.unroll(8):
                        xv[v] = xv2[v]
                elif q > qa + 1:
                    load_part(xv, X, q, lane, PARTS, VECS)
                if fp8:
                    quantise(k, xv, xq, qscale, q)
                cur = q
            row = T.shfl_sync(urow, j)
            dst = T.shfl_sync(udst, j)
            vec = T.shfl_sync(ucol, j) + lane  # this lane's 16-byte vector of the row
            if row >= 0 and vec < VECS:
                # (clamped where it is already in range: lets TileLang prove the store in
                # bounds and emit one 16-byte store)
                col = T.max(0, T.min(vec, VECS - 1)) * 8
                if fp8:
                    T.copy(xq[0:8], RecvX[row, col:col + 8], dst_pe=dst)
                    if lane % 16 == 0:
                        T.st(RecvScales[row, col // FP8_BLOCK], qscale[0], dst_pe=dst)
                else:
                    T.copy(xv[0:8], RecvX[row, col:col + 8], dst_pe=dst)


@macro
def ll_signal(k):
    """Step 5: the grid's last block writes ``epoch << 32 | count`` into the owner's word of
    each (expert, this rank) segment (thread ``x`` for expert ``x``, a system-scope release)."""
    E, blocks, Sig, Arrive = k.E, k.blocks, k.Sig, k.Arrive
    tx, me, W, EL, stot, lastb, epoch = k.tx, k.me, k.W, k.EL, k.stot, k.lastb, k.epoch
    last_block(Arrive, 0, lastb, tx, epoch, blocks)
    if lastb[0] == 1 and tx < E:
        if arrived(Arrive, 0, epoch, blocks):
            sowner = tx * W // E
            T.notify(Sig[(tx - sowner * EL) * W + me], sowner,
                     T.shift_left(T.Cast("uint64", epoch), T.uint64(32)) | T.Cast("uint64", stot[tx]))


@macro
def ll_receive(Sig, RecvCounts, tx, E, epoch):
    """The receive: thread ``x < E`` waits for segment ``x``'s word of call ``epoch`` and keeps
    its count (``RecvCounts[j * W + s]``)."""
    if tx < E:
        word = T.wait_ge(Sig[tx], T.shift_left(T.Cast("uint64", epoch), T.uint64(32)))
        RecvCounts[tx] = T.Cast("int32", word & T.uint64(0xFFFFFFFF))


@macro
def ll_dispatch_body(k, Idx, X, RecvX, RecvScales, RecvSrc, Sig, Flags, RouteRank, RouteRow, RecvCounts, Status,
                     Arrive, State):
    """The kernel (the signature of :func:`build_ll_dispatch_kernel`; ``k``: the build's sizes)."""
    E, NW, blocks, threads, dtype = k.E, k.NW, k.blocks, k.threads, k.dtype
    with T.Kernel(blocks, threads=threads) as bx:
        tx, lane, g, me, W, EL = grid_ids(bx, threads, E)
        warp = tx // 32
        wcnt = T.alloc_shared((NW, E + 2), "int32")  # columns E: skipped, E + 1: bad
        packed = T.alloc_shared((k.TK,), "int32")
        wbad = T.alloc_shared((NW,), "int32")
        wfirst = T.alloc_shared((NW,), "int32")
        stot = T.alloc_shared((E,), "int32")
        lastb = T.alloc_shared((1,), "int32")
        sc = T.alloc_local((1,), "int32")
        xv = T.alloc_local((8,), dtype)
        xv2 = T.alloc_local((8,), dtype)
        xq = T.alloc_local((8,), "float8_e4m3")
        qscale = T.alloc_local((1,), "float32")
        run = T.alloc_var("int32")
        first = T.alloc_var("int32")
        epoch = T.alloc_var("int64")
        epoch = State[0, bx] + 1  # this block's own copy of the call number
        again = T.alloc_var("int32")  # 1: no combine since the previous dispatch
        again = T.Cast("int32", State[0, bx] != State[2, bx])
        n = k.NT * k.K
        nbw = T.alloc_var("int32")  # 32-entry batches per ranking warp
        nbw = (n + threads - 1) // threads
        k = k.extend(Idx=Idx, X=X, RecvX=RecvX, RecvScales=RecvScales, RecvSrc=RecvSrc, Sig=Sig, RouteRank=RouteRank,
                     RouteRow=RouteRow, Status=Status, Arrive=Arrive, Prof=None, bx=bx, tx=tx, lane=lane, g=g, me=me,
                     W=W, EL=EL, warp=warp, n=n, nbw=nbw, wcnt=wcnt, packed=packed, wbad=wbad, wfirst=wfirst,
                     stot=stot, lastb=lastb, sc=sc, xv=xv, xv2=xv2, xq=xq, qscale=qscale, run=run, first=first, epoch=epoch)
        k = warp_units(k)
        ll_rank(k)
        small_scan(k)  # the column scans over the warps (stot: this rank's counts) and the bad entries
        ll_status(k)
        if again == 1 and W > 1:  # grid-uniform: a dispatch without a combine since the previous one
            ready_handshake(Flags, 0, bx, tx, me, W, epoch)
        ll_data(k)
        ll_signal(k)
        if k.phase == "fused":
            if bx == 0:
                ll_receive(Sig, RecvCounts, tx, E, epoch)
        T.sync_threads()
        if tx == 0:
            State[0, bx] = epoch


def build_ll_dispatch_kernel(num_experts: int, topk: int, hidden: int, max_tokens: int, dtype: str = "bfloat16",
                             index_dtype: str = "int64", blocks: int = 132, threads: int = LL_THREADS,
                             fp8: bool = False, phase: str = "fused"):
    """The low-latency dispatch ``T.prim_func`` (grid: ``blocks`` blocks of ``threads`` threads).

    Signature (``ROWS = E * TMAX`` receive rows, ``TK = TMAX * K``): ``(Idx: (NT, K)
    index_dtype, X: (NT, H) dtype, RecvX: (ROWS, H) dtype or float8_e4m3 [symmetric],
    RecvScales: (ROWS, H / 128) float32 [symmetric; FP8 only], RecvSrc: (ROWS,) int32
    [symmetric], Sig: (E,) uint64 [symmetric], Flags: (3, W) uint64 [symmetric], RouteRank:
    (TK,) int32, RouteRow: (TK,) int32, RecvCounts: (E,) int32, Status: (3,) int64, Arrive:
    (2,) uint32, State: (3, blocks) int64)``.

    Every block ranks all ``NT * K`` entries (shared memory, token order per expert), then the
    grid's warps store the rows; the last block signals each (expert, this rank) segment on its
    owner. ``phase="fused"``: block 0 then waits for this rank's ``E`` segment words and writes
    ``RecvCounts``; ``"send"``: it returns (the receive is :func:`build_ll_recv_kernel`).
    """
    import tilelang.language as T

    E, K, H, TMAX = num_experts, topk, hidden, max_tokens
    check_ll_sizes(E, K, H, TMAX, threads, fp8)
    if phase not in LL_PHASES:
        raise ValueError(f"phase must be one of {LL_PHASES}, got {phase!r}")
    TK, ROWS, VECS = TMAX * K, E * TMAX, H // 8
    NT, NR = T.dynamic("num_tokens"), T.dynamic("num_ranks")
    sizes = Scope(E=E, K=K, H=H, TMAX=TMAX, NW=threads // 32, TK=TK, G=blocks * (threads // 32), VECS=VECS,
                  PARTS=(VECS + 31) // 32, blocks=blocks, threads=threads, dtype=dtype, index_dtype=index_dtype,
                  NT=NT, fp8=fp8, phase=phase)
    recv_t = T.Tensor((ROWS, H), "float8_e4m3" if fp8 else dtype)
    # (each parameter needs an annotation object of its own: TileLang binds parameters annotated
    # with the same object to the same buffer)
    common = dict(Idx=T.Tensor((NT, K), index_dtype), X=T.Tensor((NT, H), dtype), RecvSrc=T.Tensor((ROWS,), "int32"),
                  Sig=T.Tensor((E,), "uint64"), Flags=T.Tensor((3, NR), "uint64"), RouteRank=T.Tensor((TK,), "int32"),
                  RouteRow=T.Tensor((TK,), "int32"), RecvCounts=T.Tensor((E,), "int32"),
                  Status=T.Tensor((3,), "int64"), Arrive=T.Tensor((2,), "uint32"),
                  State=T.Tensor((3, blocks), "int64"))
    c = Scope(**common)
    if not fp8:
        @T.prim_func
        def moe_ll_dispatch(Idx: c.Idx, X: c.X, RecvX: recv_t, RecvSrc: c.RecvSrc, Sig: c.Sig, Flags: c.Flags,
                            RouteRank: c.RouteRank, RouteRow: c.RouteRow, RecvCounts: c.RecvCounts, Status: c.Status,
                            Arrive: c.Arrive, State: c.State):
            T.annotate_pass_configs(PASS_CONFIGS)
            ll_dispatch_body(sizes, Idx, X, RecvX, None, RecvSrc, Sig, Flags, RouteRank, RouteRow, RecvCounts, Status,
                             Arrive, State)

        func = moe_ll_dispatch
    else:
        @T.prim_func
        def moe_ll_dispatch_fp8(Idx: c.Idx, X: c.X, RecvX: recv_t,
                                RecvScales: T.Tensor((ROWS, H // FP8_BLOCK), "float32"),
                                RecvSrc: c.RecvSrc, Sig: c.Sig, Flags: c.Flags, RouteRank: c.RouteRank,
                                RouteRow: c.RouteRow, RecvCounts: c.RecvCounts, Status: c.Status, Arrive: c.Arrive,
                                State: c.State):
            T.annotate_pass_configs(PASS_CONFIGS)
            ll_dispatch_body(sizes, Idx, X, RecvX, RecvScales, RecvSrc, Sig, Flags, RouteRank, RouteRow, RecvCounts,
                             Status, Arrive, State)

        func = moe_ll_dispatch_fp8
    name = func.attrs["global_symbol"]
    return func.with_attr("global_symbol", name if phase == "fused" else f"{name}_send")


def build_ll_recv_kernel(num_experts: int, blocks: int = 132):
    """The receive ``T.prim_func`` of ``return_recv_hook=True`` (one block of ``32 *
    ceil(E / 32)`` threads): ``(Sig: (E,) uint64 [symmetric], RecvCounts: (E,) int32, State:
    (3, blocks) int64)``; waits for the ``E`` segment words of the latest dispatch (``State[0,
    0]``, which its send kernel advanced) and writes ``RecvCounts``."""
    import tilelang.language as T

    E = num_experts
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {E}")

    @T.prim_func
    def moe_ll_recv(Sig: T.Tensor((E,), "uint64"), RecvCounts: T.Tensor((E,), "int32"),
                    State: T.Tensor((3, blocks), "int64")):
        T.annotate_pass_configs(PASS_CONFIGS)
        with T.Kernel(1, threads=-(-E // 32) * 32):
            tx = T.get_thread_binding()
            ll_receive(Sig, RecvCounts, tx, E, State[0, 0])

    return moe_ll_recv
