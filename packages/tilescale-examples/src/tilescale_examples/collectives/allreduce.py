"""Sum all-reduce: a one-shot kernel for small messages, a fused two-shot kernel for large ones.

Every rank holds a tensor of one shape; afterwards every rank holds their element-wise sum::

    ar = AllReduce(allocator, (4096, 1024), torch.bfloat16)   # collective
    out = ar(x)              # x: any contiguous (4096, 1024) tensor on the allocator's device
    ar(x, out=x)             # in place (out is keyword-only)
    ar.input.copy_(x); ar(ar.input)   # zero-copy: x already in the symmetric buffer
    ar.close()               # before allocator.close()

Algorithms (one kernel launch per call either way; :mod:`tilescale_examples.collectives.reduce_engine`
has the kernel, the deadlock argument and the buffer-reuse argument):

* ``one_shot``: every rank stages its input into its symmetric buffer, signals one epoch flag
  per block, reads every peer's buffer with 16-byte loads and reduces all of it. One flag
  round; reads ``world_size * size`` bytes per rank (``(world_size - 1) * size`` over the
  links). Best when latency dominates.
* ``two_shot``: the same staging and flag, then rank ``r`` reduces shard ``r`` and stores it
  into every rank's buffer (reduce-scatter and all-gather fused in one kernel), then a
  second flag round. Moves ``2 (world_size - 1) / world_size * size`` bytes over the links
  per rank, the bus-bandwidth optimum. Best for large messages.

* ``lamport`` (float dtypes): every rank pushes its input into a slot of every rank's
  receive buffer, and each 16-byte vector's data carries its own readiness (the Lamport
  sentinel, :mod:`tilescale_examples.collectives.lamport_kernel`): no flag, no fence, no round
  trip between ranks before the data moves. Writes ``world_size * size`` bytes per rank (as
  the one-shot reads them); ``3 * world_size * size`` bytes of symmetric memory. Best for the
  smallest messages, where a flag round is most of the call.

``algorithm="auto"`` picks by dtype and message size with :data:`LAMPORT_MAX_BYTES` and
:data:`ONE_SHOT_MAX_BYTES` (see :func:`choose_algorithm`); the other values force one.

Determinism: every element of the result is ``x_0 + x_1 + ... + x_{n-1}`` added in rank order
in float32 (float16/bfloat16) or the dtype itself (float32, int32, ...) and rounded once; every
rank gets bit-identical output, and :func:`torch_reference` reproduces it exactly. Both
algorithms give the same bits.
"""

# (no `from __future__ import annotations`: the engine defines TileLang kernels)

import math
from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import (accepts_0_1_init, accepts_0_1_out, accepts_0_1_reference, check_dtype,
                                     positional_out, rank_left_out, size_table_entry)
from tilescale_examples.collectives.lamport_kernel import LAMPORT_DTYPES
from tilescale_examples.collectives.reduce_engine import REDUCE_DTYPES, ReductionCollective
from tilescale_examples.collectives.reduce_engine import torch_reference as _rank_order_sum

__all__ = ["AllReduce", "ALGORITHMS", "ONE_SHOT_MAX_BYTES", "LAMPORT_MAX_BYTES", "choose_algorithm", "torch_reference"]

