"""TileScale's collectives as PyTorch custom operators: ``torch.ops.tilescale.*``.

Importing :mod:`tilescale_examples` registers, with :func:`torch.library.custom_op` (torch
2.4 or newer; with an older torch nothing is registered and :data:`AVAILABLE` is False)::

    torch.ops.tilescale.all_reduce(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.reduce_scatter(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.all_gather(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.all_to_all(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.all_gather_matmul(Tensor a, Tensor b, int handle) -> Tensor
    torch.ops.tilescale.matmul_reduce_scatter(Tensor a, Tensor b, int handle) -> Tensor
    torch.ops.tilescale.moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int handle)
        -> (Tensor recv_x, Tensor counts, Tensor recv_offsets)
    torch.ops.tilescale.moe_combine(Tensor y, Tensor topk_idx, int handle) -> Tensor

(:data:`SCHEMAS` holds them; each op's docstring below gives shapes and dtypes). Every op
has a fake (meta) implementation, so a function calling them traces under
``torch.compile(fullgraph=True)`` without graph breaks, and each returns *fresh* tensors
(never a collective's internal buffer, never a view of an input), so the results are
ordinary values for the compiler and for CUDA graph trees (``mode="reduce-overhead"``).

The ops are a thin layer over the class API (:class:`~tilescale_examples.collectives.allreduce.AllReduce`,
:class:`~tilescale_examples.collectives.allgather.AllGather`, ...): you build the collectives as usual
(collectively, on every rank) and pass an integer *handle* naming the instance::

    ar = AllReduce(allocator, (4096,), torch.bfloat16)       # collective, as always
    h = handle_of(ar)                                        # a process-local int

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def step(x):
        return torch.ops.tilescale.all_reduce(x * 2, h)

Lifetime rules
--------------

* :func:`register` (alias :func:`handle_of`) gives an instance a positive int, unique in the
  process and never reused; registering again returns the same handle. Registration is
  local (no communication); handles are process-local numbers, so ranks may hold different
  ones, but ranks that build and register in the same order get the same numbers and
  compile identical graphs.
* The registry holds instances by weak reference: a handle lives as long as its instance is
  alive, registered and open. Calling an op with the handle of a closed, unregistered or
  garbage-collected instance raises ``RuntimeError``; an unknown handle, or one of another
  kind (an :class:`AllGather`'s handle given to ``all_reduce``), raises ``ValueError``. Every
  message names the handle and what the op expected.
* A compiled graph holds the handle as a constant (Dynamo guards on the int). Keep the
  instance referenced and open for as long as compiled code that uses it may run. The
  checks above run in eager calls and whenever a graph is traced; a CUDA graph replays
  without running Python, so a replay cannot check: replaying a graph whose collective was
  closed or collected is undefined behaviour. Close collectives only after the compiled
  functions that use them are gone (or will never run again).
* Calls are collective: every rank calls the same ops, with the instances built by the same
  constructor calls, in the same order (eagerly, traced or replayed). The ops are
  registered as side-effecting with an *ordered* effect where torch supports it (see
  :data:`SIDE_EFFECTS`), so the compiler neither drops a call whose result is unused nor
  reorders the collectives among themselves.
* ``moe_combine`` pairs with the latest ``moe_dispatch`` of the same dispatcher (the
  registry keeps that dispatch's routing); a ``dispatch`` made through the class API in
  between invalidates it (the combine then raises).
* The ops have no autograd formulas: call them under ``torch.no_grad()`` /
  ``torch.inference_mode()`` or on tensors that do not require grad (e.g. to reduce
  gradients), or wrap them in your own :class:`torch.autograd.Function`.
"""

import inspect
import itertools
import threading
import weakref
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["register", "handle_of", "unregister", "lookup", "registered", "AVAILABLE", "NAMESPACE", "SCHEMAS",
           "OP_CLASSES", "OPS", "SIDE_EFFECTS"]

#: The ``torch.ops`` namespace of the operators.
NAMESPACE = "tilescale"

