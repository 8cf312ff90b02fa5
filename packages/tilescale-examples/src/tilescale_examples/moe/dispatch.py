"""The dispatch kernel: :func:`build_dispatch_kernel` and :func:`dispatch_body`, which composes
the small-batch path (:mod:`.dispatch_small`), the large-batch path (:mod:`.dispatch_large`)
and the closing round both share. The protocol, step by step: ``docs/moe.md``.
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

from tilescale_examples.moe._common import (CHUNK, DISPATCH_PHASES, PASS_CONFIGS, PLAN_THREADS, Scope, T, check_sizes,
                                            grid_ids, macro, phase_done)
from tilescale_examples.moe.dispatch_large import large_batch
from tilescale_examples.moe.dispatch_small import small_batch

__all__ = ["build_dispatch_kernel", "dispatch_body"]


@macro
def dispatch_body(k, Idx, Wt, X, Packed, Base, Weights, Counts, Sig, RecvX, RecvSrc, RouteRank, RouteRow,
                  RecvCounts, RecvOffsets, Status, Ctr, State, Prof):
    """The kernel (the signature of :func:`build_dispatch_kernel`; ``k``: the build's sizes);
    ``Prof`` is None or the profiler buffer."""
    E, K, NW, NWE, blocks, threads, dtype = k.E, k.K, k.NW, k.NWE, k.blocks, k.threads, k.dtype
    with T.Kernel(blocks, threads=threads) as bx:
        tx, lane, g, me, W, EL = grid_ids(bx, threads, E)
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
        n = k.NT * K
        pb = T.alloc_var("int32")  # ranking blocks: one 32-entry batch per warp when the grid allows
        pb = T.max(1, T.min(blocks, (n + NW * 32 - 1) // (NW * 32)))
        phase_done(Prof, tx, 0)
        k = k.extend(Idx=Idx, Wt=Wt, X=X, Packed=Packed, Base=Base, Weights=Weights, Counts=Counts, Sig=Sig,
                     RecvX=RecvX, RecvSrc=RecvSrc, RouteRank=RouteRank, RouteRow=RouteRow, RecvCounts=RecvCounts,
                     RecvOffsets=RecvOffsets, Status=Status, Ctr=Ctr, Prof=Prof,
                     bx=bx, tx=tx, lane=lane, g=g, me=me, W=W, EL=EL, warp=warp, n=n,
                     wcnt=wcnt, escan=escan, wsum=wsum, wbad=wbad, wfirst=wfirst, stot=stot, skey_s=skey_s,
                     srank_s=srank_s, erow=erow, eoff=eoff, edst=edst, keys=keys, wts=wts, sc=sc, xv=xv, xv2=xv2,
                     etot=etot, ebefore=ebefore, run=run, first=first, nbad=nbad, every=every, before=before,
                     epoch=epoch, par=par, pb=pb)
        if pb == 1:  # grid-uniform: a small batch (n <= threads entries), planned by every block alone
            small_batch(k)
        else:
            large_batch(k)
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

    With ``PB = clamp(ceil(NT*K / threads), 1, blocks)`` ranking blocks, ``PB = 1`` (at most
    ``threads`` entries) takes the small-batch path (:mod:`.dispatch_small`), otherwise the
    large-batch path (:mod:`.dispatch_large`); both end in the same closing round. Each step,
    the synchronisation and the two-buffer argument: "The dispatch kernel" in ``docs/moe.md``.

    ``profile=True`` builds the same kernel with one more parameter, ``Prof: (blocks, 1 + 2 *
    len(DISPATCH_PHASES)) uint64`` (a :class:`tilescale_lang.profiler.EventProfiler` buffer
    with that capacity), into which thread 0 of every block records the end of each of
    :data:`DISPATCH_PHASES` (``%globaltimer``, one slot per phase, no atomics); with the
    default ``False`` the kernel has no profiling code at all.
    """
    import tilelang.language as T

    E, K, H, TMAX = num_experts, topk, hidden, max_tokens
    check_sizes(E, K, H, TMAX, threads)
    NW = threads // 32
    TK = TMAX * K
    VECS = H // 8  # 16-byte vectors per row
    NT = T.dynamic("num_tokens")
    NR = T.dynamic("num_ranks")
    CAP = T.dynamic("capacity")
    # NWE: warps of block 0 that hold one expert per lane in step 4; PARTS: a small batch's
    # parts of a row (one 16-byte vector per lane)
    sizes = Scope(E=E, K=K, H=H, TMAX=TMAX, NW=NW, NWE=(E + 31) // 32, TK=TK, G=blocks * NW, VECS=VECS,
                  PARTS=(VECS + 31) // 32, blocks=blocks, threads=threads, dtype=dtype, index_dtype=index_dtype,
                  NT=NT, NR=NR, CAP=CAP)

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
            dispatch_body(sizes, Idx, Wt, X, Packed, Base, Weights, Counts, Sig, RecvX, RecvSrc, RouteRank,
                          RouteRow, RecvCounts, RecvOffsets, Status, Ctr, State, None)

        return moe_dispatch

    @T.prim_func
    def moe_dispatch_profiled(Idx: idx_t, Wt: wt_t, X: x_t, Packed: packed_t, Base: base_t, Weights: weights_t,
                              Counts: counts_t, Sig: sig_t, RecvX: recv_x_t, RecvSrc: recv_src_t, RouteRank: route_rank_t,
                              RouteRow: route_row_t, RecvCounts: recv_counts_t, RecvOffsets: recv_offsets_t,
                              Status: status_t, Ctr: ctr_t, State: state_t,
                              Prof: T.Tensor((blocks, 1 + 2 * len(DISPATCH_PHASES)), "uint64")):
        T.annotate_pass_configs(PASS_CONFIGS)
        dispatch_body(sizes, Idx, Wt, X, Packed, Base, Weights, Counts, Sig, RecvX, RecvSrc, RouteRank,
                      RouteRow, RecvCounts, RecvOffsets, Status, Ctr, State, Prof)

    return moe_dispatch_profiled
