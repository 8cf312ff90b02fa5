"""The handle registry of :mod:`tilescale_examples.torch_ops`: which instance an integer handle
names, by weak reference (the lifetime rules are in that module's docstring)."""

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["register", "handle_of", "unregister", "lookup", "registered", "OP_CLASSES"]

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
    "tilescale_examples.sequence.ulysses.UlyssesAllToAll": "UlyssesAllToAll",
    "tilescale_examples.sequence.sp_attention.SPAllGatherAttention": "SPAllGatherAttention",
    "tilescale_examples.sequence.flash_decode.SPFlashDecode": "SPFlashDecode",
    "tilescale_examples.decode.gemm_allreduce.GemmAllReduce": "GemmAllReduce",
    "tilescale_examples.decode.allreduce_norm.AllReduceResidualRMSNorm": "AllReduceResidualRMSNorm",
}

#: Operator name -> the classes whose handles it takes (the ``kind`` of :func:`lookup`).
OP_CLASSES: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("AllReduce", "TmaAllReduce"),
    "reduce_scatter": ("ReduceScatter",),
    "all_gather": ("AllGather",),
    "all_to_all": ("AllToAll",),
    "ulysses_all_to_all": ("UlyssesAllToAll",),
    "all_gather_matmul": ("AllGatherGEMM",),
    "matmul_reduce_scatter": ("GemmReduceScatter",),
    "moe_dispatch": ("MoEDispatcher",),
    "moe_combine": ("MoEDispatcher",),
    "sp_attention": ("SPAllGatherAttention",),
    "sp_flash_decode": ("SPFlashDecode",),
    "matmul_all_reduce": ("GemmAllReduce",),
    "all_reduce_residual_rms_norm": ("AllReduceResidualRMSNorm",),
    "all_reduce_residual_rms_norm_fp8": ("AllReduceResidualRMSNorm",),
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
    :class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter`,
    :class:`~tilescale_examples.moe.dispatcher.MoEDispatcher` or
    :class:`~tilescale_examples.sequence.ulysses.UlyssesAllToAll` (or a subclass); anything else raises
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
