"""Sum reduce-scatter over the symmetric heap, on the all-reduce's reduction engine.

Every rank contributes a ``(world_size, *row)`` tensor (the op's ``shape``); afterwards rank
``r`` holds the element-wise sum over all ranks of row ``r`` (what ``torch.distributed.
reduce_scatter_tensor`` with ``op=SUM`` produces)::

    rs = ReduceScatter(allocator, (world, 4096), torch.float16)   # collective; shape: the input
    out = rs(x)          # x: (world, 4096) on the allocator's device; out: (4096,) = sum_p x_p[r]
    rs.input.copy_(x); rs(rs.input)   # zero-copy: x already in the symmetric buffer
    rs.close()           # before allocator.close()

One kernel per call (:func:`~tilescale_examples.collectives.reduce_engine.build_reduce_kernel`, mode
``reduce_scatter``): each block stages its rows of the input into this rank's symmetric buffer
(double-buffered across calls), signals an epoch flag to every rank, waits for the same flag
from every rank, then reads row ``rank`` of every rank's buffer with 16-byte loads and adds
them in rank order (float32 accumulation for 16-bit floats), rounding once. One flag round
per call; back-to-back calls need no host synchronisation (the reuse argument is in
:mod:`tilescale_examples.collectives.reduce_engine`). Every element equals :func:`torch_reference`
bit for bit.
"""

# (no `from __future__ import annotations`: the engine defines TileLang kernels)

from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import (RowsPerRank, accepts_0_1_init, accepts_0_1_out, positional_out,
                                     row_shape_0_1)
from tilescale_examples.collectives.reduce_engine import ACCUMULATE, REDUCE_DTYPES, ReductionCollective
from tilescale_examples.collectives.reduce_engine import torch_reference as _rank_order_sum

__all__ = ["ReduceScatter", "torch_reference", "ACCUMULATE", "ALGORITHMS"]

#: Values of the ``algorithm`` argument (one kernel: ``"auto"`` is ``"sm"``).
ALGORITHMS = RowsPerRank.ALGORITHMS


def torch_reference(inputs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The expected output on ``rank``: ``sum_p inputs[p][rank]``, added in rank order in the
    kernel's accumulation dtype (float32 for 16-bit floats), then cast back."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    return _rank_order_sum([x[rank] for x in inputs])


class ReduceScatter(RowsPerRank, ReductionCollective):
    """A reusable sum reduce-scatter of one shape and dtype over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shape: the input of a call, ``(world_size, *row)``; the output is one ``row`` (the
            sum of row ``rank`` over the ranks). Any size (rows that are not whole 16-byte
            vectors are padded inside the symmetric buffer).
        dtype: torch dtype (or its name): float16, bfloat16, float32, float64, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"`` or ``"sm"`` (the reduction kernel; the only one).
        group: process group for the constructor's barrier; default ``torch.distributed``'s
            world group when initialised.
        threads: threads per block (multiple of 32, at most 1024; default 512).
        max_blocks: grid cap; default the device's SM count (all blocks must be resident).
        unroll: 16-byte rows per thread and loop iteration (default ``max(1, 8 //
            world_size)``).
        target: TileLang target (default ``sm_90a``).

    Attributes: ``input`` (the symmetric buffer the next call reads, ``shape``: write into
    it and call ``rs(rs.input)`` to skip staging), ``output`` (local, ``shard_shape``, the
    row; what a call without ``out`` returns, overwritten by the next call), ``algorithm``,
    ``plan`` (the grid), ``stages`` (two, double-buffered), ``flags``, ``kernel``, ``epoch``.

    Construction and calls are collective: every rank builds the same instances with the
    same arguments and makes the same sequence of calls. 0.1.0 spellings (``shard_shape=``
    the row, a row shape in place of ``shape``, a positional ``world_size``) work with a
    warning.
    """

    torch_reference = staticmethod(torch_reference)

    @accepts_0_1_init(positional=("world_size",), translate=row_shape_0_1)
    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "sm"] = "auto",
                 group=None, threads: int = 512, max_blocks: Optional[int] = None,
                 unroll: Optional[int] = None, target=None):
        self._setup(allocator, shape, dtype, world_size, group, threads, max_blocks, REDUCE_DTYPES,
                    algorithm=algorithm, target=target)
        self._build("reduce_scatter", self.shard_numel, unroll, target)
        self.output = self.result.view(-1)[: self.shard_numel].view(self.shard_shape)

    def _input_view(self, stage: torch.Tensor) -> torch.Tensor:
        """``stage`` as ``shape`` (strided when a row is not whole vectors)."""
        p = self.plan
        rows = stage.view(self.world_size, p.span * p.vec)[:, : self.shard_numel]
        return rows.view(self.shape)

    @accepts_0_1_out(1)
    def __call__(self, input: torch.Tensor, *out_0_1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum row ``rank`` of ``input`` over all ranks.

        Args:
            input: a contiguous tensor of ``shape`` (``(world_size, *row)``) and ``dtype`` on
                the allocator's device (or ``rs.input``).
            out: where to write the sum (``shard_shape``, the row; contiguous); default
                ``rs.output``.

        Returns ``out`` (or ``rs.output``), complete when the kernel finishes on the current
        stream. Staging into the symmetric buffer is part of the call. Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``.
        """
        if out_0_1:  # the 0.1.0 spelling
            out = positional_out(self, 1, out_0_1, out)
        if out is None and self._relaunch(input):
            return self.output
        zero_copy = self._check_call(input, out, self.shard_shape)
        out_rows = self._out_rows(out)
        self._launch(input, self.result if out_rows is None else out_rows, self._stage_copy, zero_copy,
                     keep=out is None)
        if out is None:
            return self.output
        if out_rows is None and out.data_ptr() != self.output.data_ptr():
            out.copy_(self.output)
        return out

    def _stage_copy(self, stage: torch.Tensor, input: torch.Tensor) -> None:
        p = self.plan
        stage.view(self.world_size, p.span * p.vec)[:, : self.shard_numel].copy_(input.reshape(self.world_size, -1))
