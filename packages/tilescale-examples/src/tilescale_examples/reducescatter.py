"""Reduce-scatter over the symmetric heap, built from ``T.get_block`` and flag signals.

Every rank contributes a full tensor of ``world_size`` shards; afterwards rank ``r`` holds
the element-wise sum over all ranks of shard ``r``::

    rs = ReduceScatter(allocator, shard_shape=(4096,), dtype=torch.float16)   # collective
    out = rs(x)          # x: (world, 4096) on the allocator's device; out: (4096,) = sum_p x_p[r]
    ...
    rs.close()           # before allocator.close()

The reduce-scatter kernel
-------------------------

One rank-agnostic kernel with a grid of ``chunks`` blocks; the shard is cut into ``chunks``
pieces of ``chunk`` elements (a multiple of 16 bytes). Peers read the symmetric ``input``
in place (pull), so the call first copies ``x`` into ``rs.input`` unless ``x`` is
``rs.input`` itself. Block ``c`` of rank ``me``:

1. *Ready handshake* (thread 0): ``T.notify(ready[me, c], p, epoch)`` to every rank ``p``
   (``me``'s input for this call is in place: it was written before the kernel started on
   ``me``'s stream), then ``T.wait_ge(ready[p, c], epoch)`` for every ``p``.
2. ``T.get_block`` of chunk ``c`` of shard ``me`` from every rank ``p``'s input
   (``src_pe=p``) into a local staging buffer ``stage[p]``: 16-byte vector copies.
3. ``__syncthreads()``; thread 0 issues ``T.fence_sys()`` and ``T.notify(done[me, c], p,
   epoch)`` to every ``p``: ``me`` has finished reading ``p``'s chunk ``c``.
4. Every thread reduces its elements: ``out[i] = stage[0][i] + stage[1][i] + ...`` in rank
   order, accumulated in float32 for 16-bit floats (the same order as ``torch_reference``).
5. Thread 0 waits ``T.wait_ge(done[p, c], epoch)`` for every ``p``: every rank has read
   chunk ``c`` of ``me``'s input. So when the kernel returns on ``me``, no peer will read
   ``me``'s input of this call any more, and the next call may overwrite it (stream order).

Flags are ``uint64`` words set (not added) to the *epoch*, a per-instance call counter, and
waits use ``>=``: no reset between calls, no wrap. Every block waits for blocks of other
ranks, so the grid is capped at ``max_blocks`` (default: the SM count) so that all blocks are
co-resident.

Memory: ``input`` (``world * shard``, symmetric), ``output`` (``shard``, symmetric),
``flags`` (``2 * world * chunks`` uint64, symmetric) and a local ``stage`` (``world * shard``).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional, Sequence, Union

import torch

from tilescale_examples.collective import DTYPES, SymmetricCollective, plan_chunks

__all__ = ["ReduceScatter", "build_reducescatter_kernel", "torch_reference", "ACCUMULATE"]

#: Element dtype -> accumulation dtype of the reduction (TileLang names).
ACCUMULATE = {
    "float16": "float32",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
    "int32": "int32",
    "int64": "int64",
}
_TORCH_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_ALLOWED = {d: n for d, n in DTYPES.items() if n in ACCUMULATE}
#: Smallest chunk a block is given before the grid grows (bytes).
MIN_CHUNK_BYTES = 64 * 1024


def build_reducescatter_kernel(shard_numel: int, dtype: str, world_size: int, chunks: int,
                               chunk: int, threads: int = 512):
    """The reduce-scatter ``T.prim_func`` (see the module docstring for the algorithm).

    Signature: ``(In: (world_size * shard_numel,), Stage: (world_size * shard_numel,), Out:
    (shard_numel,), Flags: (2 * world_size * chunks,) uint64, epoch: int64)``;
    ``Flags[:world_size*chunks]`` are the done flags ``done[src, c]``, the rest the ready
    flags ``ready[src, c]``. ``dtype`` is a key of ``ACCUMULATE``.
    """
    import tilelang.language as T

    if dtype not in ACCUMULATE:
        raise ValueError(f"dtype must be one of {sorted(ACCUMULATE)}, got {dtype!r}")
    S, W, C, CH = shard_numel, world_size, chunks, chunk
    if (C - 1) * CH >= S or C * CH < S:
        raise ValueError(f"chunks={C} x chunk={CH} does not tile shard_numel={S} (use plan_chunks)")
    READY = W * C
    acc = ACCUMULATE[dtype]
    steps = -(-CH // threads)

    @T.prim_func
    def reducescatter(In: T.Tensor((W * S,), dtype), Stage: T.Tensor((W * S,), dtype),
                      Out: T.Tensor((S,), dtype), Flags: T.Tensor((2 * W * C,), "uint64"),
                      epoch: T.int64):
        with T.Kernel(C, threads=threads) as c:
            tx = T.get_thread_binding()
            me = T.get_rank()
            start = T.alloc_var("int32")  # a variable: see allgather.build_allgather_kernel
            start = c * CH
            if tx == 0:
                for p in T.serial(W):
                    T.notify(Flags[READY + me * C + c], p, epoch)  # my input is in place
                for p in T.serial(W):
                    T.wait_ge(Flags[READY + p * C + c], epoch)  # p's input is in place
            T.sync_threads()
            for p in T.serial(W):
                T.get_block(T.address_of(In[me * S + start]), T.address_of(Stage[p * S + start]),
                            T.min(CH, S - start), src_pe=p)
            T.sync_threads()
            if tx == 0:
                T.fence_sys()
                for p in T.serial(W):
                    T.notify(Flags[me * C + c], p, epoch)  # done reading p's chunk c
            for k in T.serial(steps):
                i = start + k * threads + tx
                if k * threads + tx < CH and i < S:
                    Out[i] = T.Cast(dtype, _rank_order_sum(T, Stage, i, S, W, acc))
            if tx == 0:
                for p in T.serial(W):
                    T.wait_ge(Flags[p * C + c], epoch)  # p is done reading my chunk c

    return reducescatter


def _rank_order_sum(T, stage, i, shard_numel: int, world_size: int, acc: str):
    """``stage[i] + stage[S + i] + ...`` (``world_size`` terms, in ``acc``), built at trace
    time as one expression: the same order of additions as ``torch_reference``."""
    total = T.Cast(acc, stage[i])
    for p in range(1, world_size):
        total = total + T.Cast(acc, stage[p * shard_numel + i])
    return total


def torch_reference(inputs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The expected output on ``rank``: ``sum_p inputs[p][rank]``, added in rank order in the
    kernel's accumulation dtype (float32 for 16-bit floats), then cast back."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    dtype = inputs[0].dtype
    acc_dtype = _TORCH_ACCUMULATE.get(dtype, dtype)
    total = inputs[0][rank].to(acc_dtype)
    for x in inputs[1:]:
        total = total + x[rank].to(acc_dtype)
    return total.to(dtype)


class ReduceScatter(SymmetricCollective):
    """A reusable sum reduce-scatter of one shard shape and dtype over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shard_shape: shape of each output shard (an int or a tuple of positive ints); the
            input is ``(world_size, *shard_shape)``.
        dtype: torch dtype (or its name): float16, bfloat16, float32, float64, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        group: process group for the constructor's barrier and the compile's
            ``compile_group``; default ``torch.distributed``'s world group when initialised.
        threads: threads per block (multiple of 32, at most 1024).
        max_blocks: grid cap (all blocks must be co-resident); default the device's SM count.
        min_chunk_bytes: smallest piece a block is given before the grid grows.
        target: TileLang target (default ``sm_90a``).

    Attributes: ``input`` (symmetric, ``(world_size, *shard_shape)``: write into it and call
    ``rs(rs.input)`` to skip the copy), ``output`` (``shard_shape``), ``stage`` (local),
    ``flags``, ``chunks``, ``chunk``, ``kernel``, ``epoch``.

    Construction and calls are collective: every rank builds the same instances and makes
    the same sequence of calls. Do not write ``input`` from another stream while a call runs:
    peers read it until the call returns on this rank's stream.
    """

    def __init__(self, allocator, shard_shape: Union[int, Sequence[int]],
                 dtype: Union[torch.dtype, str], world_size: Optional[int] = None, *,
                 group=None, threads: int = 512, max_blocks: Optional[int] = None,
                 min_chunk_bytes: int = MIN_CHUNK_BYTES, target=None):
        self._setup(allocator, shard_shape, dtype, world_size, group, threads, max_blocks, _ALLOWED)
        # one block per chunk (world_size=1 in the plan: the grid is chunks x 1)
        self.chunks, self.chunk = plan_chunks(self.shard_numel, self.itemsize, 1, self.max_blocks, min_chunk_bytes)

        self.input = self._tensor((self.world_size, *self.shard_shape))
        self.output = self._tensor(self.shard_shape)
        self.flags = self._tensor((2 * self.world_size * self.chunks,), torch.uint64)
        self.flags.zero_()
        self.stage = torch.empty((self.world_size * self.shard_numel,), dtype=self.dtype, device=self.device)

        self._finish(build_reducescatter_kernel(self.shard_numel, _ALLOWED[self.dtype], self.world_size,
                                                self.chunks, self.chunk, threads), target)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        """Sum shard ``rank`` of ``input`` over all ranks; returns ``self.output``
        (``shard_shape``), complete when the kernel finishes on the current stream. Copies
        ``input`` into the symmetric ``self.input`` first unless it is ``self.input``."""
        self._check_open()
        self.check_input(input)
        if input.data_ptr() != self.input.data_ptr():
            self.input.copy_(input)
        self.epoch += 1
        self.kernel(self.input.view(-1), self.stage, self.output.view(-1), self.flags, self.epoch)
        return self.output
