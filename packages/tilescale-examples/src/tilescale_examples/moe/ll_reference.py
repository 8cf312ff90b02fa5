"""The torch references of :class:`tilescale_examples.moe.low_latency.MoELowLatency`, computed
on the host from every rank's inputs: the masked receive layout (:func:`ll_dispatch_reference`,
bit-exact, FP8 included), the combine (:func:`ll_combine_reference`: float32 sums in slot order,
rounded once) and the FP8 quantisation (:func:`quantize_fp8_blocks`, DeepSeek-V3's: one float32
scale ``amax / 448`` per 128 channels).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tilescale_examples.decode.norm_kernel import FP8_BLOCK, FP8_MAX, FP8_TORCH_DTYPE
from tilescale_examples.decode.reference import quantize_fp8

__all__ = ["FP8_BLOCK", "FP8_MAX", "FP8_TORCH_DTYPE", "quantize_fp8_blocks", "ll_dispatch_reference",
           "ll_combine_reference"]


def quantize_fp8_blocks(x: torch.Tensor):
    """``(q, scales)`` of ``(T, hidden)`` tokens (``hidden`` a multiple of 128): ``scale = amax /
    448`` in float32 per 128 channels of a token (``(T, hidden / 128)``), ``q = e4m3(clamp(x /
    scale, -448, 448))`` (``float8_e4m3fn``, 0 where the scale is 0); what the dispatch kernel
    computes, bit for bit."""
    return quantize_fp8(x.float(), "per_block")


def _check_ranks(topk_idx: Sequence[torch.Tensor], num_experts: int, rank: int) -> int:
    W = len(topk_idx)
    if W == 0:
        raise ValueError("topk_idx must hold one tensor per rank, got none")
    if num_experts % W:
        raise ValueError(f"num_experts={num_experts} is not a multiple of {W} ranks")
    if not 0 <= rank < W:
        raise ValueError(f"rank must be in [0, {W}), got {rank}")
    return W


def ll_dispatch_reference(xs: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor], num_experts: int,
                          max_tokens: int, rank: int, *, fp8: bool = False) -> dict:
    """What a low-latency ``dispatch`` delivers on ``rank``, from every rank's ``x`` and
    ``topk_idx`` (entries outside ``[0, num_experts)`` skipped).

    Returns a dict: ``counts`` (``(EL, W)`` int64: entries of rank ``s`` for local expert
    ``j``), ``src`` (``(EL, W * max_tokens, 2)`` int64: the source ``(token, slot)`` of each row,
    ``-1`` past a segment's count; the source rank of row ``s * max_tokens + r`` is ``s``),
    ``mask`` (``(EL, W * max_tokens)`` bool: the rows below their segment's count), ``x``
    (``(EL, W * max_tokens, hidden)`` on ``xs[rank]``'s device, zero past the counts; with
    ``fp8`` the e4m3 rows) and with ``fp8`` ``scales`` (``(EL, W * max_tokens, hidden / 128)``
    float32). Each segment's rows are in its source rank's token order (entry ``t * topk +
    k``)."""
    W = _check_ranks(topk_idx, num_experts, rank)
    if len(xs) != W:
        raise ValueError(f"need one x per rank: {len(xs)} for {W} topk_idx")
    EL, TMAX = num_experts // W, max_tokens
    device, hidden = xs[rank].device, xs[rank].shape[1]
    counts = torch.zeros((EL, W), dtype=torch.int64)
    src = torch.full((EL, W * TMAX, 2), -1, dtype=torch.int64)
    rows = torch.zeros((EL, W * TMAX, hidden), dtype=xs[rank].dtype, device=device)
    for s, (x, idx) in enumerate(zip(xs, topk_idx)):
        if x.shape[0] > TMAX:
            raise ValueError(f"rank {s} has {x.shape[0]} tokens, more than max_tokens={TMAX}")
        flat = idx.detach().reshape(-1).to("cpu", torch.int64)
        mine = ((flat >= rank * EL) & (flat < (rank + 1) * EL)).nonzero().view(-1)  # entry order
        j = flat[mine] - rank * EL
        order = torch.argsort(j, stable=True)  # by expert, then entry
        j, mine = j[order], mine[order]
        seg_counts = torch.bincount(j, minlength=EL)
        counts[:, s] = seg_counts
        slot = torch.arange(len(j)) - (seg_counts.cumsum(0) - seg_counts)[j]
        row = s * TMAX + slot
        topk = idx.shape[1]
        src[j, row, 0], src[j, row, 1] = mine // topk, mine % topk
        rows[j.to(device), row.to(device)] = x.detach().to(device)[(mine // topk).to(device)]
    out = {"counts": counts, "src": src, "mask": src[..., 0] >= 0}
    if not fp8:
        out["x"] = rows
        return out
    q, scales = quantize_fp8_blocks(rows.view(-1, hidden))
    out["x"] = q.view(EL, W * TMAX, hidden)
    out["scales"] = scales.view(EL, W * TMAX, -1)
    return out


def ll_combine_reference(ys: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                         topk_weights: torch.Tensor, num_experts: int, max_tokens: int, rank: int,
                         dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """What a low-latency ``combine`` returns on ``rank``: ``out[t] = sum_k topk_weights[t, k] *
    ys[d][j, rank * max_tokens + r]`` over ``rank``'s valid entries ``(t, k)`` in slot order
    (expert ``e`` on rank ``d = e // EL``, ``j = e % EL``, ``r`` the entry's place in its
    segment), accumulated in float32 and rounded once to ``dtype`` (default ``ys[rank]``'s).
    ``ys[d]`` is rank ``d``'s ``(EL, W * max_tokens, hidden)`` ``y``. The kernel may contract a
    product and a sum into one FMA: compare with ``COMBINE_RTOL`` / ``COMBINE_ATOL``."""
    W = _check_ranks(topk_idx, num_experts, rank)
    EL, TMAX = num_experts // W, max_tokens
    idx = topk_idx[rank].detach().to("cpu", torch.int64)
    tokens, topk = idx.shape
    device = ys[rank].device
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    place = torch.zeros_like(flat)
    for e in flat[valid].unique().tolist():  # the entry's place among this rank's entries of e
        hit = (flat == e).nonzero().view(-1)
        place[hit] = torch.arange(len(hit))
    acc = torch.zeros((tokens, ys[rank].shape[-1]), dtype=torch.float32, device=device)
    w = topk_weights.detach().to(device, torch.float32)
    for k in range(topk):
        for t in range(tokens):
            e = int(idx[t, k])
            if 0 <= e < num_experts:
                row = ys[e // EL][e % EL, rank * TMAX + int(place[t * topk + k])].to(device, torch.float32)
                acc[t] = acc[t] + w[t, k] * row
    return acc.to(dtype or ys[rank].dtype)
