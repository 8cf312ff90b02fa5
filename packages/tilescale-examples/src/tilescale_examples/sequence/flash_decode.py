"""Distributed flash-decode: decode attention over a KV cache split along the sequence across ranks.

Each rank holds ``seq_local`` positions of every sequence's cache, ``k, v (B, seq_local, Hkv,
D)``; every rank gets the same decode queries ``q (B, H, D)`` (one new token per sequence) and
returns the attention over the whole cache::

    decode = SPFlashDecode(allocator, batch=B, heads=H, kv_heads=Hkv, seq_local=S_r, head_dim=D,
                           dtype=torch.bfloat16)
    o, lse = decode(q, k_cache, v_cache)       # o (B, H, D), lse (B, H) float32, the same on every rank
    decode.close()                             # before allocator.close()

A call runs three kernels on the current stream (two on one rank):

1. :func:`build_decode_partial_kernel`: one block per (split, kv head, sequence) attends the
   ``H / Hkv`` query heads of that kv head (grouped-query attention, padded to the tensor
   cores' 64 rows) over its ``seq_local / splits`` positions, with the online softmax of
   :mod:`~tilescale_examples.sequence.flash_attention`, and writes the split's output and
   log-sum-exp (float32) into this rank's part of a flat buffer;
2. an :class:`~tilescale_examples.collectives.allgather.AllGather` of that buffer (float32,
   device-side call numbers: graph-safe, back-to-back calls need no host synchronisation); on
   one rank there is nothing to gather and the combine reads the partials themselves;
3. :func:`build_decode_combine_kernel`: every rank rescales and sums the ``W * splits``
   partials of each (sequence, head) by their log-sum-exps (the same order on every rank, so
   every rank's result has the same bits).

A partial's log-sum-exp is ``ln(sum_j exp(s_j))`` over its positions (``s_j = q k_j * scale``);
the combine's is ``m + ln(sum_p exp(lse_p - m))`` with ``m`` the largest, and its output
``sum_p exp(lse_p - lse) o_p`` (the kernel folds the partials in rounds with a running
maximum, the same quantities). :func:`partial_reference` and :func:`combine_reference` compute
them in torch.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional, Sequence, Tuple, Union

import torch

from tilescale_examples.base import check_positive_int, check_tensor
from tilescale_examples.sequence._attention_op import AttentionOp
from tilescale_examples._macros import T
from tilescale_examples.sequence.flash_attention import (LN2, LOG2E, attention_buffers, check_head_dim,
                                                         check_scale, softmax_tile, start_rows, tile_scores)

__all__ = ["SPFlashDecode", "build_decode_partial_kernel", "build_decode_combine_kernel", "partial_reference",
           "combine_reference", "rounds_combine_reference", "torch_reference", "combine_heads_per_block", "BLOCK_H",
           "BLOCK_N", "COMBINE_ROUND", "COMBINE_MIN_BLOCKS"]

#: Query heads per partial block (the tensor cores' rows; a kv head's group is padded to it).
BLOCK_H = 64
#: Positions per K/V tile.
BLOCK_N = 64
DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def build_decode_partial_kernel(batch: int, heads: int, kv_heads: int, seq_local: int, head_dim: int, splits: int,
                                scale: float, dtype: str = "bfloat16", threads: int = 128, num_stages: int = 2):
    """``decode_partial(Q, K, V, Lens, P)``: ``P`` (flat float32, ``splits * B * H * (D + 1)``)
    gets ``O[split, b, h, :]`` (first ``splits * B * H * D`` elements) and ``LSE[split, b, h]``
    (the rest) over this rank's first ``Lens[b]`` positions of sequence ``b`` (int32, at most
    ``seq_local``); a split without a position gives ``O = 0`` and ``LSE = -inf``. Grid
    ``splits x Hkv x B``."""
    groups = heads // kv_heads
    per_split = seq_local // splits
    scale_log2 = scale * LOG2E
    acc = "float32"
    n_out = splits * batch * heads * head_dim

    @T.prim_func
    def decode_partial(Q: T.Tensor((batch, heads, head_dim), dtype),
                       K: T.Tensor((batch, seq_local, kv_heads, head_dim), dtype),
                       V: T.Tensor((batch, seq_local, kv_heads, head_dim), dtype),
                       Lens: T.Tensor((batch,), "int32"), P: T.Tensor((n_out + splits * batch * heads,), acc)):
        with T.Kernel(splits, kv_heads, batch, threads=threads) as (sp, hk, b):
            (q_tile, k_tile, v_tile, scores, probs, out, row_max, prev_max, rescale, row_sum,
             denom) = attention_buffers(BLOCK_H, BLOCK_N, head_dim, dtype)

            for i, d in T.Parallel(BLOCK_H, head_dim):  # the group's queries; rows past it are zeros
                q_tile[i, d] = T.if_then_else(i < groups, Q[b, hk * groups + T.min(i, groups - 1), d], 0)
            start_rows(out, denom, row_max)
            start = sp * per_split
            valid = T.min(T.max(Lens[b] - start, 0), per_split)  # this split's positions in the cache
            for kb in T.Pipelined(T.ceildiv(valid, BLOCK_N), num_stages=num_stages):
                T.copy(K[b, start + kb * BLOCK_N:start + (kb + 1) * BLOCK_N, hk, :], k_tile)
                tile_scores(scores, q_tile, k_tile, 0, start + kb * BLOCK_N, BLOCK_H, BLOCK_N, False, start + valid)
                softmax_tile(scores, probs, out, row_max, prev_max, rescale, row_sum, denom, scale_log2, BLOCK_H,
                             BLOCK_N, head_dim)
                T.copy(V[b, start + kb * BLOCK_N:start + (kb + 1) * BLOCK_N, hk, :], v_tile)
                T.gemm(probs, v_tile, out, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(BLOCK_H, head_dim):
                if i < groups:
                    P[((sp * batch + b) * heads + hk * groups + i) * head_dim + d] = T.if_then_else(
                        denom[i] > 0, out[i, d] / T.max(denom[i], 1e-30), 0)
            for i in T.Parallel(BLOCK_H):
                if i < groups:
                    P[n_out + (sp * batch + b) * heads + hk * groups + i] = T.if_then_else(
                        denom[i] > 0, T.log2(T.max(denom[i], 1e-30)) * LN2 + row_max[i] * scale, -T.infinity(acc))

    return decode_partial


#: Partials the combine loads per round (all of a round's loads in flight at once, held in
#: registers: two floats per partial and thread).
COMBINE_ROUND = 32
#: Blocks the combine's grid keeps before it packs several heads into one block: a grid of
#: thousands of one-head blocks (batch 64 x 32 heads) pays for every block's start.
COMBINE_MIN_BLOCKS = 256


def combine_heads_per_block(batch: int, heads: int, head_dim: int) -> int:
    """Heads per combine block: the largest of 4 and 2 that divides ``heads``, keeps a block at
    most 512 threads and leaves at least :data:`COMBINE_MIN_BLOCKS` blocks; else 1."""
    for hb in (4, 2):
        if heads % hb == 0 and head_dim * hb <= 512 and heads // hb * batch >= COMBINE_MIN_BLOCKS:
            return hb
    return 1


def build_decode_combine_kernel(world_size: int, splits: int, batch: int, heads: int, head_dim: int,
                                dtype: str = "bfloat16", heads_per_block: int = 1):
    """``decode_combine(G, O, LSE)``: ``G (W, splits * B * H * (D + 1))`` every rank's partial
    buffer (:func:`build_decode_partial_kernel`'s layout) -> ``O (B, H, D)`` in ``dtype``,
    ``LSE (B, H)`` float32. Grid ``H / heads_per_block x B``, one thread per channel of each of
    the block's heads (:func:`combine_heads_per_block` picks the op's).

    The ``W * splits`` partials of a (sequence, head) are taken in rank-then-split order, in
    rounds of at most :data:`COMBINE_ROUND`: a round issues every load (each partial's
    log-sum-exp and this thread's channel of its output) before the first use, so a decode
    combine (tens of partials) waits on global memory once, then folds the round into a running
    maximum ``m``, sum ``s`` and output ``o`` (the online softmax: earlier rounds rescaled by
    ``exp(m_old - m_new)``; a round whose partials are all empty, ``lse = -inf``, adds
    nothing). The result is ``o / s`` and ``LSE = m + ln(s)``: :func:`rounds_combine_reference`
    is the same arithmetic in torch."""
    acc = "float32"
    HB = heads_per_block
    if HB < 1 or heads % HB or head_dim * HB > 1024:
        raise ValueError(f"heads_per_block={HB} must divide heads={heads} with head_dim * heads_per_block <= 1024")
    parts = world_size * splits
    rounds = -(-parts // COMBINE_ROUND)
    per_round = -(-parts // rounds)
    n_out = splits * batch * heads * head_dim
    total = n_out + splits * batch * heads

    @T.prim_func
    def decode_combine(G: T.Tensor((world_size, total), acc), O: T.Tensor((batch, heads, head_dim), dtype),
                       LSE: T.Tensor((batch, heads), acc)):
        with T.Kernel(heads // HB, batch, threads=head_dim * HB) as (hb, b):
            tx = T.get_thread_binding()
            h = hb * HB + tx // head_dim
            d = tx % head_dim
            lse = T.alloc_local((per_round,), acc)
            val = T.alloc_local((per_round,), acc)
            m = T.alloc_local((1,), acc)
            m_new = T.alloc_local((1,), acc)
            alpha = T.alloc_local((1,), acc)
            s = T.alloc_local((1,), acc)
            o = T.alloc_local((1,), acc)
            m[0] = -T.infinity(acc)
            s[0] = 0
            o[0] = 0
            for r in T.serial(rounds):
                for u in T.unroll(per_round):  # every load of the round before the first use
                    p = r * per_round + u
                    lse[u] = T.if_then_else(p < parts, G[p // splits, n_out + ((p % splits) * batch + b) * heads + h],
                                            -T.infinity(acc))
                    val[u] = T.if_then_else(p < parts,
                                            G[p // splits, (((p % splits) * batch + b) * heads + h) * head_dim + d], 0)
                m_new[0] = m[0]
                for u in T.unroll(per_round):
                    m_new[0] = T.max(m_new[0], lse[u])
                # all empty so far (m_new = -inf): nothing to rescale or add
                alpha[0] = T.if_then_else(m_new[0] == -T.infinity(acc), 0, T.exp2((m[0] - m_new[0]) * LOG2E))
                s[0] = s[0] * alpha[0]
                o[0] = o[0] * alpha[0]
                for u in T.unroll(per_round):
                    alpha[0] = T.if_then_else(m_new[0] == -T.infinity(acc), 0, T.exp2((lse[u] - m_new[0]) * LOG2E))
                    s[0] += alpha[0]
                    o[0] += alpha[0] * val[u]
                m[0] = m_new[0]
            O[b, h, d] = o[0] / s[0]
            if d == 0:
                LSE[b, h] = m[0] + T.log2(s[0]) * LN2

    return decode_combine


# ------------------------------------------------------------------------------ torch references
def partial_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      valid: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(o (B, H, D), lse (B, H))`` in float32 of ``q (B, H, D)`` over the positions of ``k``,
    ``v (B, S, Hkv, D)`` (only where ``valid (B, S)`` is True, when given)."""
    H, Hkv = q.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(H // Hkv, dim=2)  # (B, S, H, D)
    vf = v.float().repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bhd,bshd->bhs", q.float(), kf) * scale
    if valid is not None:
        s = s.masked_fill(~valid[:, None, :].to(s.device), float("-inf"))
    return torch.einsum("bhs,bshd->bhd", torch.softmax(s, -1), vf), torch.logsumexp(s, -1)


def combine_reference(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The combine of partials ``[(o_p, lse_p), ...]`` (float32, in order): ``(o, lse)``."""
    lses = torch.stack([lse for _, lse in parts])  # (P, B, H)
    lse = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - lse)  # (P, B, H)
    return sum(w[..., None] * o for w, (o, _) in zip(weights, parts)), lse


def rounds_combine_reference(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                             per_round: int = COMBINE_ROUND) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`combine_reference` computed the way the combine kernel does (float32): the
    partials ``[(o_p, lse_p), ...]`` folded in rounds of ``per_round`` (the kernel's split of
    ``len(parts)`` into equal rounds of at most that many) with a running maximum ``m``, sum
    ``s`` and unnormalised output ``o``; a round whose partials are all empty (``lse = -inf``)
    while ``m`` is still ``-inf`` adds nothing. Returns ``(o / s, m + ln(s))``."""
    rounds = -(-len(parts) // per_round)
    size = -(-len(parts) // rounds)
    o_sum = torch.zeros_like(parts[0][0], dtype=torch.float32)
    m = torch.full_like(parts[0][1], float("-inf"), dtype=torch.float32)
    s = torch.zeros_like(m)
    for r in range(rounds):
        chunk = parts[r * size:(r + 1) * size]
        m_new = torch.maximum(m, torch.stack([lse.float() for _, lse in chunk]).amax(0))
        empty = m_new == float("-inf")
        alpha = torch.where(empty, torch.zeros_like(m), torch.exp2((m - m_new) * LOG2E))
        s, o_sum = s * alpha, o_sum * alpha[..., None]
        for o_p, lse_p in chunk:
            e = torch.where(empty, torch.zeros_like(m), torch.exp2((lse_p.float() - m_new) * LOG2E))
            s = s + e
            o_sum = o_sum + e[..., None] * o_p.float()
        m = m_new
    return o_sum / s[..., None], m + torch.log2(s) * LN2


def torch_reference(inputs: Sequence[tuple], rank: int, scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a call returns on ``rank`` (the same on every rank): attention of rank 0's ``q``
    over every rank's cache, ``inputs[p] = (q, k_p, v_p)`` or ``(q, k_p, v_p,
    cache_seqlens_p)`` (then only the first ``cache_seqlens_p[b]`` positions of rank ``p``'s
    shard of sequence ``b`` count), in float32."""
    q = inputs[0][0]
    k = torch.cat([x[1] for x in inputs], dim=1)
    v = torch.cat([x[2] for x in inputs], dim=1)
    valid = None
    if any(len(x) > 3 for x in inputs):
        valid = torch.cat([torch.arange(x[1].shape[1])[None, :] < (x[3].cpu()[:, None] if len(x) > 3 else x[1].shape[1])
                           for x in inputs], dim=1)
    return partial_reference(q, k, v, check_scale(scale, q.shape[-1]), valid)


# ------------------------------------------------------------------------------ the op
class SPFlashDecode(AttentionOp):
    """Decode attention over a sequence-split KV cache (see the module docstring).

    Args:
        allocator: the distributed allocator (collective: every rank builds the same ops).
        batch, heads, kv_heads, seq_local, head_dim: ``q (batch, heads, head_dim)``, this
            rank's ``k``, ``v (batch, seq_local, kv_heads, head_dim)``; ``heads`` a multiple
            of ``kv_heads`` (at most :data:`BLOCK_H` apart), ``head_dim`` in
            :data:`~tilescale_examples.sequence.flash_attention.HEAD_DIMS`.
        dtype: bfloat16 or float16 (of ``q``, ``k``, ``v`` and the output).
        world_size, group: as every op (keyword-only).
        splits: partial blocks per (sequence, kv head) on each rank (default: enough to give
            every SM a block, dividing ``seq_local`` into whole K/V tiles).
        scale: of the scores (default ``1 / sqrt(head_dim)``).
    """

    _BUFFERS = ("partials", "gather", "output", "lse", "combine_kernel", "full_lengths")
    Q_SHAPE_NAME, KV_SHAPE_NAME, LSE_SHAPE_NAME = "(B, H, D) =", "(B, seq_local, Hkv, D) =", "(B, H) ="

    def __init__(self, allocator, batch: int, heads: int, kv_heads: int, seq_local: int, head_dim: int,
                 dtype: Union[torch.dtype, str], *, world_size: Optional[int] = None, group=None,
                 splits: Optional[int] = None, scale: Optional[float] = None, target=None):
        self._setup_op(allocator, dtype, world_size, group, tuple(DTYPES))
        self.batch, self.heads = check_positive_int("batch", batch), check_positive_int("heads", heads)
        self.kv_heads, self.seq_local = check_positive_int("kv_heads", kv_heads), check_positive_int("seq_local", seq_local)
        self.head_dim = check_head_dim(check_positive_int("head_dim", head_dim))
        if heads % kv_heads or heads // kv_heads > BLOCK_H:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}, at most {BLOCK_H} times it")
        if seq_local % BLOCK_N:
            raise ValueError(f"seq_local={seq_local} must be a multiple of {BLOCK_N} (the K/V tile)")
        self.scale = check_scale(scale, head_dim)
        self.q_shape, self.kv_shape = (batch, heads, head_dim), (batch, seq_local, kv_heads, head_dim)
        tiles = seq_local // BLOCK_N
        if splits is None:
            want = max(1, self._default_max_blocks() // (batch * kv_heads))
            splits = max(d for d in range(1, tiles + 1) if tiles % d == 0 and d <= want)
        self.splits = check_positive_int("splits", splits)
        if tiles % self.splits:
            raise ValueError(f"splits={splits} must divide the {tiles} K/V tiles of seq_local={seq_local}")
        from tilescale_examples.collectives.allgather import AllGather

        total = self.splits * batch * heads * (head_dim + 1)
        self.gather = AllGather(allocator, (total,), torch.float32, world_size=self.world_size, group=group,
                                target=target)
        self.partials = torch.empty((total,), dtype=torch.float32, device=self.device)
        self.output = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
        self.lse = torch.empty((batch, heads), dtype=torch.float32, device=self.device)
        self.full_lengths = torch.full((batch,), seq_local, dtype=torch.int32, device=self.device)
        name = DTYPES[self.dtype]
        self.kernel = self._compile_plain(lambda: build_decode_partial_kernel(
            batch, heads, kv_heads, seq_local, head_dim, self.splits, self.scale, name), target)
        self.combine_heads_per_block = combine_heads_per_block(batch, heads, head_dim)
        self.combine_kernel = self._compile_plain(lambda: build_decode_combine_kernel(
            self.world_size, self.splits, batch, heads, head_dim, name, self.combine_heads_per_block), target)

    @staticmethod
    def torch_reference(inputs, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """:func:`torch_reference` (``inputs[p] = (q, k_p, v_p)``)."""
        return torch_reference(inputs, rank)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache_seqlens: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q (B, H, D)`` over every rank's cache (collective: every rank calls
        with the same ``q``).

        Args:
            cache_seqlens: ``(B,)`` int32 on the device: how many of this rank's ``seq_local``
                positions of each sequence hold keys (the rest are ignored; default all of
                them). Every sequence needs at least one position on some rank.

        Returns ``(out, lse)``, default the op's own (overwritten by the next call), complete
        on the current stream. Raises :class:`~tilescale_examples.base.ClosedError` after
        ``close()``."""
        out, lse = self._begin_call(q, k, v, out, lse)
        if cache_seqlens is None:
            cache_seqlens = self.full_lengths
        else:
            check_tensor(cache_seqlens, (self.batch,), torch.int32, self.device, "cache_seqlens", "(B,) =",
                         type(self).__name__)
        self.kernel(q, k, v, cache_seqlens, self.partials)
        # one rank: its partials are the whole gathered buffer (no all-gather launch)
        gathered = self.gather(self.partials) if self.world_size > 1 else self.partials.view(1, -1)
        self.combine_kernel(gathered, out, lse)
        return out, lse

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch={self.batch}, heads={self.heads}, kv_heads={self.kv_heads}, "
                f"seq_local={self.seq_local}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"world_size={self.world_size}, splits={self.splits}{', closed' if self.closed else ''})")
