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
* **SPAllGatherAttention** (:class:`EmulatedSPAllGatherAttention`): the fused algorithm, its
  K and V pushes through pinned host memory as the all-gather's; its kernels read no table.

The emulated ranks share one compiled kernel per op, and a kernel's metadata table (its rank
and the peers' bases) is a global of its module. So the kernels that read the table run on
one *compute stream* shared by the ranks, in rank order, each after binding its rank's table
there (stream-ordered): the AllGatherGEMM peer GEMMs, the GemmReduceScatter GEMMs. The own
GEMMs, pushes, waits, reductions and attention kernels of every rank run concurrently on the
ranks' streams.

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
from tilescale_examples.overlap.stream_ops import CopyEnginePush
from tilescale_examples.sequence.sp_attention import SPAllGatherAttention

__all__ = ["HostStagedPush", "EmulatedAllGatherGEMM", "EmulatedGemmReduceScatter", "EmulatedSPAllGatherAttention",
           "EmulatedOverlap", "OPS", "staged_steps", "precompile_jobs"]


def staged_steps(ops: Sequence[tuple], a_ptr: int, stage_ptr: int, world_size: int) -> list:
    """The host-staged form of :meth:`CopyEnginePush.ops` (``(j, dst, src, nbytes, flag)``,
    chunk by chunk, peers ``j = 1 .. world_size - 1`` within a chunk), in enqueue order:

    * ``("stage", c, stage, src, nbytes)``: chunk ``c`` device to host, from ``src`` to
      ``stage`` (the same offset from ``stage_ptr`` as ``src`` from ``a_ptr``), once per chunk,
      before the chunk's pushes;
    * ``("push", c, j, dst, stage, nbytes, flag)``: on side stream ``j - 1``, after chunk
      ``c`` is staged: host to device from ``stage`` to ``dst``, then 1 into ``flag``.

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
    memory, for emulated peers on one GPU: the same claims and releases, and the copies of
    :func:`staged_steps`. The device-to-host copies run on a staging stream of their own (a
    CUDA event per chunk releases its pushes), the host-to-device copies and flag writes on
    the side streams, so both directions of the link and every peer's copies proceed at once.
    The pinned buffer (``m_local`` rows) is made at the first call; the next call's staging
    starts only after this call's pushes (its side streams follow the caller's stream, which
    :meth:`finish` made wait)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._staging = self._stager = self._staged = None

    def mark(self, after) -> None:
        super().mark(after)
        if self._stager is None:
            self._staging = torch.empty(self.m_local * self.row_bytes, dtype=torch.uint8, pin_memory=True)
            self._stager = torch.cuda.Stream(device=self.device)
            self._staged = [torch.cuda.Event() for _ in self.chunks]

    def _copy(self, drv, check, a_ptr: int) -> None:
        """:func:`staged_steps` of the call (after :meth:`mark`'s point and the claims)."""
        self._stager.wait_event(self._start)
        handles = [s.cuda_stream for s in self.streams]
        stager = self._stager.cuda_stream
        for step in staged_steps(self.ops(a_ptr), a_ptr, self._staging.data_ptr(), self.world_size):
            if step[0] == "stage":
                _, c, stage, src, nbytes = step
                check(drv.cuMemcpyAsync(stage, src, nbytes, stager), "cuMemcpyAsync")
                self._staged[c].record(self._stager)
            else:
                _, c, j, dst, stage, nbytes, flag = step
                self.streams[j - 1].wait_event(self._staged[c])
                self._copy_then_set(drv, check, handles[j - 1], dst, stage, nbytes, flag)


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

    def call_steps(self, a, b, out) -> tuple:
        """A call on the current stream as its four steps (``start``, ``push``, ``peers``,
        ``join``: :meth:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM._fused_steps`),
        the arguments checked first."""
        output = self._check_call(a, b, out)
        main = self._begin_call()
        start, push, peers, join = self._fused_steps(a, b, main, output)

        def join_call():
            join()
            self._end_call(main)

        return start, push, peers, join_call

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


class EmulatedSPAllGatherAttention(SPAllGatherAttention):
    """:class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention` with the fused
    algorithm on an emulated rank: its K and V pushes through pinned host memory
    (:class:`HostStagedPush`). ``compute`` is accepted for symmetry and unused (the fused
    kernels read no table). The other arguments are SPAllGatherAttention's."""

    _AUTO_PROBES = ()  # always the fused algorithm: heap_bytes is its

    def __init__(self, allocator, *args, compute=None, **kwargs):
        del compute
        super().__init__(allocator, *args, algorithm="fused", **kwargs)

    def _make_push(self, gathered: list, flags: list, free: list, rows: int) -> CopyEnginePush:
        return HostStagedPush(gathered, flags, free, self.rank, self.world_size, [(0, 1)], rows, self.device)

    def call_steps(self, q, k, v, out, lse) -> tuple:
        """A call on the current stream as its four steps (``start``, ``push``, ``peers``,
        ``join``: :meth:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention._fused_steps`),
        the arguments checked first."""
        out, lse = self._begin_call(q, k, v, out, lse)
        return self._fused_steps(q, k, v, out, lse)


#: op name -> emulated class.
OPS = {"ag_gemm": EmulatedAllGatherGEMM, "gemm_rs": EmulatedGemmReduceScatter,
       "sp_attention": EmulatedSPAllGatherAttention}


class EmulatedOverlap:
    """``ranks`` emulated ranks of one op's fused plan on one GPU.

    Args:
        op: ``"ag_gemm"``, ``"gemm_rs"`` or ``"sp_attention"`` (:data:`OPS`).
        ranks: emulated world size (>= 2).
        args: the op's constructor arguments after the allocator: ``m_local, k, n, dtype``
            (the GEMMs), ``batch, seq_local, heads, kv_heads, head_dim, dtype`` (attention).
        device: the CUDA device (keyword).
        kwargs: the op's keywords (tiles, ``max_chunks``, ``causal``, ...).

    Attributes: ``peers``, ``ops`` (rank order), ``streams`` (one per rank), ``compute`` (the
    shared stream of the table-reading kernels). Close with :meth:`close` (or ``with``).
    """

    def __init__(self, op: str, ranks: int, *args, device, **kwargs):
        from tilescale_examples.testing.emulated import ALIGNMENT, EmulatedPeers

        if op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
            raise ValueError(f"ranks must be an int >= 2 (one rank has no peer to emulate), got {ranks!r}")
        cls = OPS[op]
        self.op, self.device = op, torch.device(device)
        region = cls.heap_bytes(*args, world_size=ranks, device=self.device, **kwargs) + ALIGNMENT
        self.peers = EmulatedPeers(ranks, region, self.device)
        self.ops = []
        try:
            self.compute = torch.cuda.Stream(device=self.device)
            self.streams = [torch.cuda.Stream(device=self.device) for _ in range(ranks)]
            for r in range(ranks):
                self.ops.append(cls(self.peers.rank(r), *args, compute=self.compute, **kwargs))
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        """The emulated world size."""
        return len(self.streams)

    def round(self, inputs: Sequence[tuple], outs: Sequence, delay: Optional[tuple] = None) -> None:
        """One call of every emulated rank, forked from and joined into the current stream.

        Args:
            inputs: per rank (rank order), the op's call arguments: ``(a, b)``, or ``(q, k, v)``.
            outs: per rank, what the call writes: the ``out`` tensor, or ``(out, lse)``.
            delay: ``(rank, cycles)``: a busy kernel of ``cycles`` clock cycles
                (``torch.cuda._sleep``) ahead of that rank's call, on its stream (it delays
                its kernels and pushes) or, for GemmReduceScatter, on the compute stream
                (it delays its GEMM and the later ranks').
        """
        if len(inputs) != self.ranks or len(outs) != self.ranks:
            raise ValueError(f"need one input and one output per emulated rank ({self.ranks}), "
                             f"got {len(inputs)} and {len(outs)}")
        current = torch.cuda.current_stream(self.device)
        for s in (self.compute, *self.streams):
            s.wait_stream(current)
        if self.op == "gemm_rs":
            self._reduce_scatter_round(inputs, outs, delay)
        else:
            self._stepped_round(inputs, outs, delay)
        for s in (self.compute, *self.streams):
            current.wait_stream(s)

    def _stepped_round(self, inputs, outs, delay) -> None:
        """AllGatherGEMM and SPAllGatherAttention: every rank's call split in its steps
        (``call_steps``: start, push, peers, join), each step of every rank enqueued before
        the next step. In this order every wait (a stream's wait for another, a flag wait,
        a kernel or table copy queued after a spinning kernel) is enqueued after the work it
        waits for. Made rank by rank, rank ``r``'s waits came before rank ``r + 1``'s
        pushes: a wait at the head of a hardware queue the streams share holds back
        everything behind it, and a host call that waits for its stream (a copy from
        pageable memory) holds back the host, so that order could wait forever."""
        steps = []
        for r, (op, args, out) in enumerate(zip(self.ops, inputs, outs)):
            with torch.cuda.stream(self.streams[r]):
                _maybe_delay(delay, r)
                steps.append(op.call_steps(*args, *(out if isinstance(out, tuple) else (out,))))
        for step in range(4):
            for r, rank_steps in enumerate(steps):
                with torch.cuda.stream(self.streams[r]):
                    rank_steps[step]()

    def _reduce_scatter_round(self, inputs, outs, delay) -> None:
        """Every rank's GEMM in rank order on the compute stream (its table bound there), then
        each rank's waits and reduction on its own stream."""
        for r, (op, (a, b)) in enumerate(zip(self.ops, inputs)):
            op._check_call(a, b, outs[r])
            with torch.cuda.stream(self.compute):
                _maybe_delay(delay, r)
                op.epoch += 1
                op._send_partials(a, b)
        for r, op in enumerate(self.ops):
            with torch.cuda.stream(self.streams[r]):
                op._reduce_landed(self.streams[r], outs[r])

    def random_inputs(self, seed: int) -> list:
        """Per rank, fresh call arguments on the device from ``seed``: the GEMMs' ``a`` standard
        normal and ``b`` scaled by ``k ** -0.5`` (outputs about N(0, 1) per rank); attention's
        ``q``, ``k``, ``v`` standard normal."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        op = self.ops[0]

        def randn(shape, scale=1.0):
            return (torch.randn(shape, generator=g, device=self.device) * scale).to(op.dtype)

        if self.op == "sp_attention":
            return [(randn(op.q_shape), randn(op.kv_shape), randn(op.kv_shape)) for _ in self.ops]
        rows = op.m_local if self.op == "ag_gemm" else op.world_size * op.m_local
        return [(randn((rows, op.k)), randn((op.k, op.n), op.k ** -0.5)) for _ in self.ops]

    def empty_outputs(self) -> list:
        """Per rank, uninitialised tensors for :meth:`round`'s ``outs``."""
        op = self.ops[0]

        def empty(shape, dtype=op.dtype):
            return torch.empty(shape, dtype=dtype, device=self.device)

        if self.op == "sp_attention":
            return [(empty(op.q_shape), empty(op.lse.shape, torch.float32)) for _ in self.ops]
        shape = (op.world_size * op.m_local, op.n) if self.op == "ag_gemm" else (op.m_local, op.n)
        return [empty(shape) for _ in self.ops]

    def check(self, inputs: Sequence[tuple], outs: Sequence) -> list:
        """Failure messages for the outputs ``outs`` of a round on ``inputs`` (none when every
        rank's output is right): the GEMMs against the float32 reference within
        :func:`~tilescale_examples.overlap.gemm.error_bound`; attention's output and LSE
        within 2e-2 and 1e-3 (absolute and relative) of the float32 reference."""
        from tilescale_examples.overlap.gemm import count_outside
        from tilescale_examples.overlap.gemm_rs import partial_magnitudes

        failures, op0 = [], self.ops[0]
        for r, out in enumerate(outs):
            where = f"{self.op} N={self.ranks} rank {r}"
            if self.op == "sp_attention":
                want_o, want_lse = op0.torch_reference(inputs, r, op0.causal, op0.order)
                if not torch.allclose(out[0].float(), want_o, atol=2e-2, rtol=2e-2):
                    failures.append(f"{where}: output differs (worst {(out[0].float() - want_o).abs().max():.3g})")
                if not torch.allclose(out[1], want_lse, atol=1e-3, rtol=1e-3):
                    failures.append(f"{where}: lse differs")
                continue
            rounded = None if self.op == "ag_gemm" else partial_magnitudes([a for a, _ in inputs],
                                                                           [b for _, b in inputs], r)
            bad, worst = count_outside(out, op0.torch_reference(inputs, r), out.dtype, rounded)
            if bad:
                failures.append(f"{where}: {bad} element(s) outside the bound (worst {worst:.3g} x the bound)")
        return failures

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


def precompile_jobs(op: str, ranks: int, *args, max_chunks: int = 8, causal: bool = True,
                    order: str = "contiguous") -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of the kernels
    :class:`EmulatedOverlap` builds with the default tiles: ``args`` are the op's sizes with the
    dtype as a name (``m_local, k, n, "bfloat16"``; attention: ``batch, seq_local, heads,
    kv_heads, head_dim, "bfloat16"``, with ``causal`` and ``order``). The GEMMs' jobs include
    the op's GEMM of the whole operand (``ranks * m_local`` rows) that the benchmark compares
    with."""
    from tilescale_examples.overlap.gemm import GemmTiles, default_store
    from tilescale_examples.overlap.stream_ops import plan_row_chunks

    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if op == "sp_attention":
        from tilescale_examples.sequence.flash_attention import DEFAULT_PIPELINE, TILE_OPTIONS, default_tiles

        batch, seq_local, heads, kv_heads, head_dim, dtype = args
        pipeline = DEFAULT_PIPELINE  # SPAllGatherAttention's
        tiles = default_tiles(head_dim, pipeline)
        sizes = (batch, seq_local, heads, kv_heads, head_dim, causal, head_dim ** -0.5, dtype,
                 *(tiles[name] for name in TILE_OPTIONS))
        module = "tilescale_examples.sequence.sp_attention"
        return [(f"{module}:build_sp_own_attention_kernel", (*sizes, pipeline), None),
                (f"{module}:build_sp_peer_attention_kernel", (ranks, *sizes, order, pipeline), None)]
    m_local, k, n, dtype = args
    gemm, store = "tilescale_examples.overlap.gemm:build_gemm_kernel", default_store(GemmTiles())  # the ops' epilogue
    jobs = [(gemm, (ranks * m_local, n, k, dtype, None, store), None)]
    if op == "ag_gemm":
        chunks = len(plan_row_chunks(m_local // GemmTiles().block_m, max_chunks))
        peer = "tilescale_examples.overlap.ag_gemm:build_ag_gemm_kernel"
        return jobs + [(peer, (m_local, k, n, ranks, chunks, dtype, None, store), None),
                       (gemm, (m_local, n, k, dtype, None, store), None)]
    return jobs + [("tilescale_examples.overlap.gemm_rs:build_gemm_rs_kernel", (m_local, k, n, ranks, dtype), None),
                   ("tilescale_examples.overlap.gemm_rs:build_reduce_kernel", (m_local, n, ranks, dtype), None)]


def _maybe_delay(delay: Optional[tuple], rank: int) -> None:
    """A busy kernel of ``delay[1]`` cycles on the current stream when ``delay[0] == rank``."""
    if delay is not None and delay[0] == rank and delay[1] > 0:
        torch.cuda._sleep(int(delay[1]))
