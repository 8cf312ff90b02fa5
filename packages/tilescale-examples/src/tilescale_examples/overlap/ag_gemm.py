"""All-gather + GEMM, overlapped: ``out = all_gather(a) @ b`` (tensor-parallel column layout).

Every rank holds ``a``, an ``(m_local, k)`` row block of the activations, and ``b``, its own
``(k, n)`` weight columns; afterwards every rank holds ``out = A @ b`` with ``A`` the
``(world_size * m_local, k)`` stack of every rank's ``a`` (what ``all_gather_into_tensor``
followed by ``torch.matmul`` computes)::

    agg = AllGatherGEMM(allocator, 1024, 8192, 3584, torch.bfloat16)   # m_local, k, n, dtype
    out = agg(a, b)      # (world_size * 1024, 3584)
    ...
    agg.close()

The fused plan (deadlock-free by construction)
----------------------------------------------

* **This rank's rows** need no communication: the stock GEMM
  (:func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`) multiplies ``a`` itself into its rows
  of ``out`` on the caller's stream, launched first.
* **Producer: the copy engines.** :class:`~tilescale_examples.overlap.stream_ops.CopyEnginePush`
  copies each row chunk of ``a`` (``cuMemcpyAsync``, one side stream per peer) into slot
  ``rank`` of every other rank's gathered buffer through the heap's peer mappings, and after
  each copy writes 1 into that chunk's flag on the receiving rank (``cuStreamWriteValue64``,
  which fences the copy before the write). No SM is used, so the producer progresses whatever
  the GEMMs do.
* **Consumer: the peers' rows.** A pipelined TMA + WGMMA GEMM (:func:`build_ag_gemm_kernel`,
  the same tile program) on a compute stream. Before its main loop, thread 0 of each
  ``(block_m, block_n)`` tile waits (``T.wait_ge``, an ``ld.acquire.sys`` poll) for the flag
  of the chunk holding its rows, then every thread issues ``fence.proxy.async`` (TMA reads
  through the async proxy what the acquire made visible). Tiles run in :func:`tile_order`:
  chunk by chunk, the order in which the copies arrive. It fills the SMs the first GEMM
  leaves and takes over as that one drains.

A spinning tile waits only for copy-engine work that depends on nothing running on SMs; no
kernel needs another one to be resident. With one rank, the call is the first GEMM alone.

The handshake (constant values only, so a call captured in a CUDA graph replays correctly,
mixed with eager calls in any order): after the peer GEMM, the caller's stream *releases* the
call (:meth:`~tilescale_examples.overlap.stream_ops.CopyEnginePush.release`: it waits until
every chunk flag is 1, sets them back to 0, then sets ``free[rank]`` on every other rank to
1), and rank ``q``'s copies to ``p`` start only once ``free[p]`` on ``q`` is 1, which it then
sets to 0. So no copy overwrites rows a GEMM still reads, and every wait is in a stream's
front end or on copy-engine work.

The sequential plan (``algorithm="sequential"``, or ``"auto"`` where stream memory operations are
missing, with a log line): the example :class:`~tilescale_examples.collectives.allgather.AllGather`
kernel, then the stock GEMM on the gathered rows; no overlap.

Constraints: ``m_local % block_m == 0``, ``k % block_k == 0``, ``n % block_n == 0`` (else a
``ValueError`` naming the argument, before anything is allocated); float16 and bfloat16 with
float32 accumulation.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import (accepts_0_1_init, accepts_0_1_out, accepts_0_1_reference, check_disjoint,
                                     check_tensor, settle)
from tilescale_examples.overlap.gemm import (DTYPES, GemmTiles, OverlappedGemm, block_threads, build_gemm_kernel,
                                             check_gemm_dims, check_positive, default_tiles, gemm_tile, resolve_store,
                                             resolve_tiles, store_tile)
from tilescale_examples.overlap.stream_ops import CopyEnginePush, peer_views, plan_row_chunks

__all__ = ["AllGatherGEMM", "build_ag_gemm_kernel", "tile_order", "torch_reference", "heap_bytes"]


def tile_order(world_size: int, chunks: Sequence, units: int) -> torch.Tensor:
    """The peer GEMM's row-block order, rank-agnostic: an ``int32`` ``((world_size - 1) *
    units, 2)`` table whose row ``s`` is ``(j * units + u, c)`` for the ``s``-th row block
    to compute: unit ``u`` (``block_m`` rows) of rank ``(rank + j) % world_size`` (``j >=
    1``), delivered in chunk ``c``. Chunk by chunk, and within a chunk rank ``rank + 1``,
    ``rank + 2``, ...: the order in which the peers' copies arrive."""
    rows = [(j * units + u, c) for c, (first, n) in enumerate(chunks)
            for j in range(1, world_size) for u in range(first, first + n)]
    if sorted(code for code, _ in rows) != list(range(units, world_size * units)):
        raise ValueError(f"chunks {list(chunks)} do not cover {units} units exactly once")
    return torch.tensor(rows, dtype=torch.int32).view(-1, 2)


