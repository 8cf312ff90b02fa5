"""GEMM + reduce-scatter, overlapped: ``out_shard = reduce_scatter(a @ b)`` (the second,
row-parallel linear layer of tensor parallelism).

Every rank holds ``a``, ``(world_size * m_local, k)`` (its ``k`` columns of the activations,
all rows), and ``b``, ``(k, n)`` (its ``k`` rows of the weight). Rank ``r`` owns rows ``r *
m_local .. (r + 1) * m_local - 1`` of the result; afterwards it holds ``out_shard = sum over
ranks p of (a_p @ b_p)[its rows]``, ``(m_local, n)`` (what ``torch.matmul`` followed by
``reduce_scatter_tensor`` computes)::

    grs = GemmReduceScatter(allocator, 1024, 8192, 3584, torch.bfloat16)   # m_local, k, n, dtype
    out = grs(a, b)      # a: (world_size * 1024, 8192); out: (1024, 3584)
    ...
    grs.close()

The fused plan (deadlock-free by construction: no kernel ever waits)
---------------------------------------------------------------------

1. **GEMM with a remote epilogue** (:func:`build_gemm_rs_kernel`). The tiles of the rows of
   rank ``rank + 1`` come first, then ``rank + 2``, ..., this rank's own rows last, so every
   rank produces the partial tiles its peers need before its own. Each finished
   ``(block_m, block_n)`` tile is rounded to the dtype, staged in shared memory and stored
   with 16-byte vector stores straight into its owner's heap, slot ``partials[e % 2, rank]``
   (``T.copy`` to a peer). Then the block synchronises, thread 0 issues ``fence.sys`` and a
   release add of 1 to ``counters[rank]`` on the owner (NVSHMEM's put-with-signal order).
2. **Stream waits** (host-enqueued, :func:`~tilescale_examples.overlap.stream_ops.wait_counter_geq`):
   for every source rank ``src``, the caller's stream waits until ``counters[src] >= tiles``
   (``tiles = m_local / block_m * n / block_n``): every partial of the call has landed. The
   wait runs in the stream's front end, not on an SM.
3. **Reduction** (:func:`build_reduce_kernel`): ``out_shard = sum over src in rank order of
   partials[e % 2, src]``, float32 accumulation, one rounding: deterministic, whatever the
   arrival order. Its last block takes ``tiles`` off every counter (atomically: a peer may
   already be adding tiles of the next call) and advances the call count ``calls[0]``.

The call number ``e`` is ``calls[0] + 1``, read on the device by both kernels, and the stream
waits compare with a constant, so nothing depends on a number passed from the host: a call
captured in a CUDA graph replays correctly, mixed with eager calls in any order.

Why nothing can deadlock: the GEMM waits for nothing; the reduction kernel is launched only
once its data is complete; the stream waits depend only on the GEMMs of call ``e``, which
depend only on earlier work. No kernel needs another kernel to be resident, so ranks sharing
one GPU (time-sliced or not) cannot block each other either.

Double buffering: call ``e`` writes parity ``e % 2``. Rank ``src`` writes parity ``e % 2``
again in call ``e + 2``, which starts after its reduction of call ``e + 1``, which waited for
every owner's GEMM of call ``e + 1``, which each owner started only after its reduction of
call ``e`` (the last reader of parity ``e % 2``) had finished. A counter holds the tiles that
have landed for calls not yet reduced (32-bit, compared wrap-safely), so no host
synchronisation is needed.

With one rank there is nothing to reduce: the fused plan is the stock GEMM writing the
output.

The sequential plan (``algorithm="sequential"``, or ``"auto"`` where stream memory operations are
missing, with a log line): the stock GEMM into the symmetric input of the example
:class:`~tilescale_examples.collectives.reducescatter.ReduceScatter`, then that kernel; no overlap.

Constraints: ``m_local % block_m == 0``, ``k % block_k == 0``, ``n % block_n == 0`` (else a
``ValueError`` naming the argument, before anything is allocated); float16 and bfloat16.
The partials are rounded to the dtype (a float32 accumulation sums them).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import (accepts_0_1_init, accepts_0_1_out, accepts_0_1_reference, check_tensor,
                                     settle)
from tilescale_examples.overlap.gemm import (DTYPES, GemmTiles, OverlappedGemm, block_threads, build_gemm_kernel,
                                             check_gemm_dims, check_positive, default_tiles, gemm_tile, lead_thread,
                                             resolve_store, resolve_tiles, sync_compute)
from tilescale_examples.overlap.stream_ops import wait_counter_geq

__all__ = ["GemmReduceScatter", "build_gemm_rs_kernel", "build_reduce_kernel", "torch_reference",
           "partial_magnitudes", "heap_bytes"]


def build_gemm_rs_kernel(m_local: int, k: int, n: int, world_size: int, dtype: str = "bfloat16",
                         tiles: Optional[GemmTiles] = None):
    """The fused plan's GEMM ``T.prim_func``: ``(A: (world_size * m_local, k), B: (k, n),
    Partials: (2, world_size, m_local, n), Counters: (world_size,) uint32, Calls: (2,)
    uint32)``.

    ``Partials`` and ``Counters`` are symmetric; ``Calls[0]`` counts the completed calls
    (advanced by the reduction kernel), so this call is ``e = Calls[0] + 1`` and the tile of
    row block ``u`` of owner ``o`` goes to ``Partials[e % 2, rank, u * block_m, :]`` on
    ``o``, then ``Counters[rank]`` on ``o`` grows by 1. Needs ``kernel.initialize``."""
    import tilelang.language as T

    tiles = tiles or default_tiles(n)
    check_gemm_dims("build_gemm_rs_kernel", tiles, m_local=m_local, k=k, n=n)
    check_positive("world_size", world_size)
    W, BM, BN = world_size, tiles.block_m, tiles.block_n
    U, M = m_local // BM, world_size * m_local

    @T.macro
    def send_tile(C_f, C_s, dst, Counters, me, owner):
        """The tile to ``dst`` (its place in ``owner``'s partials of this call), then its
        counter."""
        T.copy(C_f, C_s)
        T.copy(C_s, dst, dst_pe=owner)
        sync_compute(tiles)
        if T.get_thread_binding() == lead_thread(tiles):
            T.fence_sys()  # every thread's stores (via the barrier) before the signal
            T.notify(Counters[me], owner, 1, sig_op="add")

    tile = gemm_tile(k, dtype, tiles, send_tile)

    @T.prim_func
    def gemm_rs(A: T.Tensor((M, k), dtype), B: T.Tensor((k, n), dtype),
                Partials: T.Tensor((2, W, m_local, n), dtype), Counters: T.Tensor((W,), "uint32"),
                Calls: T.Tensor((2,), "uint32")):
        with T.Kernel(n // BN, W * U, threads=block_threads(tiles)) as (bx, by):
            if tiles.swizzle:  # by: the row block in send order, in panels of tiles.swizzle rows
                T.use_swizzle(panel_size=tiles.swizzle)
            C_f = T.alloc_fragment((BM, BN), "float32")
            C_s = T.alloc_shared((BM, BN), dtype)
            me = T.get_rank()
            parity = T.alloc_var("int32")
            parity = T.Cast("int32", (Calls[0] + 1) % 2)  # this call's buffer (nothing writes Calls now)
            owner = (me + 1 + by // U) % W  # the next ranks' rows first, this rank's last
            unit = by % U
            tile(A, B, C_f, owner * m_local + unit * BM, bx * BN, C_s,
                 Partials[parity, me, unit * BM:(unit + 1) * BM, bx * BN:(bx + 1) * BN], Counters, me, owner)

    return gemm_rs


def _rank_order_sum(T, partials, parity, row, col, world_size: int):
    """``partials[parity, 0, row, col] + partials[parity, 1, row, col] + ...`` in float32,
    built at trace time as one expression (fixed order: deterministic)."""
    total = T.Cast("float32", partials[parity, 0, row, col])
    for src in range(1, world_size):
        total = total + T.Cast("float32", partials[parity, src, row, col])
    return total


def build_reduce_kernel(m_local: int, n: int, world_size: int, dtype: str = "bfloat16",
                        tiles: Optional[GemmTiles] = None):
    """The fused plan's reduction ``T.prim_func``: ``(Partials: (2, world_size, m_local, n),
    Out: (m_local, n), Counters: (world_size,) uint32, Calls: (2,) uint32)``.

    ``Out = sum over src (in rank order, float32) of Partials[e % 2, src]`` for call ``e =
    Calls[0] + 1``, one ``(block_m, block_n)`` tile per block. It does not wait: launch it
    after the stream waits. The last block to finish (``Calls[1]`` counts finished blocks)
    takes the call's ``tiles`` off every ``Counters[src]`` (atomically: peers may already
    be adding tiles of the next call), resets ``Calls[1]`` and advances ``Calls[0]``: the call
    state lives on the device, so a CUDA graph replays correctly."""
    import tilelang.language as T

    tiles = tiles or GemmTiles()
    check_gemm_dims("build_reduce_kernel", tiles, m_local=m_local, n=n)
    check_positive("world_size", world_size)
    W, BM, BN = world_size, tiles.block_m, tiles.block_n
    blocks = (n // BN) * (m_local // BM)
    per_call = blocks  # tiles every source rank sends this rank per call

    @T.prim_func
    def reduce_partials(Partials: T.Tensor((2, W, m_local, n), dtype), Out: T.Tensor((m_local, n), dtype),
                        Counters: T.Tensor((W,), "uint32"), Calls: T.Tensor((2,), "uint32")):
        with T.Kernel(n // BN, m_local // BM, threads=256) as (bx, by):
            parity = T.alloc_var("int32")
            parity = T.Cast("int32", (Calls[0] + 1) % 2)
            for i, j in T.Parallel(BM, BN):
                Out[by * BM + i, bx * BN + j] = T.Cast(
                    dtype, _rank_order_sum(T, Partials, parity, by * BM + i, bx * BN + j, W))
            T.sync_threads()  # every thread of the block has read Calls[0]
            if T.get_thread_binding() == 0:
                done = T.alloc_var("uint32")
                done = T.atomic_add(Calls[1], T.uint32(1), return_prev=True)
                if done == blocks - 1:  # the last block: every block has read Calls[0]
                    for src in T.serial(W):
                        T.atomic_add(Counters[src], T.uint32((1 << 32) - per_call))  # minus per_call, mod 2**32
                    Calls[1] = 0
                    T.fence_gpu()
                    Calls[0] = Calls[0] + 1

    return reduce_partials


def _reference(inputs: Sequence, rank: int) -> torch.Tensor:
    """The float32 result on ``rank``: ``sum_p (a_p @ b_p)[rank * m_local:(rank + 1) *
    m_local]`` from every rank's call arguments ``inputs[p] = (a_p, b_p)`` (``a_p``:
    ``(world_size * m_local, k)``)."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one (a, b) pair per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    m_local = inputs[0][0].shape[0] // len(inputs)
    rows = slice(rank * m_local, (rank + 1) * m_local)
    total = None
    for a, b in inputs:
        part = a[rows].float() @ b.float()
        total = part if total is None else total + part
    return total


