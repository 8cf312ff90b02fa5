"""The kernel of :class:`~tilescale_examples.decode.allreduce_norm.AllReduceResidualRMSNorm`:
a one-shot all-reduce fused with the residual add, RMSNorm and optional FP8 quantisation, one
launch per call.

The algorithm
-------------

A grid of ``blocks = min(tokens, max_blocks)`` blocks of ``threads`` threads; block ``b`` owns
the token rows ``t = i * blocks + b`` (``i < iters``), whole rows, so the norm's reduction over
a row stays inside the block. A row of ``hidden`` elements is ``NV = hidden / V`` 16-byte
vectors (``V = 8`` for float16/bfloat16); thread ``tx`` holds the vectors ``c = u * threads +
tx`` (``u < VPT = ceil(NV / threads)``). Rank ``me``, call ``epoch``:

1. *Weight*: every thread loads its vectors of ``weight`` into registers (nothing waits for it).
2. *Stage*: block ``b`` copies its token rows of ``x`` into buffer ``epoch % 2`` of this rank's
   symmetric ``Stage``.
3. *Ready*: the release round of the reduction engine
   (:func:`~tilescale_examples.collectives.reduce_kernel.step_macros`' ``signal_and_wait``:
   barrier, ``ready[me, b] = epoch`` on every rank with a system-scope release, wait
   ``ready[p, b] >= epoch`` here), then ``count_call`` (``State[b] = epoch``).
4. *Per row*: every thread loads its vectors of the row from every rank's ``Stage`` (all
   loads issued before the first add, at most :data:`MAX_LOADS` at once) and the residual,
   adds ``((x_0 + x_1) + ... + x_{W-1}) + residual`` in float32 (rank order, as
   :func:`~tilescale_examples.collectives.reduce_kernel.rank_order_sum`), rounds once to the
   dtype (``h``, stored to ``residual_out``), sums ``h^2`` (and, for FP8, ``max |h * w|``)
   over its elements, reduces them over the block (warp shuffles, one shared-memory exchange,
   one barrier; the partial sums are added in a fixed order, so every rank computes the same
   bits), and writes ``y = (h * w) * rsqrt(sum / hidden + eps)`` rounded once to the dtype,
   or quantised to FP8 e4m3 with its scale.

Call numbers, buffer reuse and deadlock freedom are the reduction engine's
(:mod:`tilescale_examples.collectives.reduce_engine`, "Call numbers", "Reuse under
back-to-back calls", "Deadlock freedom"): the call number is ``State[b] + 1``, read on the
device (CUDA-graph replays are new calls); one flag round, so ``Stage`` is double-buffered and
call ``e`` uses buffer ``e % 2``; every block waits only for the blocks of its own index, whose
rows (the same token rows on every rank) it reads, and the grid is at most the SM count.

The Lamport exchange (``exchange="lamport"``, :func:`build_norm_kernel`): no staging, no flag
round. ``Stage`` is then three receive buffers of ``world_size`` slots of ``tokens * NV``
rows (every element the Lamport sentinel at first, the op fills it); call ``e`` uses buffer
``e % 3``. Steps 2 and 3 become: every thread pushes its vectors of its block's rows of ``x``
into slot ``me`` of buffer ``e % 3`` on every rank (``T.lamport_put``: the data carries its
own readiness); step 4 reads the ``world_size`` slots of its own buffer with
``T.lamport_get`` (which waits per 16-byte vector) and, once a row is read, writes the
sentinel back into the same rows of buffer ``(e + 2) % 3`` (the previous call's, read
completely in that call): the reuse argument of
:mod:`tilescale_examples.collectives.lamport_kernel`. Every put of a block is issued before
its first wait, and ``State[b] = epoch`` is written after the block's last row. ``Flags`` is
not used.

One rank (``world_size = 1``, either exchange): nothing to exchange, so steps 2 and 3 go
(``x`` is read in place where step 4 reads ``Stage``, the call is counted right after the
weight is loaded; no flag, no wait, no slot): the same results.

FP8 (``fp8="per_token"`` or ``"per_block"``, the DeepSeek-V3 convention): ``scale = amax / 448``
in float32, ``amax`` the largest ``|y|`` (float32, before rounding) of the token
(``per_token``) or of each 128 channels of the token (``per_block``; 16 consecutive threads
hold a group), ``q = e4m3(clamp(y / scale, -448, 448))`` (``q = 0`` where ``scale == 0``);
``y ~= q * scale``. ``amax`` is computed as ``max |h * w| * rsqrt(...)``, which is the same
float32 number (rounding is monotonic).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional

import torch

from tilescale_examples.base import check_threads
from tilescale_examples.collectives.lamport_kernel import LAMPORT_BUFFERS
from tilescale_examples.collectives.reduce_kernel import (FLAG_STRIDE, PASS_CONFIGS, check_kernel_world_size,
                                                          rank_order_sum, step_macros, vector_elems)

__all__ = ["NORM_DTYPES", "FP8_MODES", "FP8_MAX", "FP8_BLOCK", "FP8_TORCH_DTYPE", "MAX_LOADS", "MAX_ROW_VECTORS",
           "EXCHANGES", "PASS_CONFIGS", "FLAG_STRIDE", "row_vectors", "load_chunk",
           "build_norm_kernel", "norm_jobs"]

#: torch dtypes of ``x``, ``residual`` and ``weight``, with their TileLang names.
NORM_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: Values of the ``fp8`` argument besides None.
FP8_MODES = ("per_token", "per_block")
#: Largest finite float8 e4m3 (``torch.float8_e4m3fn``) value: ``scale = amax / FP8_MAX``.
FP8_MAX = 448.0
#: Channels per scale of ``fp8="per_block"``.
FP8_BLOCK = 128
#: The torch dtype of an FP8 output.
FP8_TORCH_DTYPE = getattr(torch, "float8_e4m3fn", None)
#: Most 16-byte loads of peers' rows a thread holds at once (64 registers: half the budget).
MAX_LOADS = 16
#: Most vectors of a row per thread (``ceil(hidden / V / threads)``): a trace-time bound (the
#: kernel is unrolled that many times).
MAX_ROW_VECTORS = 8
#: Values of :func:`build_norm_kernel`'s ``exchange`` (named as the op's ``algorithm``): the
#: staged one-shot with a flag round, or the Lamport exchange.
EXCHANGES = ("one_shot", "lamport")


def row_vectors(hidden: int, itemsize: int, threads: int) -> tuple:
    """``(NV, VPT)``: 16-byte vectors of a row of ``hidden`` elements of ``itemsize`` bytes,
    and vectors per thread at ``threads`` threads (``ceil(NV / threads)``). ``ValueError``
    naming ``shape`` unless a row is whole vectors and ``VPT <= MAX_ROW_VECTORS``."""
    vec = vector_elems(itemsize)
    if hidden % vec:
        raise ValueError(f"shape: hidden ({hidden}) must be a multiple of {vec} (whole 16-byte vectors)")
    nv = hidden // vec
    vpt = -(-nv // threads)
    if vpt > MAX_ROW_VECTORS:
        raise ValueError(f"shape: hidden {hidden} needs {vpt} vectors per thread at {threads} threads (at most "
                         f"{MAX_ROW_VECTORS}); raise threads")
    return nv, vpt


def load_chunk(world_size: int, vpt: int) -> int:
    """Vectors of a row a thread loads from every rank before adding (``chunk x world_size <=
    MAX_LOADS``, at least 1)."""
    return max(1, min(vpt, MAX_LOADS // world_size))


def _check_builder(dtype: str, world_size: int, threads: int, fp8, exchange: str = "one_shot") -> None:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if dtype not in NORM_DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(NORM_DTYPES.values())}, got {dtype!r}")
    check_kernel_world_size(world_size)
    check_threads(threads)
    if world_size > threads:
        raise ValueError(f"threads ({threads}) must be >= world_size ({world_size}): thread p signals rank p")
    if fp8 is not None and fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be None or one of {FP8_MODES}, got {fp8!r}")


def _load_macros(T, W: int, TH: int, VPT: int, V: int, NV: int, dtype: str, lamport: bool = False,
                 alone: bool = False):
    """The moves of rows: ``load_weight`` (step 1), ``stage_rows`` (step 2; Lamport: the puts
    to every rank) and ``sum_row`` (the loads and rank-order sums of step 4; Lamport: the polls
    of the slots, then the clears of the previous call's; ``alone``, one rank: the loads of
    ``x`` itself, passed as ``Stage`` with ``lo = 0``)."""
    PEERS, VECS = list(range(W)), list(range(VPT))  # unrolled at trace time
    C = load_chunk(W, VPT)
    CHUNKS = [VECS[s:s + C] for s in range(0, VPT, C)]

    @T.macro
    def load_weight(Wt, w, tx):
        for u in VECS:
            if u * TH + tx < NV:
                for k in T.vectorized(V):
                    w[u, k] = Wt[u * TH + tx, k]

    @T.macro
    def stage_rows(X, Stage, bx, tx, blocks, iters, tokens, lo, xin, me):
        """This block's token rows, X -> the call's buffer of Stage (its first row ``lo``);
        Lamport: into slot ``me`` (from ``lo``) of the call's buffer on every rank, through the
        registers ``xin``."""
        for i in T.serial(iters):
            if i * blocks + bx < tokens:
                for u in VECS:
                    if u * TH + tx < NV:
                        row = (i * blocks + bx) * NV + u * TH + tx  # this vector's row of X
                        if lamport:
                            T.copy(X[row, 0:V], xin[0:V])
                            for p in PEERS:
                                T.lamport_put(xin[0:V], Stage[lo + me * tokens * NV + row, 0:V], dst_pe=p)
                        else:
                            for k in T.vectorized(V):
                                Stage[lo + row, k] = X[row, k]

    @T.macro
    def sum_row(Stage, Res, ResOut, vals, rin, h, t, tx, lo, old, tokens):
        """Row ``t``: per chunk, W peers' vectors and the residual's, then ``h`` (rank-order
        float32 sum + residual, rounded once), stored to ResOut. Lamport: slot ``p`` of the
        call's buffer (from ``lo``) polled for peer ``p``'s vectors, then the row's vectors of
        every slot of the previous call's buffer (from ``old``) cleared."""
        for chunk in CHUNKS:
            for u in chunk:
                if u * TH + tx < NV:
                    for p in PEERS:
                        if lamport:
                            T.lamport_get(Stage[lo + p * tokens * NV + t * NV + u * TH + tx, 0:V],
                                          vals[u - chunk[0], p, 0:V])
                        elif alone:
                            T.copy(Stage[lo + t * NV + u * TH + tx, 0:V], vals[u - chunk[0], p, 0:V])
                        else:
                            T.copy(Stage[lo + t * NV + u * TH + tx, 0:V], vals[u - chunk[0], p, 0:V], src_pe=p)
                    for k in T.vectorized(V):
                        rin[u, k] = Res[t * NV + u * TH + tx, k]
            for u in chunk:
                if u * TH + tx < NV:
                    for k in T.vectorized(V):
                        h[u, k] = T.Cast(dtype, rank_order_sum(T, vals, u - chunk[0], k, W, "float32")
                                         + T.Cast("float32", rin[u, k]))
                    for k in T.vectorized(V):
                        ResOut[t * NV + u * TH + tx, k] = h[u, k]
                    if lamport:
                        for p in PEERS:
                            T.lamport_clear(Stage[old + p * tokens * NV + t * NV + u * TH + tx, 0:V])

    return load_weight, stage_rows, sum_row