#: Whether this torch has :func:`torch.library.custom_op` (torch >= 2.4), i.e. whether the
#: operators are registered. The registry (:func:`register`, :func:`lookup`) works either way.
AVAILABLE = hasattr(torch, "library") and hasattr(torch.library, "custom_op")

#: The operators' schemas (``torch.ops.tilescale.<name>``).
SCHEMAS: Dict[str, str] = {
    "all_reduce": "(Tensor x, int handle) -> Tensor",
    "reduce_scatter": "(Tensor x, int handle) -> Tensor",
    "all_gather": "(Tensor x, int handle) -> Tensor",
    "all_to_all": "(Tensor x, int handle) -> Tensor",
    "all_gather_matmul": "(Tensor a, Tensor b, int handle) -> Tensor",
    "matmul_reduce_scatter": "(Tensor a, Tensor b, int handle) -> Tensor",
    "moe_dispatch": ("(Tensor x, Tensor topk_idx, Tensor topk_weights, int handle)"
                     " -> (Tensor recv_x, Tensor counts, Tensor recv_offsets)"),
    "moe_combine": "(Tensor y, Tensor topk_idx, int handle) -> Tensor",
}

#: Classes the registry accepts: ``"module.QualName"`` -> the name used in messages. A
#: subclass registers as its nearest listed base.
_CLASSES: Dict[str, str] = {
    "tilescale_examples.collectives.allreduce.AllReduce": "AllReduce",
    "tilescale_examples.tutorials.tma_allreduce.TmaAllReduce": "TmaAllReduce",
    "tilescale_examples.collectives.reducescatter.ReduceScatter": "ReduceScatter",
    "tilescale_examples.collectives.allgather.AllGather": "AllGather",
    "tilescale_examples.collectives.alltoall.AllToAll": "AllToAll",
    "tilescale_examples.overlap.ag_gemm.AllGatherGEMM": "AllGatherGEMM",
    "tilescale_examples.overlap.gemm_rs.GemmReduceScatter": "GemmReduceScatter",
    "tilescale_examples.moe.dispatcher.MoEDispatcher": "MoEDispatcher",
}

#: Operator name -> the classes whose handles it takes (the ``kind`` of :func:`lookup`).
OP_CLASSES: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("AllReduce", "TmaAllReduce"),
    "reduce_scatter": ("ReduceScatter",),
    "all_gather": ("AllGather",),
    "all_to_all": ("AllToAll",),
    "all_gather_matmul": ("AllGatherGEMM",),
    "matmul_reduce_scatter": ("GemmReduceScatter",),
    "moe_dispatch": ("MoEDispatcher",),
    "moe_combine": ("MoEDispatcher",),
}


# ---------------------------------------------------------------------------- the registry
@dataclass
class _Entry:
    ref: "weakref.ReferenceType"
    class_name: str
    #: moe: the latest dispatch's DispatchHandle as (class, fields without the dispatcher),
    #: rebuilt around the live dispatcher by moe_combine (no strong reference to it here).
    dispatch: Optional[Tuple[type, Dict[str, Any]]] = None


_lock = threading.RLock()
_entries: Dict[int, _Entry] = {}
_retired: Dict[int, Tuple[str, str]] = {}  # handle -> (class name, why it is gone)
_next_handle = itertools.count(1)
_HANDLE_ATTR = "_op_handle"


def _a(name: str) -> str:
    """``name`` with its indefinite article."""
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _class_name(obj) -> Optional[str]:
    for cls in type(obj).__mro__:
        name = _CLASSES.get(f"{cls.__module__}.{cls.__qualname__}")
        if name is not None:
            return name
    return None


def _reaper(handle: int):
    def reap(_ref) -> None:
        with _lock:
            entry = _entries.pop(handle, None)
            if entry is not None:
                _retired[handle] = (entry.class_name, "garbage-collected")
    return reap


