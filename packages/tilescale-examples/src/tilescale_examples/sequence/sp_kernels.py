"""The kernels of :class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`: the
flash kernel over the gathered shards (the sequential algorithm), over the rank's own shard
and over the peers' shards as they land (the fused algorithm's two kernels), each on the sync
or the async attention pipeline (``pipeline``, as
:func:`~tilescale_examples.sequence.flash_attention.flash_attention` takes it).
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

from tilescale_examples._macros import Scope, T, macro
from tilescale_examples.sequence.flash_attention import (LOG2E, attend_tile, attention_buffers, attention_builder,
                                                         check_pipeline, resume_rows, store_rows)

__all__ = ["build_sp_attention_kernel", "build_sp_own_attention_kernel", "build_sp_peer_attention_kernel",
           "wait_peer_shards", "peer_tiles", "peer_tile_source"]


def build_sp_attention_kernel(world_size: int, batch: int, seq_local: int, heads: int, kv_heads: int, head_dim: int,
                              causal: bool, scale: float, dtype: str = "bfloat16", block_m: int = 128,
                              block_n: int = 128, num_stages: int = 2, threads: int = 256, order: str = "contiguous",
                              pipeline: str = "sync"):
    """:func:`~tilescale_examples.sequence.flash_attention.build_attention_kernel` over the
    gathered shards (``pipeline="async"``: its async twin): ``sp_attention(Q, K, V, O, LSE,
    q_start)``, ``Q (B, SP, H, D)``, ``K``, ``V (W, B, SP, Hkv, D)``, ``q_start`` the global
    position of this rank's first query (see
    :func:`~tilescale_examples.sequence.sp_attention.positions`)."""
    return attention_builder(pipeline)(world_size, batch, seq_local, seq_local, heads, kv_heads, head_dim, causal, scale,
                              dtype, block_m, block_n, num_stages, threads, name=f"sp_attention_{order}",
                              zigzag=order == "zigzag")


def build_sp_own_attention_kernel(batch: int, seq_local: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                                  scale: float, dtype: str = "bfloat16", block_m: int = 128, block_n: int = 128,
                                  num_stages: int = 2, threads: int = 256, pipeline: str = "sync"):
    """The fused algorithm's first kernel: the flash kernel over this rank's own shard,
    ``sp_attention_own(Q, K, V, O, LSE, q_start)`` with ``K``, ``V`` as ``(1, B, SP, Hkv, D)``
    and ``q_start = 0`` (queries and keys are the same positions: causal is the diagonal)."""
    return attention_builder(pipeline)(1, batch, seq_local, seq_local, heads, kv_heads, head_dim, causal, scale, dtype,
                              block_m, block_n, num_stages, threads, name="sp_attention_own")


def build_sp_peer_attention_kernel(world_size: int, batch: int, seq_local: int, heads: int, kv_heads: int,
                                   head_dim: int, causal: bool, scale: float, dtype: str = "bfloat16",
                                   block_m: int = 128, block_n: int = 128, num_stages: int = 2, threads: int = 256,
                                   order: str = "contiguous", pipeline: str = "sync"):
    """The fused algorithm's second kernel ``sp_attention_peers(Q, K, V, O, LSE, FlagsK, FlagsV,
    rank)``: ``Q (B, SP, H, D)``; ``K``, ``V (W, B, SP, Hkv, D)`` the gathered shards; ``O (B,
    SP, H, D)`` and ``LSE (B, H, SP)`` float32 the own shard's result, continued and
    overwritten; ``FlagsK``, ``FlagsV (W,)`` uint64 ready flags; ``rank``.

    Thread 0 of each block waits until ``FlagsK[src]`` and ``FlagsV[src]`` are 1 for every
    shard ``src`` it reads, then the block resumes its rows' online softmax
    (:func:`~tilescale_examples.sequence.flash_attention.resume_rows`) over those shards' key
    tiles, each either wholly visible or not read (nothing is masked):

    * not causal: every shard but ``rank``;
    * causal, ``"contiguous"``: shards ``0 .. rank - 1`` (``rank * SP / block_n`` tiles);
    * causal, ``"zigzag"`` (shard ``p`` is chunks ``p`` and ``2 W - 1 - p`` of ``C = SP / 2``
      positions, :func:`~tilescale_examples.sequence.sp_attention.positions`): a block of the
      first chunk reads the first chunks of shards ``0 .. rank - 1``; a block of the second
      chunk reads the first chunk of every other shard, then the second chunks of shards
      ``rank + 1 .. W - 1``.

    Grid ``SP / block_m x H x B``; ``SP`` a multiple of the tiles (zigzag: of twice the tiles;
    checked by the caller). ``pipeline="async"``: the same on the async pipeline
    (:func:`~tilescale_examples.sequence.flash_attention_async.async_attention_block`)."""
    W, groups = world_size, heads // kv_heads
    zigzag = causal and order == "zigzag"  # without a mask the order changes nothing
    scale_log2 = scale * LOG2E
    layout = (W, seq_local, block_n, causal, zigzag)
    name = f"sp_attention_peers_{order}" if zigzag else "sp_attention_peers"
    asynchronous = check_pipeline(pipeline) == "async"
    block_threads, block = threads, None
    if asynchronous:
        from tilescale_examples.overlap.gemm_async import PRODUCER_THREADS
        from tilescale_examples.sequence.flash_attention_async import async_attention_block

        block_threads = threads + PRODUCER_THREADS
        block = async_attention_block(block_m, block_n, head_dim, dtype, num_stages, threads,
                                      lambda t, rank, second: peer_tile_source(t, rank, second, *layout))

    @T.prim_func
    def sp_attention_peers(Q: T.Tensor((batch, seq_local, heads, head_dim), dtype),
                           K: T.Tensor((W, batch, seq_local, kv_heads, head_dim), dtype),
                           V: T.Tensor((W, batch, seq_local, kv_heads, head_dim), dtype),
                           O: T.Tensor((batch, seq_local, heads, head_dim), dtype),
                           LSE: T.Tensor((batch, heads, seq_local), "float32"), FlagsK: T.Tensor((W,), "uint64"),
                           FlagsV: T.Tensor((W,), "uint64"), rank: T.int32):
        with T.Kernel(seq_local // block_m, heads, batch, threads=block_threads) as (bx, by, bz):
            kv_head = by // groups
            if zigzag:
                second = bx * block_m >= seq_local // 2  # this block's rows are the shard's second chunk
            wait_peer_shards(FlagsK, FlagsV, rank, second if zigzag else False, W, causal, zigzag)
            visits = peer_tiles(rank, second if zigzag else False, *layout)
            if asynchronous:
                block(Scope(Q=Q, K=K, V=V, O=O, LSE=LSE, bx=bx, by=by, bz=bz, kv_head=kv_head, tiles=visits,
                            first_query=0, causal=False, key_end=None, scale=scale, resume=True,
                            source=(rank, second if zigzag else False)))
            else:
                buffers = attention_buffers(block_m, block_n, head_dim, dtype)
                q_tile, out, row_max, denom = buffers[0], buffers[5], buffers[6], buffers[10]
                T.copy(Q[bz, bx * block_m:(bx + 1) * block_m, by, :], q_tile)
                resume_rows(out, denom, row_max, O, LSE, bz, bx * block_m, by, scale, block_m)
                for t in T.Pipelined(visits, num_stages=num_stages):
                    shard, first = peer_tile_source(t, rank, second if zigzag else False, *layout)
                    attend_tile(K, V, shard, first, bz, kv_head, buffers, 0, 0, False, None, scale_log2)
                store_rows(O, LSE, buffers, bz, bx * block_m, by, scale)

    return sp_attention_peers.with_attr("global_symbol", name)


@macro
def wait_peer_shards(FlagsK, FlagsV, rank, second, world_size, causal, zigzag):
    """The fused peer kernel's start: thread 0 waits until ``FlagsK[src]`` and ``FlagsV[src]``
    are 1 for every shard ``src`` the block reads (:func:`build_sp_peer_attention_kernel`),
    then the block's barrier and an async-proxy fence (the landed shards before the TMA reads)."""
    if T.get_thread_binding() == 0:  # the shards this block reads have landed
        for src in T.serial(world_size):
            if zigzag:
                if src != rank and (src < rank or second):
                    T.wait_ge(FlagsK[src], 1)
                    T.wait_ge(FlagsV[src], 1)
            elif src != rank and (src < rank or not causal):
                T.wait_ge(FlagsK[src], 1)
                T.wait_ge(FlagsV[src], 1)
    T.sync_threads()
    T.fence_proxy_async()  # the landed shards before the async-proxy (TMA) reads


