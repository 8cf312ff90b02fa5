"""The low-latency combine kernel of :class:`tilescale_examples.moe.low_latency.MoELowLatency`:
:func:`build_ll_combine_kernel`. Each received row of the masked layout goes back to its source
rank's combine buffer (the origin the dispatch recorded), the grid's last block signals every
other rank, every block waits for theirs, then each token's ``K`` rows are summed with its
weights in float32 (the normal mode's :func:`~tilescale_examples.moe.combine.combine_sums`).
The protocol: "Low-latency mode" in ``docs/moe.md``.
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

from tilescale_examples.moe._common import PASS_CONFIGS, PUT_UNROLL, Scope, T, grid_ids, macro
from tilescale_examples.moe.combine import combine_sums
from tilescale_examples.moe.ll_dispatch import LL_THREADS, arrived, check_ll_sizes, last_block, ready_handshake

__all__ = ["build_ll_combine_kernel"]


@macro
def ll_return_rows(ctx):
    """Rows back: global warp ``g`` takes flat rows ``f = g, g + G, ...`` of ``E * TMAX``; a row
    of segment ``(j, s)`` (``f // TMAX = j * W + s``) below its count, from another rank ``s``,
    goes to ``CombBuf[RecvSrc[f]]`` on ``s``. Then the last block writes ``epoch`` into
    ``Flags[2, me]`` on every other rank (a release), and every block waits for theirs."""
    E, H, TMAX, G, blocks = ctx.E, ctx.H, ctx.TMAX, ctx.G, ctx.blocks
    Y, CombBuf, RecvSrc, RecvCounts = ctx.Y, ctx.CombBuf, ctx.RecvSrc, ctx.RecvCounts
    Flags, Arrive = ctx.Flags, ctx.Arrive
    tx, g, me, W, epoch, lastb = ctx.tx, ctx.g, ctx.me, ctx.W, ctx.epoch, ctx.lastb
    for j in T.serial((E * TMAX + G - 1) // G):
        f = g + j * G
        if f < E * TMAX:
            src = f // TMAX % W
            if src != me and f % TMAX < RecvCounts[f // TMAX]:
                T.put_warp(T.address_of(Y[f, 0]), T.address_of(CombBuf[RecvSrc[f], 0]), H, dst_pe=src,
                           unroll_factor=PUT_UNROLL)
    last_block(Arrive, 1, lastb, tx, epoch, blocks)
    if lastb[0] == 1 and tx < W and tx != me:
        if arrived(Arrive, 1, epoch, blocks):
            T.notify(Flags[2, me], tx, epoch)
    if tx < W and tx != me:
        T.wait_ge(Flags[2, tx], epoch)
    T.sync_threads()


@macro
def record_call(State, bx, tx, epoch, routing):
    """Block barrier (every thread has read the block's copies), then ``State[1, bx] = epoch``
    and ``State[2, bx] = routing`` (the dispatch this combine followed)."""
    T.sync_threads()
    if tx == 0:
        State[1, bx] = epoch
        State[2, bx] = routing


@macro
def ll_combine_body(ctx, Y, Out, Weights, CombBuf, RecvSrc, RecvCounts, RouteRank, RouteRow, Flags, Arrive, State):
    """The kernel (the signature of :func:`build_ll_combine_kernel`; ``ctx``: the build's sizes)."""
    E, K, blocks, threads, dtype, VEC = ctx.E, ctx.K, ctx.blocks, ctx.threads, ctx.dtype, ctx.VEC
    with T.Kernel(blocks, threads=threads) as bx:
        tx, lane, g, me, W, EL = grid_ids(bx, threads, E)
        # this block's own copies of the call numbers: the combine's, the latest dispatch's, and
        # whether no dispatch ran since the previous combine (the same routing combined again)
        epoch, routing, again = T.alloc_var("int64"), T.alloc_var("int64"), T.alloc_var("int32")
        epoch = State[1, bx] + 1
        routing = State[0, bx]
        again = T.Cast("int32", routing == State[2, bx])
        lastb = T.alloc_shared((1,), "int32")
        # the sums' registers: each slot's route, row and weight, its vectors, the float32 sums
        rk, rw, wk = T.alloc_local((K,), "int32"), T.alloc_local((K,), "int32"), T.alloc_local((K,), "float32")
        vals, acc = T.alloc_local((K * VEC,), dtype), T.alloc_local((VEC,), "float32")
        ctx = ctx.extend(Y=Y, Out=Out, Weights=Weights, CombBuf=CombBuf, RecvSrc=RecvSrc, RecvCounts=RecvCounts,
                         RouteRank=RouteRank, RouteRow=RouteRow, Flags=Flags, Arrive=Arrive, bx=bx, tx=tx, lane=lane,
                         g=g, me=me, W=W, EL=EL, epoch=epoch, lastb=lastb, rk=rk, rw=rw, wk=wk, vals=vals, acc=acc)
        if W > 1:  # grid-uniform; with one rank every row is here
            if again == 1:  # the same routing combined again: every other rank's CombBuf is free
                ready_handshake(Flags, 1, bx, tx, me, W, epoch)
            ll_return_rows(ctx)
        combine_sums(ctx)
        record_call(State, bx, tx, epoch, routing)


def build_ll_combine_kernel(num_experts: int, topk: int, hidden: int, max_tokens: int, dtype: str = "bfloat16",
                            blocks: int = 132, threads: int = LL_THREADS):
    """The low-latency combine ``T.prim_func`` (grid: ``blocks`` blocks of ``threads`` threads).

    Signature (``ROWS = E * TMAX``, ``TK = TMAX * K``, ``NE = NT * K``): ``(Y: (ROWS, H) dtype,
    Out: (NT, H) dtype, Weights: (NE,) float32, CombBuf: (TK, H) dtype [symmetric], RecvSrc:
    (ROWS,) int32 [symmetric], RecvCounts: (E,) int32, RouteRank: (TK,) int32, RouteRow: (TK,)
    int32, Flags: (3, W) uint64 [symmetric], Arrive: (2,) uint32, State: (3, blocks) int64)``.

    ``Out[t] = sum_k Weights[t * K + k] * row(t, k)`` in float32, slot order, rounded once;
    ``row`` is ``Y[RouteRow]`` for an entry whose expert lives here, ``CombBuf[t * K + k]``
    (sent back by its owner) otherwise, zero for a skipped entry.
    """
    import tilelang.language as T

    E, K, H, TMAX = num_experts, topk, hidden, max_tokens
    check_ll_sizes(E, K, H, TMAX, threads)
    TK, ROWS, VEC = TMAX * K, E * TMAX, 8
    NT, NE, NR = T.dynamic("num_tokens"), T.dynamic("num_entries"), T.dynamic("num_ranks")
    sizes = Scope(E=E, K=K, H=H, TMAX=TMAX, TK=TK, G=blocks * (threads // 32), VEC=VEC, COLS=-(-H // (VEC * 32)),
                  blocks=blocks, threads=threads, dtype=dtype, NT=NT)

    @T.prim_func
    def moe_ll_combine(Y: T.Tensor((ROWS, H), dtype), Out: T.Tensor((NT, H), dtype),
                       Weights: T.Tensor((NE,), "float32"),
                       CombBuf: T.Tensor((TK, H), dtype), RecvSrc: T.Tensor((ROWS,), "int32"),
                       RecvCounts: T.Tensor((E,), "int32"), RouteRank: T.Tensor((TK,), "int32"),
                       RouteRow: T.Tensor((TK,), "int32"), Flags: T.Tensor((3, NR), "uint64"),
                       Arrive: T.Tensor((2,), "uint32"), State: T.Tensor((3, blocks), "int64")):
        T.annotate_pass_configs(PASS_CONFIGS)
        ll_combine_body(sizes, Y, Out, Weights, CombBuf, RecvSrc, RecvCounts, RouteRank, RouteRow, Flags, Arrive, State)

    return moe_ll_combine