#: Values of the ``algorithm`` argument.
ALGORITHMS = ("auto", "one_shot", "two_shot", "lamport")
#: Size table of ``algorithm="auto"`` for float dtypes: the largest message (bytes) sent by the
#: Lamport kernel, by world size (keys and lookup as :data:`ONE_SHOT_MAX_BYTES`). One rank
#: (one H100, replayed from a CUDA graph): Lamport 2.58 / 3.33 us at 4 / 16 KiB against the
#: one-shot's 3.58 / 4.11, but 6.38 against 6.03 us at 64 KiB. Several ranks (emulated ranks
#: running at once on one H100, ``python -m tilescale_examples.benchmarks.concurrent``,
#: bfloat16, 4 to 256 KiB): Lamport 0.74-0.94 of the one-shot at every size at 2 ranks,
#: 0.81-0.95 at 4, 0.96-0.99 at 8 up to 64 KiB (1.10 at 128 KiB); the entries stop at the
#: largest size where it won (at 2 and 4 ranks the largest timed). Re-tune across GPUs with
#: ``python -m tilescale_examples.benchmarks.allreduce --algorithm lamport|one_shot``.
LAMPORT_MAX_BYTES = {1: 16 << 10, 2: 256 << 10, 4: 256 << 10, 8: 64 << 10}
#: Size table of ``algorithm="auto"``: the largest message (bytes) sent one-shot, by world
#: size (a world size between two keys uses the smaller key's entry; 1 rank: always one-shot).
#: One-shot reads ``(n - 1) * size`` over the links against two-shot's ``2 (n - 1) / n *
#: size`` but saves a flag round, so its range shrinks as ``n`` grows. Re-tune from
#: ``python -m tilescale_examples.benchmarks.allreduce --algorithm one_shot|two_shot``.
ONE_SHOT_MAX_BYTES = {2: 1 << 20, 4: 256 << 10, 8: 64 << 10}


def choose_algorithm(nbytes: int, world_size: int, table: Optional[dict] = None, *,
                     dtype: Union[torch.dtype, str, None] = None, lamport_table: Optional[dict] = None) -> str:
    """``"lamport"`` for a float ``dtype`` when ``nbytes`` is at most the Lamport table's limit
    for ``world_size``; else ``"one_shot"`` when ``nbytes`` is at most the one-shot table's
    limit (always at one rank); else ``"two_shot"``.

    Args:
        nbytes: message size in bytes (``numel * itemsize``).
        world_size: number of ranks (>= 1).
        table: world size -> largest one-shot message in bytes (default
            :data:`ONE_SHOT_MAX_BYTES`).
        dtype: the element type; None (or an integer type) never picks ``"lamport"``.
        lamport_table: world size -> largest Lamport message in bytes (default
            :data:`LAMPORT_MAX_BYTES`).
    """
    name = None if dtype is None else REDUCE_DTYPES[check_dtype(dtype, REDUCE_DTYPES)]
    if name in LAMPORT_DTYPES:
        lamport_limit = size_table_entry(LAMPORT_MAX_BYTES if lamport_table is None else lamport_table, world_size)
        if nbytes <= lamport_limit:
            return "lamport"
    limit = size_table_entry(ONE_SHOT_MAX_BYTES if table is None else table, world_size)
    return "one_shot" if world_size == 1 or nbytes <= limit else "two_shot"


