"""The async flash-attention pipeline: one tile's softmax overlapped with the previous tile's
output GEMM inside each compute warpgroup (flash-attention 3's intra-warpgroup overlap).

Why
---

The attention kernel of :mod:`~tilescale_examples.sequence.flash_attention` (``T.Pipelined``
with ``T.gemm``) is warp-specialised by TileLang: a producer warpgroup loads the K/V tiles, two
compute warpgroups each take 64 of the block's query rows. Within a compute warpgroup every
step waits for its GEMM: scores ``S = Q K^T``, then the softmax on the CUDA cores while the
tensor cores idle, then ``O += P V`` while the CUDA cores idle. cuDNN and flash-attention 3
overlap the two: the scores GEMM of tile ``k`` and the output GEMM of tile ``k - 1`` are
issued together, the softmax of tile ``k`` runs while the output GEMM of tile ``k - 1`` is
still on the tensor cores. TileLang's automatic lowering cannot express it (``T.gemm`` always
waits), so this kernel spells the warp specialisation out, as the async GEMM pipeline
(:mod:`~tilescale_examples.overlap.gemm_async`) does:

* **Producer** (threads ``0 .. 127``, one warp working, ``setmaxnreg`` 40): the block's ``Q``
  tile once (``T.tma_copy``, its own barrier), then for each key tile ``k`` its ``K`` and
  ``V`` slabs into stage ``k % num_stages`` of two rings, each slab after its stage was
  released (separate *full* and *empty* barriers for ``K`` and ``V``, so the scores GEMM of a
  tile starts when its ``K`` has landed).
* **Consumers** (``threads`` compute threads, two warpgroups for ``block_m`` 128), per key tile
  ``k``: the mask into ``S`` (zeros, or minus infinity where causal or past the end); wait for
  ``K[k]``; issue ``S += Q K[k]^T``; for ``k > 0`` wait for ``V[k - 1]`` and issue ``O += P
  V[k - 1]`` (``P`` still holds tile ``k - 1``'s probabilities); wait until only that last
  group is in flight (``T.wait_wgmma(1)``: WGMMA groups retire in order, so ``S`` is complete)
  and release ``K[k]``; the softmax of ``S`` (running maximum, ``rescale``, exponentials, row
  sums) while ``O += P V[k - 1]`` runs; wait for it (``T.wait_wgmma(0)``) and release ``V[k -
  1]``; then ``P = S`` (rounded to the inputs' dtype) and ``O *= rescale``. After the last tile
  the last ``O += P V`` is issued and waited for (a block with no key tile, which the SP peer
  kernel has, issues none), and the rows are finished and stored as the synchronous kernel
  stores them.

The register fences (``T.warpgroup_fence_operand``) after each wait keep the compiler from
moving a read of ``S`` or ``O`` above the wait that completes it, or from reusing ``P``'s
registers while a WGMMA still reads them.

The arithmetic is the synchronous kernel's (:func:`~tilescale_examples.sequence.flash_attention.softmax_scores`,
:func:`~tilescale_examples.sequence.flash_attention.rescale_output`, the same masks and the same
finishing), in another order: ``O *= rescale(k)`` comes after ``O += P(k - 1) V(k - 1)``, as in
the synchronous kernel, whose ``rescale_output`` precedes tile ``k``'s own ``P V``.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from tilescale_examples._macros import Scope, T, macro
from tilescale_examples.overlap.gemm_async import PRODUCER_REGISTERS, PRODUCER_THREADS, consumer_registers
from tilescale_examples.sequence.flash_attention import (LOG2E, attention_fragments, block_first_query,
                                                         key_tile_source, key_tiles, mask_scores, rescale_output,
                                                         resume_rows, softmax_scores, start_rows, store_rows)

__all__ = ["build_async_attention_kernel", "async_attention_block"]


def async_attention_block(block_m: int, block_n: int, head_dim: int, dtype: str, num_stages: int, threads: int,
                          tile_source):
    """A ``T.macro`` ``block(k)``: one query block's attention on the async pipeline (the module
    docstring), in a block of ``threads + 128`` threads. ``k`` is a
    :class:`~tilescale_examples._macros.Scope` of the kernel's ``Q``, ``K``, ``V``, ``O``,
    ``LSE``, the block's ``bx`` (query block), ``by`` (head), ``bz`` (batch) and ``kv_head``,
    ``tiles`` (key tiles to visit), ``first_query`` (global position of its first query, for
    the causal mask), and the Python values ``causal``, ``key_end`` (None: no tail),
    ``scale``, ``resume`` (True: continue the rows ``O`` and ``LSE`` hold,
    :func:`~tilescale_examples.sequence.flash_attention.resume_rows`; False: start them) and
    ``source`` (a tuple): key tile ``t`` (``0 <= t < tiles``) is rows ``first .. first +
    block_n`` of shard ``shard`` of ``K`` and ``V``, ``(shard, first) = tile_source(t,
    *source)``, and its mask positions are ``t * block_n``."""
    S = num_stages
    policy = T.GemmWarpPolicy.FullRow
    score_regs = block_m * block_n // threads  # float32 registers of a fragment per thread
    out_regs = block_m * head_dim // threads
    prob_regs = block_m * block_n // threads // 2  # two 16-bit probabilities per register
    consumer_nreg = consumer_registers(threads)

    @macro
    def block(k):
        Q, K, V, O, LSE, bx, by, bz, kv_head, tiles = k.Q, k.K, k.V, k.O, k.LSE, k.bx, k.by, k.bz, k.kv_head, k.tiles
        first_query, causal, key_end, scale = k.first_query, k.causal, k.key_end, k.scale
        scale_log2 = scale * LOG2E
        q_tile = T.alloc_shared((block_m, head_dim), dtype)
        fragments = attention_fragments(block_m, block_n, head_dim, dtype)
        (scores, probs, out, row_max, prev_max, rescale, row_sum, denom) = fragments
        k_ring = T.alloc_shared((S, block_n, head_dim), dtype)
        v_ring = T.alloc_shared((S, block_n, head_dim), dtype)
        q_full = T.alloc_barrier([32])
        k_full = T.alloc_barrier([32] * S)
        v_full = T.alloc_barrier([32] * S)
        k_empty = T.alloc_barrier([threads] * S)
        v_empty = T.alloc_barrier([threads] * S)
        tx = T.get_thread_binding()
        if tx < PRODUCER_THREADS:
            T.set_max_nreg(PRODUCER_REGISTERS, 0)
            if tx < 32:
                T.tma_copy(Q[bz, bx * block_m:(bx + 1) * block_m, by, :], q_tile, barrier=q_full)
                T.mbarrier_arrive(q_full)
                for kb in T.serial(tiles):
                    shard, s0 = tile_source(kb, *k.source)
                    T.mbarrier_wait_parity(k_empty[kb % S], ((kb // S) & 1) ^ 1)
                    T.tma_copy(K[shard, bz, s0:s0 + block_n, kv_head, :], k_ring[kb % S, :, :], barrier=k_full[kb % S])
                    T.mbarrier_arrive(k_full[kb % S])
                    T.mbarrier_wait_parity(v_empty[kb % S], ((kb // S) & 1) ^ 1)
                    T.tma_copy(V[shard, bz, s0:s0 + block_n, kv_head, :], v_ring[kb % S, :, :], barrier=v_full[kb % S])
                    T.mbarrier_arrive(v_full[kb % S])
        else:
            T.set_max_nreg(consumer_nreg, 1)
            if k.resume:
                resume_rows(out, denom, row_max, O, LSE, bz, bx * block_m, by, scale, block_m)
            else:
                start_rows(out, denom, row_max)
            T.clear(probs)  # read by no WGMMA before the first tile's softmax writes it (the pass's init check)
            T.mbarrier_wait_parity(q_full, 0)
            for kb in T.serial(tiles):
                mask_scores(scores, first_query, kb * block_n, block_m, block_n, causal, key_end)
                T.mbarrier_wait_parity(k_full[kb % S], (kb // S) & 1)
                T.wgmma_gemm(q_tile, k_ring[kb % S, :, :], scores, transpose_B=True, policy=policy)
                if kb > 0:
                    T.mbarrier_wait_parity(v_full[(kb - 1) % S], ((kb - 1) // S) & 1)
                    T.wgmma_gemm(probs, v_ring[(kb - 1) % S, :, :], out, policy=policy)
                    T.wait_wgmma(1)  # groups retire in order: the scores are complete
                else:
                    T.wait_wgmma(0)
                T.warpgroup_fence_operand(scores, num_regs=score_regs)
                T.mbarrier_arrive(k_empty[kb % S])
                softmax_scores(scores, row_max, prev_max, rescale, row_sum, denom, scale_log2, block_m, block_n)
                T.wait_wgmma(0)  # the previous tile's output GEMM
                T.warpgroup_fence_operand(out, num_regs=out_regs)
                T.warpgroup_fence_operand(probs, num_regs=prob_regs)
                if kb > 0:
                    T.mbarrier_arrive(v_empty[(kb - 1) % S])
                rescale_output(scores, probs, out, rescale, block_m, head_dim)
            if tiles > 0:  # the last tile's output GEMM (a block with no key tile, which the SP peer
                # kernel has, stores its resumed rows as they are: no V stage was loaded)
                T.mbarrier_wait_parity(v_full[(tiles - 1) % S], ((tiles - 1) // S) & 1)
                T.wgmma_gemm(probs, v_ring[(tiles - 1) % S, :, :], out, policy=policy)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(out, num_regs=out_regs)
                T.mbarrier_arrive(v_empty[(tiles - 1) % S])
            store_rows(O, LSE, (q_tile, None, None, *fragments), bz, bx * block_m, by, scale)

    return block


def build_async_attention_kernel(world_size: int, batch: int, seq_q: int, seq_kv: int, heads: int, kv_heads: int,
                                 head_dim: int, causal: bool, scale: float, dtype: str = "bfloat16",
                                 block_m: int = 128, block_n: int = 128, num_stages: int = 2, threads: int = 256,
                                 name: str = "attention_async", zigzag: bool = False):
    """:func:`~tilescale_examples.sequence.flash_attention.build_attention_kernel` (same
    arguments, parameters and results: ``<name>(Q, K, V, O, LSE, q_start)``) on the async
    pipeline of this module (:func:`async_attention_block`): ``threads`` compute threads
    (``block_m / 64`` warpgroups, one per 64 query rows) beside a producer warpgroup of 128,
    ``num_stages`` (at least 1) stages of ``K`` and of ``V``. Sizes are checked by the
    callers."""
    groups = heads // kv_heads
    n_tiles = world_size * -(-seq_kv // block_n)
    key_end = None if seq_kv % block_n == 0 else seq_kv  # a tail: keys past the end masked
    m_blocks = -(-seq_q // block_m)
    block = async_attention_block(block_m, block_n, head_dim, dtype, num_stages, threads,
                                  lambda kb: key_tile_source(kb, world_size, seq_kv, block_n, zigzag))

    @T.prim_func
    def attention_async(Q: T.Tensor((batch, seq_q, heads, head_dim), dtype),
                        K: T.Tensor((world_size, batch, seq_kv, kv_heads, head_dim), dtype),
                        V: T.Tensor((world_size, batch, seq_kv, kv_heads, head_dim), dtype),
                        O: T.Tensor((batch, seq_q, heads, head_dim), dtype),
                        LSE: T.Tensor((batch, heads, seq_q), "float32"), q_start: T.int32):
        with T.Kernel(m_blocks, heads, batch, threads=threads + PRODUCER_THREADS) as (grid_x, by, bz):
            bx = m_blocks - 1 - grid_x if causal else grid_x  # causal: the heaviest query blocks first
            first_query = block_first_query(bx, q_start, world_size, seq_kv, block_m, zigzag)
            block(Scope(Q=Q, K=K, V=V, O=O, LSE=LSE, bx=bx, by=by, bz=bz, kv_head=by // groups,
                        tiles=key_tiles(first_query, n_tiles, block_m, block_n, causal), first_query=first_query,
                        causal=causal, key_end=key_end, scale=scale, resume=False, source=()))

    return attention_async.with_attr("global_symbol", name)
