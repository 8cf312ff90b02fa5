"""Stream-ordered communication for the overlapped GEMMs: copy-engine pushes with flag
writes, and waits on counters, all enqueued from the host (CUDA driver stream memory
operations), so that no streaming multiprocessor (SM) is spent or held.

* :class:`CopyEnginePush`: the all-gather producer of
  :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` and of
  :class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`'s fused algorithm.
  For every row chunk of this rank's operand and every other rank ``p`` it enqueues
  ``cuMemcpyAsync`` into ``p``'s gathered buffer through the heap's peer mapping, then
  ``cuStreamWriteValue64`` of 1 into the chunk's flag on ``p``; the consumer releases the rows
  (flags back to 0, the producer's *free* flag to 1) before the next call's copies may start.
  Copies and flag operations run on the copy engines and the stream front end: they progress
  whatever the SMs are doing, which is what makes a GEMM that spins on those flags
  deadlock-free; the values are constants, so a call captured in a CUDA graph replays.
* :func:`wait_counter_geq`: ``cuStreamWaitValue32`` with ``GEQ`` (wrap-safe 32-bit compare)
  on a counter that kernels of other ranks increment; work enqueued later on the stream
  starts only when the counter has reached the value.
* :func:`stream_ops_available`: whether the device supports these operations.
* :func:`plan_row_chunks`: how a shard's row blocks are cut into chunks (growing sizes).
* :func:`choose_plan` / :func:`resolve_plan`: ``"fused"`` when every rank's device supports
  these operations, else (for ``algorithm="auto"``) the ``"sequential"`` fallback with a log line.
* :class:`CallOrder`: keeps an object's calls in one stream order when the caller switches
  streams between calls.
* :func:`peer_views`: every rank's view of a symmetric tensor, as a list.

The driver calls go through :mod:`tilescale_host.cuda` (checked: a failure raises
``CudaError`` naming the call).
"""

from __future__ import annotations

import logging
from typing import Sequence

__all__ = ["log", "PLANS", "stream_ops_available", "ranks_share_a_gpu", "choose_plan", "resolve_plan", "plan_row_chunks",
           "CopyEnginePush", "CallOrder", "wait_counter_geq", "peer_views"]

#: Logger of the examples (the plans' fallback notices go here, at WARNING).
log = logging.getLogger("tilescale_examples")


