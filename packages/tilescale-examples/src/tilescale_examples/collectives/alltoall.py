"""All-to-all over the symmetric heap, built from ``T.put_block`` and flag signals.

Every rank holds ``world_size`` rows of one row shape; row ``p`` is for rank ``p``.
Afterwards rank ``r`` holds ``output[src] == input of rank src, row r`` for every ``src``
(what ``torch.distributed.all_to_all_single`` produces with equal splits)::

    a2a = AllToAll(allocator, (world, 4096), torch.float16)   # collective; shape: the input
    out = a2a(x)         # x: (world, 4096), row p goes to rank p; out: (world, 4096)
    ...
    a2a.close()          # before allocator.close()

The kernel is the all-gather's (:mod:`tilescale_examples.collectives.put_exchange`, protocol described in
:mod:`tilescale_examples.collectives.allgather`) with one difference: block ``(c, p)`` puts chunk ``c``
of input row ``p`` (not of the single shard) into row ``me`` of rank ``p``'s output. The
ready handshake makes back-to-back calls safe without host synchronisation, and the kernel
returns on a rank only when every row of its output has landed. The kernel reads the input
in place (the local rank's rows only), so any contiguous tensor of ``shape`` on
the allocator's device works; ``a2a.input`` is a symmetric buffer for it.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import (DTYPES, RowsPerRank, accepts_0_1_init, accepts_0_1_out, positional_out,
                                     row_shape_0_1)
from tilescale_examples.collectives.put_exchange import PutExchange, build_put_exchange_kernel

__all__ = ["AllToAll", "build_alltoall_kernel", "torch_reference", "ALGORITHMS"]

#: Smallest chunk a block is given before the grid grows (bytes).
MIN_CHUNK_BYTES = 64 * 1024
#: Values of the ``algorithm`` argument (one kernel: ``"auto"`` is ``"sm"``).
ALGORITHMS = RowsPerRank.ALGORITHMS


def build_alltoall_kernel(shard_numel: int, dtype: str, world_size: int, chunks: int,
                          chunk: int, threads: int = 512):
    """The all-to-all ``T.prim_func``: ``(In: (world_size * shard_numel,), Out: (world_size
    * shard_numel,), Flags: (2 * world_size * chunks,) uint64, State: (world_size * chunks,)
    int64)``, grid ``chunks x world_size`` (see :func:`build_put_exchange_kernel`)."""
    return build_put_exchange_kernel(shard_numel, dtype, world_size, chunks, chunk, threads,
                                     row_per_peer=True, name="alltoall")


def torch_reference(inputs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The expected output on ``rank``: ``stack([inputs[p][rank] for p in ranks])``."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    return torch.stack([x.detach()[rank] for x in inputs], dim=0)


class AllToAll(RowsPerRank, PutExchange):
    """A reusable all-to-all of equal rows over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shape: the input of a call, ``(world_size, *row)`` (row ``p`` goes to rank ``p``);
            the output has the same shape.
        dtype: torch dtype (or its name): float16, bfloat16, float32, float64, int8, uint8,
            int16, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"`` or ``"sm"`` (the put_block kernel; the only one).
        group: process group for the constructor's barrier and the compile's
            ``compile_group``; default ``torch.distributed``'s world group when initialised.
        threads: threads per block (multiple of 32, at most 1024).
        max_blocks: grid cap (all blocks must be co-resident); default the device's SM count.
        min_chunk_bytes: smallest piece a block is given before the grid grows.
        target: TileLang target (default ``sm_90a``).

    Attributes: ``input`` (symmetric, ``shape``), ``output`` (symmetric, same shape,
    overwritten by the next call), ``shard_shape`` (the row), ``algorithm``, ``flags``,
    ``state`` (the kernel's per-block call counters, on the device), ``chunks``, ``chunk``,
    ``kernel``, ``epoch`` (calls issued from the host; graph replays are counted on the device
    only). Construction and calls are collective (same instances, same call sequence on every
    rank). 0.1.0 spellings (``shard_shape=`` the row, a row shape in place of ``shape``, a
    positional ``world_size``) work with a warning.
    """

    torch_reference = staticmethod(torch_reference)

    @accepts_0_1_init(positional=("world_size",), translate=row_shape_0_1)
    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "sm"] = "auto",
                 group=None, threads: int = 512, max_blocks: Optional[int] = None,
                 min_chunk_bytes: int = MIN_CHUNK_BYTES, target=None):
        self._setup(allocator, shape, dtype, world_size, group, threads, max_blocks, algorithm=algorithm,
                    target=target, min_chunk_bytes=min_chunk_bytes)
        self.input = self._tensor(self.shape)
        self.output = self._tensor(self.shape)
        self._make_flags()
        self._finish_build(lambda: build_alltoall_kernel(self.shard_numel, DTYPES[self.dtype], self.world_size,
                                                         self.chunks, self.chunk, threads), target)

    @accepts_0_1_out(1)
    def __call__(self, input: torch.Tensor, *out_0_1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Send row ``p`` of ``input`` (``shape``) to rank ``p``; returns ``self.output`` (row
        ``src``: what rank ``src`` sent here, overwritten by the next call), or ``out`` (a
        contiguous tensor of that shape and dtype) holding a copy of it; complete when the
        kernel finishes on the current stream. Every rank must make the same sequence of calls
        (eagerly or in CUDA graph replays). Raises :class:`~tilescale_examples.base.ClosedError`
        after ``close()``."""
        if out_0_1:  # the 0.1.0 spelling
            out = positional_out(self, 1, out_0_1, out)
        return self._call(input, out)
