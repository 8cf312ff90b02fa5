"""The combine kernel: :func:`build_combine_kernel` and its macros (steps 1-3, the row exchange
with the other ranks, in :func:`combine_exchange`; step 4, the weighted sums, in
:func:`combine_sums`). The protocol, step by step: "The combine kernel" in ``docs/moe.md``.

The macros take the kernel's :class:`~tilescale_examples.moe._common.Scope` as ``ctx`` (``k``
names the kernel's slot loops).
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

from tilescale_examples.moe._common import PASS_CONFIGS, PUT_UNROLL, Scope, T, check_sizes, grid_ids, macro

__all__ = ["build_combine_kernel", "combine_body"]


@macro
def combine_body(ctx, Y, Out, CombBuf, RecvSrc, RecvOffsets, RouteRank, RouteRow, Weights, Sig, Ctr, State):
    """The kernel (the signature of :func:`build_combine_kernel`; ``ctx``: the build's sizes)."""
    E, K, blocks, threads, dtype, VEC = ctx.E, ctx.K, ctx.blocks, ctx.threads, ctx.dtype, ctx.VEC
    with T.Kernel(blocks, threads=threads) as bx:
        tx, lane, g, me, W, EL = grid_ids(bx, threads, E)
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
        ctx = ctx.extend(Y=Y, Out=Out, CombBuf=CombBuf, RecvSrc=RecvSrc, RecvOffsets=RecvOffsets, RouteRank=RouteRank,
                         RouteRow=RouteRow, Weights=Weights, Sig=Sig, Ctr=Ctr, bx=bx, tx=tx, lane=lane, g=g, me=me,
                         W=W, EL=EL, epoch=epoch, again=again, rk=rk, rw=rw, wk=wk, vals=vals, acc=acc)
        if W > 1:  # grid-uniform; with one rank there is nobody to hand rows to or wait for
            combine_exchange(ctx)
        combine_sums(ctx)
        # ---- 5. the block records the call in its own copies, once all its threads read them
        T.sync_threads()
        if tx == 0:
            State[1, bx] = epoch
            State[2, bx] = routing


@macro
def combine_exchange(ctx):
    """Steps 1-3 (several ranks): the ready handshake when the same routing is combined again,
    the received rows back to their source ranks, and the counter round."""
    H, TK, G, blocks = ctx.H, ctx.TK, ctx.G, ctx.blocks
    Y, CombBuf, RecvSrc, RecvOffsets, Sig, Ctr = ctx.Y, ctx.CombBuf, ctx.RecvSrc, ctx.RecvOffsets, ctx.Sig, ctx.Ctr
    bx, tx, g, me, W, EL, epoch, again = ctx.bx, ctx.tx, ctx.g, ctx.me, ctx.W, ctx.EL, ctx.epoch, ctx.again
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


@macro
def combine_sums(ctx):
    """Step 4: each token's ``K`` rows summed with its weights in float32, in slot order."""
    K, H, G, VEC, COLS, dtype = ctx.K, ctx.H, ctx.G, ctx.VEC, ctx.COLS, ctx.dtype
    Y, Out, CombBuf, RouteRank, RouteRow, Weights = (ctx.Y, ctx.Out, ctx.CombBuf, ctx.RouteRank, ctx.RouteRow,
                                                     ctx.Weights)
    lane, g, me, rk, rw, wk, vals, acc = ctx.lane, ctx.g, ctx.me, ctx.rk, ctx.rw, ctx.wk, ctx.vals, ctx.acc
    # ---- 4. weighted sum, float32, slot order; a work item is one token's 32 * 8
    # columns, so few tokens still spread over many warps
    for j in T.serial((ctx.NT * COLS + G - 1) // G):
        item = g + j * G
        if item < ctx.NT * COLS:
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


def build_combine_kernel(num_experts: int, topk: int, hidden: int, max_tokens: int,
                         dtype: str = "bfloat16", blocks: int = 132, threads: int = 1024):
    """The combine ``T.prim_func`` (grid: ``blocks`` blocks of ``threads`` threads).

    Signature: ``(Y: (CAP, H) dtype, Out: (NT, H) dtype, CombBuf: (TMAX*K, H) dtype
    [symmetric], RecvSrc: (CAP,) int32 [symmetric], RecvOffsets: (E + 1,) int32, RouteRank:
    (TMAX*K,) int32, RouteRow: (TMAX*K,) int32, Weights: (TMAX*K,) float32, Sig: (2, W)
    uint64 [symmetric], Ctr: (4,) uint32 [symmetric], State: (3, blocks) int64)``.

    With several ranks, pushes each received row back to its source rank (unless the source is
    this rank), signals the other ranks and waits for them (after a ready handshake when the
    same routing is combined again); then sums each token's ``K`` rows weighted by
    ``Weights`` in float32 (in slot order), reading rows that stayed on this rank directly from
    ``Y``. With one rank it only sums. Each step: "The combine kernel" in ``docs/moe.md``.

    The default 1024 threads (64 registers each, no spills) give a 4096-token combine twice
    the warps of 512 threads, which use 95 registers and so also fit one block per SM.
    """
    import tilelang.language as T

    E, K, H, TMAX = num_experts, topk, hidden, max_tokens
    check_sizes(E, K, H, TMAX)
    TK = TMAX * K
    VEC = 8  # elements per 16-byte vector
    NT = T.dynamic("num_tokens")
    CAP = T.dynamic("capacity")
    NR = T.dynamic("num_ranks")
    # G: warps in the grid; COLS: 256-column groups per row
    sizes = Scope(E=E, K=K, H=H, TMAX=TMAX, TK=TK, G=blocks * (threads // 32), VEC=VEC, COLS=-(-H // (VEC * 32)),
                  blocks=blocks, threads=threads, dtype=dtype, NT=NT, CAP=CAP, NR=NR)

    @T.prim_func
    def moe_combine(Y: T.Tensor((CAP, H), dtype), Out: T.Tensor((NT, H), dtype),
                    CombBuf: T.Tensor((TK, H), dtype), RecvSrc: T.Tensor((CAP,), "int32"),
                    RecvOffsets: T.Tensor((E + 1,), "int32"), RouteRank: T.Tensor((TK,), "int32"),
                    RouteRow: T.Tensor((TK,), "int32"), Weights: T.Tensor((TK,), "float32"),
                    Sig: T.Tensor((2, NR), "uint64"), Ctr: T.Tensor((4,), "uint32"),
                    State: T.Tensor((3, blocks), "int64")):
        T.annotate_pass_configs(PASS_CONFIGS)
        combine_body(sizes, Y, Out, CombBuf, RecvSrc, RecvOffsets, RouteRank, RouteRow, Weights, Sig, Ctr, State)

    return moe_combine