def stream_ops_available(device) -> tuple:
    """``(ok, reason)``: whether ``device`` (a ``torch.device``) supports 64-bit stream memory
    operations (``CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS``); never raises."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device} is not a CUDA device"
    try:
        from tilescale_host import cuda

        index = device.index if device.index is not None else torch.cuda.current_device()
        if not cuda.device_attribute("CAN_USE_64_BIT_STREAM_MEM_OPS", index):
            return False, f"cuda:{index} reports no 64-bit stream memory operations"
    except Exception as exc:  # no driver, no cuda-python, an old enum
        return False, f"stream memory operations could not be queried: {exc}"
    return True, f"cuda:{index} supports 64-bit stream memory operations"


def ranks_share_a_gpu(device, group=None, world_size: int = 1) -> bool:
    """Whether two ranks of ``group`` run on one physical GPU (their devices' UUIDs agree).
    Collective over ``group`` when ``world_size > 1``; ``False`` for one rank.

    Why it matters: a device-to-device ``cuMemcpyAsync`` whose source and destination are on
    the same GPU may be carried out by a copy kernel on the SMs rather than by a copy engine,
    and then a kernel that spins on every SM waiting for that copy never sees it."""
    import torch

    if world_size <= 1 or group is None:
        return False
    import torch.distributed as dist

    device = torch.device(device)
    mine = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else f"host:{device}"
    # a fixed-size byte tensor on the backend's device: object collectives pick a device of
    # their own, which a gloo group given CUDA tensors rejects
    from tilescale_examples.base import collective_device

    raw = mine.encode()[:64].ljust(64, b"\0")
    local = torch.tensor(list(raw), dtype=torch.uint8, device=collective_device(group, device))
    every = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(every, local, group=group)
    uuids = {bytes(t.cpu().tolist()) for t in every}
    return len(uuids) < world_size


#: Values of the overlapped GEMMs' ``algorithm`` argument (``plan`` in 0.1.0).
PLANS = ("auto", "fused", "sequential")


def choose_plan(requested: str, available: bool, reason: str = "") -> tuple:
    """``(plan, reason)`` for a ``requested`` plan (one of :data:`PLANS`) given whether stream
    memory operations are ``available`` on every rank (``reason`` says why or why not).

    ``"sequential"`` is always honoured; ``"fused"`` needs the operations (``RuntimeError``
    otherwise); ``"auto"`` is ``"fused"`` when they are available, else ``"sequential"``.
    Pure: no device access."""
    if requested not in PLANS:
        raise ValueError(f"algorithm must be one of {PLANS}, got {requested!r}")
    if requested == "sequential":
        return "sequential", "requested"
    if available:
        return "fused", reason
    if requested == "fused":
        raise RuntimeError(f"algorithm='fused' needs stream memory operations on every rank: {reason}")
    return "sequential", reason


def resolve_plan(owner: str, requested: str, device, group=None, world_size: int = 1,
                 needs_own_gpus: bool = False) -> tuple:
    """:func:`choose_plan` with availability probed on ``device`` and agreed over ``group``
    (collective when ``world_size > 1`` and ``requested`` is not ``"sequential"``: the ranks
    must allocate the same buffers). ``needs_own_gpus``: the fused plan waits on SMs for
    device-to-device copies, so it is unavailable when ranks share a GPU
    (:func:`ranks_share_a_gpu`). Logs a WARNING when ``"auto"`` falls back."""
    from tilescale_examples.base import all_ranks_agree

    if requested not in PLANS:
        raise ValueError(f"algorithm must be one of {PLANS}, got {requested!r}")
    if requested == "sequential":
        return choose_plan(requested, False)
    ok, reason = stream_ops_available(device)
    if world_size > 1:
        agreed = all_ranks_agree(ok, group, device)
        if ok and not agreed:
            reason = "another rank's device has no 64-bit stream memory operations"
        ok = agreed
        if ok and needs_own_gpus and ranks_share_a_gpu(device, group, world_size):
            ok, reason = False, ("ranks share a GPU, where device-to-device copies may run on the SMs "
                                 "that the waiting GEMM holds")
    plan, reason = choose_plan(requested, ok, reason)
    if requested == "auto" and plan == "sequential":
        log.warning("%s: %s; using the sequential plan (the communication kernel, then the compute kernel: no "
                    "overlap)", owner, reason)
    return plan, reason


def plan_row_chunks(units: int, max_chunks: int = 8) -> list:
    """Cut ``units`` row blocks into at most ``max_chunks`` chunks ``(first_unit, n_units)``
    of growing size: 1, 2, 4, ... units, the last one taking the rest (a rest smaller than the
    chunk before joins it). The first chunk is small so that the first GEMM tiles start
    early; later chunks are large so that few copies (and host calls) are needed."""
    for name, value in (("units", units), ("max_chunks", max_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    sizes, size, left = [], 1, units
    while left:
        take = min(size, left)
        if len(sizes) == max_chunks - 1 or (sizes and left - take < take and left - take > 0):
            take = left  # the last chunk: everything left
        sizes.append(take)
        left -= take
        size *= 2
    chunks, first = [], 0
    for n in sizes:
        chunks.append((first, n))
        first += n
    return chunks


def peer_views(views, world_size: int) -> list:
    """``tilelang.tensor(..., return_peers=True)``'s result as a list of ``world_size`` views
    (index = rank); ``RuntimeError`` when the allocator returned another number."""
    views = list(views) if isinstance(views, (list, tuple)) else [views]
    if len(views) != world_size:
        raise RuntimeError(f"the allocator returned {len(views)} peer view(s) for {world_size} rank(s)")
    return views


def _driver():
    from tilescale_host import cuda

    return cuda.driver(), cuda.check


def wait_counter_geq(stream_handle: int, address: int, value: int) -> None:
    """Enqueue on the stream with raw handle ``stream_handle`` a wait until the 32-bit word at
    device ``address`` satisfies ``(int32)(word - value) >= 0`` (``cuStreamWaitValue32``,
    ``GEQ``: correct across wrap-around while the two are within 2**31)."""
    drv, check = _driver()
    check(drv.cuStreamWaitValue32(stream_handle, address, value & 0xFFFFFFFF,
                                  drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


class CopyEnginePush:
    """The copy-engine all-gather of a row-chunked ``(m_local, k)`` operand to the other ranks,
    with a handshake of constant flag values, so that a call captured in a CUDA graph replays
    correctly (nothing carries a call number from the host).

    Args:
        gathered: one view per rank (index = rank) of the symmetric ``(world_size, m_local,
            k)`` gathered buffer: slot ``src`` holds rank ``src``'s rows.
        flags: one view per rank of the symmetric ``uint64`` *ready* flags, ``(world_size *
            len(chunks),)``: ``flags[src * len(chunks) + c]`` on rank ``p`` is 1 while chunk
            ``c`` of ``src`` has landed on ``p`` and ``p`` has not released it.
        free: one view per rank of the symmetric ``uint64`` *free* flags, ``(world_size,)``,
            1 at construction: ``free[p]`` on rank ``q`` is 1 while ``q`` may push into its
            slot on ``p`` (``p`` has released ``q``'s previous rows).
        rank, world_size: this rank and the number of ranks (at least 2).
        chunks: ``[(first_unit, n_units), ...]`` (:func:`plan_row_chunks`) in units of
            ``block_m`` rows.
        block_m: rows per unit.
        device: the CUDA device of the views (the side streams are made at the first call).

    A call is :meth:`mark` (the point of the caller's stream the copies follow),
    :meth:`enqueue` (on one side stream per peer offset ``j``, peer ``(rank + j) %
    world_size``: wait until ``free[p]`` is 1 and set it to 0, then per chunk
    ``cuMemcpyAsync`` into ``p``'s slot ``rank`` and ``cuStreamWriteValue64`` of 1 into the
    chunk's flag on ``p``, fenced after the copy), the consumer's kernels, :meth:`release` on
    the caller's stream once they have read the rows (for every other rank ``src`` and chunk:
    wait until its flag is 1, set it to 0, then set ``free[rank]`` on ``src`` to 1), and
    :meth:`finish`. Every wait is in a stream's front end: no SM is held, and a copy never
    needs one. Rank ``q``'s copies of one call wait for ``p``'s release of the call before,
    which follows ``p``'s reads of it, so no copy overwrites rows a kernel still reads.
    """

    def __init__(self, gathered: Sequence, flags: Sequence, free: Sequence, rank: int, world_size: int,
                 chunks: Sequence, block_m: int, device):
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (one rank has no peer), got {world_size}")
        if not len(gathered) == len(flags) == len(free) == world_size:
            raise ValueError(f"need one gathered, one flags and one free view per rank ({world_size}), "
                             f"got {len(gathered)}, {len(flags)} and {len(free)}")
        w, self.m_local, k = gathered[rank].shape
        if w != world_size:
            raise ValueError(f"gathered has {w} rank slots, world_size is {world_size}")
        if sum(n for _, n in chunks) * block_m != self.m_local:
            raise ValueError(f"chunks {list(chunks)} of {block_m} rows do not cover m_local={self.m_local}")
        self.rank, self.world_size, self.chunks = rank, world_size, list(chunks)
        self.row_bytes = k * gathered[rank].element_size()
        self.block_m, self.device = block_m, device
        self._dst = [g.data_ptr() for g in gathered]
        self._flag = [f.data_ptr() for f in flags]
        self._free = [f.data_ptr() for f in free]
        self.streams = None

    def ops(self, a_ptr: int) -> list:
        """A call's copies in enqueue order: ``(j, dst, src, nbytes, flag)``: on side stream
        ``j - 1``, copy ``nbytes`` from ``src`` to ``dst``, then write 1 into the 8-byte
        ``flag`` (device addresses). Chunk by chunk, and within a chunk to ``rank + 1``,
        ``rank + 2``, ... (pure: no device access)."""
        W, me, C = self.world_size, self.rank, len(self.chunks)
        slot = me * self.m_local * self.row_bytes
        unit_bytes = self.block_m * self.row_bytes
        out = []
        for c, (first, n) in enumerate(self.chunks):
            offset = first * unit_bytes
            for j in range(1, W):
                p = (me + j) % W
                out.append((j, self._dst[p] + slot + offset, a_ptr + offset, n * unit_bytes,
                            self._flag[p] + 8 * (me * C + c)))
        return out

    def claims(self) -> list:
        """``(j, free)`` per side stream: before its copies, stream ``j - 1`` waits until the
        word at ``free`` (this rank's ``free[p]``, ``p = (rank + j) % world_size``) is 1, then
        sets it to 0 (pure)."""
        W, me = self.world_size, self.rank
        return [(j, self._free[me] + 8 * ((me + j) % W)) for j in range(1, W)]

    def releases(self) -> list:
        """``(flags, free)`` per other rank ``src`` (rank order): the addresses of ``src``'s
        ready flags on this rank, each waited for (1) and reset (0), then the word ``free``
        (``free[rank]`` on ``src``) set to 1 (pure)."""
        W, me, C = self.world_size, self.rank, len(self.chunks)
        return [([self._flag[me] + 8 * (src * C + c) for c in range(C)], self._free[src] + 8 * me)
                for src in range(W) if src != me]

    def mark(self, after) -> None:
        """The copies of the next :meth:`enqueue` follow everything enqueued on the stream
        ``after`` so far (the operand is written; this rank's previous calls are released)."""
        import torch

        if self.streams is None:
            self.streams = [torch.cuda.Stream(device=self.device) for _ in range(self.world_size - 1)]
            self._start = torch.cuda.Event()
            self._done = [torch.cuda.Event() for _ in self.streams]
        self._start.record(after)

    def enqueue(self, a_ptr: int) -> None:
        """Enqueue the :meth:`claims`, then the copies (:meth:`_copy`) on the side streams
        (after :meth:`mark`'s point)."""
        drv, check = _driver()
        for s in self.streams:
            s.wait_event(self._start)
        for j, free in self.claims():
            _take(drv, check, self.streams[j - 1].cuda_stream, free)
        self._copy(drv, check, a_ptr)

    def _copy(self, drv, check, a_ptr: int) -> None:
        """The copies and flag writes of :meth:`ops` on the side streams."""
        handles = [s.cuda_stream for s in self.streams]
        for j, dst, src, nbytes, flag in self.ops(a_ptr):
            self._copy_then_set(drv, check, handles[j - 1], dst, src, nbytes, flag)

    @staticmethod
    def _copy_then_set(drv, check, handle: int, dst: int, src: int, nbytes: int, flag: int) -> None:
        """Enqueue on the stream ``handle``: copy ``nbytes`` from ``src`` to ``dst``, then set
        the 64-bit ``flag`` to 1, fenced after the copy (the default write flag's memory
        barrier)."""
        check(drv.cuMemcpyAsync(dst, src, nbytes, handle), "cuMemcpyAsync")
        _write(drv, check, handle, flag, 1)

    def release(self, stream) -> None:
        """Enqueue :meth:`releases` on ``stream`` (the caller's), after the kernels that read
        the gathered rows: every other rank may then push its next call's rows."""
        drv, check = _driver()
        handle = stream.cuda_stream
        for flags, free in self.releases():
            for flag in flags:
                _take(drv, check, handle, flag)
            _write(drv, check, handle, free, 1)  # fenced: the resets before the peer sees free

    def finish(self, main) -> None:
        """Make ``main`` wait for the side streams: later work on ``main`` may overwrite the
        operand."""
        for s, done in zip(self.streams, self._done):
            done.record(s)
            main.wait_event(done)


def _take(drv, check, handle: int, address: int) -> None:
    """Enqueue on the stream ``handle``: wait until the 64-bit flag at ``address`` is 1 (a GEQ
    wait), then set it back to 0. The reset keeps the default fence: the driver's current
    stream memory operations refuse ``CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER``
    (``CUDA_ERROR_INVALID_VALUE``)."""
    check(drv.cuStreamWaitValue64(handle, address, 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue64")
    _write(drv, check, handle, address, 0)


def _write(drv, check, handle: int, address: int, value: int) -> None:
    """Enqueue on the stream ``handle`` a write of ``value`` into the 64-bit word at
    ``address``, after a memory fence over the stream's earlier work (the default write flag,
    the only one the driver's current stream memory operations accept)."""
    check(drv.cuStreamWriteValue64(handle, address, value, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64")


class CallOrder:
    """Orders each call of an instance after the previous one when the caller switches
    streams between calls (the double-buffering arguments assume one stream order):
    ``before(stream)`` makes ``stream`` wait for the previous call's ``after(stream)``."""

    def __init__(self):
        self._event = None
        self._stream = None

    def before(self, stream) -> None:
        if self._stream is not None and self._stream != stream.cuda_stream:
            stream.wait_event(self._event)

    def after(self, stream) -> None:
        import torch

        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(stream)
        self._stream = stream.cuda_stream
