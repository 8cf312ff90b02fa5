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


def _named(kind: str, implementation, fake) -> tuple:
    """``(implementation, fake)`` of operator ``kind``, named ``_<kind>`` and ``_<kind>_fake``
    (the names torch shows in traces and errors)."""
    implementation.__name__, fake.__name__ = f"_{kind}", f"_{kind}_fake"
    implementation.__qualname__, fake.__qualname__ = implementation.__name__, fake.__name__
    return implementation, fake


# ---------------------------------------------------------------------------- implementations
#: The operators of the dense ops (collectives and GEMMs): operator -> ``(inputs, output)``;
#: ``inputs``: for each tensor argument ``(name, its shape from the instance, how the error
#: message calls that shape)`` (each also in the instance's dtype); ``output``: the result's
#: shape from the instance. Every such operator returns a fresh tensor of the output shape in
#: the inputs' dtype, filled by one call of the instance:
#:
#: * ``all_reduce(x)``: the sum of ``x`` over every rank (``x``: the instance's ``shape``);
#: * ``reduce_scatter(x)``: the sum of row ``rank`` of ``x`` (``(world_size, *row)``) over
#:   every rank, a ``row`` (``shard_shape``);
#: * ``all_gather(x)``: every rank's shard ``x`` (``shape``), ``(world_size, *shape)``, row
#:   ``r`` being rank ``r``'s;
#: * ``all_to_all(x)``: row ``p`` of ``x`` (``(world_size, *row)``) sent to rank ``p``; row
#:   ``s`` of the result is what rank ``s`` sent here;
#: * ``ulysses_all_to_all(x)``: the Ulysses exchange of ``x`` (the instance's ``shape``,
#:   ``(batch, positions, heads, head_dim)``), the instance's ``output_shape`` (its direction's);
#: * ``all_gather_matmul(a, b)``: ``all_gather(a) @ b``, ``a`` ``(m_local, k)`` on every rank,
#:   ``b`` ``(k, n)``: ``(world_size * m_local, n)`` (rows ``r * m_local ..`` from rank ``r``'s ``a``);
#: * ``matmul_reduce_scatter(a, b)``: ``reduce_scatter(a @ b)``, ``a`` ``(world_size * m_local,
#:   k)``: ``(m_local, n)``, rows ``rank * m_local ..`` of the product summed over every rank;
#: * ``matmul_all_reduce(a, b)``: ``all_reduce(a @ b)``
#:   (:class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`), ``a`` ``(m, k)``, ``b``
#:   ``(k, n)``: ``(m, n)``, the same bits on every rank.
_ROWS = "shape = (world_size, *row) ="
_B = ("b", lambda i: (i.k, i.n), "b = (k, n) =")
DENSE = {
    "all_reduce": ((("x", lambda i: i.shape, "shape"),), lambda i: i.shape),
    "reduce_scatter": ((("x", lambda i: i.shape, _ROWS),), lambda i: i.shard_shape),
    "all_gather": ((("x", lambda i: i.shape, "shape ="),), lambda i: (i.world_size, *i.shape)),
    "all_to_all": ((("x", lambda i: i.shape, _ROWS),), lambda i: i.shape),
    "ulysses_all_to_all": ((("x", lambda i: i.shape, "shape = (batch, positions, heads, head_dim) ="),),
                           lambda i: i.output_shape),
    "all_gather_matmul": ((("a", lambda i: (i.m_local, i.k), "a = (m_local, k) ="), _B),
                          lambda i: (i.world_size * i.m_local, i.n)),
    "matmul_reduce_scatter": ((("a", lambda i: (i.world_size * i.m_local, i.k), "a = (world_size * m_local, k) ="), _B),
                              lambda i: (i.m_local, i.n)),
    "matmul_all_reduce": ((("a", lambda i: (i.m, i.k), "a = (m, k) ="), _B), lambda i: (i.m, i.n)),
}


def _dense_call(kind: str, args: tuple):
    """``(instance, tensor arguments, output shape)`` of a call of dense operator ``kind``
    (``args``: its tensors, then the handle), the tensors checked against the instance."""
    *tensors, handle = args
    h, _, inst = _lookup_entry(handle, kind)
    inputs, output = DENSE[kind]
    for (name, shape_of, what), t in zip(inputs, tensors):
        _fail_shape(kind, h, inst, name, t, shape_of(inst), inst.dtype, what)
    return inst, tensors, tuple(output(inst))


def _dense_impls(kind: str):
    """``(implementation, fake)`` of dense operator ``kind`` (see :data:`DENSE`)."""

    def implementation(*args):
        inst, tensors, shape = _dense_call(kind, args)
        out = torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)
        return _call_into(inst, out, *(t.contiguous() for t in tensors))

    def fake(*args):
        _, tensors, shape = _dense_call(kind, args)
        return tensors[0].new_empty(shape)

    return _named(kind, implementation, fake)


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


#: The attention operators, ``(q, k, v, handle) -> (out, lse)``: the instance's call
#: (:class:`~tilescale_examples.sequence._attention_op.AttentionOp`) on this rank's queries and
#: K/V shard, into fresh ``out`` (the instance's output shape, the inputs' dtype) and ``lse``
#: (float32):
#:
#: * ``sp_attention``: :class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`;
#: * ``sp_flash_decode``: :class:`~tilescale_examples.sequence.flash_decode.SPFlashDecode`
#:   (``cache_seqlens``: the ``(B,)`` int32 filled lengths of this rank's shard, default every
#:   position).
ATTENTION = ("sp_attention", "sp_flash_decode")