def _shards_and_rank(*args, **kwargs):
    """The 0.1.0 ``torch_reference(a_shards, b_shards, rank)``: ``(list(zip(a_shards,
    b_shards)), rank)``."""
    if len(args) == 3 and not kwargs:
        a_shards, b_shards, rank = list(args[0]), list(args[1]), args[2]
        if not a_shards or len(a_shards) != len(b_shards):
            raise ValueError(f"need one a and one b per rank, got {len(a_shards)} and {len(b_shards)}")
        return list(zip(a_shards, b_shards)), rank
    return None


#: :meth:`GemmReduceScatter.torch_reference`; ``torch_reference(a_shards, b_shards, rank)`` is
#: the 0.1.0 spelling (it warns).
torch_reference = accepts_0_1_reference("gemm_rs.torch_reference(a_shards, b_shards, rank)",
                                        _shards_and_rank)(_reference)


def partial_magnitudes(a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """``sum_p |(a_p @ b_p)[rows of rank]|`` in float32: the ``rounded`` term of
    :func:`~tilescale_examples.overlap.gemm.error_bound` (each partial is rounded to the dtype once)."""
    m_local = a_shards[0].shape[0] // len(a_shards)
    rows = slice(rank * m_local, (rank + 1) * m_local)
    return sum((a[rows].float() @ b.float()).abs() for a, b in zip(a_shards, b_shards))


def heap_bytes(world_size: int, m_local: int, n: int, dtype: torch.dtype = torch.bfloat16, max_blocks: int = 256) -> int:
    """Symmetric-heap bytes per rank one :class:`GemmReduceScatter` needs under either plan
    (the larger): :meth:`GemmReduceScatter.heap_bytes` (a dry run of the constructor) with
    the reduce-scatter of the sequential plan on a grid of at most ``max_blocks`` blocks
    (``k`` does not change the heap)."""
    return GemmReduceScatter._heap_bytes((m_local, GemmTiles().block_k, n, dtype), {}, world_size, max_blocks)


class GemmReduceScatter(OverlappedGemm):
    """``out_shard = reduce_scatter(a @ b)`` with the partial tiles pushed to their owners by
    the GEMM's epilogue (see the module docstring).

    Args:
        allocator: an open tilescale-core allocator; its ``num_ranks`` ranks take part.
        m_local, k, n: ``a`` is ``(world_size * m_local, k)``, ``b`` ``(k, n)``, the output
            ``(m_local, n)``. Multiples of ``block_m``, ``block_k``, ``block_n``.
        dtype: float16 or bfloat16 (float32 accumulation; partials rounded to ``dtype``).
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"``, ``"fused"`` or ``"sequential"`` (as for
            :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM`).
        group: process group (the constructor's barrier and plan agreement); default the
            initialised world group.
        block_m, block_n, block_k, num_stages, threads, swizzle, pipeline, warp_policy: the
            GEMM's tiling, as for :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM`.
        store: how the plain GEMM (one rank, or the sequential plan) writes its output tiles,
            as for :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` (None: the
            pipeline's default); the fused plan's GEMM sends its tiles to their owners.
        target: TileLang target (default ``sm_90a``).

    Attributes: ``output`` (``(m_local, n)``, overwritten by the next call), ``epoch``,
    ``algorithm`` and ``algorithm_reason`` (``plan`` and ``plan_reason`` in 0.1.0),
    ``kernel`` (the GEMM), ``reduce_kernel`` (fused, two or more ranks), ``tiles``, ``store``,
    ``partials`` and ``counters`` (fused), ``reduce_scatter`` (sequential). Construction and
    calls are collective: same instances, same call sequence on every rank. 0.1.0 spellings
    (no ``dtype``, ``plan=``, ``out`` positional) work with a warning.
    """

    _BUFFERS = ("output", "partials", "counters", "calls", "reduce_kernel", "reduce_scatter", "_products")
    torch_reference = staticmethod(_reference)

    @accepts_0_1_init(renamed={"plan": "algorithm"}, defaults={"dtype": torch.float16})
    def __init__(self, allocator, m_local: int, k: int, n: int, dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "fused", "sequential"] = "auto",
                 group=None, block_m: int = 128, block_n: int = 256, block_k: int = 64, num_stages: int = 3,
                 threads: int = 256, swizzle: Optional[int] = None, pipeline: str = "sync",
                 warp_policy: str = "square", store: Optional[str] = None, target=None):
        from tilescale_examples.base import check_target

        check_target(target)
        tiles = resolve_tiles(n, block_m, block_n, block_k, num_stages, threads, swizzle, pipeline, warp_policy)
        self._setup_gemm(allocator, m_local, k, n, dtype, world_size, group, tiles, algorithm, rows_per_call=2)
        W, name = self.world_size, DTYPES[self.dtype]
        self.store = store = resolve_store(store, tiles, name)
        self.tiles_per_rank = (m_local // block_m) * (n // block_n)
        self.partials = self.counters = self.calls = self.reduce_kernel = self.reduce_scatter = None
        self._products = None  # sequential plan, under CUDA graphs: the GEMM's output
        import tilelang

        if self.algorithm == "fused" and W == 1:  # nothing to reduce: the GEMM writes the output
            self.output = torch.empty((m_local, n), dtype=self.dtype, device=self.device)
            self.kernel = self._compile_plain(lambda: build_gemm_kernel(m_local, n, k, name, tiles, store), target)
            self.algorithm_reason = "one rank: the GEMM alone, nothing to communicate"
        elif self.algorithm == "fused":
            self.partials = tilelang.tensor((2, W, m_local, n), self.dtype, allocator=allocator)
            self.counters = tilelang.tensor((W,), torch.uint32, allocator=allocator)
            self.counters.view(torch.int32).zero_()
            self.calls = torch.zeros((2,), dtype=torch.int32, device=self.device).view(torch.uint32)  # calls, done blocks
            self.output = torch.empty((m_local, n), dtype=self.dtype, device=self.device)
            self.kernel = self._compile_kernel(lambda: build_gemm_rs_kernel(m_local, k, n, W, name, tiles), target)
            self.bind_table(force=True)
            self.reduce_kernel = self._compile_plain(lambda: build_reduce_kernel(m_local, n, W, name, tiles), target)
            settle(self.device, self.group)
        else:
            from tilescale_examples.collectives.reducescatter import ReduceScatter

            self.reduce_scatter = ReduceScatter(allocator, (W, m_local, n), self.dtype, group=self.group,
                                                target=target)
            self.output = self.reduce_scatter.output
            self.kernel = self._compile_plain(lambda: build_gemm_kernel(W * m_local, n, k, name, tiles, store), target)

    def check_inputs(self, a, b) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``a`` or ``b`` unless they are contiguous
        ``(world_size * m_local, k)`` and ``(k, n)`` tensors of this dtype on the allocator's
        device, 16-byte aligned."""
        check_tensor(a, (self.world_size * self.m_local, self.k), self.dtype, self.device, "a",
                     "(world_size * m_local, k) =", "GemmReduceScatter")
        check_tensor(b, (self.k, self.n), self.dtype, self.device, "b", "(k, n) =", "GemmReduceScatter")
        self._check_operands(a, b)

    @accepts_0_1_out(2)
    def __call__(self, a: torch.Tensor, b: torch.Tensor, *out_0_1,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``reduce_scatter(a @ b)`` on the current stream; returns ``self.output``
        (``(m_local, n)``, overwritten by the next call) or ``out`` (a contiguous ``(m_local,
        n)`` tensor of the dtype on the device, written directly; at one rank 16-byte aligned
        with ``store="tma"``, 4-byte aligned otherwise), complete when the stream
        reaches the end of the call. Every rank makes the same sequence of calls, eagerly or
        in CUDA graph replays (the call state lives on the device). Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        return self._call(a, b, out_0_1, out)

    def _run_plan(self, a, b, main, result, out) -> None:
        if self.algorithm == "fused":
            self._send_partials(a, b)
            self._reduce_landed(main, result)
        else:
            rs = self.reduce_scatter
            products = rs._next_input_view()  # zero-copy into the reduce-scatter's staging buffer
            if products is None:  # captured: the staging buffer of a call is chosen on the device
                if self._products is None:
                    self._products = torch.empty((self.world_size, self.m_local, self.n), dtype=self.dtype,
                                                 device=self.device)
                products = self._products
            self.kernel(a, b, products.view(-1, self.n))
            rs(products, out=out)

    def _check_call(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        """What a call checks before anything runs: :class:`~tilescale_examples.base.ClosedError`
        once closed, ``a`` and ``b`` (:meth:`check_inputs`), and ``out`` when given; returns
        where the call writes (``out`` or ``self.output``), as AllGatherGEMM's does."""
        self._check_open()
        self.check_inputs(a, b)
        if out is not None:
            self._check_out(out, (self.m_local, self.n), "(m_local, n) =")
            if self._lone_gemm:  # the GEMM writes it
                self._check_gemm_out(out)
        return self.output if out is None else out

    def _send_partials(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Fused plan, step 1 on the current stream: the GEMM whose epilogue stores each
        partial tile on its owner and counts it there (this instance's table bound first)."""
        self.bind_table()
        self.kernel(a, b, self.partials, self.counters, self.calls)

    def _reduce_landed(self, stream, result: torch.Tensor) -> None:
        """Fused plan, steps 2 and 3 on ``stream`` (the current one): wait in the stream's
        front end until every rank's partials of this call have landed here, then reduce
        them into ``result``."""
        base = self.counters.data_ptr()
        for src in range(self.world_size):  # every partial of this call has landed here
            wait_counter_geq(stream.cuda_stream, base + 4 * src, self.tiles_per_rank)
        self.reduce_kernel(self.partials, result, self.counters, self.calls)