def _reference(inputs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The expected output on ``rank`` (the same on every rank): ``sum_p inputs[p]`` in rank
    order in the accumulation dtype, rounded once."""
    inputs = list(inputs)
    if inputs and not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    return _rank_order_sum(inputs)


#: :meth:`AllReduce.torch_reference`; ``torch_reference(inputs)`` is the 0.1.0 spelling (it warns).
torch_reference = accepts_0_1_reference("allreduce.torch_reference(inputs)", rank_left_out)(_reference)


class AllReduce(ReductionCollective):
    """A reusable sum all-reduce of one shape and dtype over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shape: the tensor's shape (an int or a tuple of positive ints); any size (sizes that
            are not whole 16-byte vectors, or that the ranks do not divide, are zero-padded
            inside the symmetric buffer).
        dtype: torch dtype (or its name): float16, bfloat16, float32, float64, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"`` (by dtype and size, :func:`choose_algorithm`), ``"one_shot"``,
            ``"two_shot"`` or ``"lamport"`` (float dtypes).
        group, threads, max_blocks, unroll, target: as for
            :class:`~tilescale_examples.collectives.reducescatter.ReduceScatter`.

    Attributes: ``algorithm`` (the one chosen), ``plan`` (grid and buffer plan), ``input``
    (the symmetric buffer the next call reads, ``shape``: write into it and call
    ``ar(ar.input)`` to skip staging; Lamport: a local buffer, nothing to skip), ``output``
    (what a call without ``out`` returns), ``stages``, ``flags`` (None for Lamport),
    ``kernel``, ``epoch``.

    Memory (symmetric, per rank): one (two-shot) or two (one-shot: double-buffered) staging
    buffers of the padded size, ``2 * world_size * blocks`` uint64 flags (one per 32-byte
    sector); one-shot also a local result buffer. Lamport: ``3 * world_size`` buffers of the
    padded size and no flags (a local input and result buffer beside them).

    Construction and calls are collective: every rank builds the same instances with the
    same arguments and makes the same sequence of calls.
    """

    ALGORITHMS = ALGORITHMS
    torch_reference = staticmethod(_reference)

    @accepts_0_1_init(positional=("world_size",))
    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None,
                 algorithm: Literal["auto", "one_shot", "two_shot", "lamport"] = "auto",
                 group=None, threads: int = 512, max_blocks: Optional[int] = None, unroll: Optional[int] = None,
                 target=None):
        self._setup(allocator, shape, dtype, world_size, group, threads, max_blocks, REDUCE_DTYPES,
                    algorithm=algorithm, target=target)
        self.numel = self.shard_numel
        if algorithm == "auto":
            algorithm = choose_algorithm(self.numel * self.itemsize, self.world_size, dtype=self.dtype)
        self.algorithm = algorithm
        self._build(algorithm, self.numel, unroll, target)
        self.output = (self.stages[0] if algorithm == "two_shot" else self.result).view(-1)[: self.numel].view(self.shape)

    def _largest_numel(self) -> int:
        return math.prod(self.shape)  # one tensor of shape, not world_size pieces

    # ------------------------------------------------------------------ calls
    def _input_view(self, stage: torch.Tensor) -> torch.Tensor:
        return stage.view(-1)[: self.numel].view(self.shape)

    @accepts_0_1_out(1)
    def __call__(self, input: torch.Tensor, *out_0_1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum ``input`` over all ranks.

        Args:
            input: a contiguous tensor of ``shape`` and ``dtype`` on the allocator's device
                (an ordinary tensor, a heap tensor, or ``ar.input``).
            out: where to write the sum (``shape``, ``dtype``, contiguous; may be ``input``
                for an in-place call); default ``ar.output``, which the next call overwrites.

        Returns ``out`` (or ``ar.output``), complete when the kernel finishes on the current
        stream. Staging the input into the symmetric buffer is part of the call (inside the
        kernel when ``input`` is 16-byte aligned whole vectors, else a copy before it). Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``.
        """
        if out_0_1:  # the 0.1.0 spelling
            out = positional_out(self, 1, out_0_1, out)
        if out is None and self._relaunch(input):
            return self.output
        zero_copy = self._check_call(input, out, self.shape)
        out_rows = None
        if self.algorithm != "two_shot":
            out_rows = self._out_rows(out)
            out_rows = self.result if out_rows is None else out_rows
        stage = self._launch(input, out_rows, self._stage_copy, zero_copy, keep=out is None)
        if out is None:
            return self.output
        result = stage.view(-1)[: self.numel] if self.algorithm == "two_shot" else self.result.view(-1)[: self.numel]
        if out_rows is self.result or self.algorithm == "two_shot":
            if out.data_ptr() != result.data_ptr():
                out.view(-1).copy_(result)
        return out

    def _stage_copy(self, stage: torch.Tensor, input: torch.Tensor) -> None:
        stage.view(-1)[: self.numel].copy_(input.reshape(-1))

    def bus_bytes(self) -> float:
        """Bytes per call for the bus bandwidth: ``2 (n - 1) / n * size`` (nccl-tests)."""
        n = self.world_size
        return 2 * (n - 1) / n * self.numel * self.itemsize
