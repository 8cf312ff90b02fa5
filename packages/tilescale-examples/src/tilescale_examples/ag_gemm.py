"""All-gather + GEMM, overlapped: ``out = all_gather(a) @ b`` (tensor-parallel column layout).

Every rank holds ``a``, an ``(m_local, k)`` row block of the activations, and ``b``, its own
``(k, n)`` weight columns; afterwards every rank holds ``out = A @ b`` with ``A`` the
``(world * m_local, k)`` stack of every rank's ``a`` (what ``all_gather_into_tensor`` followed
by ``torch.matmul`` computes)::

    agg = AllGatherGEMM(allocator, m_local=1024, k=8192, n=3584, dtype=torch.bfloat16)
    out = agg(a, b)      # (world * 1024, 3584)
    ...
    agg.close()

How it overlaps
---------------

Two kernels run at the same time:

* the producer is the example :class:`~tilescale_examples.allgather.AllGather` on a side
  stream, on a few SMs (``ag_blocks`` blocks, default 16): it puts every 16-byte aligned chunk
  of ``a`` into every rank's gathered ``A`` and, per chunk, release-sets a data flag on the
  receiving rank (``flags[src, c] = epoch``);
* the consumer is a pipelined TMA + WGMMA GEMM on the caller's stream: before its main loop,
  each ``(block_m, block_n)`` output tile waits (thread 0, ``ld.acquire.sys``) for the flags of
  the chunks that hold its ``block_m`` rows of ``A``, then every thread issues
  ``fence.proxy.async`` (the rows were written by generic-proxy stores, TMA reads them through
  the async proxy) and the tile is computed from the local gathered ``A``. Tiles whose rows
  arrived first start first; the tiles of this rank's own rows can start at once.

The all-gather is launched before the GEMM so that its few blocks are resident before the
GEMM's blocks fill the GPU (the GEMM's tiles wait on them). The side stream waits for the
caller's stream at each call (``a`` is written, the previous GEMM no longer reads ``A``) and
the caller's stream waits for the side stream after the GEMM (``a`` may be overwritten
afterwards). Flags carry the epoch, so calls need no reset and no host synchronisation.

Constraints: ``m_local % block_m == 0``, ``k % block_k == 0``, ``n % block_n == 0``;
dtypes float16 and bfloat16 (float32 accumulation).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional, Union

import torch

from tilescale_examples.allgather import AllGather
from tilescale_examples.collective import TARGET, Closable, check_dtype, check_tensor

__all__ = ["AllGatherGEMM", "build_gemm_kernel", "torch_reference"]

_ALLOWED = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def build_gemm_kernel(m_local: int, k: int, n: int, world_size: int, chunks: int, chunk: int,
                      dtype: str = "float16", block_m: int = 128, block_n: int = 128, block_k: int = 64,
                      num_stages: int = 3, threads: int = 256):
    """The consumer GEMM ``T.prim_func``: ``(A: (world_size * m_local, k), B: (k, n), Out:
    (world_size * m_local, n), Flags: (2 * world_size * chunks,) uint64, epoch: int64)``.
    ``Flags[src * chunks + c]`` is the all-gather's data flag of chunk ``c`` (``chunk``
    elements of the flattened ``(m_local, k)`` shard) from rank ``src``."""
    import tilelang.language as T

    for name, value, mult in (("m_local", m_local, block_m), ("k", k, block_k), ("n", n, block_n)):
        if value % mult:
            raise ValueError(f"{name}={value} must be a multiple of {mult}")
    if (chunks - 1) * chunk >= m_local * k or chunks * chunk < m_local * k:
        raise ValueError(f"chunks={chunks} x chunk={chunk} does not tile the {m_local} x {k} shard")
    M, C, CH, BM, BN, BK = world_size * m_local, chunks, chunk, block_m, block_n, block_k

    @T.prim_func
    def ag_gemm(A: T.Tensor((M, k), dtype), B: T.Tensor((k, n), dtype), Out: T.Tensor((M, n), dtype),
                Flags: T.Tensor((2 * world_size * C,), "uint64"), epoch: T.int64):
        with T.Kernel(n // BN, M // BM, threads=threads) as (bx, by):
            A_s = T.alloc_shared((BM, BK), dtype)
            B_s = T.alloc_shared((BK, BN), dtype)
            C_f = T.alloc_fragment((BM, BN), "float32")
            tx = T.get_thread_binding()
            if tx == 0:  # wait for the chunks holding rows by*BM .. by*BM+BM-1 of A
                src = by * BM // m_local
                first = by * BM % m_local * k // CH
                last = ((by * BM % m_local + BM) * k - 1) // CH
                for i in T.serial(last - first + 1):
                    T.wait_ge(Flags[src * C + first + i], epoch)
            T.sync_threads()
            T.fence_proxy_async()  # generic-proxy writes (the puts) before async-proxy reads (TMA)
            T.clear(C_f)
            for kk in T.Pipelined(k // BK, num_stages=num_stages):
                T.copy(A[by * BM, kk * BK], A_s)
                T.copy(B[kk * BK, bx * BN], B_s)
                T.gemm(A_s, B_s, C_f)
            T.copy(C_f, Out[by * BM, bx * BN])

    return ag_gemm


def torch_reference(a_shards, b: torch.Tensor) -> torch.Tensor:
    """``cat(a_shards) @ b`` in float32 (compare the kernel's output with a tolerance)."""
    a_shards = list(a_shards)
    if not a_shards:
        raise ValueError("a_shards must hold one tensor per rank, got none")
    return torch.cat([a.float() for a in a_shards], dim=0) @ b.float()


class AllGatherGEMM(Closable):
    """``out = all_gather(a) @ b`` with the all-gather overlapped with the GEMM.

    Args:
        allocator: an open tilescale-core allocator; its ``num_ranks`` ranks take part.
        m_local, k, n: ``a`` is ``(m_local, k)`` on every rank, ``b`` ``(k, n)``; the output
            is ``(world_size * m_local, n)``.
        dtype: float16 or bfloat16 (float32 accumulation).
        group: process group (the collectives' barrier and ``compile_group``).
        block_m, block_n, block_k, num_stages, threads: the GEMM's tiling.
        ag_blocks: blocks (SMs) of the all-gather producer (default 16).
        min_chunk_bytes: smallest all-gather chunk (default: one ``block_m`` row block).
        target: TileLang target (default ``sm_90a``).

    Attributes: ``all_gather`` (its ``output`` is the gathered ``A``), ``kernel`` (the GEMM),
    ``output`` (``(world_size * m_local, n)``, overwritten by the next call), ``epoch``.
    Construction and calls are collective (same instances, same call sequence on every rank).
    """

    def __init__(self, allocator, m_local: int, k: int, n: int, dtype: Union[torch.dtype, str] = torch.float16, *,
                 group=None, block_m: int = 128, block_n: int = 128, block_k: int = 64, num_stages: int = 3,
                 threads: int = 256, ag_blocks: int = 16, min_chunk_bytes: Optional[int] = None, target=None):
        for name, value in (("m_local", m_local), ("k", k), ("n", n), ("ag_blocks", ag_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.dtype = check_dtype(dtype, _ALLOWED)
        self.m_local, self.k, self.n = m_local, k, n
        itemsize = self.dtype.itemsize
        if min_chunk_bytes is None:
            min_chunk_bytes = block_m * k * itemsize
        self.all_gather = AllGather(allocator, (m_local, k), self.dtype, group=group,
                                    max_blocks=ag_blocks, min_chunk_bytes=min_chunk_bytes, target=target)
        ag = self.all_gather
        self.world_size, self.device = ag.world_size, ag.device
        func = build_gemm_kernel(m_local, k, n, ag.world_size, ag.chunks, ag.chunk, _ALLOWED[self.dtype],
                                 block_m, block_n, block_k, num_stages, threads)
        import tilelang

        self.kernel = tilelang.compile(func, target=target or TARGET, compile_once=True, compile_group=ag.group)
        self.output = torch.empty((ag.world_size * m_local, n), dtype=self.dtype, device=self.device)
        self._side = None  # the producer's stream, made at the first call

    @property
    def epoch(self) -> int:
        """Calls made so far."""
        return self.all_gather.epoch

    def check_inputs(self, a, b) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``a`` or ``b`` unless they are contiguous
        ``(m_local, k)`` and ``(k, n)`` tensors of this dtype on the allocator's device."""
        check_tensor(a, (self.m_local, self.k), self.dtype, self.device, "a", "(m_local, k) =", "AllGatherGEMM")
        check_tensor(b, (self.k, self.n), self.dtype, self.device, "b", "(k, n) =", "AllGatherGEMM")

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``all_gather(a) @ b`` on the current stream; returns ``self.output``."""
        if self.kernel is None:
            raise RuntimeError("this AllGatherGEMM is closed")
        self.all_gather._check_open()
        self.check_inputs(a, b)
        main = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        self._side.wait_stream(main)  # a is written; the previous GEMM is done with A
        with torch.cuda.stream(self._side):
            gathered = self.all_gather(a)  # launched first: its few blocks go resident first
        self.kernel(gathered.view(-1, self.k), b, self.output, self.all_gather.flags, self.all_gather.epoch)
        main.wait_stream(self._side)  # the caller may overwrite a after this call
        return self.output

    def flops(self) -> float:
        """Floating-point operations of one call's GEMM: ``2 * M * n * k``."""
        return 2.0 * self.world_size * self.m_local * self.n * self.k

    def close(self) -> None:
        """Drop the kernels and buffers (idempotent); heap bytes return with ``allocator.close()``."""
        self.all_gather.close()
        self.kernel = self.output = self._side = None

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self.kernel is None

    def __repr__(self) -> str:
        return (f"AllGatherGEMM(m_local={self.m_local}, k={self.k}, n={self.n}, dtype={self.dtype}, "
                f"world_size={self.world_size}, epoch={self.epoch}{', closed' if self.closed else ''})")
