"""The reduction kernel of :mod:`tilescale_examples.collectives.reduce_engine` (whose docstring
describes the algorithm, the deadlock argument and the buffer reuse): its constants, the
``T.macro`` pieces of its steps, and :func:`build_reduce_kernel`, which assembles them into
one ``T.prim_func`` per mode."""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from types import SimpleNamespace
from typing import Optional

import torch

from tilescale_examples.base import DTYPES, check_threads

__all__ = ["MODES", "buffers", "ACCUMULATE", "REDUCE_DTYPES", "VECTOR_BYTES", "MAX_REGISTERS", "FLAG_STRIDE",
           "MAX_UNROLLED_VECTORS", "PASS_CONFIGS", "build_reduce_kernel", "default_unroll", "max_unroll",
           "check_unroll", "check_kernel_world_size", "vector_elems", "rank_order_sum", "step_macros"]

#: Kernel modes of :func:`build_reduce_kernel`.
MODES = ("one_shot", "two_shot", "reduce_scatter")
#: Element dtype -> accumulation dtype (TileLang names).
ACCUMULATE = {
    "float16": "float32",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
    "int32": "int32",
    "int64": "int64",
}
#: torch dtypes the reductions accept, with their TileLang names.
REDUCE_DTYPES = {d: n for d, n in DTYPES.items() if n in ACCUMULATE}
#: Bytes per vector (one ld/st.v4.b32).
VECTOR_BYTES = 16
#: Register budget of the reduction kernel: 65536 per SM / 512 threads (one block per SM).
MAX_REGISTERS = 128
#: uint64 words from one flag to the next in ``Flags``: one flag per 32-byte memory sector, so
#: the flag stores and polls of different blocks never share a sector (packed flags cost the
#: kernels 1-3.5% at 16 MiB on an H200, see docs/benchmarks.md).
FLAG_STRIDE = 4