def register(obj) -> int:
    """The handle of collective ``obj`` for ``torch.ops.tilescale.*``: a positive int,
    unique in this process and never reused; registering an instance again returns its
    handle (also stored as ``obj._op_handle``).

    ``obj`` is an open :class:`~tilescale_examples.collectives.allreduce.AllReduce`,
    :class:`~tilescale_examples.tutorials.tma_allreduce.TmaAllReduce`,
    :class:`~tilescale_examples.collectives.reducescatter.ReduceScatter`,
    :class:`~tilescale_examples.collectives.allgather.AllGather`,
    :class:`~tilescale_examples.collectives.alltoall.AllToAll`,
    :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM`,
    :class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter` or
    :class:`~tilescale_examples.moe.dispatcher.MoEDispatcher` (or a subclass); anything else raises
    ``TypeError``, a closed instance ``RuntimeError``. The registry keeps only a weak
    reference: keep ``obj`` alive yourself (see the module docstring's lifetime rules).
    Local to the process: no communication.
    """
    name = _class_name(obj)
    if name is None:
        raise TypeError(f"tilescale_examples.torch_ops.register: {type(obj).__name__} is not a TileScale collective "
                        f"(expected one of {', '.join(sorted(set(_CLASSES.values())))})")
    if getattr(obj, "closed", False):
        raise RuntimeError(f"tilescale_examples.torch_ops.register: this {name} is closed; register an open instance")
    with _lock:
        handle = getattr(obj, "__dict__", {}).get(_HANDLE_ATTR)
        entry = _entries.get(handle) if handle is not None else None
        if entry is not None and entry.ref() is obj:
            return handle
        handle = next(_next_handle)
        _entries[handle] = _Entry(weakref.ref(obj, _reaper(handle)), name)
        setattr(obj, _HANDLE_ATTR, handle)
    return handle


#: The same as :func:`register`: ``handle_of(ar)`` reads well at a call site.
handle_of = register


def unregister(obj_or_handle) -> bool:
    """Forget an instance (given as the instance or its handle): later calls with its handle
    raise ``RuntimeError``. Returns whether it was registered. Does not close it; a compiled
    graph that still holds the handle raises when it is traced again (replays of captured
    CUDA graphs do not look the handle up)."""
    if isinstance(obj_or_handle, int) and not isinstance(obj_or_handle, bool):
        handle, obj = obj_or_handle, None
    else:
        obj = obj_or_handle
        handle = getattr(obj, "__dict__", {}).get(_HANDLE_ATTR)
        if handle is None:
            return False
    with _lock:
        entry = _entries.get(handle)
        if entry is None or (obj is not None and entry.ref() is not obj):
            return False
        del _entries[handle]
        _retired[handle] = (entry.class_name, "unregistered")
        live = entry.ref()
    if live is not None and getattr(live, "__dict__", {}).get(_HANDLE_ATTR) == handle:
        delattr(live, _HANDLE_ATTR)
    return True


def registered() -> Dict[int, str]:
    """``{handle: class name}`` of the live registered instances (a snapshot, for debugging)."""
    with _lock:
        return {h: e.class_name for h, e in _entries.items() if e.ref() is not None}


def _as_handle(handle, kind: str) -> int:
    if isinstance(handle, torch.SymInt):  # an int that Dynamo made dynamic: specialise it
        handle = int(handle)
    if not isinstance(handle, int) or isinstance(handle, bool):
        raise TypeError(f"torch.ops.tilescale.{kind}: handle must be an int from "
                        f"tilescale_examples.torch_ops.register(), got {type(handle).__name__}")
    return handle