def _attention_impls(kind: str):
    """``(implementation, fake)`` of attention operator ``kind`` (see :data:`ATTENTION`)."""

    def checked(q, k, v, handle, lengths=None):
        h, _, inst = _lookup_entry(handle, kind)
        _fail_shape(kind, h, inst, "q", q, inst.q_shape, inst.dtype, f"q {inst.Q_SHAPE_NAME}")
        for name, t in (("k", k), ("v", v)):
            _fail_shape(kind, h, inst, name, t, inst.kv_shape, inst.dtype, f"{name} {inst.KV_SHAPE_NAME}")
        if lengths is not None:
            _fail_shape(kind, h, inst, "cache_seqlens", lengths, inst.q_shape[:1], torch.int32, "cache_seqlens (B,) =")
        return inst

    def implementation(q, k, v, handle, *lengths):
        inst = checked(q, k, v, handle, *lengths)
        out = torch.empty(tuple(inst.output.shape), dtype=q.dtype, device=q.device)
        lse = torch.empty(tuple(inst.lse.shape), dtype=torch.float32, device=q.device)
        options = {} if not lengths or lengths[0] is None else {"cache_seqlens": lengths[0].contiguous()}
        inst(q.contiguous(), k.contiguous(), v.contiguous(), out=out, lse=lse, **options)
        return out, lse

    def fake(q, k, v, handle, *lengths):
        inst = checked(q, k, v, handle, *lengths)
        return q.new_empty(tuple(inst.output.shape)), q.new_empty(tuple(inst.lse.shape), dtype=torch.float32)

    return _named(kind, implementation, fake)


#: The fused norm's operators, ``(x, residual, weight, handle)``: one call of an
#: :class:`~tilescale_examples.decode.allreduce_norm.AllReduceResidualRMSNorm` into fresh
#: tensors, ``h = all_reduce(x) + residual`` and ``y = rms_norm(h) * weight`` (``x`` and
#: ``residual`` ``(tokens, hidden)``, ``weight`` ``(hidden,)``, the instance's dtype):
#:
#: * ``all_reduce_residual_rms_norm``: ``(y, residual_out)``, both in the instance's dtype
#:   (an instance built without ``fp8``);
#: * ``all_reduce_residual_rms_norm_fp8``: ``(y, scales, residual_out)``, ``y`` in
#:   ``torch.float8_e4m3fn`` and the float32 ``scales`` of the instance's FP8 mode (``(tokens,
#:   1)`` per token, ``(tokens, hidden / 128)`` per block) (an instance built with ``fp8``).
#:
#: ``residual_out`` is a new tensor: to update a residual stream in place, assign the result.
NORM = {"all_reduce_residual_rms_norm": False, "all_reduce_residual_rms_norm_fp8": True}


def _norm_impls(kind: str):
    """``(implementation, fake)`` of fused-norm operator ``kind`` (see :data:`NORM`)."""
    fp8 = NORM[kind]

    def checked(x, residual, weight, handle):
        h, _, inst = _lookup_entry(handle, kind)
        if (inst.fp8 is not None) != fp8:
            other = "all_reduce_residual_rms_norm" + ("" if fp8 else "_fp8")
            mode = "without fp8" if inst.fp8 is None else f"with fp8={inst.fp8!r}"
            raise ValueError(f"torch.ops.tilescale.{kind}: handle {h} names an AllReduceResidualRMSNorm built {mode}: "
                             f"call torch.ops.tilescale.{other}")
        for name, t in (("x", x), ("residual", residual)):
            _fail_shape(kind, h, inst, name, t, inst.shape, inst.dtype, f"{name} = (tokens, hidden) =")
        _fail_shape(kind, h, inst, "weight", weight, inst.shape[1:], inst.dtype, "weight = (hidden,) =")
        return inst

    def results(inst, like: torch.Tensor) -> tuple:
        y = like.new_empty(inst.shape, dtype=inst.output.dtype)
        h = like.new_empty(inst.shape)
        return (y, like.new_empty(tuple(inst.scales.shape), dtype=torch.float32), h) if fp8 else (y, h)

    def implementation(x, residual, weight, handle):
        inst = checked(x, residual, weight, handle)
        out = results(inst, x)
        inst(x.contiguous(), residual.contiguous(), weight.contiguous(), out=out[0], residual_out=out[-1],
             **({"scales_out": out[1]} if fp8 else {}))
        return out

    def fake(x, residual, weight, handle):
        return results(checked(x, residual, weight, handle), x)

    return _named(kind, implementation, fake)


#: Operator name -> ``(implementation, fake)``.
IMPLS = {
    **{kind: _dense_impls(kind) for kind in DENSE},
    **{kind: _attention_impls(kind) for kind in ATTENTION},
    **{kind: _norm_impls(kind) for kind in NORM},
    "moe_dispatch": (_moe_dispatch, _moe_dispatch_fake),
    "moe_combine": (_moe_combine, _moe_combine_fake),
}
