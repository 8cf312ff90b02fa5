"""The Lamport one-shot all-reduce kernel: every rank pushes its input into a slot of every
rank's receive buffer with ``T.lamport_put``, then reads the ``world_size`` slots of its own
buffer with ``T.lamport_get`` (which waits for each 16-byte vector's data itself: no flag, no
fence, no barrier between ranks) and sums them in rank order.

Buffers and reuse
-----------------

``Buf`` (symmetric, per rank) holds three buffers of ``world_size`` slots of ``span`` rows;
slot ``p`` of a buffer receives rank ``p``'s input. Every element starts as the Lamport
sentinel (all ones, a NaN; the host fills it once). Call ``e`` (the block's call number,
``State[b] + 1``, kept on the device as in :mod:`.reduce_engine`) writes buffer ``e % 3`` on
every rank, reads it here, and writes the sentinel back into its rows of buffer ``(e + 2) %
3`` here (the buffer of call ``e - 1``, which this rank read completely in call ``e - 1``).
Three buffers suffice: a peer writes into this rank's buffer ``(e + 1) % 3`` while this rank
is still in call ``e`` (cleared here in call ``e - 1``), but it can start call ``e + 2`` only
after finishing call ``e + 1``, which needs this rank's call ``e + 1`` data, written by a
kernel that starts after this one ended (its clears included).

A thread moves rows ``r = ((t * blocks + b) * U + u) * threads + tx`` as the reduction
engine's kernel does: it loads its ``U`` input rows, puts them to every rank, then gets the
``U x world_size`` rows of its own buffer (all puts of a block issued before its first
wait), so no wait depends on work queued behind it, and the grid needs no residency
guarantee beyond every rank's blocks making progress.

Values: a sentinel element of the input (a NaN with every bit set) is sent as the canonical
NaN, so a result is NaN exactly where the plain sum is; every other bit pattern is summed as
it is, in rank order, in float32 for float16/bfloat16, and rounded once (the bits of
:func:`~tilescale_examples.collectives.reduce_engine.torch_reference`). Float dtypes only
(integers have no spare bit pattern for a sentinel).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional

import torch

from tilescale_examples.base import check_threads
from tilescale_examples.collectives.reduce_kernel import (ACCUMULATE, check_kernel_world_size, check_unroll,
                                                          rank_order_sum, vector_elems)

__all__ = ["LAMPORT_DTYPES", "LAMPORT_BUFFERS", "build_lamport_kernel", "lamport_rows", "SENTINEL_BYTE"]

#: TileLang names of the dtypes the Lamport kernel takes (float types: the sentinel is a NaN).
LAMPORT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Receive buffers rotated by call number.
LAMPORT_BUFFERS = 3
#: Every byte of a pending element (``Buf.view(torch.uint8).fill_(SENTINEL_BYTE)``).
SENTINEL_BYTE = 0xFF


def lamport_rows(world_size: int, span: int) -> int:
    """Rows of ``Buf``: ``LAMPORT_BUFFERS * world_size * span``."""
    return LAMPORT_BUFFERS * world_size * span


def build_lamport_kernel(dtype: str, world_size: int, threads: int = 512, unroll: Optional[int] = None):
    """The Lamport one-shot all-reduce ``T.prim_func`` (see the module docstring).

    Sizes are run-time arguments (one compiled kernel per ``(dtype, world_size, threads,
    unroll)``). Signature (``V = 16 // itemsize``)::

        X: (rows_x, V)      the caller's input, span rows
        Buf: (rows_b, V)    this rank's symmetric receive buffers (lamport_rows(W, span) rows)
        Out: (rows_o, V)    the local output, span rows
        State: (nstate,) int64  block b's count of the calls made so far
        blocks, iters, span: int32  grid size, iterations per block, rows
    """
    import tilelang.language as T

    if dtype not in LAMPORT_DTYPES:
        raise ValueError(f"dtype must be one of {LAMPORT_DTYPES} (the Lamport sentinel is a NaN), got {dtype!r}")
    check_kernel_world_size(world_size)
    check_threads(threads)
    U = check_unroll(unroll, world_size)
    W, TH, acc, NB = world_size, threads, ACCUMULATE[dtype], LAMPORT_BUFFERS
    V = vector_elems(torch.empty((), dtype=getattr(torch, dtype)).element_size())
    PEERS, ROWS = list(range(W)), list(range(U))  # unrolled at trace time
    rows_x, rows_b, rows_o, nstate = T.dynamic("rows_x"), T.dynamic("rows_b"), T.dynamic("rows_o"), T.dynamic("nstate")

    @T.prim_func
    def lamport(X: T.Tensor((rows_x, V), dtype), Buf: T.Tensor((rows_b, V), dtype), Out: T.Tensor((rows_o, V), dtype),
                State: T.Tensor((nstate,), "int64"), blocks: T.int32, iters: T.int32, span: T.int32):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            xin = T.alloc_local((U, V), dtype)
            vals = T.alloc_local((U, W, V), dtype)
            epoch = T.alloc_var("int64")
            epoch = State[bx] + 1  # this call's number
            cur = T.alloc_var("int32")
            old = T.alloc_var("int32")
            cur = T.Cast("int32", epoch % NB) * (W * span)  # first row of this call's buffer
            old = T.Cast("int32", (epoch + NB - 1) % NB) * (W * span)  # the previous call's
            for t in T.serial(iters):
                for u in ROWS:
                    r = ((t * blocks + bx) * U + u) * TH + tx
                    if r < span:
                        T.copy(X[r, 0:V], xin[u, 0:V])
                for u in ROWS:
                    r = ((t * blocks + bx) * U + u) * TH + tx
                    if r < span:
                        for p in PEERS:
                            T.lamport_put(xin[u, 0:V], Buf[cur + me * span + r, 0:V], dst_pe=p)
                for u in ROWS:
                    r = ((t * blocks + bx) * U + u) * TH + tx
                    if r < span:
                        for p in PEERS:
                            T.lamport_get(Buf[cur + p * span + r, 0:V], vals[u, p, 0:V])
                        for i in T.vectorized(V):
                            Out[r, i] = T.Cast(dtype, rank_order_sum(T, vals, u, i, W, acc))
                        for p in PEERS:
                            T.lamport_clear(Buf[old + p * span + r, 0:V])
            T.sync_threads()  # every thread has read State[bx]
            if tx == 0:
                State[bx] = epoch

    return lamport.with_attr("global_symbol", "allreduce_lamport")
