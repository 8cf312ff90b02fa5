"""The implementations of ``torch.ops.tilescale.*`` (:mod:`tilescale_examples.torch_ops`):
for each operator its eager function (a fresh result, through the class API) and its fake
(meta) function, which checks the same shapes at trace time."""

import inspect
from dataclasses import fields
from typing import Dict, Tuple

import torch

from tilescale_examples.torch_ops._registry import _class_name, _lock, _lookup_entry

__all__ = ["IMPLS"]


# ---------------------------------------------------------------------------- helpers
def _fail_shape(kind: str, h: int, inst, name: str, t: torch.Tensor, shape, dtype, what: str) -> None:
    """``ValueError`` unless ``t`` has ``shape`` and ``dtype`` (at trace time too)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"torch.ops.tilescale.{kind}: {name} is {tuple(t.shape)} {t.dtype}, but handle {h} "
                         f"({_class_name(inst)}) takes {what} {tuple(shape)} {dtype}")


_TAKES_OUT: Dict[Tuple[type, str], bool] = {}


def _takes_out(obj, method: str = "__call__") -> bool:
    """Whether ``obj``'s ``method`` accepts an ``out=`` keyword (cached per class)."""
    key = (type(obj), method)
    known = _TAKES_OUT.get(key)
    if known is None:
        try:
            params = inspect.signature(getattr(type(obj), method)).parameters
            known = "out" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            known = False
        _TAKES_OUT[key] = known
    return known


def _call_into(inst, out: torch.Tensor, *args) -> torch.Tensor:
    """``inst(*args, out=out)`` (a copy of the result into ``out`` for a class without
    ``out=``); returns ``out``, which the caller allocated (a fresh tensor)."""
    if _takes_out(inst):
        inst(*args, out=out)
    else:
        result = inst(*args)
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)
    return out


