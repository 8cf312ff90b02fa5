"""The overlapped GEMMs' fused plans on one GPU, with emulated peers.

Ranks sharing a GPU run :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM`'s sequential
plan (its fused plan waits on SMs for copies that, within one GPU, may themselves be SM
kernels). :class:`EmulatedOverlap` runs the fused plans anyway, in one process: ``N``
emulated ranks are ``N`` regions of one device buffer
(:class:`~tilescale_examples.testing.emulated.EmulatedPeers`), each rank's calls go on a stream
of its own (its "GPU's" stream), and every kernel and stream operation of the real multi-rank
call runs. The emulation keeps the real plans' property that a producer never needs an SM a
waiting consumer holds:

* **AllGatherGEMM** (:class:`EmulatedAllGatherGEMM`): the pushes go through pinned host
  memory (:class:`HostStagedPush`): each row chunk is copied device to host once into the
  rank's pinned staging buffer, then host to device into every peer's gathered slot, then its
  flag is written (``cuStreamWriteValue64``). Both copies are done by the copy engines (a
  same-device copy would be an SM kernel), over PCIe, which is slower than NVLink: the
  emulated copies are a pessimistic stand-in for the real ones.
* **GemmReduceScatter** (:class:`EmulatedGemmReduceScatter`): no copies; the GEMMs' remote
  epilogues store into the peers' regions (local HBM standing in for NVLink), each rank's
  stream waits for its counters and reduces.

The emulated ranks share one compiled kernel per op, and a kernel's metadata table (its rank
and the peers' bases) is a global of its module. So the kernels that read the table run on
one *compute stream* shared by the ranks, in rank order, each after binding its rank's table
there (stream-ordered): the AllGatherGEMM peer GEMMs, the GemmReduceScatter GEMMs. The own
GEMMs, pushes, waits and reductions of every rank run concurrently on the ranks' streams.

A round (:meth:`EmulatedOverlap.round`) is one call of every emulated rank, forked from and
joined into the caller's current stream, so it can be timed with events, held behind a
stream hold, or repeated back to back; a rank can be delayed (a busy kernel ahead of its
call) to play a straggler.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
from tilescale_examples.overlap.gemm_rs import GemmReduceScatter
from tilescale_examples.overlap.stream_ops import CopyEnginePush, _driver

__all__ = ["HostStagedPush", "EmulatedAllGatherGEMM", "EmulatedGemmReduceScatter", "EmulatedOverlap", "OPS",
           "staged_steps", "precompile_jobs"]


def staged_steps(ops: Sequence[tuple], a_ptr: int, stage_ptr: int, world_size: int) -> list:
    """The host-staged form of :meth:`CopyEnginePush.ops` (``(j, dst, src, nbytes, flag)``,
    chunk by chunk, peers ``j = 1 .. world_size - 1`` within a chunk), in enqueue order:

    * ``("stage", c, stage, src, nbytes)``: chunk ``c`` device to host, from ``src`` to
      ``stage`` (the same offset from ``stage_ptr`` as ``src`` from ``a_ptr``), once per chunk,
      before the chunk's pushes;
    * ``("push", c, j, dst, stage, nbytes, flag)``: on side stream ``j - 1``, after chunk
      ``c`` is staged: host to device from ``stage`` to ``dst``, then the flag write.

    Pure: no device access."""
    per = world_size - 1
    steps = []
    for i, (j, dst, src, nbytes, flag) in enumerate(ops):
        c, stage = i // per, stage_ptr + (src - a_ptr)
        if i % per == 0:
            steps.append(("stage", c, stage, src, nbytes))
        steps.append(("push", c, j, dst, stage, nbytes, flag))
    return steps


class HostStagedPush(CopyEnginePush):
    """:class:`~tilescale_examples.overlap.stream_ops.CopyEnginePush` through pinned host
    memory, for emulated peers on one GPU: :func:`staged_steps`. The device-to-host copies
    run on a staging stream of their own (a CUDA event per chunk releases its pushes), the
    host-to-device copies and flag writes on the side streams, so both directions of the
    link and every peer's copies proceed at once. The pinned buffer (``m_local`` rows) is
    made at the first call; the next call's staging starts only after this call's pushes
    (its side streams follow the caller's stream, which :meth:`finish` made wait)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._staging = self._stager = self._staged = None

    def mark(self, after) -> None:
        super().mark(after)
        if self._stager is None:
            self._staging = torch.empty(self.m_local * self.row_bytes, dtype=torch.uint8, pin_memory=True)
            self._stager = torch.cuda.Stream(device=self.device)
            self._staged = [torch.cuda.Event() for _ in self.chunks]

    def enqueue(self, a_ptr: int, epoch: int) -> None:
        """Enqueue :func:`staged_steps` of call ``epoch`` (after :meth:`mark`'s point)."""
        drv, check = _driver()
        memcpy, write = drv.cuMemcpyAsync, drv.cuStreamWriteValue64
        fence = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT  # orders the copy before the flag
        self._stager.wait_event(self._start)
        for s in self.streams:
            s.wait_event(self._start)
        handles = [s.cuda_stream for s in self.streams]
        stager = self._stager.cuda_stream
        for step in staged_steps(self.ops(a_ptr, epoch), a_ptr, self._staging.data_ptr(), self.world_size):
            if step[0] == "stage":
                _, c, stage, src, nbytes = step
                check(memcpy(stage, src, nbytes, stager), "cuMemcpyAsync")
                self._staged[c].record(self._stager)
            else:
                _, c, j, dst, stage, nbytes, flag = step
                self.streams[j - 1].wait_event(self._staged[c])
                check(memcpy(dst, stage, nbytes, handles[j - 1]), "cuMemcpyAsync")
                check(write(handles[j - 1], flag, epoch, fence), "cuStreamWriteValue64")


class EmulatedAllGatherGEMM(AllGatherGEMM):
    """:class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` with the fused plan on an
    emulated rank: pushes through pinned host memory (:class:`HostStagedPush`) and the peer
    GEMM on ``compute`` (a stream shared by the emulated ranks; None: a stream of its own).
    The other arguments are AllGatherGEMM's (``algorithm`` is ``"fused"``)."""

    _AUTO_PROBES = ()  # always the fused plan: heap_bytes is that plan's

    def __init__(self, allocator, m_local: int, k: int, n: int, dtype, *, compute=None, **kwargs):
        self._shared_compute = compute
        super().__init__(allocator, m_local, k, n, dtype, algorithm="fused", **kwargs)

    def _make_push(self) -> CopyEnginePush:
        return HostStagedPush(*self._peers, self.rank, self.world_size, self.chunks, self.tiles.block_m, self.device)

    def _make_compute_stream(self):
        return self._shared_compute if self._shared_compute is not None else super()._make_compute_stream()


class EmulatedGemmReduceScatter(GemmReduceScatter):
    """:class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter` with the fused plan on an
    emulated rank (``compute`` is accepted for symmetry with :class:`EmulatedAllGatherGEMM`;
    :meth:`EmulatedOverlap.round` runs the GEMMs on its shared stream)."""

    _AUTO_PROBES = ()  # always the fused plan: heap_bytes is that plan's

    def __init__(self, allocator, m_local: int, k: int, n: int, dtype, *, compute=None, **kwargs):
        del compute
        super().__init__(allocator, m_local, k, n, dtype, algorithm="fused", **kwargs)


#: op name -> emulated class.
OPS = {"ag_gemm": EmulatedAllGatherGEMM, "gemm_rs": EmulatedGemmReduceScatter}


class EmulatedOverlap:
    """``ranks`` emulated ranks of one overlapped GEMM's fused plan on one GPU.

    Args:
        op: ``"ag_gemm"`` or ``"gemm_rs"`` (:data:`OPS`).
        ranks: emulated world size (>= 2).
        m_local, k, n, dtype: the op's sizes and dtype (as its constructor's).
        device: the CUDA device.
        tiles: the op's tile and chunk keywords (``block_m``, ..., ``max_chunks``).

    Attributes: ``peers``, ``ops`` (rank order), ``streams`` (one per rank), ``compute`` (the
    shared stream of the table-reading kernels). Close with :meth:`close` (or ``with``).
    """

    def __init__(self, op: str, ranks: int, m_local: int, k: int, n: int, dtype, device, **tiles):
        from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers

        if op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
            raise ValueError(f"ranks must be an int >= 2 (one rank has no peer to emulate), got {ranks!r}")
        cls = OPS[op]
        self.op, self.device = op, torch.device(device)
        region = cls.heap_bytes(m_local, k, n, dtype, world_size=ranks, device=self.device, **tiles) + ALIGNMENT
        self.peers = EmulatedPeers(ranks, region, self.device)
        self.ops = []
        try:
            self.compute = torch.cuda.Stream(device=self.device)
            self.streams = [torch.cuda.Stream(device=self.device) for _ in range(ranks)]
            for r in range(ranks):
                self.ops.append(cls(self.peers.rank(r), m_local, k, n, dtype, compute=self.compute, **tiles))
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        """The emulated world size."""
        return len(self.streams)

    def round(self, inputs: Sequence[tuple], outs: Sequence[torch.Tensor], delay: Optional[tuple] = None) -> None:
        """One call of every emulated rank, forked from and joined into the current stream.

        Args:
            inputs: ``(a, b)`` per rank (rank order), the op's call arguments.
            outs: per rank, the tensor the call writes (the op's ``out``).
            delay: ``(rank, cycles)``: a busy kernel of ``cycles`` clock cycles
                (``torch.cuda._sleep``) ahead of that rank's call, on its stream
                (AllGatherGEMM: delays its GEMM and pushes) or on the compute stream
                (GemmReduceScatter: delays its GEMM and the later ranks').
        """
        if len(inputs) != self.ranks or len(outs) != self.ranks:
            raise ValueError(f"need one input pair and one output per emulated rank ({self.ranks}), "
                             f"got {len(inputs)} and {len(outs)}")
        current = torch.cuda.current_stream(self.device)
        for s in (self.compute, *self.streams):
            s.wait_stream(current)
        if self.op == "ag_gemm":
            for r, (op, (a, b), out) in enumerate(zip(self.ops, inputs, outs)):
                with torch.cuda.stream(self.streams[r]):
                    _maybe_delay(delay, r)
                    op(a, b, out=out)
        else:
            for r, (op, (a, b)) in enumerate(zip(self.ops, inputs)):
                op.check_inputs(a, b)
                op._check_out(outs[r], (op.m_local, op.n), "(m_local, n) =")
                with torch.cuda.stream(self.compute):
                    _maybe_delay(delay, r)
                    op.epoch += 1
                    op._send_partials(a, b)
            for r, op in enumerate(self.ops):
                with torch.cuda.stream(self.streams[r]):
                    op._reduce_landed(self.streams[r], outs[r])
        for s in (self.compute, *self.streams):
            current.wait_stream(s)

    def reference(self, inputs: Sequence[tuple], rank: int) -> torch.Tensor:
        """The float32 result of ``rank`` (the op's ``torch_reference``)."""
        return type(self.ops[0]).torch_reference(inputs, rank)

    def output_shape(self) -> tuple:
        """The shape of one rank's output."""
        op = self.ops[0]
        return (op.world_size * op.m_local, op.n) if self.op == "ag_gemm" else (op.m_local, op.n)

    def input_shapes(self) -> tuple:
        """``(a shape, b shape)`` of one rank's call."""
        op = self.ops[0]
        rows = op.m_local if self.op == "ag_gemm" else op.world_size * op.m_local
        return (rows, op.k), (op.k, op.n)

    def close(self) -> None:
        """Close every op, then the peers (idempotent)."""
        for op in self.ops:
            op.close()
        self.ops = []
        if self.peers is not None:
            self.peers.close()
            self.peers = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def precompile_jobs(op: str, ranks: int, m_local: int, k: int, n: int, dtype: str, max_chunks: int = 8) -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of the kernels
    :class:`EmulatedOverlap` ``(op, ranks, m_local, k, n)`` builds with the default tiles
    (``dtype`` a name, ``"bfloat16"``), plus the stock GEMM of the whole operand
    (``ranks * m_local`` rows) that the benchmarks compare with."""
    from tilescale_examples.overlap.gemm import GemmTiles
    from tilescale_examples.overlap.stream_ops import plan_row_chunks

    gemm = "tilescale_examples.overlap.gemm:build_gemm_kernel"
    jobs = [(gemm, (ranks * m_local, n, k, dtype), None)]
    if op == "ag_gemm":
        chunks = len(plan_row_chunks(m_local // GemmTiles().block_m, max_chunks))
        jobs += [("tilescale_examples.overlap.ag_gemm:build_ag_gemm_kernel", (m_local, k, n, ranks, chunks, dtype), None),
                 (gemm, (m_local, n, k, dtype), None)]
    elif op == "gemm_rs":
        jobs += [("tilescale_examples.overlap.gemm_rs:build_gemm_rs_kernel", (m_local, k, n, ranks, dtype), None),
                 ("tilescale_examples.overlap.gemm_rs:build_reduce_kernel", (m_local, n, ranks, dtype), None)]
    else:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    return jobs


def _maybe_delay(delay: Optional[tuple], rank: int) -> None:
    """A busy kernel of ``delay[1]`` cycles on the current stream when ``delay[0] == rank``."""
    if delay is not None and delay[0] == rank and delay[1] > 0:
        torch.cuda._sleep(int(delay[1]))
