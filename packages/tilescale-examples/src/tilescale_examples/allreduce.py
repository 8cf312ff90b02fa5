"""Sum all-reduce as a reduce-scatter followed by an all-gather (two kernels, no host sync).

Every rank holds a tensor of one shape; afterwards every rank holds their element-wise sum::

    ar = AllReduce(allocator, shape=(4096, 1024), dtype=torch.bfloat16)   # collective
    out = ar(x)          # x: (4096, 1024) on the allocator's device; out: sum over ranks
    ...
    ar.close()           # before allocator.close()

The flattened tensor is cut into ``world_size`` shards of ``ceil(numel / world_size)``
elements (the last one zero-padded). :class:`~tilescale_examples.reducescatter.ReduceScatter`
sums shard ``rank`` over all ranks (float32 accumulation for 16-bit floats, ranks added in
order), then :class:`~tilescale_examples.allgather.AllGather` sends every rank's summed shard
to every rank. Both kernels carry their own epoch handshakes, so back-to-back calls need no
host synchronisation, and both run on the current stream, in order. Every element of the
result is therefore ``x_0 + x_1 + ... + x_{n-1}`` added in rank order and rounded once, on
every rank alike (:func:`torch_reference`).

Memory: the reduce-scatter's ``(world, shard)`` input (which ``input`` views), its staging
buffer and ``shard`` output, and the all-gather's ``(world, shard)`` output (which ``output``
views), plus flags.
"""

# (no `from __future__ import annotations`: the collectives define TileLang kernels)

import math
from typing import Optional, Sequence, Union

import torch

from tilescale_examples.allgather import AllGather
from tilescale_examples.collective import Closable, check_shape, check_tensor
from tilescale_examples.reducescatter import ReduceScatter
from tilescale_examples.reducescatter import torch_reference as _rs_reference

__all__ = ["AllReduce", "torch_reference"]


def torch_reference(inputs: Sequence[torch.Tensor], rank: int = 0) -> torch.Tensor:
    """The expected output (the same on every rank): ``sum_p inputs[p]`` added in rank order
    in the accumulation dtype (float32 for 16-bit floats), rounded once. ``rank`` is accepted
    for symmetry with the other collectives' references and ignored."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    return _rs_reference([x.reshape(1, -1) for x in inputs], 0).view(inputs[0].shape)


class AllReduce(Closable):
    """A reusable sum all-reduce of one shape and dtype over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shape: the tensor's shape (an int or a tuple of positive ints).
        dtype: torch dtype (or its name): float16, bfloat16, float32, float64, int32 or int64.
        world_size, group, threads, max_blocks, min_chunk_bytes, target: as for
            :class:`~tilescale_examples.reducescatter.ReduceScatter`, used by both kernels.

    Attributes: ``input`` (``shape``, a view of the reduce-scatter's symmetric input: write
    into it and call ``ar(ar.input)`` to skip the copy), ``output`` (``shape``, a view of the
    all-gather's output, overwritten by the next call), ``reduce_scatter``, ``all_gather``,
    ``shard`` (elements per rank), ``chunks`` (the reduce-scatter's grid), ``epoch``.

    Construction and calls are collective (same instances, same call sequence on every rank).
    """

    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str],
                 world_size: Optional[int] = None, *, group=None, threads: int = 512,
                 max_blocks: Optional[int] = None, min_chunk_bytes: int = 64 * 1024, target=None):
        self.shape = check_shape(shape, "shape")
        self.numel = math.prod(self.shape)
        num_ranks = getattr(allocator, "num_ranks", None)
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise TypeError(f"allocator must be a tilescale-core allocator (with num_ranks), got {type(allocator).__name__}")
        self.shard = -(-self.numel // num_ranks)
        kw = dict(group=group, threads=threads, max_blocks=max_blocks, min_chunk_bytes=min_chunk_bytes, target=target)
        self.reduce_scatter = ReduceScatter(allocator, (self.shard,), dtype, world_size, **kw)
        self.all_gather = AllGather(allocator, (self.shard,), self.reduce_scatter.dtype, world_size, **kw)
        self.dtype, self.world_size = self.reduce_scatter.dtype, self.reduce_scatter.world_size
        self.device, self.chunks = self.reduce_scatter.device, self.reduce_scatter.chunks
        flat_in = self.reduce_scatter.input.view(-1)
        flat_in[self.numel:].zero_()  # padding: summed as zeros, never written by calls
        self.input = flat_in[: self.numel].view(self.shape)
        self.output = self.all_gather.output.view(-1)[: self.numel].view(self.shape)

    @property
    def epoch(self) -> int:
        """Calls made so far."""
        return self.reduce_scatter.epoch

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        """Sum ``input`` over all ranks; returns ``self.output`` (``shape``), complete when
        both kernels finish on the current stream. Copies ``input`` into ``self.input``
        first unless it is ``self.input``."""
        if self.closed:
            raise RuntimeError("this AllReduce is closed")
        self.reduce_scatter._check_open()
        check_tensor(input, self.shape, self.dtype, self.device, "input", "the shape", "AllReduce")
        if input.data_ptr() != self.input.data_ptr():
            self.input.copy_(input)
        part = self.reduce_scatter(self.reduce_scatter.input)
        self.all_gather(part)
        return self.output

    def bus_bytes(self) -> float:
        """Bytes per call for the bus bandwidth: ``2 (n - 1) / n * size`` (nccl-tests)."""
        n = self.world_size
        return 2 * (n - 1) / n * self.numel * self.reduce_scatter.itemsize

    def close(self) -> None:
        """Close both collectives (idempotent); heap bytes return with ``allocator.close()``."""
        self.reduce_scatter.close()
        self.all_gather.close()
        self.input = self.output = None

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self.reduce_scatter.closed

    def __repr__(self) -> str:
        return (f"AllReduce(shape={self.shape}, dtype={self.dtype}, world_size={self.world_size}, "
                f"shard={self.shard}, epoch={self.epoch}{', closed' if self.closed else ''})")
