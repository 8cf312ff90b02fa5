"""Sequence-parallel attention by all-gathering K and V: each rank holds its shard of the sequence.

With ``W`` ranks and ``SP`` positions per rank, rank ``r`` holds positions ``[r SP, (r + 1) SP)``
of ``q (B, SP, H, D)``, ``k``, ``v (B, SP, Hkv, D)`` (the ``bshd`` layout) and gets its
queries' attention over the whole sequence::

    attn = SPAllGatherAttention(allocator, batch=B, seq_local=SP, heads=H, kv_heads=Hkv, head_dim=D,
                                dtype=torch.bfloat16, causal=True)
    o, lse = attn(q, k, v)      # o (B, SP, H, D), lse (B, H, SP) float32: this rank's queries
    attn.close()                # before allocator.close()

``causal`` masks by global position: query ``r SP + i`` sees keys up to itself.
``order="zigzag"`` gives rank ``r`` the chunks ``r`` and ``2 W - 1 - r`` of ``SP / 2`` positions
instead (:func:`positions`), so that every rank has the same causal work.

The fused algorithm (``algorithm="fused"``; ``"auto"`` takes it where every rank has a GPU of
its own with stream memory operations): the all-gather overlaps the attention of the rank's
own shard, as in
:class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM`.

1. The copy engines push ``k`` and ``v`` (one
   :class:`~tilescale_examples.overlap.stream_ops.CopyEnginePush` each, one side stream per
   peer) into slot ``rank`` of every peer's gathered ``(W, B, SP, Hkv, D)`` buffers, then set
   this rank's ready flag on the peer to 1 (once the peer has released the previous call's
   rows: the push's handshake of constant values).
2. Meanwhile the flash kernel attends this rank's queries to its own shard
   (:func:`build_sp_own_attention_kernel`, no communication), writing ``out`` and ``lse``.
3. Then :func:`build_sp_peer_attention_kernel` continues each row's online softmax from that
   result over the peers' key chunks that its queries see, each wholly visible (causal,
   contiguous: the shards before this rank's; zigzag: per chunk of queries, see the
   builder; otherwise every other shard). Thread 0 of each
   block first waits for the flags of the shards it reads; the copies it waits for run on
   copy engines, never on an SM that a waiting block holds. A causal rank 0 of the
   contiguous order reads no peer shard and skips it.
4. The caller's stream releases the gathered shards (flags back to 0, the producers' free
   flags to 1) and waits for this rank's copies.

It allocates the gathered buffers and flags instead of two all-gathers. Every flag value is a
constant, so a call captured in a CUDA graph replays correctly, mixed with eager calls. With
one rank it is the flash kernel alone.

The sequential algorithm (``"auto"`` where ranks share a GPU):
two :class:`~tilescale_examples.collectives.allgather.AllGather` calls (device-side call state:
back-to-back calls need no host synchronisation and a call can be captured in a CUDA graph),
then :func:`build_sp_attention_kernel`: the flash kernel's blocks reading the gathered
``(W, B, SP, Hkv, D)`` buffers in place, key tile ``t`` from rank ``t // (SP / block_n)``; a
causal block stops after its diagonal's tile (the rank's first position is a run-time
argument: every rank runs the same compiled kernel).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Literal, Optional, Sequence, Tuple, Union

import torch

from tilescale_examples.base import check_bool, check_positive_int, settle
from tilescale_examples.sequence._attention_op import AttentionOp
from tilescale_examples.sequence.flash_attention import (DEFAULT_PIPELINE, DTYPES, check_head_dim, check_pipeline,
                                                         check_scale, check_tiles, compile_options)
from tilescale_examples.sequence.sp_kernels import (build_sp_attention_kernel, build_sp_own_attention_kernel,
                                                    build_sp_peer_attention_kernel)
from tilescale_examples.sequence.flash_attention import torch_reference as attention_reference

__all__ = ["SPAllGatherAttention", "build_sp_attention_kernel", "build_sp_own_attention_kernel",
           "build_sp_peer_attention_kernel", "torch_reference", "positions", "ORDERS", "ALGORITHMS"]


#: Values of ``algorithm`` (see the module docstring).
ALGORITHMS = ("auto", "fused", "sequential")

#: Values of ``order``: how the sequence is split into the ranks' shards.
ORDERS = ("contiguous", "zigzag")


def positions(rank: int, world_size: int, seq_local: int, order: str = "contiguous") -> torch.Tensor:
    """The global positions of rank ``rank``'s ``seq_local`` rows: ``[r SP, (r + 1) SP)``
    (``"contiguous"``), or chunks ``r`` and ``2 W - 1 - r`` of ``SP / 2`` positions each
    (``"zigzag"``: every rank then has the same causal work)."""
    if order == "contiguous":
        return torch.arange(rank * seq_local, (rank + 1) * seq_local)
    c = seq_local // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)])


def torch_reference(inputs: Sequence[tuple], rank: int, causal: bool = True,
                    order: str = "contiguous") -> Tuple[torch.Tensor, torch.Tensor]:
    """What a call returns on ``rank`` in float32: ``inputs[p] = (q_p, k_p, v_p)``, rank ``p``'s
    shards (rows at :func:`positions`); ``rank``'s queries over the whole sequence (causal by
    global position): global attention, sliced."""
    world, SP = len(inputs), inputs[0][0].shape[1]
    full = []
    for i in range(3):
        x = inputs[0][i]
        t = x.new_empty((x.shape[0], world * SP, *x.shape[2:]))
        for p in range(world):
            t[:, positions(p, world, SP, order)] = inputs[p][i]
        full.append(t)
    o, lse = attention_reference(*full, causal=causal)
    mine = positions(rank, world, SP, order)
    return o[:, mine], lse[:, :, mine]


class SPAllGatherAttention(AttentionOp):
    """Sequence-parallel attention over K/V all-gathered from every rank (see the module
    docstring).

    Args:
        allocator: the distributed allocator (collective: every rank builds the same ops).
        batch, seq_local, heads, kv_heads, head_dim: this rank's ``q (batch, seq_local, heads,
            head_dim)`` and ``k``, ``v (batch, seq_local, kv_heads, head_dim)``; ``heads`` a
            multiple of ``kv_heads``; ``head_dim`` in
            :data:`~tilescale_examples.sequence.flash_attention.HEAD_DIMS`; ``seq_local`` a
            multiple of the tiles (``block_m``, ``block_n``).
        dtype: bfloat16 or float16.
        world_size, group: as every op (keyword-only).
        causal: mask by global position (default True).
        order: ``"contiguous"`` (rank ``r`` holds positions ``[r SP, (r + 1) SP)``) or
            ``"zigzag"`` (chunks ``r`` and ``2 W - 1 - r`` of ``SP / 2``: every rank has the
            same causal work; ``seq_local`` then a multiple of twice the tiles); see
            :func:`positions`.
        algorithm: ``"auto"``, ``"fused"`` (the all-gather on the copy engines, overlapped with
            the own shard's attention) or ``"sequential"`` (two all-gathers, then the kernel);
            see the module docstring. ``"auto"`` is fused where every rank has a GPU of its
            own with stream memory operations, else sequential (with a log line).
        scale: of the scores (default ``1 / sqrt(head_dim)``).
        fast_math: compile the attention kernels with nvcc's ``--use_fast_math`` (the default,
            as :func:`~tilescale_examples.sequence.flash_attention.flash_attention`'s);
            ``False``: IEEE exponentials and division.
        pipeline: the attention kernels' pipeline, ``"async"`` (the default) or ``"sync"``
            (as :func:`~tilescale_examples.sequence.flash_attention.flash_attention` takes it).
        tiles: ``block_m``, ``block_n``, ``num_stages``, ``threads`` (default
            :func:`~tilescale_examples.sequence.flash_attention.default_tiles` of the head
            dimension and ``pipeline``).

    Attributes: ``output``, ``lse`` (the default outputs), ``algorithm`` and
    ``algorithm_reason``, ``kernel``; fused: ``own_kernel``, ``gathered_k``, ``gathered_v``
    (this rank's ``(W, B, SP, Hkv, D)`` buffers), ``flags_k``, ``flags_v`` (ready),
    ``free_k``, ``free_v``; sequential:
    ``gather_k``, ``gather_v``.
    """

    ALGORITHMS = ALGORITHMS
    _AUTO_PROBES = ("fused", "sequential")
    _BUFFERS = ("gather_k", "gather_v", "output", "lse", "gathered_k", "gathered_v", "flags_k", "flags_v", "free_k",
                "free_v", "own_kernel", "_peers", "_push_k", "_push_v")
    Q_SHAPE_NAME, KV_SHAPE_NAME, LSE_SHAPE_NAME = "(B, seq_local, H, D) =", "(B, seq_local, Hkv, D) =", "(B, H, seq_local) ="

    def __init__(self, allocator, batch: int, seq_local: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: Union[torch.dtype, str], *, world_size: Optional[int] = None, group=None, causal: bool = True,
                 order: str = "contiguous", algorithm: Literal["auto", "fused", "sequential"] = "auto",
                 scale: Optional[float] = None, fast_math: bool = True, pipeline: str = DEFAULT_PIPELINE, target=None,
                 **tiles):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.fast_math = check_bool("fast_math", fast_math)
        self.pipeline = check_pipeline(pipeline)
        self._setup_op(allocator, dtype, world_size, group, tuple(DTYPES))
        self.batch, self.seq_local = check_positive_int("batch", batch), check_positive_int("seq_local", seq_local)
        self.heads, self.kv_heads = check_positive_int("heads", heads), check_positive_int("kv_heads", kv_heads)
        self.head_dim = check_head_dim(check_positive_int("head_dim", head_dim))
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
        self.tiles = check_tiles(tiles, head_dim, pipeline)
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        unit = 2 if order == "zigzag" else 1  # a zigzag shard is two chunks of whole tiles
        if seq_local % (unit * self.tiles["block_m"]) or seq_local % (unit * self.tiles["block_n"]):
            times = "" if unit == 1 else f"{unit} x "
            raise ValueError(f"seq_local={seq_local} must be a multiple of {times}block_m={self.tiles['block_m']} and "
                             f"{times}block_n={self.tiles['block_n']} (order={order!r})")
        self.order = order
        self.causal = check_bool("causal", causal)
        self.scale = check_scale(scale, head_dim)
        self.q_shape, self.kv_shape = (batch, seq_local, heads, head_dim), (batch, seq_local, kv_heads, head_dim)
        self.algorithm, self.algorithm_reason = self._choose_algorithm(algorithm)
        self.gather_k = self.gather_v = self.gathered_k = self.gathered_v = self.flags_k = self.flags_v = None
        self.free_k = self.free_v = None
        self.own_kernel = self._peers = self._push_k = self._push_v = None
        self.output = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
        self.lse = torch.empty((batch, heads, seq_local), dtype=torch.float32, device=self.device)
        self._q_start = int(positions(self.rank, self.world_size, seq_local, order)[0])
        if self.algorithm == "fused":
            self._build_fused(target)
        else:
            self._build_sequential(group, target)

    def _choose_algorithm(self, requested: str) -> Tuple[str, str]:
        """``(algorithm, reason)``: the overlapped GEMMs' choice
        (:func:`~tilescale_examples.overlap.stream_ops.resolve_plan`: collective, one GPU per
        rank and stream memory operations for the fused one)."""
        if self._dry_run:
            return ("sequential" if requested == "auto" else requested), "dry run"
        if requested == "sequential":
            return "sequential", "requested"
        from tilescale_examples.overlap.stream_ops import resolve_plan

        return resolve_plan(type(self).__name__, requested, self.device, self.group, self.world_size,
                            needs_own_gpus=True)

    def _kernel_args(self) -> tuple:
        return (self.batch, self.seq_local, self.heads, self.kv_heads, self.head_dim, self.causal, self.scale,
                DTYPES[self.dtype])

    def _build_sequential(self, group, target) -> None:
        from tilescale_examples.collectives.allgather import AllGather

        self.gather_k = AllGather(self.allocator, self.kv_shape, self.dtype, world_size=self.world_size, group=group,
                                  target=target)
        self.gather_v = AllGather(self.allocator, self.kv_shape, self.dtype, world_size=self.world_size, group=group,
                                  target=target)
        args = (self.world_size, *self._kernel_args())
        self.kernel = self._compile_plain(lambda: build_sp_attention_kernel(*args, **self.tiles, order=self.order,
                                                                            pipeline=self.pipeline),
                                          target, compile_options(self.fast_math))

    def _build_fused(self, target) -> None:
        import tilelang

        from tilescale_examples.overlap.stream_ops import peer_views

        W = self.world_size
        self.own_kernel = self._compile_plain(lambda: build_sp_own_attention_kernel(*self._kernel_args(), **self.tiles,
                                                                                pipeline=self.pipeline),
                                              target, compile_options(self.fast_math))
        if W == 1:  # nothing to gather: the own shard is the whole sequence
            self.kernel = self.own_kernel
            self.algorithm_reason = "one rank: the attention kernel alone, nothing to gather"
            return
        views = [peer_views(tilelang.tensor(shape, dtype, allocator=self.allocator, return_peers=True), W)
                 for shape, dtype in (((W, *self.kv_shape), self.dtype), ((W, *self.kv_shape), self.dtype),
                                      ((W,), torch.uint64), ((W,), torch.uint64), ((W,), torch.uint64),
                                      ((W,), torch.uint64))]
        self._peers = views
        (self.gathered_k, self.gathered_v, self.flags_k, self.flags_v, self.free_k,
         self.free_v) = (v[self.rank] for v in views)
        for flags in (self.flags_k, self.flags_v):
            flags.zero_()
        for free in (self.free_k, self.free_v):
            free.view(torch.int64).fill_(1)  # every peer's slot may be written
        args = (W, *self._kernel_args())
        self.kernel = self._compile_plain(lambda: build_sp_peer_attention_kernel(*args, **self.tiles,
                                                                                 order=self.order,
                                                                                 pipeline=self.pipeline),
                                          target, compile_options(self.fast_math))
        settle(self.device, self.group)

    @staticmethod
    def torch_reference(inputs, rank: int, causal: bool = True, order: str = "contiguous") -> Tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
        """:func:`torch_reference`."""
        return torch_reference(inputs, rank, causal, order)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                 lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's queries over every rank's keys (collective). Returns ``(out, lse)``,
        default the op's own (overwritten by the next call), complete on the current stream.
        ``k`` and ``v`` may be overwritten by work enqueued after the call. Calls may be
        captured in CUDA graphs (both algorithms). Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        out, lse = self._begin_call(q, k, v, out, lse)
        if self.algorithm == "sequential":
            keys, values = self.gather_k(k), self.gather_v(v)
            self.kernel(q, keys, values, out, lse, self._q_start)
        elif self.world_size == 1:
            self.own_kernel(q, k.view(1, *self.kv_shape), v.view(1, *self.kv_shape), out, lse, 0)
        else:
            self._fused(q, k, v, out, lse)
        return out, lse

    def _fused(self, q, k, v, out, lse) -> None:
        """The fused algorithm's call on the current stream: pushes marked, own shard, pushes
        enqueued, peers' shards (not for a causal rank 0 of the contiguous order), the
        gathered shards released, then the stream waits for the pushes (``k`` and ``v`` may be
        overwritten afterwards)."""
        start, push, peers, join = self._fused_steps(q, k, v, out, lse)
        start()
        push()
        peers()
        join()

    def _fused_steps(self, q, k, v, out, lse) -> tuple:
        """A fused call as its four steps on the current stream ``main``, callables:
        ``start`` (mark the pushes' point, this rank's own shard), ``push`` (the K and V
        copies), ``peers`` (the peers' shards, waiting for their flags) and ``join`` (release
        the gathered shards, wait for the copies). :meth:`_fused` runs them in order; emulated
        ranks sharing a GPU run each step for every rank before the next
        (:mod:`tilescale_examples.testing.emulated_overlap`)."""
        main = torch.cuda.current_stream(self.device)
        if self._push_k is None:
            rows, W = self.batch * self.seq_local, self.world_size
            gk, gv, fk, fv, free_k, free_v = self._peers
            self._push_k, self._push_v = (self._make_push([g.view(W, rows, -1) for g in gathered], flags, free, rows)
                                          for gathered, flags, free in ((gk, fk, free_k), (gv, fv, free_v)))
        pushes = (self._push_k, self._push_v)

        def start():
            for p in pushes:
                p.mark(main)
            with torch.cuda.stream(main):
                self.own_kernel(q, k.view(1, *self.kv_shape), v.view(1, *self.kv_shape), out, lse, 0)

        def push():
            self._push_k.enqueue(k.data_ptr())
            self._push_v.enqueue(v.data_ptr())

        def peers():
            if self.rank > 0 or not self.causal or self.order == "zigzag":
                with torch.cuda.stream(main):
                    self.kernel(q, self.gathered_k, self.gathered_v, out, lse, self.flags_k, self.flags_v, self.rank)

        def join():
            for p in pushes:
                p.release(main)
                p.finish(main)

        return start, push, peers, join

    def _make_push(self, gathered: list, flags: list, free: list, rows: int):
        """The producer of one of K and V, made at the first fused call: a
        :class:`~tilescale_examples.overlap.stream_ops.CopyEnginePush` of this rank's shard (one
        chunk of ``rows = B * SP`` rows) into slot ``rank`` of every peer's ``gathered`` view
        ``(W, rows, Hkv * D)``, then its ready flag (``flags``, ``free``: every rank's views)."""
        from tilescale_examples.overlap.stream_ops import CopyEnginePush

        return CopyEnginePush(gathered, flags, free, self.rank, self.world_size, [(0, 1)], rows, self.device)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch={self.batch}, seq_local={self.seq_local}, heads={self.heads}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, causal={self.causal}, "
                f"world_size={self.world_size}, algorithm={self.algorithm!r}{', closed' if self.closed else ''})")
