"""The async GEMM pipeline (:class:`~tilescale_examples.overlap.gemm.GemmTiles` with
``pipeline="async"``): compute warpgroups that keep one WGMMA group in flight, with the warp
specialisation of stock TileLang's GEMM written out by hand to make the one change its
automatic lowering cannot make.

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
(``T.wgmma_gemm`` with a delayed wait releases the stage too early), so this pipeline spells
the warp specialisation out:

* **Producer** (threads ``0 .. 127``, one warp working, ``setmaxnreg`` 40): for each ``k``
  step, wait until stage ``s = step % num_stages`` is empty, issue the TMA loads of ``A``'s
  ``block_m x block_k`` and ``B``'s ``block_k x block_n`` slabs into it (``T.tma_copy``:
  expect-tx and load, the stage's *full* barrier counting the bytes), arrive on *full*.
* **Consumers** (``tiles.threads`` threads, ``setmaxnreg`` up to 232): for each step, wait
  until stage ``s`` is full, issue its WGMMAs (``T.wgmma_gemm``: no implicit wait), wait until
  at most this group is in flight (``T.wait_wgmma(1)``: the previous step's WGMMAs are done)
  and release the **previous** step's stage (its *empty* barrier). After the loop: wait for
  the last group and release its stage; the kernel's epilogue then runs on these threads
  alone.

Barrier parities are derived from the step number (stage ``s`` is filled for the ``j``-th
time at step ``j * num_stages + s``: *full* completes phase ``j``, the producer waits for
*empty*'s phase ``j - 1``); the first lap's waits on *empty* pass at once (parity 1 of a fresh
barrier). The step number runs on across a block's tiles: a block computing several tiles
(:mod:`~tilescale_examples.overlap.gemm_persistent`) numbers tile ``i``'s step ``kk`` as ``i *
steps + kk`` (the ``first`` of :func:`load_steps` and :func:`compute_steps`), so its ring of
stages never drains between tiles.

:func:`pipeline_stages`, :func:`load_steps` and :func:`compute_steps` are the pieces as
``T.macro`` s; :func:`async_gemm_tile` is one tile of them and its epilogue. The library's
kernels with one output tile per block take it through
:func:`~tilescale_examples.overlap.gemm.gemm_tile` when their tiles say ``pipeline="async"``:
``build_gemm_kernel(m, n, k, dtype, GemmTiles(pipeline="async"))`` is the async GEMM.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from tilescale_examples.overlap.gemm import GemmTiles

__all__ = ["async_gemm_tile", "pipeline_stages", "load_steps", "compute_steps", "consumer_registers", "PRODUCER_THREADS",
           "PRODUCER_REGISTERS"]

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


def pipeline_stages(dtype: str, tiles: GemmTiles):
    """A ``T.macro`` ``stages()`` allocating the pipeline's shared memory and barriers in the
    calling kernel; returns ``(A_s, B_s, full, empty)``: ``tiles.num_stages`` slabs of ``A``
    (``block_m x block_k``) and of ``B`` (``block_k x block_n``) of ``dtype``, each stage's
    *full* barrier (the producer warp's 32 arrivals and the TMA bytes) and *empty* barrier
    (every compute thread's release)."""
    import tilelang.language as T

    BM, BN, BK, S, TH = tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages, tiles.threads

    @T.macro
    def stages():
        A_s = T.alloc_shared((S, BM, BK), dtype)
        B_s = T.alloc_shared((S, BK, BN), dtype)
        full = T.alloc_barrier([32] * S)
        empty = T.alloc_barrier([TH] * S)
        return A_s, B_s, full, empty

    return stages


def load_steps(steps: int, tiles: GemmTiles):
    """A ``T.macro`` ``load(A, B, A_s, B_s, full, empty, row, col, first)`` for the producer
    warp (32 threads): the TMA loads of ``steps`` ``k`` steps of one output tile (``A[row:row +
    block_m, kk * block_k ...]``, ``B[kk * block_k ..., col:col + block_n]``), each into its
    stage after waiting for the stage to be empty. ``first`` is the pipeline's running step
    number of this tile's step 0 (0 for a kernel's first tile; ``i * steps`` for a persistent
    block's ``i``-th): stage and barrier parities follow from it (module docstring)."""
    import tilelang.language as T

    BM, BN, BK, S = tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages

    @T.macro
    def load(A, B, A_s, B_s, full, empty, row, col, first):
        for kk in T.serial(steps):
            T.mbarrier_wait_parity(empty[(first + kk) % S], (((first + kk) // S) & 1) ^ 1)
            T.tma_copy(A[row:row + BM, kk * BK:(kk + 1) * BK], A_s[(first + kk) % S, :, :],
                       barrier=full[(first + kk) % S])
            T.tma_copy(B[kk * BK:(kk + 1) * BK, col:col + BN], B_s[(first + kk) % S, :, :],
                       barrier=full[(first + kk) % S])
            T.mbarrier_arrive(full[(first + kk) % S])

    return load


def compute_steps(steps: int, tiles: GemmTiles):
    """A ``T.macro`` ``compute(A_s, B_s, full, empty, C_f, first)`` for the compute threads:
    ``C_f = `` the sum over ``steps`` ``k`` steps of their stages' products, one WGMMA group in
    flight (each step's stage released once the next step's group is issued and the step's
    own has finished; the last after ``wait_wgmma(0)``); ``first`` as in :func:`load_steps`.
    On return every WGMMA has finished, every stage of the tile is released and ``C_f``'s
    registers are fenced (no read of them moves above the last wait)."""
    import tilelang.language as T

    from tilescale_examples.overlap.gemm import warp_policy

    BM, BN, S, TH = tiles.block_m, tiles.block_n, tiles.num_stages, tiles.threads
    policy = warp_policy(tiles)

    @T.macro
    def compute(A_s, B_s, full, empty, C_f, first):
        T.clear(C_f)
        for kk in T.serial(steps):
            T.mbarrier_wait_parity(full[(first + kk) % S], ((first + kk) // S) & 1)
            T.wgmma_gemm(A_s[(first + kk) % S, :, :], B_s[(first + kk) % S, :, :], C_f, policy=policy)
            T.wait_wgmma(1)  # the previous step's group is done: its stage is free
            if kk > 0:
                T.mbarrier_arrive(empty[(first + kk + S - 1) % S])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(C_f, num_regs=BM * BN // TH)  # no read of C_f moves above the wait
        T.mbarrier_arrive(empty[(first + steps - 1) % S])

    return compute


def async_gemm_tile(steps: int, dtype: str, tiles: GemmTiles, epilogue):
    """A ``T.macro`` ``tile(A, B, C_f, row, col, *args)``: ``C_f = A[row:row+block_m, :steps *
    block_k] @ B[:steps * block_k, col:col+block_n]`` in the float32 fragment ``C_f``
    (``(block_m, block_n)``) of the compute threads (module docstring), then the ``T.macro``
    ``epilogue(C_f, *args)`` on those threads (the producer warpgroup, at 40 registers, never
    holds ``C_f``). Threads ``0 .. 127`` load, the ``tiles.threads`` after them compute: run it
    once per kernel, in a block of ``tiles.threads + 128`` threads. ``tiles.num_stages`` is at
    least 2 (GemmTiles checks it). What :func:`~tilescale_examples.overlap.gemm.gemm_tile`
    returns for ``pipeline="async"``."""
    import tilelang.language as T

    stages, load, compute = pipeline_stages(dtype, tiles), load_steps(steps, tiles), compute_steps(steps, tiles)
    consumer_nreg = consumer_registers(tiles.threads)

    @T.macro
    def tile(A, B, C_f, row, col, *args):
        A_s, B_s, full, empty = stages()
        tx = T.get_thread_binding()
        if tx < PRODUCER_THREADS:
            T.set_max_nreg(PRODUCER_REGISTERS, 0)
            if tx < 32:
                load(A, B, A_s, B_s, full, empty, row, col, 0)
        else:
            T.set_max_nreg(consumer_nreg, 1)
            compute(A_s, B_s, full, empty, C_f, 0)
            epilogue(C_f, *args)

    return tile