def peer_tiles(rank, second, world_size: int, seq_local: int, block_n: int, causal: bool, zigzag: bool):
    """The peer kernel's key tile count of a block (PrimExpr; ``second``: whether the block's
    rows are its shard's second chunk, zigzag only): see :func:`build_sp_peer_attention_kernel`."""
    tps, tpc = seq_local // block_n, seq_local // 2 // block_n
    if zigzag:
        return T.if_then_else(second, (2 * world_size - 2 - rank) * tpc, rank * tpc)
    return rank * tps if causal else (world_size - 1) * tps


def peer_tile_source(t, rank, second, world_size: int, seq_local: int, block_n: int, causal: bool, zigzag: bool):
    """``(shard, first)`` of the peer kernel's ``t``-th key tile (PrimExprs): zigzag, the first
    chunks (skipping the own shard) then the later shards' second chunks; else every tile but
    the own shard's (causal: the earlier shards' only)."""
    W, tps, tpc, C = world_size, seq_local // block_n, seq_local // 2 // block_n, seq_local // 2
    if zigzag:
        late, early = t >= (W - 1) * tpc, t // tpc
        shard = T.if_then_else(late, rank + 1 + (t - (W - 1) * tpc) // tpc,
                               T.if_then_else(T.And(second, early >= rank), early + 1, early))
        return shard, T.if_then_else(late, C, 0) + (t % tpc) * block_n
    kb = t if causal else t + T.if_then_else(t >= rank * tps, tps, 0)  # every tile but the own shard's
    return kb // tps, (kb % tps) * block_n
