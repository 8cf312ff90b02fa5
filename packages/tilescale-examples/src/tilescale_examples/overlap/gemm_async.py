"""A GEMM ``C = A @ B`` whose compute warpgroups keep one WGMMA group in flight: the pipeline of
stock TileLang's GEMM written out by hand, with the one change its automatic lowering cannot
make.

Why
---

Stock TileLang's Hopper GEMM (:func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`,
``T.Pipelined`` with ``T.gemm``) is warp-specialised: a producer warpgroup issues the TMA loads
of each ``k`` step into a ring of ``num_stages`` shared-memory stages, the compute warpgroups
wait for a stage, run its WGMMAs and release it. After every step they wait for **all** their
WGMMAs to finish (``warpgroup_wait<0>``) before they release the stage and issue the next
step, so the tensor cores idle between steps while the next step's instructions are issued.
cuBLAS (and CUTLASS's Hopper mainloop) waits for all but the newest group
(``warpgroup_wait<1>``) and releases the stage of the step before: the next step's WGMMAs are
queued while the current ones run. TileLang's automatic lowering refuses that form
(``T.wgmma_gemm`` with a delayed wait releases the stage too early), so this kernel spells the
warp specialisation out:

* **Producer** (threads ``0 .. 127``, one warp working, ``setmaxnreg`` 40): for each ``k``
  step, wait until stage ``s = step % num_stages`` is empty, issue the TMA loads of ``A``'s
  ``block_m x block_k`` and ``B``'s ``block_k x block_n`` slabs into it (``T.tma_copy``:
  expect-tx and load, the stage's *full* barrier counting the bytes), arrive on *full*.
* **Consumers** (``tiles.threads`` threads, ``setmaxnreg`` up to 232): for each step, wait
  until stage ``s`` is full, issue its WGMMAs (``T.wgmma_gemm``: no implicit wait), wait until
  at most this group is in flight (``T.wait_wgmma(1)``: the previous step's WGMMAs are done)
  and release the **previous** step's stage (its *empty* barrier). After the loop: wait for
  the last group, release its stage, store the float32 accumulator rounded to ``C``.

Barrier parities are derived from the step number (stage ``s`` is filled for the ``j``-th
time at step ``j * num_stages + s``: *full* completes phase ``j``, the producer waits for
*empty*'s phase ``j - 1``); the first lap's waits on *empty* pass at once (parity 1 of a fresh
barrier). Each block computes one output tile, in the grid order of
:func:`~tilescale_examples.overlap.gemm.build_gemm_kernel` (``tiles.swizzle`` rasterizes it).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional

from tilescale_examples.overlap.gemm import GemmTiles, check_gemm_dims, default_tiles

__all__ = ["build_async_gemm_kernel", "consumer_registers", "PRODUCER_THREADS", "PRODUCER_REGISTERS"]

#: Threads of the producer warpgroup (one warp of it issues the loads; the others only give
#: their registers back).
PRODUCER_THREADS = 128
#: ``setmaxnreg`` of the producer warpgroup.
PRODUCER_REGISTERS = 40
#: Registers per SM (``setmaxnreg`` budgets must fit in it together).
SM_REGISTERS = 65536


def consumer_registers(threads: int) -> int:
    """``setmaxnreg`` of ``threads`` compute threads beside the producer warpgroup: what the
    SM's 64 Ki registers leave them, rounded down to a multiple of 8, at most 232 (CUTLASS's
    budget for two compute warpgroups)."""
    share = (SM_REGISTERS - PRODUCER_THREADS * PRODUCER_REGISTERS) // threads
    return max(24, min(232, share // 8 * 8))


def build_async_gemm_kernel(m: int, n: int, k: int, dtype: str = "bfloat16", tiles: Optional[GemmTiles] = None):
    """The ``T.prim_func`` ``gemm_async(A, B, C)``: ``C = A @ B`` with ``A: (m, k)``, ``B: (k,
    n)``, ``C: (m, n)`` of ``dtype`` (float16 or bfloat16; float32 accumulation), one block of
    ``tiles.threads + 128`` threads per ``block_m x block_n`` output tile (module docstring).
    ``tiles`` defaults to :func:`~tilescale_examples.overlap.gemm.default_tiles` of ``n``
    (as :func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`'s); every dimension must be
    a multiple of its tile (``ValueError`` naming it), and ``tiles.num_stages`` at least 2 (a
    stage is released one step late: with one stage the producer would wait for a release that
    waits for its load). Needs an sm_90a target (WGMMA, TMA, ``setmaxnreg``)."""
    import tilelang.language as T

    tiles = tiles or default_tiles(n)
    check_gemm_dims("build_async_gemm_kernel", tiles, m=m, k=k, n=n)
    if tiles.num_stages < 2:
        raise ValueError(f"num_stages must be >= 2 for the async pipeline (a stage is released one step late), "
                         f"got {tiles.num_stages}")
    BM, BN, BK, S, TH = tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages, tiles.threads
    steps = k // BK
    consumer_nreg = consumer_registers(TH)

    @T.prim_func
    def gemm_async(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype)):
        with T.Kernel(n // BN, m // BM, threads=TH + PRODUCER_THREADS) as (bx, by):
            if tiles.swizzle:
                T.use_swizzle(panel_size=tiles.swizzle)
            A_s = T.alloc_shared((S, BM, BK), dtype)
            B_s = T.alloc_shared((S, BK, BN), dtype)
            full = T.alloc_barrier([32] * S)  # the producer warp's arrivals (+ the TMA bytes)
            empty = T.alloc_barrier([TH] * S)  # every compute thread's release
            C_f = T.alloc_fragment((BM, BN), "float32")
            tx = T.get_thread_binding()
            if tx < PRODUCER_THREADS:
                T.set_max_nreg(PRODUCER_REGISTERS, 0)
                if tx < 32:
                    for kk in T.serial(steps):
                        T.mbarrier_wait_parity(empty[kk % S], ((kk // S) & 1) ^ 1)
                        T.tma_copy(A[by * BM:(by + 1) * BM, kk * BK:(kk + 1) * BK], A_s[kk % S, :, :],
                                   barrier=full[kk % S])
                        T.tma_copy(B[kk * BK:(kk + 1) * BK, bx * BN:(bx + 1) * BN], B_s[kk % S, :, :],
                                   barrier=full[kk % S])
                        T.mbarrier_arrive(full[kk % S])
            else:
                T.set_max_nreg(consumer_nreg, 1)
                T.clear(C_f)
                for kk in T.serial(steps):
                    T.mbarrier_wait_parity(full[kk % S], (kk // S) & 1)
                    T.wgmma_gemm(A_s[kk % S, :, :], B_s[kk % S, :, :], C_f)
                    T.wait_wgmma(1)  # the previous step's group is done: its stage is free
                    if kk > 0:
                        T.mbarrier_arrive(empty[(kk + S - 1) % S])
                T.wait_wgmma(0)
                T.mbarrier_arrive(empty[(steps - 1) % S])
                T.copy(C_f, C[by * BM, bx * BN])

    return gemm_async.with_attr("global_symbol", "gemm_async")
