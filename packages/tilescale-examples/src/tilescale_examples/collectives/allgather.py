"""All-gather over the symmetric heap, built from ``T.put_signal_block`` and flag signals.

Every rank contributes one *shard* (same shape and dtype on every rank); afterwards every
rank holds ``output[r] == shard of rank r`` for all ranks ``r``::

    ag = AllGather(allocator, (4096,), torch.float16)   # collective; shape: this rank's shard
    out = ag(x)          # x: this rank's shard on the allocator's device; out: (world, 4096)
    ...
    ag.close()           # before allocator.close()

The kernel
----------

One rank-agnostic kernel (the rank comes from ``T.get_rank()``; the binary and TileLang's
disk cache serve every rank) with a grid of ``chunks x num_ranks`` blocks. The shard is cut
into ``chunks`` pieces of ``chunk`` elements (a multiple of 16 bytes, so the peer copy moves
16-byte vectors whenever the slot's offset allows it). Block ``(c, p)`` of rank ``me``:

1. *Ready handshake* (thread 0): adding 1 to ``ready[me, c]`` on ``p`` tells rank ``p`` that
   ``me``'s output slot for ``p``'s chunk ``c`` is free (every earlier use of this output on
   ``me``'s stream has finished, since the kernel has started), then
   ``T.wait_ge(ready[p, c], epoch)`` waits for the same word from ``p``.
2. ``T.put_signal_block`` of chunk ``c`` of the local shard into
   ``output[me*shard + c*chunk]`` on rank ``p`` (``dst_pe=p``; ``p == me`` is a local copy
   through the same path), adding 1 to the signal ``data[me, c]`` on ``p``: every thread
   stores its part, the block synchronises (``bar.sync``) and thread 0 releases the flag
   (``red.release.sys.add``), so the chunk is visible on rank ``p`` before the flag is (see
   "Memory-model guarantees" in docs/lang.md).
3. Thread 0 ``T.wait_ge(data[p, c], epoch)`` (``ld.acquire.sys`` polls): ``p``'s chunk
   ``c`` has landed here. When every block has passed its wait, the whole output is present,
   so the kernel returns only when the all-gather is complete on this rank.

Flags are ``uint64`` counters: rank ``me``'s block ``(c, p)`` adds 1 to its flag on ``p`` per
call (a release add), and call ``e`` waits for ``>= e``. The call number ``e`` is kept on the
device (``state``: each block's own count of its calls, read at the start and written at the
end of the kernel), never passed from the host, so a call captured in a CUDA graph replays
correctly, and eager calls and replays of several graphs mix in any order; repeated calls need
no flag reset and the counters cannot wrap. The handshake of step 1 makes back-to-back calls safe without any host
barrier: rank ``p`` cannot overwrite ``me``'s output for call ``e + 1`` before ``me`` has
launched call ``e + 1``, i.e. before everything ``me`` enqueued earlier on its stream
(consumers of call ``e``'s output, a poison ``fill_``) has run.

Every block waits for a block of another rank, so all blocks of the grid must be co-resident:
the grid is capped at ``max_blocks`` (default: the number of SMs) blocks of ``threads``
threads (one block per SM always fits). Ranks that share one GPU still progress, because
their contexts time-slice, but that mode measures scheduling, not bandwidth.

Engines (the ``algorithm`` argument)
------------------------------------

``algorithm="sm"`` is the kernel above. ``algorithm="copy"`` moves the shards with the GPU's copy
engines instead: ``torch`` ``copy_`` of the input into every peer's output slot through the
peer mapping of the heap (``cudaMemcpyAsync`` device to device; the local slot on a side
stream), with the same two flag rounds as host-enqueued stream memory operations
(``tilescale_host.set_signal`` on the peer's flag, ``stream_wait_eq`` on this rank's):
ready to every peer, wait for every peer's ready, the copies, data to every peer (the
stream write orders the copies before the flag), wait for every peer's data. No SM runs
while it waits, so it needs no residency argument; each stream operation costs a few
microseconds, so it pays only for large shards. ``algorithm="auto"`` picks by the output's size
with :data:`COPY_ENGINE_MIN_BYTES` (:func:`choose_engine`).

The copy engine's flags are 32-bit words that hold only 0 or 1, so the stream operations
carry no call number and a captured CUDA graph replays them correctly: a peer sets the flag
to 1, and this rank waits for 1 and then resets it to 0. No peer can set a flag again before
its reset: peer ``p`` sets ``ready[p]`` here for call ``e + 1`` only after finishing call
``e``, which needed this rank's data flag of call ``e``, written after the reset of
``ready[p]``; and ``p`` sets ``data[p]`` here for call ``e + 1`` only after this rank's
ready flag of call ``e + 1``, written after the reset of ``data[p]`` in call ``e``.

Lifetime
--------

The constructor is **collective** over ``group``: every rank must construct the same
all-gathers (same shapes, dtypes and order), because it allocates symmetric tensors (the
heap hands out the same offsets on every rank), compiles with ``compile_once=True``, and ends
with a barrier so that no peer signals a flag before its owner has zeroed it. The heap is a
bump allocator: ``close()`` drops the kernel and the tensors but the heap bytes return only
with ``allocator.close()``. Use an instance only while its allocator is open; the output
tensor returned by a call is overwritten by the next call (copy it if it must survive).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import DTYPES as _DTYPES
from tilescale_examples.base import (TARGET, accepts_0_1_init, accepts_0_1_out, accepts_0_1_reference, plan_chunks,
                                     positional_out, rank_left_out, size_table_entry)
from tilescale_examples.collectives.put_exchange import PutExchange, build_put_exchange_kernel

__all__ = ["AllGather", "plan_chunks", "build_allgather_kernel", "torch_reference", "TARGET",
           "ALGORITHMS", "ENGINES", "COPY_ENGINE_MIN_BYTES", "choose_engine"]

#: Smallest chunk a block is given before the grid grows (bytes).
MIN_CHUNK_BYTES = 64 * 1024
#: Values of the ``algorithm`` argument (``ENGINES``: their 0.1.0 name).
ALGORITHMS = ENGINES = ("auto", "sm", "copy")
#: Size table of ``algorithm="auto"``: the smallest output (bytes, ``world_size`` shards) moved by
#: the copy engines, by world size (between keys: the smaller key's entry); smaller outputs use
#: the SM kernel (below it, the stream operations' fixed cost outweighs the copy engines'
#: throughput). Re-tune from ``python -m tilescale_examples.benchmarks.allgather --engine sm|copy``.
COPY_ENGINE_MIN_BYTES = {2: 64 << 20, 4: 64 << 20, 8: 64 << 20}


def choose_engine(nbytes: int, world_size: int, table: Optional[dict] = None) -> str:
    """``"copy"`` when an output of ``nbytes`` bytes reaches the table's entry for
    ``world_size`` (default :data:`COPY_ENGINE_MIN_BYTES`), else ``"sm"``; one rank: ``"sm"``."""
    limit = size_table_entry(COPY_ENGINE_MIN_BYTES if table is None else table, world_size)
    return "copy" if world_size > 1 and nbytes >= limit else "sm"


def build_allgather_kernel(shard_numel: int, dtype: str, world_size: int, chunks: int,
                           chunk: int, threads: int = 512):
    """The all-gather ``T.prim_func`` (see the module docstring for the algorithm).

    Signature: ``(In: (shard_numel,), Out: (world_size * shard_numel,), Flags: (2 *
    world_size * chunks,) uint64, State: (world_size * chunks,) int64)``;
    ``Flags[:world_size*chunks]`` are the data flags ``data[src, c]``, the rest the ready
    flags ``ready[src, c]``, ``State`` the blocks' call counters.
    """
    return build_put_exchange_kernel(shard_numel, dtype, world_size, chunks, chunk, threads,
                                     row_per_peer=False)


def _reference(inputs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The expected output on ``rank`` (the same on every rank): the inputs (shards) of ranks
    ``0 .. n-1`` stacked along a new dim 0."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    return torch.stack([s.detach() for s in inputs], dim=0)


#: :meth:`AllGather.torch_reference`; ``torch_reference(shards)`` is the 0.1.0 spelling (it warns).
torch_reference = accepts_0_1_reference("allgather.torch_reference(shards)", rank_left_out)(_reference)


class AllGather(PutExchange):
    """A reusable all-gather of one shard shape and dtype over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shape: shape of each rank's shard, the input of a call (an int or a tuple of
            positive ints).
        dtype: torch dtype (or its name) of the shards: float16, bfloat16, float32,
            float64, int8, uint8, int16, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"sm"`` (the put_block kernel, the default), ``"copy"`` (copy engines
            through the peer mapping) or ``"auto"`` (by size, :func:`choose_engine`). The
            per-chunk ``flags`` are written by the SM kernel only: a consumer that waits on
            them (as :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` does) needs ``"sm"``.
        group: process group for the closing barrier (and the compile's ``compile_group``); default
            ``torch.distributed``'s world group when it is initialised, else none.
        threads: threads per block (multiple of 32, at most 1024).
        max_blocks: grid cap (all blocks must be co-resident); default the device's SM count.
        min_chunk_bytes: smallest piece a block is given before the grid grows.
        target: TileLang target (default ``sm_90a``).

    Attributes: ``algorithm`` (the one chosen; ``engine`` is its 0.1.0 name), ``input`` (a
    symmetric shard buffer, for ``ag(ag.input)``; the kernel reads its input in place, so any
    contiguous tensor of the shard's shape and dtype on the allocator's device works as
    well), ``output`` (symmetric, ``(world_size, *shape)``), ``flags`` (``uint64``, data then
    ready flags), ``state`` (the SM kernel's per-block call counters, on the device),
    ``chunks``, ``chunk``, ``kernel``, ``epoch`` (calls issued from the host; graph replays are
    counted on the device only).

    The constructor is collective (see the module docstring); ``__call__`` is too, in the
    sense that every rank must make the same sequence of calls. 0.1.0 spellings
    (``shard_shape=``, ``engine=``, a positional ``world_size``) work with a warning.
    """

    ALGORITHMS = ALGORITHMS
    torch_reference = staticmethod(_reference)

    @accepts_0_1_init(positional=("world_size",), renamed={"shard_shape": "shape", "engine": "algorithm"})
    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "sm", "copy"] = "sm",
                 group=None, threads: int = 512, max_blocks: Optional[int] = None,
                 min_chunk_bytes: int = MIN_CHUNK_BYTES, target=None):
        self._setup(allocator, shape, dtype, world_size, group, threads, max_blocks, algorithm=algorithm,
                    target=target, min_chunk_bytes=min_chunk_bytes)
        if algorithm == "auto":
            algorithm = choose_engine(self.world_size * self.shard_numel * self.itemsize, self.world_size)
        self.algorithm = algorithm

        # ---- symmetric buffers (same order on every rank)
        self.input = self._tensor(self.shape)
        self.peer_outputs = self._tensor((self.world_size, *self.shape), return_peers=True)
        self.output = self.peer_outputs[self.rank]
        self._make_flags()
        # copy engine: ready[p] and data[p] words (uint32), written by rank p through its mapping
        self.peer_copy_flags = self._tensor((2, self.world_size), torch.int32, return_peers=True)
        self.copy_flags = self.peer_copy_flags[self.rank]
        self.copy_flags.zero_()
        self._side = None

        # ---- one rank-agnostic kernel, compiled once per host; flags zero everywhere after
        self._finish_build(lambda: build_allgather_kernel(self.shard_numel, _DTYPES[self.dtype], self.world_size,
                                                          self.chunks, self.chunk, threads), target)

    @property
    def engine(self) -> str:
        """The 0.1.0 name of :attr:`algorithm`."""
        return self.algorithm

    # ------------------------------------------------------------------ calls
    INPUT_SHAPE_NAME = "the shard shape"

    @accepts_0_1_out(1)
    def __call__(self, input: torch.Tensor, *out_0_1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Gather ``input`` (this rank's shard, ``shape``) from every rank; returns
        ``self.output``, ``(world_size, *shape)`` (overwritten by the next call), or ``out`` (a
        contiguous tensor of that shape and dtype) holding a copy of it; complete when the
        call's work finishes on the current stream. Every rank must make the same sequence
        of calls (eagerly or in CUDA graph replays). Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        if out_0_1:  # the 0.1.0 spelling
            out = positional_out(self, 1, out_0_1, out)
        return self._call(input, out)

    _BUFFERS = ("input", "output", "flags", "state", "peer_outputs", "copy_flags", "peer_copy_flags",
                "_flat_output")

    def _launch(self, input: torch.Tensor, keep: bool = False) -> None:
        if self.algorithm == "copy":
            self._copy_engines(input)  # stream operations and copies: never relaunched as a kernel
        else:
            super()._launch(input, keep)

    def _copy_engines(self, input: torch.Tensor) -> None:
        """One call on the copy engines (see "Engines" in the module docstring)."""
        from tilescale_host.signals import set_signal

        stream = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        me = self.rank
        peers = [p for p in range(self.world_size) if p != me]
        for p in peers:  # my output slot for p is free for this call
            set_signal(self.peer_copy_flags[p][0, me:me + 1], 1, stream)
        self._wait_and_reset(0, peers, stream)
        self._side.wait_stream(stream)
        with torch.cuda.stream(self._side):
            self.output[me].copy_(input)
        for p in peers:  # into rank p's output, row me, through the peer mapping
            self.peer_outputs[p][me].copy_(input)
        for p in peers:  # the stream write orders the copies before the flag
            set_signal(self.peer_copy_flags[p][1, me:me + 1], 1, stream)
        self._wait_and_reset(1, peers, stream)
        stream.wait_stream(self._side)

    def _wait_and_reset(self, row: int, peers, stream) -> None:
        """Wait until every peer has set its flag of ``row`` (0: ready, 1: data) here to 1,
        then reset it to 0 for the next call (no peer can set it again before: see
        "Engines")."""
        from tilescale_host.signals import set_signal, stream_wait_eq

        for p in peers:
            stream_wait_eq(self.copy_flags[row, p:p + 1], 1, stream)
            set_signal(self.copy_flags[row, p:p + 1], 0, stream)