def buffers(mode: str) -> int:
    """Staging buffers of ``mode``: 2 for ``one_shot`` and ``reduce_scatter`` (one flag
    round: call ``e`` uses buffer ``e % 2``), 1 for ``two_shot``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return 1 if mode == "two_shot" else 2


def vector_elems(itemsize: int) -> int:
    """Elements per 16-byte vector for an element of ``itemsize`` bytes."""
    if itemsize not in (1, 2, 4, 8, 16):
        raise ValueError(f"itemsize must divide 16, got {itemsize}")
    return VECTOR_BYTES // itemsize


def default_unroll(world_size: int) -> int:
    """Rows per thread and iteration: ``max(1, 8 // world_size)``, so that every thread keeps
    about 8 independent 16-byte loads in flight at every world size within the register
    budget."""
    return max(1, 8 // world_size)


#: Most 16-byte vectors a thread holds for one iteration (``unroll x world_size``): the
#: register budget (:data:`MAX_REGISTERS`, 4 registers a vector) and a trace-time bound (the
#: kernel is unrolled ``unroll x world_size`` times when it is built).
MAX_UNROLLED_VECTORS = 32


def max_unroll(world_size: int) -> int:
    """The largest ``unroll`` at ``world_size`` ranks: ``max(1, MAX_UNROLLED_VECTORS //
    world_size)``."""
    return max(1, MAX_UNROLLED_VECTORS // world_size)


def check_unroll(unroll, world_size: int) -> int:
    """``unroll`` (None: :func:`default_unroll`) if it is an int in ``[1,
    max_unroll(world_size)]``; else ``ValueError`` naming ``unroll``."""
    if unroll is None:
        return default_unroll(world_size)
    if not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1:
        raise ValueError(f"unroll must be a positive int, got {unroll!r}")
    if unroll > max_unroll(world_size):
        raise ValueError(f"unroll must be at most {max_unroll(world_size)} at {world_size} rank(s) (a thread holds "
                         f"unroll x world_size 16-byte vectors, at most {MAX_UNROLLED_VECTORS}), got {unroll}")
    return unroll


def check_kernel_world_size(world_size) -> int:
    """``world_size`` if it is an int in ``[1, 1022]`` (the ranks a kernel's table holds);
    else ``ValueError`` naming ``world_size``."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= 1022:
        raise ValueError(f"world_size must be an int in [1, 1022], got {world_size!r}")
    return world_size


# ------------------------------------------------------------------------------ kernel
def rank_order_sum(T, vals, u: int, i, world_size: int, acc: str):
    """``vals[u, 0, i] + vals[u, 1, i] + ... + vals[u, W-1, i]`` in ``acc``, built at trace
    time as one expression: the rank order of
    :func:`~tilescale_examples.collectives.reduce_engine.torch_reference`."""
    total = T.Cast(acc, vals[u, 0, i])
    for p in range(1, world_size):
        total = total + T.Cast(acc, vals[u, p, i])
    return total


def step_macros(T, W: int, TH: int, U: int, V: int, shards: int):
    """The steps that move whole rows and signal (trace-time constants: ``W`` ranks, ``TH``
    threads, ``U`` rows per thread and iteration, ``V`` elements per row, ``shards``):
    ``stage`` (step 1), ``signal_and_wait`` (steps 2 and 4), ``stage_and_ready`` (steps 1 and
    2) and ``count_call``. Also the flag round and call counter of
    :mod:`tilescale_examples.decode.norm_kernel` (``signal_and_wait``, ``count_call``)."""
    SHARDS, ROWS = list(range(shards)), list(range(U))  # unrolled at trace time

    @T.macro
    def stage(X, Stage, t, bx, tx, blocks, span, rows_in, lo):
        """Step 1 for one iteration: this thread's rows of every shard, X -> the call's
        buffer of Stage (its first row ``lo``)."""
        for q in SHARDS:
            for u in ROWS:
                r = ((t * blocks + bx) * U + u) * TH + tx
                if r < span:
                    if q * span + r < rows_in:
                        for i in T.vectorized(V):
                            Stage[lo + q * span + r, i] = X[q * span + r, i]

    @T.macro
    def signal_and_wait(Flags, tx, me, bx, blocks, epoch, base, release=True):
        """Steps 2/4: set this block's flag on every rank to ``epoch``, then wait until every
        rank's flag here has reached it. ``release`` (trace time): publish the block's writes
        of this kernel (a barrier, then a release store at system scope, which after the
        barrier covers the block's writes); otherwise a relaxed store with no barrier before
        it (nothing written in this kernel to publish). (Adding 1 instead, which needs no
        call number, measured slower: 0.1-0.4 us a call at 4 KiB with emulated peers. So did
        reading the peers' flags of the first round at the kernel's start, right behind the
        call counter, with an acquire load at system scope: 1.048 of the host-numbered
        kernel on average over the A/B's rows on one H100, against 1.031 without it.)"""
        if release:
            T.sync_threads()
        if tx < W:
            if release:
                T.notify(Flags[(base + me * blocks + bx) * FLAG_STRIDE], tx, epoch)
            else:
                T.st(Flags[(base + me * blocks + bx) * FLAG_STRIDE], epoch, scope="sys", sem="relaxed", dst_pe=tx)
            T.wait_ge(Flags[(base + tx * blocks + bx) * FLAG_STRIDE], epoch)
        T.sync_threads()

    @T.macro
    def stage_and_ready(X, Stage, Flags, tx, me, bx, blocks, epoch, iters, span, rows_in, stage_in, lo):
        """Steps 1 and 2: staged here, the release round of :func:`signal_and_wait`; staged
        before the kernel, its relaxed round (see the module docstring)."""
        if stage_in != 0:
            for t in T.serial(iters):
                stage(X, Stage, t, bx, tx, blocks, span, rows_in, lo)
            signal_and_wait(Flags, tx, me, bx, blocks, epoch, 0)
        else:
            signal_and_wait(Flags, tx, me, bx, blocks, epoch, 0, release=False)

    @T.macro
    def count_call(State, bx, tx, epoch):
        """Record the call in block ``bx``'s counter. After the first round's barrier: every
        thread of the block has read the old count; the next call starts after this kernel."""
        if tx == 0:
            State[bx] = epoch

    return SimpleNamespace(signal_and_wait=signal_and_wait, stage_and_ready=stage_and_ready, count_call=count_call)


def _row_macros(T, W: int, TH: int, U: int, V: int, dtype: str, acc: str):
    """The steps on this thread's rows: ``load_reduce`` (step 3), ``store_local`` and
    ``store_peers`` (step 4)."""
    PEERS, ROWS = list(range(W)), list(range(U))  # unrolled at trace time

    @T.macro
    def load_reduce(Stage, vals, res, t, bx, tx, blocks, span, lo):
        """Step 3: W rows per unrolled row (all loads issued before any add), rank-order sum."""
        for u in ROWS:
            r = ((t * blocks + bx) * U + u) * TH + tx
            if r < span:
                for p in PEERS:
                    T.copy(Stage[lo + r, 0:V], vals[u, p, 0:V], src_pe=p)
        for u in ROWS:
            for i in T.vectorized(V):
                res[u, i] = T.Cast(dtype, rank_order_sum(T, vals, u, i, W, acc))

    @T.macro
    def store_local(Out, res, t, bx, tx, blocks, span):
        for u in ROWS:
            r = ((t * blocks + bx) * U + u) * TH + tx
            if r < span:
                for i in T.vectorized(V):
                    Out[r, i] = res[u, i]

    @T.macro
    def store_peers(Stage, res, t, bx, tx, blocks, span, lo):
        for u in ROWS:
            r = ((t * blocks + bx) * U + u) * TH + tx
            if r < span:
                for p in PEERS:
                    T.copy(res[u, 0:V], Stage[lo + r, 0:V], dst_pe=p)

    return SimpleNamespace(load_reduce=load_reduce, store_local=store_local, store_peers=store_peers)


#: Where a reduction kernel's call number comes from: its device counter (``State``: the
#: library's kernels, graph-safe), or a scalar argument the host passes (``epoch_in``: the
#: kernels before call numbers moved to the device, which a CUDA graph freezes; built only as
#: the baseline of ``benchmarks.emulated``'s A/B column).
CALL_NUMBERS = ("device", "argument")


def build_reduce_kernel(mode: str, dtype: str, world_size: int, threads: int = 512,
                        unroll: Optional[int] = None, call_number: str = "device"):
    """The reduction ``T.prim_func`` of ``mode`` (see
    :mod:`~tilescale_examples.collectives.reduce_engine`'s docstring).

    Sizes are run-time arguments, so one compiled kernel serves every tensor size of a
    ``(mode, dtype, world_size, threads, unroll)``. Signature (``V = 16 // itemsize``)::

        X: (rows_x, V)      the caller's input (read when stage_in == 1)
        Stage: (rows_s, V)  this rank's symmetric staging buffers: buffers(mode) of
                            shards * span rows each (call e uses buffer e % buffers(mode))
        Out: (rows_o, V)    the local output, span rows (not for two_shot)
        Flags: (n,) uint64  ready[p, b] = Flags[(p * blocks + b) * FLAG_STRIDE],
                            data[p, b] = Flags[((W + p) * blocks + b) * FLAG_STRIDE]
        State: (blocks,) int64  block b's count of the calls made so far (the call
                            number lives on the device: see "Call numbers")
        blocks: int32       grid size, the same on every rank
        iters: int32        ceil(span / (blocks * threads * unroll))
        span: int32         rows per shard
        rows_in: int32      rows of real input (stage rows >= rows_in stay untouched: padding)
        stage_in: int32     1: copy X into Stage first; 0: Stage already holds the input

    ``one_shot`` reduces all ``span`` rows (one shard); ``reduce_scatter`` and ``two_shot``
    reduce shard ``rank`` (rows ``rank * span + r``) of ``world_size`` shards.

    ``call_number="argument"`` (:data:`CALL_NUMBERS`) builds the same kernel with the call
    number passed by the host, a last parameter ``epoch_in: int64`` (> 0, increasing from call
    to call), instead of read from and written to ``State`` (which it leaves untouched): not
    graph-safe (a graph freezes the argument), the baseline of the A/B that measures what the
    device counter costs. Its symbol ends in ``_host_epoch``.
    """
    import tilelang.language as T

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if call_number not in CALL_NUMBERS:
        raise ValueError(f"call_number must be one of {CALL_NUMBERS}, got {call_number!r}")
    from_host = call_number == "argument"
    counted = not from_host  # the device counts the calls (trace-time branches below)
    if dtype not in ACCUMULATE:
        raise ValueError(f"dtype must be one of {sorted(ACCUMULATE)}, got {dtype!r}")
    check_kernel_world_size(world_size)
    check_threads(threads)
    U = check_unroll(unroll, world_size)
    W, TH, acc = world_size, threads, ACCUMULATE[dtype]
    V = vector_elems(torch.empty((), dtype=getattr(torch, dtype)).element_size())
    shards = 1 if mode == "one_shot" else W
    push = mode == "two_shot"
    NB = buffers(mode)
    steps, rows = step_macros(T, W, TH, U, V, shards), _row_macros(T, W, TH, U, V, dtype, acc)
    stage_and_ready, count_call, signal_and_wait = steps.stage_and_ready, steps.count_call, steps.signal_and_wait
    load_reduce, store_local, store_peers = rows.load_reduce, rows.store_local, rows.store_peers

    def shard_start(me, span):
        """First row of the shard this rank reduces: 0 (one-shot) or ``me * span``."""
        return 0 if shards == 1 else me * span

    @T.macro
    def one_call(X, Stage, Out, Flags, State, blocks, iters, span, rows_in, stage_in, epoch_in):
        """A call of either signature: each block's registers and this call's number, then
        the steps of the mode (``push``, a trace-time constant, picks them; ``Out`` is not
        used by ``two_shot``; ``epoch_in`` only where the host numbers the calls)."""
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            vals = T.alloc_local((U, W, V), dtype)
            res = T.alloc_local((U, V), dtype)
            epoch = T.alloc_var("int64")
            if from_host:
                epoch = epoch_in
            else:
                epoch = State[bx] + 1  # this call's number: block bx's count of earlier calls + 1
            if push:
                stage_and_ready(X, Stage, Flags, tx, me, bx, blocks, epoch, iters, span, rows_in, stage_in, 0)
                if counted:
                    count_call(State, bx, tx, epoch)
                for t in T.serial(iters):
                    load_reduce(Stage, vals, res, t, bx, tx, blocks, span, me * span)
                    store_peers(Stage, res, t, bx, tx, blocks, span, me * span)
                signal_and_wait(Flags, tx, me, bx, blocks, epoch, W * blocks)  # data
            else:
                lo = T.alloc_var("int32")
                lo = T.Cast("int32", epoch % NB) * (shards * span)  # first row of this call's buffer
                stage_and_ready(X, Stage, Flags, tx, me, bx, blocks, epoch, iters, span, rows_in, stage_in, lo)
                if counted:
                    count_call(State, bx, tx, epoch)
                for t in T.serial(iters):
                    load_reduce(Stage, vals, res, t, bx, tx, blocks, span, lo + shard_start(me, span))
                    store_local(Out, res, t, bx, tx, blocks, span)

    return _entry_point(T, one_call, mode, V, dtype, from_host)


def _entry_point(T, one_call, mode: str, V: int, dtype: str, from_host: bool):
    """The ``T.prim_func`` of :func:`build_reduce_kernel` around its ``one_call`` macro: the
    signature of ``mode`` (``two_shot`` has no ``Out``), ``epoch_in`` last where the host numbers
    the calls (``from_host``), and its global symbol."""
    rows_x, rows_s, rows_o, nflags = T.dynamic("rows_x"), T.dynamic("rows_s"), T.dynamic("rows_o"), T.dynamic("nflags")
    nstate = T.dynamic("nstate")
    suffix = "_host_epoch" if from_host else ""
    if mode == "two_shot":
        if from_host:

            @T.prim_func
            def two_shot(X: T.Tensor((rows_x, V), dtype), Stage: T.Tensor((rows_s, V), dtype),
                         Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"), blocks: T.int32,
                         iters: T.int32, span: T.int32, rows_in: T.int32, stage_in: T.int32, epoch_in: T.int64):
                one_call(X, Stage, None, Flags, State, blocks, iters, span, rows_in, stage_in, epoch_in)
        else:

            @T.prim_func
            def two_shot(X: T.Tensor((rows_x, V), dtype), Stage: T.Tensor((rows_s, V), dtype),
                         Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"), blocks: T.int32,
                         iters: T.int32, span: T.int32, rows_in: T.int32, stage_in: T.int32):
                one_call(X, Stage, None, Flags, State, blocks, iters, span, rows_in, stage_in, None)

        return two_shot.with_attr("global_symbol", "allreduce_two_shot" + suffix)

    if from_host:

        @T.prim_func
        def reduce_local(X: T.Tensor((rows_x, V), dtype), Stage: T.Tensor((rows_s, V), dtype),
                         Out: T.Tensor((rows_o, V), dtype), Flags: T.Tensor((nflags,), "uint64"),
                         State: T.Tensor((nstate,), "int64"), blocks: T.int32, iters: T.int32, span: T.int32,
                         rows_in: T.int32, stage_in: T.int32, epoch_in: T.int64):
            one_call(X, Stage, Out, Flags, State, blocks, iters, span, rows_in, stage_in, epoch_in)
    else:

        @T.prim_func
        def reduce_local(X: T.Tensor((rows_x, V), dtype), Stage: T.Tensor((rows_s, V), dtype),
                         Out: T.Tensor((rows_o, V), dtype), Flags: T.Tensor((nflags,), "uint64"),
                         State: T.Tensor((nstate,), "int64"), blocks: T.int32, iters: T.int32, span: T.int32,
                         rows_in: T.int32, stage_in: T.int32):
            one_call(X, Stage, Out, Flags, State, blocks, iters, span, rows_in, stage_in, None)

    name = "allreduce_one_shot" if mode == "one_shot" else "reducescatter"
    return reduce_local.with_attr("global_symbol", name + suffix)


#: TileLang pass configuration of the reduction kernels: the host code sizes every buffer
#: for the plan, so the bounds guards TileLang would add around each 16-byte access (and
#: that would silently skip an out-of-range flag instead of failing) are left out.
PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}