def _lookup_entry(handle, kind: str):
    if kind not in OP_CLASSES:
        raise ValueError(f"unknown operator kind {kind!r}: expected one of {', '.join(OP_CLASSES)}")
    h = _as_handle(handle, kind)
    op = f"torch.ops.tilescale.{kind}"
    expected = " or ".join(OP_CLASSES[kind])
    with _lock:
        entry = _entries.get(h)
        gone = _retired.get(h)
    if entry is None:
        if gone is not None:
            raise RuntimeError(f"{op}: handle {h} named {_a(gone[0])} that has been {gone[1]}; keep the instance "
                               f"alive and registered while code that uses its handle runs (expected the handle of "
                               f"an open {expected})")
        raise ValueError(f"{op}: handle {h} is not a registered TileScale collective (expected the handle of an "
                         f"open {expected}, from tilescale_examples.torch_ops.register(obj))")
    obj = entry.ref()
    if obj is None:
        raise RuntimeError(f"{op}: handle {h} named {_a(entry.class_name)} that has been garbage-collected; keep "
                           "the instance alive while code that uses its handle runs")
    if entry.class_name not in OP_CLASSES[kind]:
        raise ValueError(f"{op}: handle {h} names {_a(entry.class_name)}, but {kind} takes the handle of "
                         f"{_a(expected)}")
    if getattr(obj, "closed", False):
        raise RuntimeError(f"{op}: handle {h} names a closed {entry.class_name}; keep it open while code that "
                           "uses its handle runs")
    return h, entry, obj


def lookup(handle, kind: str):
    """The live, open instance that ``handle`` names, for operator ``kind`` (an op name of
    :data:`OP_CLASSES`, e.g. ``"all_reduce"``).

    Raises ``ValueError`` for an unknown handle or one of another kind (naming the handle,
    its class and the classes ``kind`` takes), ``RuntimeError`` for the handle of a closed,
    unregistered or garbage-collected instance, ``TypeError`` for a handle that is not an
    int."""
    return _lookup_entry(handle, kind)[2]


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


def _all_reduce_shape(inst) -> Tuple[int, ...]:
    shape = getattr(inst, "shape", None)  # AllReduce; TmaAllReduce keeps it in shard_shape
    return tuple(shape if shape is not None else inst.shard_shape)