def _norm_macros(T, TH: int, VPT: int, V: int, NV: int, fp8):
    """The row statistics: ``row_stats`` (this thread's ``sum h^2`` and ``max |h * w|``) and
    ``block_reduce`` (over the block: ``acc[0]`` the sum, ``acc[1]`` the max, on every
    thread); ``per_block`` FP8 also reduces ``amax[u]`` over each 16-thread group."""
    VECS, NW = list(range(VPT)), TH // 32

    @T.macro
    def row_stats(h, w, acc, amax, tx):
        acc[0] = T.float32(0)
        acc[1] = T.float32(0)
        for u in VECS:
            amax[u] = T.float32(0)
            if u * TH + tx < NV:
                for k in T.serial(V):
                    acc[0] = acc[0] + T.Cast("float32", h[u, k]) * T.Cast("float32", h[u, k])
                    if fp8 is not None:
                        amax[u] = T.max(amax[u], T.abs(T.Cast("float32", h[u, k]) * T.Cast("float32", w[u, k])))
            if fp8 == "per_token":
                acc[1] = T.max(acc[1], amax[u])
        if fp8 == "per_block":  # 16 lanes (128 channels) per group: xor 8, 4, 2, 1 stays in the group
            for u in VECS:
                for s in [8, 4, 2, 1]:
                    amax[u] = T.max(amax[u], T.shfl_xor(amax[u], s))

    @T.macro
    def block_reduce(acc, red, tx, parity):
        """Warp shuffles, then each warp's partials through shared memory (slot ``parity``:
        the next row's exchange uses the other one, so one barrier per row suffices), added
        by every thread in warp order."""
        for s in [16, 8, 4, 2, 1]:
            acc[0] = acc[0] + T.shfl_xor(acc[0], s)
            if fp8 == "per_token":
                acc[1] = T.max(acc[1], T.shfl_xor(acc[1], s))
        if tx % 32 == 0:
            red[parity, 0, tx // 32] = acc[0]
            red[parity, 1, tx // 32] = acc[1]
        T.sync_threads()
        acc[0] = T.float32(0)
        for j in T.unroll(NW):
            acc[0] = acc[0] + red[parity, 0, j]
            if fp8 == "per_token":
                acc[1] = T.max(acc[1], red[parity, 1, j])

    return row_stats, block_reduce


def _store_macro(T, TH: int, VPT: int, V: int, NV: int, dtype: str, fp8):
    """``store_row``: ``y`` of row ``t`` (dtype, or e4m3 and its scales)."""
    VECS, G = list(range(VPT)), NV // 16  # per_block: scales per token (16 vectors = 128 channels)

    @T.macro
    def store_row(Y, Scales, h, w, q, acc, amax, t, tx, hidden, eps):
        rs = T.rsqrt(acc[0] / T.float32(hidden) + eps)
        for u in VECS:
            if u * TH + tx < NV:
                if fp8 is None:
                    for k in T.vectorized(V):
                        Y[t * NV + u * TH + tx, k] = T.Cast(
                            dtype, T.Cast("float32", h[u, k]) * T.Cast("float32", w[u, k]) * rs)
                else:
                    scale = (acc[1] if fp8 == "per_token" else amax[u]) * rs / T.float32(FP8_MAX)
                    for k in T.vectorized(V):
                        q[u, k] = T.Cast("float8_e4m3", T.clamp(T.if_then_else(
                            scale > T.float32(0), T.Cast("float32", h[u, k]) * T.Cast("float32", w[u, k]) * rs / scale,
                            T.float32(0)), T.float32(-FP8_MAX), T.float32(FP8_MAX)))
                    T.copy(q[u, 0:V], Y[t * NV + u * TH + tx, 0:V])
                    if fp8 == "per_block":
                        if tx % 16 == 0:
                            Scales[t * G + (u * TH + tx) // 16] = scale
        if fp8 == "per_token":
            if tx == 0:
                Scales[t] = acc[1] * rs / T.float32(FP8_MAX)

    return store_row


def build_norm_kernel(dtype: str, world_size: int, hidden: int, threads: int = 512, fp8: Optional[str] = None,
                      exchange: str = "one_shot"):
    """The fused all-reduce + residual + RMSNorm ``T.prim_func`` (see the module docstring;
    ``exchange``: one of :data:`EXCHANGES`, ``"lamport"`` the module docstring's Lamport
    exchange, with ``Stage`` the ``3 * world_size * tokens * NV`` rows of its receive buffers).

    ``hidden`` (elements per token row) and the rest are trace-time constants; the token count
    is a run-time argument, so one compiled kernel serves every ``tokens``. Signature (``V =
    8``, ``NV = hidden / V``, rows of 16 bytes)::

        X: (rows, V)          this rank's input x, tokens * NV rows (read once, staged)
        Res: (rows, V)        the residual
        Wt: (NV, V)           the norm's weight
        Stage: (2 * tokens * NV, V)  this rank's symmetric staging buffers (call e: e % 2)
        ResOut: (rows, V)     h = all_reduce(x) + residual, rounded (may be Res or X itself)
        Y: (rows, V)          y, dtype; FP8: (tokens * NV, V) float8_e4m3
        Scales: (n,) float32  FP8 only: tokens (per_token) or tokens * hidden / 128 (per_block)
        Flags: (n,) uint64    ready[p, b] = Flags[(p * blocks + b) * FLAG_STRIDE]
        State: (blocks,) int64  block b's count of the calls made so far
        blocks, iters, tokens: int32   grid size, ceil(tokens / blocks), token rows
        eps: float32
    """
    import tilelang.language as T

    _check_builder(dtype, world_size, threads, fp8, exchange)
    if fp8 == "per_block" and hidden % FP8_BLOCK:
        raise ValueError(f"shape: hidden ({hidden}) must be a multiple of {FP8_BLOCK} for fp8='per_block'")
    W, TH = world_size, threads
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    V = vector_elems(itemsize)
    NV, VPT = row_vectors(hidden, itemsize, TH)
    C = load_chunk(W, VPT)
    alone = W == 1  # nothing to exchange (either exchange): x read in place, no flag, no wait
    lamport = exchange == "lamport" and not alone
    load_weight, stage_rows, sum_row = _load_macros(T, W, TH, VPT, V, NV, dtype, lamport, alone)
    row_stats, block_reduce = _norm_macros(T, TH, VPT, V, NV, fp8)
    store_row = _store_macro(T, TH, VPT, V, NV, dtype, fp8)
    steps = step_macros(T, W, TH, 1, V, 1)
    rows, rows_s, nscales = T.dynamic("rows"), T.dynamic("rows_s"), T.dynamic("nscales")
    nflags, nstate = T.dynamic("nflags"), T.dynamic("nstate")
    y_dtype = dtype if fp8 is None else "float8_e4m3"

    @T.macro
    def one_call(X, Res, Wt, Stage, ResOut, Y, Scales, Flags, State, blocks, iters, tokens, eps):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            vals = T.alloc_local((C, W, V), dtype)
            rin, h, w = T.alloc_local((VPT, V), dtype), T.alloc_local((VPT, V), dtype), T.alloc_local((VPT, V), dtype)
            q = T.alloc_local((VPT, V), y_dtype)
            acc, amax = T.alloc_local((2,), "float32"), T.alloc_local((VPT,), "float32")
            red = T.alloc_shared((2, 2, TH // 32), "float32")
            epoch = T.alloc_var("int64")
            epoch = State[bx] + 1  # this call's number: block bx's count of earlier calls + 1
            xin = T.alloc_local((V,), dtype)
            lo, old = T.alloc_var("int32"), T.alloc_var("int32")
            if lamport:  # this call's and the previous call's receive buffers
                lo = T.Cast("int32", epoch % LAMPORT_BUFFERS) * (W * tokens * NV)
                old = T.Cast("int32", (epoch + LAMPORT_BUFFERS - 1) % LAMPORT_BUFFERS) * (W * tokens * NV)
            elif alone:
                lo = 0  # x itself
            else:
                lo = T.Cast("int32", epoch % 2) * (tokens * NV)  # first row of this call's buffer
            load_weight(Wt, w, tx)
            if alone:  # nothing staged, no round
                steps.count_call(State, bx, tx, epoch)  # epoch: used by this thread alone
            elif lamport:
                stage_rows(X, Stage, bx, tx, blocks, iters, tokens, lo, xin, me)
            else:
                stage_rows(X, Stage, bx, tx, blocks, iters, tokens, lo, xin, me)
                steps.signal_and_wait(Flags, tx, me, bx, blocks, epoch, 0)
                steps.count_call(State, bx, tx, epoch)
            for i in T.serial(iters):
                if i * blocks + bx < tokens:
                    sum_row(X if alone else Stage, Res, ResOut, vals, rin, h, i * blocks + bx, tx, lo, old, tokens)
                    row_stats(h, w, acc, amax, tx)
                    block_reduce(acc, red, tx, i % 2)
                    store_row(Y, Scales, h, w, q, acc, amax, i * blocks + bx, tx, hidden, eps)
            if lamport:
                T.sync_threads()  # every thread has read State[bx]
                steps.count_call(State, bx, tx, epoch)

    if fp8 is None:

        @T.prim_func
        def norm(X: T.Tensor((rows, V), dtype), Res: T.Tensor((rows, V), dtype), Wt: T.Tensor((NV, V), dtype),
                 Stage: T.Tensor((rows_s, V), dtype), ResOut: T.Tensor((rows, V), dtype), Y: T.Tensor((rows, V), dtype),
                 Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"), blocks: T.int32,
                 iters: T.int32, tokens: T.int32, eps: T.float32):
            one_call(X, Res, Wt, Stage, ResOut, Y, None, Flags, State, blocks, iters, tokens, eps)

        return norm.with_attr("global_symbol", "allreduce_residual_rmsnorm" + ("_lamport" if lamport else ""))

    @T.prim_func
    def norm_fp8(X: T.Tensor((rows, V), dtype), Res: T.Tensor((rows, V), dtype), Wt: T.Tensor((NV, V), dtype),
                 Stage: T.Tensor((rows_s, V), dtype), ResOut: T.Tensor((rows, V), dtype),
                 Y: T.Tensor((rows, V), "float8_e4m3"), Scales: T.Tensor((nscales,), "float32"),
                 Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"), blocks: T.int32,
                 iters: T.int32, tokens: T.int32, eps: T.float32):
        one_call(X, Res, Wt, Stage, ResOut, Y, Scales, Flags, State, blocks, iters, tokens, eps)

    name = f"allreduce_residual_rmsnorm_fp8_{fp8}"
    return norm_fp8.with_attr("global_symbol", name + ("_lamport" if lamport else ""))


def norm_jobs(dtypes, world_sizes, hiddens, fp8_modes=(None,), threads: int = 512, exchanges=("one_shot",)) -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of every kernel
    :func:`build_norm_kernel` makes for ``dtype name x world size x hidden x fp8 mode x
    exchange``."""
    return [("tilescale_examples.decode.norm_kernel:build_norm_kernel",
             (d, w, h, threads, f) + ((x,) if x != "one_shot" else ()), PASS_CONFIGS)
            for d in dtypes for w in world_sizes for h in hiddens for f in fp8_modes for x in exchanges]
