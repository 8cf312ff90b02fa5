"""A TileLang flash-attention forward: the compute core of sequence-parallel attention.

``flash_attention(q, k, v, causal=False)`` returns ``(o, lse)`` for ``q (B, Sq, H, D)`` and
``k``, ``v (B, Skv, Hkv, D)`` in the ``bshd`` layout (flash-attention's; the layout
:class:`~tilescale_examples.sequence.ulysses.UlyssesAllToAll` produces), ``H`` a multiple of
``Hkv`` (grouped-query attention: query head ``h`` reads key/value head ``h // (H / Hkv)``):

* ``o (B, Sq, H, D)`` in the inputs' dtype: ``softmax(q k^T * scale) v`` per head;
* ``lse (B, H, Sq)`` float32: the natural log of each row's softmax denominator,
  ``log(sum_j exp(q k_j * scale))``, which the partial results of a split key/value sequence
  combine with (sequence-parallel attention, flash-decode).

``scale`` defaults to ``1 / sqrt(D)``. ``causal``: query ``i`` sees keys ``j <= i + offset``
with ``offset = Skv - Sq`` (the queries are the last ``Sq`` positions, flash-attention's
convention; ``Sq == Skv`` for self-attention).

The kernel (:func:`build_flash_attention_kernel`) runs one block per ``block_m`` queries of one
head: Q stays in shared memory, K and V tiles of ``block_n`` keys stream through a
``num_stages``-deep software pipeline, the scores and the output accumulate in registers in
float32 (tensor-core GEMMs, WGMMA on Hopper) with the online softmax in base 2; a causal block
stops at its diagonal. Any sequence lengths (a tail tile's loads read zeros, its keys are
masked and its rows not stored; the tiles, ``block_m`` x ``block_n``, are 128 x 128 by default
for head dim 64 and 128, 128 x 64 above), head dim one of :data:`HEAD_DIMS`, dtype bfloat16 or
float16. :func:`flash_attention` runs it on one of two pipelines (:data:`PIPELINES`): by default
the async one (:mod:`~tilescale_examples.sequence.flash_attention_async`: each tile's softmax
overlapped with the previous tile's output GEMM), or ``pipeline="sync"`` (TileLang's
``T.Pipelined``, each GEMM waited for); the same arithmetic.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

import math
from typing import Optional, Tuple

import torch

from tilescale_examples._checks import check_bool
from tilescale_examples._macros import T, macro

__all__ = ["flash_attention", "build_attention_kernel", "build_flash_attention_kernel", "torch_reference",
           "default_tiles", "attention_buffers", "attention_fragments", "start_rows", "resume_rows", "mask_scores",
           "tile_scores", "softmax_scores", "rescale_output", "softmax_tile", "attend_tile", "finish_rows",
           "store_rows", "check_tiles", "check_head_dim", "check_scale", "compile_options", "check_pipeline",
           "attention_builder", "key_tile_source", "block_first_query", "key_tiles",
           "TILE_OPTIONS", "PIPELINES", "DEFAULT_PIPELINE", "HEAD_DIMS", "DTYPES"]

#: Head dimensions the kernel is built for.
HEAD_DIMS = (64, 128, 256)
#: torch dtype -> TileLang dtype name.
DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def attention_fragments(rows: int, cols: int, head_dim: int, dtype: str) -> tuple:
    """The register fragments of an attention block of ``rows`` queries and K/V tiles of
    ``cols`` positions (inside a kernel being built): ``scores`` (float32), ``probs``
    (``dtype``), ``out`` (float32 ``rows x head_dim``) and the online softmax's float32
    ``row_max``, ``prev_max``, ``rescale``, ``row_sum``, ``denom`` (see :func:`softmax_tile`),
    in that order."""
    return (T.alloc_fragment((rows, cols), "float32"), T.alloc_fragment((rows, cols), dtype),
            T.alloc_fragment((rows, head_dim), "float32"), *(T.alloc_fragment((rows,), "float32") for _ in range(5)))


def attention_buffers(rows: int, cols: int, head_dim: int, dtype: str) -> tuple:
    """The buffers of an attention block of ``rows`` queries and K/V tiles of ``cols``
    positions (inside a kernel being built): shared ``q_tile``, ``k_tile``, ``v_tile``, then
    :func:`attention_fragments`, in that order."""
    return (T.alloc_shared((rows, head_dim), dtype), T.alloc_shared((cols, head_dim), dtype),
            T.alloc_shared((cols, head_dim), dtype), *attention_fragments(rows, cols, head_dim, dtype))


@macro
def softmax_scores(scores, row_max, prev_max, rescale, row_sum, denom, scale_log2, rows, cols):
    """The first part of :func:`softmax_tile`, on the scores alone: ``row_max`` becomes the
    running maximum of the raw scores (this tile's included), ``rescale`` the factor that takes
    the earlier sum and output to it, ``scores`` the tile's ``exp2((s - max) * scale_log2)``,
    whose row sums are added to the rescaled ``denom``. ``prev_max``, ``row_sum``: scratch."""
    T.copy(row_max, prev_max)
    T.reduce_max(scores, row_max, dim=1, clear=False)  # the max so far, this tile included
    for i in T.Parallel(rows):
        rescale[i] = T.exp2(prev_max[i] * scale_log2 - row_max[i] * scale_log2)
    for i, j in T.Parallel(rows, cols):
        scores[i, j] = T.exp2(scores[i, j] * scale_log2 - row_max[i] * scale_log2)
    T.reduce_sum(scores, row_sum, dim=1)
    for i in T.Parallel(rows):
        denom[i] = denom[i] * rescale[i] + row_sum[i]


@macro
def rescale_output(scores, probs, out, rescale, rows, head_dim):
    """The second part of :func:`softmax_tile`: the tile's probabilities into ``probs`` (the
    inputs' dtype) for the probabilities-times-V GEMM, and the output so far rescaled."""
    T.copy(scores, probs)
    for i, j in T.Parallel(rows, head_dim):
        out[i, j] *= rescale[i]


@macro
def softmax_tile(scores, probs, out, row_max, prev_max, rescale, row_sum, denom, scale_log2, rows, cols, head_dim):
    """One K/V tile of the online softmax, in base 2: ``row_max`` becomes the running maximum
    of the raw scores (this tile's included), the earlier sum ``denom`` and output ``out`` are
    rescaled to it, the tile's ``exp2((s - max) * scale_log2)`` is added to ``denom`` and left
    in ``probs`` (the inputs' dtype) for the probabilities-times-V GEMM. ``prev_max``,
    ``rescale``, ``row_sum``: scratch fragments of ``rows``. :func:`softmax_scores`, then
    :func:`rescale_output`."""
    softmax_scores(scores, row_max, prev_max, rescale, row_sum, denom, scale_log2, rows, cols)
    rescale_output(scores, probs, out, rescale, rows, head_dim)


@macro
def start_rows(out, denom, row_max):
    """Before the first K/V tile: no output, no sum, a running maximum of minus infinity."""
    T.fill(out, 0)
    T.fill(denom, 0)
    T.fill(row_max, -T.infinity("float32"))


@macro
def resume_rows(out, denom, row_max, O, LSE, batch_index, first_row, head, scale, rows):
    """Before the first K/V tile of a continuation: the state that :func:`finish_rows` left
    for ``rows`` queries from ``first_row`` of head ``head`` in ``O`` (their normalised
    output, in ``O``'s dtype) and ``LSE`` (their natural-log LSE), so that the next tiles add
    to that result: ``out`` the output, ``denom`` 1, ``row_max`` ``lse / scale`` (in the
    scores' units: the running maximum that makes the earlier sum exactly 1)."""
    T.copy(O[batch_index, first_row:first_row + rows, head, :], out)
    for i in T.Parallel(rows):
        row_max[i] = LSE[batch_index, head, first_row + i] / scale
        denom[i] = 1.0


@macro
def mask_scores(scores, first_query, first_key, rows, cols, causal, key_end):
    """``scores`` before a K/V tile's scores GEMM accumulates into them: minus infinity where
    key ``first_key + j`` is at or past ``key_end`` (None: every key exists) or, with
    ``causal``, after query ``first_query + i`` (global positions); zero elsewhere."""
    if causal and key_end is not None:
        for i, j in T.Parallel(rows, cols):
            scores[i, j] = T.if_then_else(first_query + i >= first_key + j and first_key + j < key_end, 0,
                                          -T.infinity("float32"))
    elif causal:
        for i, j in T.Parallel(rows, cols):
            scores[i, j] = T.if_then_else(first_query + i >= first_key + j, 0, -T.infinity("float32"))
    elif key_end is not None:
        for i, j in T.Parallel(rows, cols):
            scores[i, j] = T.if_then_else(first_key + j < key_end, 0, -T.infinity("float32"))
    else:
        T.clear(scores)


@macro
def tile_scores(scores, q_tile, k_tile, first_query, first_key, rows, cols, causal, key_end):
    """``scores`` of a K/V tile: ``q_tile @ k_tile^T`` (raw, unscaled) over
    :func:`mask_scores`' minus infinities."""
    mask_scores(scores, first_query, first_key, rows, cols, causal, key_end)
    T.gemm(q_tile, k_tile, scores, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)


@macro
def finish_rows(out, denom, row_max, scale, rows, head_dim):
    """After the last K/V tile: ``out`` divided by the sum; ``denom`` becomes the rows'
    natural-log LSE, ``ln(sum) + scale * max``."""
    for i, j in T.Parallel(rows, head_dim):
        out[i, j] /= denom[i]
    for i in T.Parallel(rows):
        denom[i] = T.log2(denom[i]) * LN2 + row_max[i] * scale


@macro
def attend_tile(K, V, shard, first, batch_index, kv_head, buffers, first_query, first_key, causal, key_end, scale_log2):
    """One K/V tile of ``block_n`` keys into the rows' online softmax: keys ``first ..
    first + block_n`` of shard ``shard`` of ``K`` and ``V`` (``(W, B, S, Hkv, D)``), scored
    against ``q_tile`` (:func:`tile_scores`: global positions ``first_query`` and
    ``first_key`` for the masks), :func:`softmax_tile`, then ``probs @ v_tile`` added to
    ``out``. ``buffers``: :func:`attention_buffers`' tuple."""
    (q_tile, k_tile, v_tile, scores, probs, out, row_max, prev_max, rescale, row_sum, denom) = buffers
    rows, cols, head_dim = scores.shape[0], scores.shape[1], out.shape[1]
    T.copy(K[shard, batch_index, first:first + cols, kv_head, :], k_tile)
    tile_scores(scores, q_tile, k_tile, first_query, first_key, rows, cols, causal, key_end)
    softmax_tile(scores, probs, out, row_max, prev_max, rescale, row_sum, denom, scale_log2, rows, cols, head_dim)
    T.copy(V[shard, batch_index, first:first + cols, kv_head, :], v_tile)
    T.gemm(probs, v_tile, out, policy=T.GemmWarpPolicy.FullRow)


@macro
def store_rows(O, LSE, buffers, batch_index, first_row, head, scale):
    """After the last K/V tile: :func:`finish_rows`, then the rows' output into ``O (B, S, H,
    D)`` and their natural-log LSE into ``LSE (B, H, S)``."""
    out, denom, row_max = buffers[5], buffers[10], buffers[6]
    rows, head_dim = out.shape[0], out.shape[1]
    finish_rows(out, denom, row_max, scale, rows, head_dim)
    T.copy(out, O[batch_index, first_row:first_row + rows, head, :])
    T.copy(denom, LSE[batch_index, head, first_row:first_row + rows])


def default_tiles(head_dim: int, pipeline: str = "sync") -> dict:
    """``block_m``, ``block_n``, ``num_stages`` and ``threads`` for a head dimension and a
    :data:`PIPELINES` entry: 128 x 128 tiles up to head dim 128, 128 x 64 above; on the sync
    pipeline one stage up to head dim 128 (TileLang's producer warp group already overlaps the
    K/V loads with the two consumer warp groups' work; a second stage was slower at every
    sequence length but the longest in docs/benchmarks.md's tile rows), two above; on the
    async pipeline two stages of K and of V."""
    check_pipeline(pipeline)
    if head_dim <= 128:
        return {"block_m": 128, "block_n": 128, "num_stages": 1 if pipeline == "sync" else 2, "threads": 256}
    return {"block_m": 128, "block_n": 64, "num_stages": 2, "threads": 256}


#: The attention kernel's pipelines: ``"sync"`` (TileLang's warp specialisation of
#: ``T.Pipelined``: each consumer step waits for its GEMM) and ``"async"``
#: (:mod:`~tilescale_examples.sequence.flash_attention_async`: a tile's softmax overlapped with
#: the previous tile's output GEMM; the default of :func:`flash_attention` and of
#: :class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`, 1.03-1.15x faster
#: than ``"sync"`` in docs/benchmarks.md's attention table).
PIPELINES = ("sync", "async")
#: The pipeline of the attention ops (:func:`flash_attention`,
#: :class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`) when none is given.
DEFAULT_PIPELINE = "async"


def check_pipeline(pipeline: str) -> str:
    """``pipeline``, or ``ValueError`` naming it unless one of :data:`PIPELINES`."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    return pipeline


def attention_builder(pipeline: str):
    """The attention kernel builder of ``pipeline``: :func:`build_attention_kernel`, or for
    ``"async"`` its twin
    :func:`~tilescale_examples.sequence.flash_attention_async.build_async_attention_kernel`
    (same arguments, parameters and results); ``ValueError`` naming an unknown ``pipeline``."""
    if check_pipeline(pipeline) == "async":
        from tilescale_examples.sequence.flash_attention_async import build_async_attention_kernel

        return build_async_attention_kernel
    return build_attention_kernel


def key_tile_source(kb, world_size: int, seq_kv: int, block_n: int, zigzag: bool) -> tuple:
    """``(shard, first)`` of global key tile ``kb`` (PrimExprs): the shard of ``K`` and ``V``
    that holds it and its first position there (see
    :func:`~tilescale_examples.sequence.flash_attention.build_attention_kernel`: shard ``t //
    tiles_per_shard``, or with ``zigzag`` chunk ``c`` of ``2 W`` held by shard ``c`` (first
    half) or ``2 W - 1 - c`` (second half))."""
    if zigzag:
        tiles_per_chunk, chunk = seq_kv // 2 // block_n, seq_kv // 2
        c = kb // tiles_per_chunk
        shard = T.if_then_else(c < world_size, c, 2 * world_size - 1 - c)
        return shard, T.if_then_else(c < world_size, 0, chunk) + (kb % tiles_per_chunk) * block_n
    tiles_per_shard = -(-seq_kv // block_n)
    return kb // tiles_per_shard, (kb % tiles_per_shard) * block_n


def block_first_query(bx, q_start, world_size: int, seq_kv: int, block_m: int, zigzag: bool):
    """The global position of query block ``bx``'s first query (PrimExpr): ``q_start + bx *
    block_m``, or with ``zigzag`` its place in the shard's first or second chunk."""
    if not zigzag:
        return q_start + bx * block_m
    chunk = seq_kv // 2
    return T.if_then_else(bx * block_m < chunk, q_start + bx * block_m,
                          (2 * world_size - 1) * chunk - q_start + bx * block_m - chunk)


def key_tiles(first_query, n_tiles: int, block_m: int, block_n: int, causal: bool):
    """Key tiles a query block starting at global position ``first_query`` visits: all
    ``n_tiles``, or with ``causal`` those up to its diagonal's."""
    return T.min(n_tiles, T.ceildiv(first_query + block_m, block_n)) if causal else n_tiles


def build_attention_kernel(world_size: int, batch: int, seq_q: int, seq_kv: int, heads: int, kv_heads: int,
                           head_dim: int, causal: bool, scale: float, dtype: str = "bfloat16", block_m: int = 128,
                           block_n: int = 128, num_stages: int = 2, threads: int = 256, name: str = "attention",
                           zigzag: bool = False):
    """The forward ``T.prim_func`` ``<name>(Q, K, V, O, LSE, q_start)``: ``Q (B, Sq, H, D)``,
    ``K``, ``V (W, B, Skv, Hkv, D)`` (``W`` shards of ``Skv`` keys each, in position order: key
    tile ``t`` is shard ``t // (Skv / block_n)``'s), ``O (B, Sq, H, D)``, ``LSE (B, H, Sq)``
    float32, ``q_start`` (int32) the global position of the first query (``causal``: query
    ``i`` sees keys ``j <= q_start + i``; a block stops after its diagonal's tile). Grid
    ``ceil(Sq / block_m) x H x B``. One shard may have lengths that are not multiples of the
    tiles (the tail's loads read zeros, its keys are masked, its rows are not stored);
    several shards must be whole tiles. Sizes are checked by the callers.

    ``zigzag``: the sequence is ``2 W`` chunks of ``C = Skv / 2`` positions and shard ``p``
    holds chunks ``p`` and ``2 W - 1 - p`` (so causal work is the same on every rank); the
    queries are such a shard too (``Sq == Skv``), ``q_start = r C`` the first chunk's
    position (the second's is ``(2 W - 1) C - q_start``). Key tiles are visited in global
    order, each read from the shard that holds it; ``C`` must be whole tiles."""
    groups = heads // kv_heads
    scale_log2 = scale * LOG2E
    acc = "float32"
    tiles_per_shard = -(-seq_kv // block_n)
    n_tiles = world_size * tiles_per_shard
    key_end = None if seq_kv % block_n == 0 else seq_kv  # a tail: keys past the end masked
    m_blocks = -(-seq_q // block_m)

    @T.prim_func
    def attention(Q: T.Tensor((batch, seq_q, heads, head_dim), dtype),
                  K: T.Tensor((world_size, batch, seq_kv, kv_heads, head_dim), dtype),
                  V: T.Tensor((world_size, batch, seq_kv, kv_heads, head_dim), dtype),
                  O: T.Tensor((batch, seq_q, heads, head_dim), dtype),
                  LSE: T.Tensor((batch, heads, seq_q), acc), q_start: T.int32):
        with T.Kernel(m_blocks, heads, batch, threads=threads) as (block, by, bz):
            # causal: the last queries' blocks (the most key tiles) first, so that the grid ends on light blocks
            bx = m_blocks - 1 - block if causal else block
            buffers = attention_buffers(block_m, block_n, head_dim, dtype)
            q_tile, out, row_max, denom = buffers[0], buffers[5], buffers[6], buffers[10]
            kv_head = by // groups
            T.copy(Q[bz, bx * block_m:(bx + 1) * block_m, by, :], q_tile)
            start_rows(out, denom, row_max)
            first = block_first_query(bx, q_start, world_size, seq_kv, block_m, zigzag)
            blocks = key_tiles(first, n_tiles, block_m, block_n, causal)
            for kb in T.Pipelined(blocks, num_stages=num_stages):
                shard, s0 = key_tile_source(kb, world_size, seq_kv, block_n, zigzag)
                attend_tile(K, V, shard, s0, bz, kv_head, buffers, first, kb * block_n, causal, key_end, scale_log2)
            store_rows(O, LSE, buffers, bz, bx * block_m, by, scale)

    return attention.with_attr("global_symbol", name)


def build_flash_attention_kernel(batch: int, heads: int, kv_heads: int, seq_q: int, seq_kv: int, head_dim: int,
                                 causal: bool, scale: float, dtype: str = "bfloat16", block_m: int = 128,
                                 block_n: int = 128, num_stages: int = 2, threads: int = 256, pipeline: str = "sync"):
    """:func:`build_attention_kernel` of one shard (``pipeline="async"``:
    :func:`~tilescale_examples.sequence.flash_attention_async.build_async_attention_kernel`'s):
    ``flash_attention(Q, K, V, O, LSE, q_start)`` with ``K``, ``V`` as ``(1, B, Skv, Hkv, D)``
    (a view of the ``bshd`` tensors) and ``q_start = Skv - Sq`` (the queries are the last
    positions)."""
    return attention_builder(pipeline)(1, batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, scale, dtype,
                                       block_m, block_n, num_stages, threads, name="flash_attention")


#: The tile options of the attention kernels (:func:`default_tiles`).
TILE_OPTIONS = ("block_m", "block_n", "num_stages", "threads")


def check_tiles(tiles: dict, head_dim: int, pipeline: str = "sync") -> dict:
    """``tiles`` (some of :data:`TILE_OPTIONS`) over :func:`default_tiles` of ``head_dim`` and
    ``pipeline``; ``TypeError`` naming an unknown option."""
    unknown = set(tiles) - set(TILE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown tile options {sorted(unknown)}")
    return {**default_tiles(head_dim, pipeline), **tiles}


def check_head_dim(head_dim: int) -> int:
    """``head_dim``, or ``ValueError`` unless it is one of :data:`HEAD_DIMS`."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    return head_dim


def check_scale(scale: Optional[float], head_dim: int) -> float:
    """The scores' scale: ``scale``, default ``1 / sqrt(head_dim)``; ``ValueError`` unless a
    positive number or None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    return float(scale)


def _check(q, k, v, causal, scale, tiles) -> Tuple[int, ...]:
    """The sizes ``(B, Sq, H, Skv, Hkv, D)``, or ``TypeError`` / ``ValueError`` naming the
    argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float16, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    B, Sq, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k and v must be (batch={B}, seq_kv, kv_heads, head_dim={D}) alike, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError("q, k and v must have one dtype and one device")
    Skv, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's ({Hkv})")
    check_head_dim(D)
    check_bool("causal", causal)
    if causal and Skv < Sq:
        raise ValueError(f"causal attention needs at least as many keys as queries, got {Skv} < {Sq}")
    check_scale(scale, D)
    return B, Sq, H, Skv, Hkv, D


_KERNELS: dict = {}


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                    lse: Optional[torch.Tensor] = None, fast_math: bool = True, pipeline: str = DEFAULT_PIPELINE,
                    **tiles) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward ``(o, lse)`` of ``q (B, Sq, H, D)``, ``k``, ``v (B, Skv, Hkv, D)``
    (see the module docstring), on the current stream.

    Args:
        causal: query ``i`` sees keys ``j <= i + Skv - Sq``.
        scale: of the scores (default ``1 / sqrt(D)``).
        out, lse: where to write (``(B, Sq, H, D)`` in q's dtype, ``(B, H, Sq)`` float32,
            contiguous, on q's device); default new tensors.
        fast_math: compile the kernel with nvcc's ``--use_fast_math`` (TileLang's
            ``TL_ENABLE_FAST_MATH``, as flash-attention's own builds and TileLang's attention
            examples are; the default): the exponentials, logarithms and the final division
            in their approximate hardware forms (a few float32 ulps), denormals flushed to
            zero. ``False``: IEEE forms (2-19% slower on an H100).
        pipeline: one of :data:`PIPELINES`: ``"async"`` (the default: each tile's softmax
            overlapped with the previous tile's output GEMM,
            :mod:`~tilescale_examples.sequence.flash_attention_async`) or ``"sync"`` (each
            GEMM waited for before the softmax); the same arithmetic.
        tiles: ``block_m``, ``block_n``, ``num_stages``, ``threads`` (default
            :func:`default_tiles` of the head dimension and ``pipeline``).

    The kernel is compiled once per shape, dtype, scale and tiles in this process (TileLang's
    disk cache keeps it across processes).

    Raises:
        TypeError / ValueError: naming the argument, before anything is compiled or launched.
    """
    check_pipeline(pipeline)
    tiles = check_tiles(tiles, q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 4 else 128, pipeline)
    check_bool("fast_math", fast_math)
    B, Sq, H, Skv, Hkv, D = _check(q, k, v, causal, scale, tiles)
    scale = check_scale(scale, D)
    for name, t, shape, dtype in (("out", out, (B, Sq, H, D), q.dtype), ("lse", lse, (B, H, Sq), torch.float32)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                              or t.device != q.device or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {q.device}")
    key = (B, H, Hkv, Sq, Skv, D, causal, scale, DTYPES[q.dtype], fast_math, pipeline, *sorted(tiles.items()))
    kernel = _KERNELS.get(key)
    if kernel is None:
        import tilelang

        from tilescale_examples.base import TARGET

        func = build_flash_attention_kernel(B, H, Hkv, Sq, Skv, D, causal, scale, DTYPES[q.dtype], **tiles,
                                            pipeline=pipeline)
        kernel = _KERNELS[key] = tilelang.compile(func, target=TARGET, pass_configs=compile_options(fast_math))
    out = torch.empty((B, Sq, H, D), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if lse is None else lse
    kernel(q, k.unsqueeze(0), v.unsqueeze(0), out, lse, Skv - Sq)
    return out, lse


def compile_options(fast_math: bool) -> Optional[dict]:
    """TileLang pass configuration of the attention kernel: None (TileLang's defaults), or with
    ``fast_math`` ``TL_ENABLE_FAST_MATH`` (nvcc ``--use_fast_math``)."""
    if not fast_math:
        return None
    from tilelang import PassConfigKey

    return {PassConfigKey.TL_ENABLE_FAST_MATH: True}


def torch_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` in float32 with torch (the scores materialised): what :func:`flash_attention`
    computes, for checking it."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().permute(0, 2, 1, 3)  # (B, H, Sq, D)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(H // Hkv, dim=1)
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(H // Hkv, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Skv - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ vf
    return o.permute(0, 2, 1, 3).contiguous(), lse
