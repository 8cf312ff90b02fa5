"""TileScale's collectives as PyTorch custom operators: ``torch.ops.tilescale.*``.

Importing :mod:`tilescale_examples` registers, with :func:`torch.library.custom_op` (torch
2.4 or newer; with an older torch nothing is registered and :data:`AVAILABLE` is False)::

    torch.ops.tilescale.all_reduce(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.reduce_scatter(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.all_gather(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.all_to_all(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.ulysses_all_to_all(Tensor x, int handle) -> Tensor
    torch.ops.tilescale.all_gather_matmul(Tensor a, Tensor b, int handle) -> Tensor
    torch.ops.tilescale.matmul_reduce_scatter(Tensor a, Tensor b, int handle) -> Tensor
    torch.ops.tilescale.moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int handle)
        -> (Tensor recv_x, Tensor counts, Tensor recv_offsets)
    torch.ops.tilescale.moe_combine(Tensor y, Tensor topk_idx, int handle) -> Tensor
    torch.ops.tilescale.sp_attention(Tensor q, Tensor k, Tensor v, int handle) -> (Tensor out, Tensor lse)
    torch.ops.tilescale.sp_flash_decode(Tensor q, Tensor k, Tensor v, int handle, Tensor? cache_seqlens=None)
        -> (Tensor out, Tensor lse)
    torch.ops.tilescale.matmul_all_reduce(Tensor a, Tensor b, int handle) -> Tensor
    torch.ops.tilescale.all_reduce_residual_rms_norm(Tensor x, Tensor residual, Tensor weight, int handle)
        -> (Tensor y, Tensor residual_out)
    torch.ops.tilescale.all_reduce_residual_rms_norm_fp8(Tensor x, Tensor residual, Tensor weight, int handle)
        -> (Tensor y, Tensor scales, Tensor residual_out)

(:data:`SCHEMAS` holds them; each op's docstring in :mod:`._impls` gives shapes and dtypes; the
handle registry is :mod:`._registry`). Every op
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

from typing import Any, Dict, Tuple

import torch

from tilescale_examples.torch_ops._impls import IMPLS as _IMPLS
from tilescale_examples.torch_ops._registry import (OP_CLASSES, handle_of, lookup, register, registered,
                                                    unregister)

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
    "ulysses_all_to_all": "(Tensor x, int handle) -> Tensor",
    "all_gather_matmul": "(Tensor a, Tensor b, int handle) -> Tensor",
    "matmul_reduce_scatter": "(Tensor a, Tensor b, int handle) -> Tensor",
    "moe_dispatch": ("(Tensor x, Tensor topk_idx, Tensor topk_weights, int handle)"
                     " -> (Tensor recv_x, Tensor counts, Tensor recv_offsets)"),
    "moe_combine": "(Tensor y, Tensor topk_idx, int handle) -> Tensor",
    "sp_attention": "(Tensor q, Tensor k, Tensor v, int handle) -> (Tensor out, Tensor lse)",
    "sp_flash_decode": ("(Tensor q, Tensor k, Tensor v, int handle, Tensor? cache_seqlens=None)"
                        " -> (Tensor out, Tensor lse)"),
    "matmul_all_reduce": "(Tensor a, Tensor b, int handle) -> Tensor",
    "all_reduce_residual_rms_norm": ("(Tensor x, Tensor residual, Tensor weight, int handle)"
                                     " -> (Tensor y, Tensor residual_out)"),
    "all_reduce_residual_rms_norm_fp8": ("(Tensor x, Tensor residual, Tensor weight, int handle)"
                                         " -> (Tensor y, Tensor scales, Tensor residual_out)"),
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