# ---------------------------------------------------------------------------- implementations
def _all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Sum ``x`` over every rank. ``x``: the instance's ``shape`` and dtype, on its device;
    returns a fresh tensor of the same shape and dtype."""
    h, _, inst = _lookup_entry(handle, "all_reduce")
    _fail_shape("all_reduce", h, inst, "x", x, _all_reduce_shape(inst), inst.dtype, "shape")
    out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _all_reduce_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "all_reduce")
    _fail_shape("all_reduce", h, inst, "x", x, _all_reduce_shape(inst), inst.dtype, "shape")
    return x.new_empty(tuple(x.shape))


def _reduce_scatter(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Sum row ``rank`` of ``x`` over every rank. ``x``: ``(world_size, *shard_shape)``;
    returns a fresh ``shard_shape`` tensor."""
    h, _, inst = _lookup_entry(handle, "reduce_scatter")
    _fail_shape("reduce_scatter", h, inst, "x", x, (inst.world_size, *inst.shard_shape), inst.dtype,
                "(world_size, *shard_shape) =")
    out = torch.empty(tuple(inst.shard_shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _reduce_scatter_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "reduce_scatter")
    _fail_shape("reduce_scatter", h, inst, "x", x, (inst.world_size, *inst.shard_shape), inst.dtype,
                "(world_size, *shard_shape) =")
    return x.new_empty(tuple(inst.shard_shape))


def _all_gather(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Gather every rank's shard ``x`` (``shard_shape``); returns a fresh ``(world_size,
    *shard_shape)`` tensor, row ``r`` being rank ``r``'s shard."""
    h, _, inst = _lookup_entry(handle, "all_gather")
    _fail_shape("all_gather", h, inst, "x", x, inst.shard_shape, inst.dtype, "shard_shape =")
    out = torch.empty((inst.world_size, *inst.shard_shape), dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _all_gather_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "all_gather")
    _fail_shape("all_gather", h, inst, "x", x, inst.shard_shape, inst.dtype, "shard_shape =")
    return x.new_empty((inst.world_size, *inst.shard_shape))


def _all_to_all(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Send row ``p`` of ``x`` (``(world_size, *shard_shape)``) to rank ``p``; returns a
    fresh tensor of the same shape, row ``s`` being what rank ``s`` sent here."""
    h, _, inst = _lookup_entry(handle, "all_to_all")
    shape = (inst.world_size, *inst.shard_shape)
    _fail_shape("all_to_all", h, inst, "x", x, shape, inst.dtype, "(world_size, *shard_shape) =")
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    return _call_into(inst, out, x.contiguous())


def _all_to_all_fake(x, handle):
    h, _, inst = _lookup_entry(handle, "all_to_all")
    shape = (inst.world_size, *inst.shard_shape)
    _fail_shape("all_to_all", h, inst, "x", x, shape, inst.dtype, "(world_size, *shard_shape) =")
    return x.new_empty(shape)


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


_IMPLS = {
    "all_reduce": (_all_reduce, _all_reduce_fake),
    "reduce_scatter": (_reduce_scatter, _reduce_scatter_fake),
    "all_gather": (_all_gather, _all_gather_fake),
    "all_to_all": (_all_to_all, _all_to_all_fake),
    "all_gather_matmul": (_all_gather_matmul, _all_gather_matmul_fake),
    "matmul_reduce_scatter": (_matmul_reduce_scatter, _matmul_reduce_scatter_fake),
    "moe_dispatch": (_moe_dispatch, _moe_dispatch_fake),
    "moe_combine": (_moe_combine, _moe_combine_fake),
}


# ---------------------------------------------------------------------------- registration
def _effect_type():
    try:
        from torch._library.effects import EffectType  # recent torch
        return EffectType
    except ImportError:
        pass
    try:
        from torch._higher_order_ops.effects import _EffectType
        return _EffectType
    except ImportError:
        return None


def _mark_side_effects(op, name: str) -> str:
    """Keep the compiler from dropping or reordering calls of ``op``; returns how:
    ``"ordered"`` (an ordered effect: calls thread an effect token, so none is dropped and
    their order among the effectful ops is kept), ``"kept"`` (FX dead-code elimination
    skips it; no ordering promise) or ``"none"``."""
    effect = _effect_type()
    register_effect = getattr(op, "register_effect", None)  # CustomOpDef.register_effect (torch >= 2.11)
    if effect is not None and register_effect is not None:
        try:
            register_effect(effect.ORDERED)
            return "ordered"
        except Exception:  # noqa: BLE001 - fall through to the weaker guarantee
            pass
    register_effectful = getattr(torch.library, "_register_effectful_op", None)
    if effect is not None and register_effectful is not None:
        try:
            register_effectful(f"{NAMESPACE}::{name}", effect.ORDERED)
            return "ordered"
        except Exception:  # noqa: BLE001
            pass
    try:
        torch.fx.node.has_side_effect(getattr(getattr(torch.ops, NAMESPACE), name).default)
        return "kept"
    except Exception:  # noqa: BLE001
        return "none"


def _register_ops() -> Tuple[Dict[str, Any], Dict[str, str]]:
    ops, effects = {}, {}
    if not AVAILABLE:
        return ops, effects
    for name, (impl, fake) in _IMPLS.items():
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=SCHEMAS[name])
        op.register_fake(fake)
        ops[name] = op
        effects[name] = _mark_side_effects(op, name)
    return ops, effects


#: ``{name: torch.library.CustomOpDef}`` of the registered operators (empty without
#: :data:`AVAILABLE`); and ``SIDE_EFFECTS``, ``{name: "ordered" | "kept" | "none"}``: how
#: each operator is protected from dead-code elimination and reordering under
#: ``torch.compile``. ``"ordered"`` (torch 2.11 and newer): an ordered effect, so no call is
#: dropped and the calls keep their program order among themselves; ``"kept"``: never
#: dropped, but collectives that do not depend on each other's results may be reordered;
#: ``"none"``: use every result, and order the collectives through data dependencies.
OPS, SIDE_EFFECTS = _register_ops()