def build_ag_gemm_kernel(m_local: int, k: int, n: int, world_size: int, num_chunks: int,
                         dtype: str = "bfloat16", tiles: Optional[GemmTiles] = None, store: str = "direct"):
    """The fused plan's peer GEMM ``T.prim_func`` (the rows of the other ranks):
    ``(A: (world_size * m_local, k), B: (k, n), Out: (world_size * m_local, n), Flags:
    (world_size * num_chunks,) uint64, Order: ((world_size - 1) * m_local / block_m, 2)
    int32)``.

    ``A`` is the gathered buffer, ``Flags[src * num_chunks + c]`` the ready flag of chunk
    ``c`` from rank ``src`` (a tile waits until it is 1), ``Order`` the :func:`tile_order`
    table; ``store`` the epilogue's writes (:data:`~tilescale_examples.overlap.gemm.STORES`).
    Needs ``kernel.initialize`` (it reads its rank from the table) and ``world_size >= 2``."""
    import tilelang.language as T

    tiles = tiles or default_tiles(n)
    check_gemm_dims("build_ag_gemm_kernel", tiles, m_local=m_local, k=k, n=n)
    check_positive("num_chunks", num_chunks)
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (one rank has no peer rows), got {world_size!r}")
    W, C, BM, BN = world_size, num_chunks, tiles.block_m, tiles.block_n
    U, M = m_local // BM, world_size * m_local
    tile = gemm_tile(k, dtype, tiles, store_tile(tiles, dtype, store))

    @T.prim_func
    def ag_gemm(A: T.Tensor((M, k), dtype), B: T.Tensor((k, n), dtype), Out: T.Tensor((M, n), dtype),
                Flags: T.Tensor((W * C,), "uint64"), Order: T.Tensor(((W - 1) * U, 2), "int32")):
        with T.Kernel(n // BN, (W - 1) * U, threads=block_threads(tiles)) as (bx, by):
            if tiles.swizzle:  # by: the row of the order table, in panels of tiles.swizzle rows
                T.use_swizzle(panel_size=tiles.swizzle)
            C_f = T.alloc_fragment((BM, BN), "float32")
            code = Order[by, 0]
            src = (T.get_rank() + code // U) % W
            row = src * m_local + code % U * BM  # the tile's first row of the gathered A
            if T.get_thread_binding() == 0:
                T.wait_ge(Flags[src * C + Order[by, 1]], 1)  # its chunk of this call landed
            T.sync_threads()
            T.fence_proxy_async()  # the landed rows before the async-proxy (TMA) reads
            tile(A, B, C_f, row, bx * BN, Out, row, bx * BN)

    return ag_gemm


def _reference(inputs: Sequence, rank: int) -> torch.Tensor:
    """The float32 result on ``rank``: ``cat(a_p for every rank p) @ b_rank``, from every
    rank's call arguments ``inputs[p] = (a_p, b_p)`` (compare the kernel's output with
    :func:`~tilescale_examples.overlap.gemm.count_outside`)."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one (a, b) pair per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    return torch.cat([a.float() for a, _ in inputs], dim=0) @ inputs[rank][1].float()


def _shards_and_b(*args, **kwargs):
    """The 0.1.0 ``torch_reference(a_shards, b)``: ``([(a_p, b), ...], 0)``."""
    if len(args) == 2 and not kwargs and isinstance(args[1], torch.Tensor):
        shards = list(args[0])
        if not shards:
            raise ValueError("a_shards must hold one tensor per rank, got none")
        return [(a, args[1]) for a in shards], 0
    return None


#: :meth:`AllGatherGEMM.torch_reference`; ``torch_reference(a_shards, b)`` is the 0.1.0 spelling (it warns).
torch_reference = accepts_0_1_reference("ag_gemm.torch_reference(a_shards, b)", _shards_and_b)(_reference)


def heap_bytes(world_size: int, m_local: int, k: int, dtype: torch.dtype = torch.bfloat16, max_chunks: int = 8,
               max_blocks: int = 256) -> int:
    """Symmetric-heap bytes per rank one :class:`AllGatherGEMM` needs under either plan
    (the larger): :meth:`AllGatherGEMM.heap_bytes` (a dry run of the constructor) with the
    all-gather of the sequential plan on a grid of ``max_blocks`` blocks (``n`` does not
    change the heap)."""
    return AllGatherGEMM._heap_bytes((m_local, k, GemmTiles().block_n, dtype), {"max_chunks": max_chunks},
                                     world_size, max_blocks)


class AllGatherGEMM(OverlappedGemm):
    """``out = all_gather(a) @ b`` with the all-gather on the copy engines, overlapped with
    the GEMM (see the module docstring).

    Args:
        allocator: an open tilescale-core allocator; its ``num_ranks`` ranks take part.
        m_local, k, n: ``a`` is ``(m_local, k)`` on every rank, ``b`` ``(k, n)``; the output
            is ``(world_size * m_local, n)``. Multiples of ``block_m``, ``block_k``,
            ``block_n``.
        dtype: float16 or bfloat16 (float32 accumulation).
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"`` (fused where stream memory operations exist on every rank and
            every rank has a GPU of its own, else sequential with a log line), ``"fused"`` or
            ``"sequential"``.
        group: process group (the constructor's barrier and plan agreement); default the
            initialised world group.
        block_m, block_n, block_k, num_stages, threads, swizzle, pipeline, warp_policy: the
            GEMM's tiling (:class:`~tilescale_examples.overlap.gemm.GemmTiles`, whose fields
            these are: ``**dataclasses.asdict(tiles)`` passes a tuned one); ``swizzle=None``
            (default) rasterizes wide outputs (:func:`~tilescale_examples.overlap.gemm.default_swizzle`);
            ``pipeline="async"`` keeps one WGMMA group in flight
            (:mod:`~tilescale_examples.overlap.gemm_async`); ``warp_policy`` is how the compute
            warpgroups split a tile.
        store: how the GEMMs write their output tiles
            (:data:`~tilescale_examples.overlap.gemm.STORES`): None (default) picks
            :func:`~tilescale_examples.overlap.gemm.default_store` (``"tma"``, through shared
            memory and TMA stores, with the sync pipeline; ``"direct"`` with the async one).
        max_chunks: most row chunks per rank (:func:`~tilescale_examples.overlap.stream_ops.plan_row_chunks`).
        target: TileLang target (default ``sm_90a``).

    Attributes: ``output`` (``(world_size * m_local, n)``, overwritten by the next call),
    ``epoch`` (calls made), ``algorithm`` and ``algorithm_reason`` (``plan`` and
    ``plan_reason`` in 0.1.0), ``tiles``, ``store``; fused: ``own_kernel`` (this rank's
    rows), ``kernel`` (the peers' rows; the same as ``own_kernel`` with one rank), ``chunks``
    (``[(first_unit, n_units)]``), ``gathered`` (the local ``(world_size, m_local, k)``
    buffer), ``flags`` (ready) and ``free``; sequential: ``all_gather`` and ``kernel`` (the stock GEMM).
    Construction and calls are collective: same instances, same call sequence on every rank.
    0.1.0 spellings (no ``dtype``, ``plan=``, ``out`` positional) work with a warning.
    """

    _BUFFERS = ("output", "gathered", "flags", "free", "all_gather", "own_kernel", "_push", "_peers", "_order",
                "_compute")
    #: Ranks sharing a GPU run the sequential plan: a copy within one GPU may be an SM kernel.
    FUSED_NEEDS_OWN_GPUS = True
    torch_reference = staticmethod(_reference)

    @accepts_0_1_init(renamed={"plan": "algorithm"}, defaults={"dtype": torch.float16})
    def __init__(self, allocator, m_local: int, k: int, n: int, dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "fused", "sequential"] = "auto",
                 group=None, block_m: int = 128, block_n: int = 256, block_k: int = 64, num_stages: int = 3,
                 threads: int = 256, swizzle: Optional[int] = None, pipeline: str = "sync", warp_policy: str = "square",
                 store: Optional[str] = None, max_chunks: int = 8, target=None):
        from tilescale_examples.base import check_target

        check_target(target)
        tiles = resolve_tiles(n, block_m, block_n, block_k, num_stages, threads, swizzle, pipeline, warp_policy)
        check_positive("max_chunks", max_chunks)
        self._setup_gemm(allocator, m_local, k, n, dtype, world_size, group, tiles, algorithm, rows_per_call=1)
        W, name = self.world_size, DTYPES[self.dtype]
        self.store = store = resolve_store(store, tiles, name)
        self.all_gather = self.gathered = self.flags = self.free = self.chunks = self.own_kernel = None
        self._push = self._peers = self._order = self._compute = None
        self.output = torch.empty((W * m_local, n), dtype=self.dtype, device=self.device)
        if self.algorithm == "sequential":
            from tilescale_examples.collectives.allgather import AllGather

            self.all_gather = AllGather(allocator, (m_local, k), self.dtype, group=self.group, target=target)
            self.kernel = self._compile_plain(lambda: build_gemm_kernel(W * m_local, n, k, name, tiles, store), target)
            return
        self.own_kernel = self._compile_plain(lambda: build_gemm_kernel(m_local, n, k, name, tiles, store), target)
        if W == 1:  # nothing to gather: the GEMM of this rank's rows is the whole call
            self.kernel = self.own_kernel
            self.algorithm_reason = "one rank: the GEMM alone, nothing to communicate"
            return
        import tilelang

        units = m_local // block_m
        self.chunks = plan_row_chunks(units, max_chunks)
        gathered = peer_views(tilelang.tensor((W, m_local, k), self.dtype, allocator=allocator, return_peers=True), W)
        flags = peer_views(tilelang.tensor((W * len(self.chunks),), torch.uint64, allocator=allocator,
                                           return_peers=True), W)
        free = peer_views(tilelang.tensor((W,), torch.uint64, allocator=allocator, return_peers=True), W)
        self.gathered, self.flags, self.free = gathered[self.rank], flags[self.rank], free[self.rank]
        self.flags.zero_()
        self.free.view(torch.int64).fill_(1)  # every peer's slot may be written
        self._peers = (gathered, flags, free)
        self._order = tile_order(W, self.chunks, units).to(self.device)
        self.kernel = self._compile_kernel(
            lambda: build_ag_gemm_kernel(m_local, k, n, W, len(self.chunks), name, tiles, store), target)
        self.bind_table(force=True)
        settle(self.device, self.group)

    def check_inputs(self, a, b) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``a`` or ``b`` unless they are contiguous
        ``(m_local, k)`` and ``(k, n)`` tensors of this dtype on the allocator's device, 16-byte
        aligned."""
        check_tensor(a, (self.m_local, self.k), self.dtype, self.device, "a", "(m_local, k) =", "AllGatherGEMM")
        check_tensor(b, (self.k, self.n), self.dtype, self.device, "b", "(k, n) =", "AllGatherGEMM")
        self._check_operands(a, b)

    @accepts_0_1_out(2)
    def __call__(self, a: torch.Tensor, b: torch.Tensor, *out_0_1,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``all_gather(a) @ b`` on the current stream; returns ``self.output`` (overwritten
        by the next call) or ``out`` (a contiguous ``(world_size * m_local, n)`` tensor of the
        dtype on the device, written directly, overlapping neither ``a`` nor ``b``, 16-byte
        aligned with ``store="tma"``, 4-byte aligned otherwise: else a ``ValueError``). ``a`` is
        read by the copy engines; it may be overwritten by work enqueued after this call. Every
        rank makes the same sequence of calls, eagerly or in CUDA graph replays (in any mix: the
        fused plan's handshake uses constant flag values). Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        return self._call(a, b, out_0_1, out)

    def _run_plan(self, a, b, main, result, out) -> None:
        if self.algorithm == "sequential":
            gathered = self.all_gather(a)
            self.kernel(gathered.view(-1, self.k), b, result)
        else:
            self._fused(a, b, main, result)

    def _check_call(self, a, b, out):
        """Everything a call checks before anything runs (``TypeError`` / ``ValueError``
        naming the argument, :class:`~tilescale_examples.base.ClosedError`); returns where
        the call writes (``out`` or ``self.output``)."""
        self._check_open()
        self.check_inputs(a, b)
        if out is not None:
            self._check_out(out, (self.world_size * self.m_local, self.n), "(world_size * m_local, n) =")
            self._check_gemm_out(out)
            check_disjoint({"out": out}, {"a": a, "b": b},
                           "the GEMMs (and the copies of a) read it while the output is written; pass a separate "
                           "tensor")
        return self.output if out is None else out

    def _fused(self, a, b, main, output) -> None:
        """(Two or more ranks: one rank's call is :meth:`_gemm_alone`.) Own rows on ``main``
        straight from ``a``; the peers' rows on the compute stream as their chunks land; the
        copies last (a copy waiting in a hardware queue shared with a GEMM's stream then
        cannot hold that GEMM back); then ``main`` releases the gathered rows to the peers
        and waits for this rank's copies."""
        start, push, peers, join = self._fused_steps(a, b, main, output)
        start()
        peers()
        push()
        join()

    def _fused_steps(self, a, b, main, output) -> tuple:
        """A fused call (``world_size > 1``) as its four steps, callables enqueueing on their
        own streams: ``start`` (mark the copies' point on ``main``, fork the compute stream,
        this rank's GEMM on ``main``), ``push`` (the copies), ``peers`` (the peer GEMM on the
        compute stream) and ``join`` (``main`` waits for the compute stream, releases the
        gathered rows, waits for the copies). :meth:`_fused` runs them in that order but
        ``push`` last but one; emulated ranks sharing a GPU run each step for every rank
        before the next step, so that no wait is enqueued before the work it waits for
        (:mod:`tilescale_examples.testing.emulated_overlap`)."""
        m = self.m_local
        if self._push is None:
            self._push, self._compute = self._make_push(), self._make_compute_stream()
        push_, compute = self._push, self._compute

        def start():
            push_.mark(main)
            compute.wait_stream(main)
            with torch.cuda.stream(main):
                self.own_kernel(a, b, output[self.rank * m:(self.rank + 1) * m])

        def peers():
            with torch.cuda.stream(compute):
                self.bind_table()
                self.kernel(self.gathered.view(-1, self.k), b, output, self.flags, self._order)

        def join():
            main.wait_stream(compute)
            push_.release(main)
            push_.finish(main)

        return start, lambda: push_.enqueue(a.data_ptr()), peers, join

    def _make_push(self) -> CopyEnginePush:
        """The fused plan's producer, made at the first call: a
        :class:`~tilescale_examples.overlap.stream_ops.CopyEnginePush` of this rank's chunks
        into every peer's gathered buffer (one side stream per peer)."""
        return CopyEnginePush(*self._peers, self.rank, self.world_size, self.chunks, self.tiles.block_m, self.device)

    def _make_compute_stream(self) -> torch.cuda.Stream:
        """The stream of the fused plan's peer GEMM, made at the first call (its own)."""
        return torch.cuda.Stream(device=self.device)