# ---------------------------------------------------------------------------- implementations
def _all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Sum ``x`` over every rank. ``x``: the instance's ``shape`` and dtype, on its device;
    returns a fresh tensor of the same shape and dtype."""
    h, _, inst = _lookup_entry(handle, "all_reduce")
    _fail_shape("all_reduce", h, inst, "x", x, tuple(inst.shape), inst.dtype, "shape")
    out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _all_reduce_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "all_reduce")
    _fail_shape("all_reduce", h, inst, "x", x, tuple(inst.shape), inst.dtype, "shape")
    return x.new_empty(tuple(x.shape))


def _reduce_scatter(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Sum row ``rank`` of ``x`` over every rank. ``x``: the instance's ``shape``,
    ``(world_size, *row)``; returns a fresh ``row`` tensor (``shard_shape``)."""
    h, _, inst = _lookup_entry(handle, "reduce_scatter")
    _fail_shape("reduce_scatter", h, inst, "x", x, inst.shape, inst.dtype, "shape = (world_size, *row) =")
    out = torch.empty(tuple(inst.shard_shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _reduce_scatter_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "reduce_scatter")
    _fail_shape("reduce_scatter", h, inst, "x", x, inst.shape, inst.dtype, "shape = (world_size, *row) =")
    return x.new_empty(tuple(inst.shard_shape))


def _all_gather(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Gather every rank's shard ``x`` (the instance's ``shape``); returns a fresh
    ``(world_size, *shape)`` tensor, row ``r`` being rank ``r``'s shard."""
    h, _, inst = _lookup_entry(handle, "all_gather")
    _fail_shape("all_gather", h, inst, "x", x, inst.shape, inst.dtype, "shape =")
    out = torch.empty((inst.world_size, *inst.shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _all_gather_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "all_gather")
    _fail_shape("all_gather", h, inst, "x", x, inst.shape, inst.dtype, "shape =")
    return x.new_empty((inst.world_size, *inst.shape))


def _all_to_all(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Send row ``p`` of ``x`` (the instance's ``shape``, ``(world_size, *row)``) to rank
    ``p``; returns a fresh tensor of the same shape, row ``s`` being what rank ``s`` sent
    here."""
    h, _, inst = _lookup_entry(handle, "all_to_all")
    _fail_shape("all_to_all", h, inst, "x", x, inst.shape, inst.dtype, "shape = (world_size, *row) =")
    out = torch.empty(tuple(inst.shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _all_to_all_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "all_to_all")
    _fail_shape("all_to_all", h, inst, "x", x, inst.shape, inst.dtype, "shape = (world_size, *row) =")
    return x.new_empty(tuple(inst.shape))


def _gemm_checks(kind: str, h: int, inst, a, b, gathered: bool) -> None:
    if gathered:
        _fail_shape(kind, h, inst, "a", a, (inst.m_local, inst.k), inst.dtype, "a = (m_local, k) =")
    else:
        _fail_shape(kind, h, inst, "a", a, (inst.world_size * inst.m_local, inst.k), inst.dtype,
                    "a = (world_size * m_local, k) =")
    _fail_shape(kind, h, inst, "b", b, (inst.k, inst.n), inst.dtype, "b = (k, n) =")


def _all_gather_matmul(a: torch.Tensor, b: torch.Tensor, handle: int) -> torch.Tensor:
    """``all_gather(a) @ b``: ``a`` ``(m_local, k)`` on every rank, ``b`` ``(k, n)``; returns a
    fresh ``(world_size * m_local, n)`` tensor (rows ``r * m_local ..`` from rank ``r``'s
    ``a``)."""
    h, _, inst = _lookup_entry(handle, "all_gather_matmul")
    _gemm_checks("all_gather_matmul", h, inst, a, b, True)
    out = torch.empty((inst.world_size * inst.m_local, inst.n), dtype=a.dtype, device=a.device)
    return _call_into(inst, out, a.contiguous(), b.contiguous())


def _all_gather_matmul_fake(a, b, handle):
    h, _, inst = _lookup_entry(handle, "all_gather_matmul")
    _gemm_checks("all_gather_matmul", h, inst, a, b, True)
    return a.new_empty((inst.world_size * inst.m_local, inst.n))


def _matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, handle: int) -> torch.Tensor:
    """``reduce_scatter(a @ b)``: ``a`` ``(world_size * m_local, k)``, ``b`` ``(k, n)``;
    returns a fresh ``(m_local, n)`` tensor: rows ``rank * m_local ..`` of the product,
    summed over every rank."""
    h, _, inst = _lookup_entry(handle, "matmul_reduce_scatter")
    _gemm_checks("matmul_reduce_scatter", h, inst, a, b, False)
    out = torch.empty((inst.m_local, inst.n), dtype=a.dtype, device=a.device)
    return _call_into(inst, out, a.contiguous(), b.contiguous())


def _matmul_reduce_scatter_fake(a, b, handle):
    h, _, inst = _lookup_entry(handle, "matmul_reduce_scatter")
    _gemm_checks("matmul_reduce_scatter", h, inst, a, b, False)
    return a.new_empty((inst.m_local, inst.n))


def _moe_token_checks(kind: str, h: int, inst, x, topk_idx, topk_weights) -> None:
    if x.dim() != 2 or x.shape[1] != inst.hidden or x.dtype != inst.dtype:
        raise ValueError(f"torch.ops.tilescale.{kind}: x is {tuple(x.shape)} {x.dtype}, but handle {h} "
                         f"(MoEDispatcher) takes (tokens, hidden={inst.hidden}) {inst.dtype}")
    if x.shape[0] > inst.max_tokens:
        raise ValueError(f"torch.ops.tilescale.{kind}: x has {x.shape[0]} tokens, more than the max_tokens="
                         f"{inst.max_tokens} of handle {h} (MoEDispatcher)")
    T = x.shape[0]
    _fail_shape(kind, h, inst, "topk_idx", topk_idx, (T, inst.topk), inst.index_dtype, "topk_idx = (tokens, topk) =")
    _fail_shape(kind, h, inst, "topk_weights", topk_weights, (T, inst.topk), torch.float32,
                "topk_weights = (tokens, topk) =")


def _moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  handle: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send every token of ``x`` (``(T, hidden)``, ``T <= max_tokens``) to the owners of its
    ``topk`` experts (``topk_idx`` ``(T, topk)`` in ``index_dtype``, ``-1`` skips a slot;
    ``topk_weights`` ``(T, topk)`` float32, used by the combine).

    Returns fresh tensors ``(recv_x, counts, recv_offsets)``: ``(capacity, hidden)`` in
    the dispatcher's dtype (a copy of the whole receive buffer: rows past
    ``recv_offsets[-1]`` are stale), ``(experts_per_rank,)`` int32 rows per local expert
    and ``(experts_per_rank + 1,)`` int32 offsets (expert ``j``'s rows are
    ``recv_offsets[j] .. recv_offsets[j + 1]``). The dispatcher's ``validate`` setting
    applies (``validate=True`` cannot be captured in a CUDA graph)."""
    h, entry, inst = _lookup_entry(handle, "moe_dispatch")
    _moe_token_checks("moe_dispatch", h, inst, x, topk_idx, topk_weights)
    recv_x, counts, dh = inst.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())
    state = {f.name: getattr(dh, f.name) for f in fields(dh) if f.name != "dispatcher"}
    with _lock:
        entry.dispatch = (type(dh), state)
    return recv_x.clone(), counts.clone(), dh.recv_offsets.clone()


def _moe_dispatch_fake(x, topk_idx, topk_weights, handle):
    h, _, inst = _lookup_entry(handle, "moe_dispatch")
    _moe_token_checks("moe_dispatch", h, inst, x, topk_idx, topk_weights)
    EL = inst.experts_per_rank
    return (x.new_empty((inst.capacity, inst.hidden)), x.new_empty((EL,), dtype=torch.int32),
            x.new_empty((EL + 1,), dtype=torch.int32))


def _moe_combine_checks(h: int, inst, y, topk_idx) -> None:
    _fail_shape("moe_combine", h, inst, "y", y, (inst.capacity, inst.hidden), inst.dtype,
                "y = (capacity, hidden) =")
    if topk_idx.dim() != 2 or topk_idx.shape[1] != inst.topk or topk_idx.shape[0] > inst.max_tokens:
        raise ValueError(f"torch.ops.tilescale.moe_combine: topk_idx is {tuple(topk_idx.shape)}, but handle {h} "
                         f"(MoEDispatcher) takes (tokens, topk={inst.topk}) with tokens <= {inst.max_tokens}")


def _moe_combine(y: torch.Tensor, topk_idx: torch.Tensor, handle: int) -> torch.Tensor:
    """Return every expert output row of ``y`` (``(capacity, hidden)`` in ``recv_x``'s
    layout) to its token's rank and sum it with the token's weights, for the latest
    ``moe_dispatch`` of this dispatcher. ``topk_idx`` is that dispatch's ``(T, topk)``
    routing (its row count sizes the result; the routing itself was kept by the dispatch).
    Returns a fresh ``(T, hidden)`` tensor in the dispatcher's dtype."""
    h, entry, inst = _lookup_entry(handle, "moe_combine")
    _moe_combine_checks(h, inst, y, topk_idx)
    with _lock:
        latest = entry.dispatch
    if latest is None:
        raise RuntimeError(f"torch.ops.tilescale.moe_combine: handle {h} (MoEDispatcher) has no moe_dispatch to "
                           "combine: call torch.ops.tilescale.moe_dispatch with the same handle first")
    cls, state = latest
    if topk_idx.shape[0] != state["num_tokens"]:
        raise ValueError(f"torch.ops.tilescale.moe_combine: topk_idx has {topk_idx.shape[0]} tokens, but the latest "
                         f"moe_dispatch of handle {h} sent {state['num_tokens']}")
    out = inst.combine(y.contiguous(), cls(dispatcher=inst, **state))
    return out.clone()


def _moe_combine_fake(y, topk_idx, handle):
    h, _, inst = _lookup_entry(handle, "moe_combine")
    _moe_combine_checks(h, inst, y, topk_idx)
    return y.new_empty((topk_idx.shape[0], inst.hidden))


#: Operator name -> ``(implementation, fake)``.
IMPLS = {
    "all_reduce": (_all_reduce, _all_reduce_fake),
    "reduce_scatter": (_reduce_scatter, _reduce_scatter_fake),
    "all_gather": (_all_gather, _all_gather_fake),
    "all_to_all": (_all_to_all, _all_to_all_fake),
    "all_gather_matmul": (_all_gather_matmul, _all_gather_matmul_fake),
    "matmul_reduce_scatter": (_matmul_reduce_scatter, _matmul_reduce_scatter_fake),
    "moe_dispatch": (_moe_dispatch, _moe_dispatch_fake),
    "moe_combine": (_moe_combine, _moe_combine_fake),
}
