"""Emulated peers: ``N`` ranks of the symmetric-heap model inside one process on one GPU.

The device code of a TileScale kernel reaches peer ``p`` through its metadata table
``[rank, num_ranks, base_0, ..., base_{N-1}]``: a peer address is ``ptr - base[rank] +
base[p]``. :class:`EmulatedPeers` cuts one device buffer into ``N`` equal *regions* and hands
out allocator stand-ins (:meth:`EmulatedPeers.rank`) whose table maps PE ``p`` to region ``p``.
A collective built on ``peers.rank(r)`` is emulated rank ``r``: the unchanged kernel runs,
with local HBM standing in for NVLink. Allocations follow the heap's contract (the same
sequence on every emulated rank gives the same offset in every region).

:func:`run_round` makes one call of every emulated rank, one after the other on one stream:
rank ``r``'s kernel runs alone on the GPU, so its time is one rank's share of the
collective's data movement. The peers are not running at the same time, so before a round
every flag is preset to a value above any epoch (:data:`PRESET`) and every wait passes at its
first poll; flags a kernel sets during the round (to the epoch) still satisfy the later
ranks' waits. Inputs must be in the symmetric buffers before the round (``c(c.input)``
calls), because rank 0 reads the buffers of ranks that have not run yet. This measures the
kernels' bytes per second; it does not measure flag latency between GPUs.

Emulated ranks can also run at the same time, one stream each, with real waits (no preset):
:func:`build_concurrent` gives every rank's op a compiled kernel of its own (a module, and so a
heap table, of its own), which the ranks' concurrent launches need; :func:`release_kernels`
undoes that once the ops are closed.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from tilescale_core.table import build_table

__all__ = ["EmulatedPeers", "EmulatedRank", "run_round", "build_concurrent", "release_kernels", "PRESET",
           "ALIGNMENT"]

#: Alignment of every allocation in a region (bytes), as the real heap's.
ALIGNMENT = 256
#: Flag value written before a round: above any epoch, so every ``wait_ge`` passes.
PRESET = 1 << 62


class EmulatedRank:
    """Allocator stand-in for emulated rank ``local_rank`` of an :class:`EmulatedPeers`:
    ``num_ranks``, ``local_rank``, ``device``, ``table`` (CPU uint64), ``closed`` and the
    ``tensor`` bump allocation of tilescale-core's allocator (in its region)."""

    def __init__(self, peers: "EmulatedPeers", rank: int):
        self.peers = peers
        self.local_rank = rank
        self.num_ranks = peers.num_ranks
        self.device = peers.device
        self.used = 0
        self.table = build_table(rank, peers.num_ranks, peers.bases)

    @property
    def closed(self) -> bool:
        """Whether the :class:`EmulatedPeers` was closed."""
        return self.peers.closed

    def tensor(self, shape, dtype, return_peers: bool = False):
        """Allocate ``shape`` of ``dtype`` at the next aligned offset of this rank's region;
        with ``return_peers`` the views of every emulated rank's copy (index = rank)."""
        if self.closed:
            raise RuntimeError("the emulated peers are closed")
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
        offset = -(-self.used // ALIGNMENT) * ALIGNMENT
        if offset + nbytes > self.peers.region_bytes:
            raise MemoryError(f"emulated rank {self.local_rank}: {nbytes} bytes at offset {offset} exceed the "
                              f"region of {self.peers.region_bytes} bytes (pass a larger region_bytes)")
        self.used = offset + nbytes
        views = [self.peers.view(r, offset, shape, dtype) for r in range(self.num_ranks)]
        return views if return_peers else views[self.local_rank]

    _allocate_tensor = tensor  # the name tilescale-core's allocator kept before tensor() was public


class EmulatedPeers:
    """``num_ranks`` regions of ``region_bytes`` bytes in one device buffer, one per
    emulated rank.

    Args:
        num_ranks: emulated ranks (>= 1).
        region_bytes: bytes per region (rounded up to :data:`ALIGNMENT`).
        device: a CUDA device (CPU works too, for tests of the bookkeeping).
    """

    def __init__(self, num_ranks: int, region_bytes: int, device="cuda"):
        for name, value in (("num_ranks", num_ranks), ("region_bytes", region_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_ranks = num_ranks
        self.region_bytes = -(-region_bytes // ALIGNMENT) * ALIGNMENT
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = torch.empty(num_ranks * self.region_bytes + ALIGNMENT, dtype=torch.uint8, device=self.device)
        start = (-self.buffer.data_ptr()) % ALIGNMENT
        self._start = start
        self.bases = [self.buffer.data_ptr() + start + r * self.region_bytes for r in range(num_ranks)]
        self._ranks = [EmulatedRank(self, r) for r in range(num_ranks)]
        self._closed = False

    def rank(self, r: int) -> EmulatedRank:
        """The allocator stand-in of emulated rank ``r``."""
        if not 0 <= r < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {r}")
        return self._ranks[r]

    def view(self, rank: int, offset: int, shape, dtype) -> torch.Tensor:
        """The tensor of ``shape`` and ``dtype`` at byte ``offset`` of region ``rank``."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = self._start + rank * self.region_bytes + offset
        return self.buffer[start:start + nbytes].view(dtype).view(shape)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the buffer (idempotent); collectives built on it must be closed first."""
        self._closed = True
        self.buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_round(collectives: Sequence, call: Optional[Callable] = None, events=None,
              preset: Optional[Callable] = None) -> list:
    """One call of every emulated rank's collective, rank 0 first, on the current stream.

    Presets every rank's flags to :data:`PRESET` (or calls ``preset(collectives)`` instead,
    for an op with waits that must stay real: see
    :func:`~tilescale_examples.benchmarks.gemm_allreduce.preset_peer_flags`), then for each
    rank ``r``: points the
    kernel's metadata table at rank ``r`` (``c.bind_table()``, stream-ordered: the ranks'
    collectives share one compiled kernel) and calls ``call(collective)`` (default
    ``c(c.input)``). With ``events`` (a list of ``(start,
    end)`` CUDA event pairs, one per rank) the kernel of rank ``r`` is bracketed by pair
    ``r``. Returns the calls' results.
    """
    call = call or (lambda c: c(c.input))
    if preset is not None:
        preset(collectives)
    else:
        for c in collectives:
            c.flags.view(torch.int64).fill_(PRESET)
    stream = torch.cuda.current_stream() if collectives[0].device.type == "cuda" else None
    results = []
    for r, c in enumerate(collectives):
        if c.allocator.local_rank != r:
            raise ValueError(f"collectives[{r}] is emulated rank {c.allocator.local_rank}; pass them in rank order")
        c.bind_table()
        if events is not None:
            events[r][0].record(stream)
        results.append(call(c))
        if events is not None:
            events[r][1].record(stream)
    return results


def build_concurrent(make: Callable[[int], object], num_ranks: int) -> tuple:
    """``(ops, kernels)``: ``make(r)`` (an op built on emulated rank ``r``) for every rank in
    rank order, each op's compiled kernel pinned to its own allocator before the next rank's op
    is built, so that op compiles a copy of its own (the same code under another symbol: a
    module and heap table of its own, compiled once per process and cached on disk). Ranks
    launched at once on several streams then never rebind a table another rank's kernel is
    reading. ``kernels``: what :func:`release_kernels` takes after the ops are closed."""
    from tilescale_examples.base import _PINNED

    ops, kernels = [], []
    for r in range(num_ranks):
        op = make(r)
        op.kernel.__dict__[_PINNED] = op.allocator
        ops.append(op)
        kernels.append(op.kernel)
    return ops, kernels


def release_kernels(kernels: Sequence) -> None:
    """Forget which allocators used ``kernels`` (from :func:`build_concurrent`, their ops
    closed), so that later ops take and bind them like fresh ones instead of compiling more
    copies."""
    from tilescale_examples.base import _PINNED, _REBIND, _USERS, KernelOwner

    for kernel in kernels:
        for attr in (_PINNED, _REBIND, _USERS, KernelOwner._TABLE_OWNER):
            kernel.__dict__.pop(attr, None)
