"""The torch references of :class:`tilescale_examples.moe.dispatcher.MoEDispatcher` (computed on
the host from every rank's inputs): where every entry goes (:func:`expected_routes`), what
``dispatch`` returns on a rank (:func:`torch_dispatch_reference`, bit-exact) and what
``combine`` returns (:func:`torch_combine_reference`, in float64, within :data:`COMBINE_RTOL` /
:data:`COMBINE_ATOL`). The receive layout they build is described in the module docstring of
:mod:`tilescale_examples.moe.dispatcher` and in ``docs/moe.md``.

They are re-exported by :mod:`tilescale_examples.moe.dispatcher` (and :mod:`tilescale_examples.moe`).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["expected_routes", "torch_dispatch_reference", "torch_combine_reference", "COMBINE_RTOL", "COMBINE_ATOL"]

#: Tolerance of ``combine`` against the float64 :func:`torch_combine_reference`: the float32
#: sum is rounded once to the dtype (half an ulp: at most 2**-8 relative for bfloat16, 2**-11
#: for float16), and the float32 accumulation errs by at most ``topk * 2**-24 * sum_k |w_k
#: y_k|``, which ``COMBINE_ATOL`` covers while that sum stays below 20 per element.
COMBINE_RTOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}
COMBINE_ATOL = 1e-5

def expected_routes(topk_idx: Sequence[torch.Tensor], num_experts: int):
    """Where every entry goes, computed with torch on the CPU from every rank's ``topk_idx``.

    Returns ``(routes, counts)``: ``routes[s] = (dest_rank, dest_row)``, two int64 tensors of
    ``T_s * topk`` entries (flat index ``t * topk + k``; ``-1`` for an entry whose index is
    outside ``[0, num_experts)``), and ``counts`` (``(W, num_experts)`` int64): entries of rank
    ``s`` that chose expert ``g``. The rows follow the layout of
    :mod:`tilescale_examples.moe.dispatcher`'s module docstring.
    """
    W = len(topk_idx)
    if W == 0:
        raise ValueError("topk_idx must hold one tensor per rank, got none")
    if num_experts % W:
        raise ValueError(f"num_experts={num_experts} is not a multiple of {W} ranks")
    E, EL = num_experts, num_experts // W
    flat = [idx.detach().reshape(-1).to("cpu", torch.int64) for idx in topk_idx]
    valid = [(f >= 0) & (f < E) for f in flat]
    counts = torch.stack([torch.bincount(f[ok], minlength=E) for f, ok in zip(flat, valid)])
    per_owner = counts.sum(0).view(W, EL)
    expert_start = (per_owner.cumsum(1) - per_owner).reshape(E)  # start of each expert on its owner
    src_prefix = counts.cumsum(0) - counts  # entries of lower ranks, per expert
    routes = []
    for s, (f, ok) in enumerate(zip(flat, valid)):
        g = f[ok]
        order = torch.argsort(g, stable=True)
        ranked = torch.empty_like(g)
        sorted_g = g[order]
        ranked[order] = torch.arange(len(g)) - torch.searchsorted(sorted_g, sorted_g)
        dest_rank = torch.full_like(f, -1)
        dest_row = torch.full_like(f, -1)
        dest_rank[ok] = g // EL
        dest_row[ok] = expert_start[g] + src_prefix[s, g] + ranked
        routes.append((dest_rank, dest_row))
    return routes, counts


def torch_dispatch_reference(xs: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                             num_experts: int, rank: int):
    """What ``dispatch`` returns on ``rank``, from every rank's ``x`` and ``topk_idx``.

    Returns ``(rows, counts, origin)``: ``rows`` (``(R, hidden)`` on ``xs[rank]``'s device:
    the first ``R`` rows of ``recv_x``), ``counts`` (``(EL,)`` int64, CPU) and ``origin``
    (``(R, 2)`` int64, CPU: source rank and entry ``t * topk + k`` of every row)."""
    W = len(xs)
    if len(topk_idx) != W:
        raise ValueError(f"need one topk_idx per rank: {len(topk_idx)} for {W} x")
    if not 0 <= rank < W:
        raise ValueError(f"rank must be in [0, {W}), got {rank}")
    routes, counts = expected_routes(topk_idx, num_experts)
    EL = num_experts // W
    mine = counts[:, rank * EL:(rank + 1) * EL].sum(0)
    total = int(mine.sum())
    device = xs[rank].device
    rows = torch.empty((total, xs[rank].shape[1]), dtype=xs[rank].dtype, device=device)
    origin = torch.full((total, 2), -1, dtype=torch.int64)
    for s, (dest_rank, dest_row) in enumerate(routes):
        here = (dest_rank == rank).nonzero().view(-1)
        topk = topk_idx[s].shape[1]
        rows[dest_row[here].to(device)] = xs[s].detach().to(device)[(here // topk).to(device)]
        origin[dest_row[here], 0] = s
        origin[dest_row[here], 1] = here
    return rows, mine, origin


def torch_combine_reference(ys: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor],
                            topk_weights: Sequence[torch.Tensor], num_experts: int,
                            rank: int) -> torch.Tensor:
    """What ``combine`` returns on ``rank``, in float64 on ``ys[rank]``'s device: ``out[t] =
    sum_k topk_weights[rank][t, k] * ys[d][row]`` over the entries of ``rank`` with a valid
    expert (``(d, row)`` from :func:`expected_routes`); ``ys[d]`` is rank ``d``'s ``y`` (at
    least its received rows). Compare with ``COMBINE_RTOL`` / ``COMBINE_ATOL``."""
    routes, _ = expected_routes(topk_idx, num_experts)
    dest_rank, dest_row = routes[rank]
    T, K = topk_idx[rank].shape
    device = ys[rank].device
    out = torch.zeros((T, ys[rank].shape[1]), dtype=torch.float64, device=device)
    w = topk_weights[rank].detach().to(device, torch.float64).reshape(-1)
    for d, y in enumerate(ys):
        here = (dest_rank == d).nonzero().view(-1).to(device)
        rows = y.detach().to(device)[dest_row.to(device)[here]].to(torch.float64) * w[here, None]
        out.index_add_(0, here // K, rows)
    return out
