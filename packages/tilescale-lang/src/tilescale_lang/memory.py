"""Scoped scalar memory operations: ``T.ld``, ``T.st``, ``T.atom_add`` and fences.

Each maps to one PTX instruction (see ``include/tilescale/memory.cuh``).  Scope/semantic
pairs that PTX does not have are rejected while tracing:

* ``ld``: sem ``weak`` | ``volatile`` | ``relaxed`` | ``acquire``; ``nc`` only with ``weak``;
  ``na`` (``.L1::no_allocate``) not with ``volatile``.
* ``st``: sem ``weak`` | ``volatile`` | ``relaxed`` | ``release``; ``na`` not with ``volatile``.
* ``atom_add``: uint32 (int32 accepted), scope ``gpu`` | ``sys``, sem ``relaxed`` |
  ``acquire`` | ``release`` | ``acq_rel``.

``scope`` is ``cta`` | ``gpu`` | ``sys``; ``weak`` and ``volatile`` accesses have no scope in
PTX, so it is ignored for them.  Values are 32- or 64-bit.
"""

from __future__ import annotations

from ._tvm import tirx

from . import validation as V

_LD_SEMS = ("weak", "volatile", "relaxed", "acquire")
_ST_SEMS = ("weak", "volatile", "relaxed", "release")
_ATOM_SEMS = ("relaxed", "acquire", "release", "acq_rel")
_SCOPES = ("cta", "gpu", "sys")


def _sem(value, allowed, name, what):
    low = V.choice(value, tuple(V.SEMS), name)
    if low not in allowed:
        raise ValueError(f"{name}={low!r} is not a PTX {what} semantic; {what} supports {allowed}")
    return low


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def ld(src, value=None, scope: str = "gpu", sem: str = "weak", na: bool = False, nc: bool = False, src_pe=-1):
    """Load one 32/64-bit element of ``src`` (on rank ``src_pe``; -1: local) into ``value``.

    Args:
        src: the element to load (``buf[i]``, ``T.address_of(buf[i])``, a buffer or region:
            its first element).
        value: where to store the result: a local element (``v[0]``) or ``T.alloc_var``
            variable; None returns the loaded expression instead.
        scope: ``cta`` | ``gpu`` | ``sys`` (for relaxed/acquire).
        sem: ``weak`` | ``volatile`` | ``relaxed`` | ``acquire``.
        na: add ``.L1::no_allocate``.
        nc: use the non-coherent ``ld.global.nc`` path (weak only, global memory).
        src_pe: rank to read from; -1 keeps ``src`` local.
    """
    op = V.operand(src, "src", as_value=True)
    dtype = V.require_dtype(op, "src")
    scope = V.choice(scope, _SCOPES, "scope")
    sem = _sem(sem, _LD_SEMS, "sem", "load")
    na = V.const_bool(na, "na")
    nc = V.const_bool(nc, "nc")
    if nc and sem != "weak":
        raise ValueError(f"nc=True (ld.global.nc) has no memory-model semantic; it needs sem='weak', got sem={sem!r}")
    if na and sem == "volatile":
        raise ValueError("na=True (.L1::no_allocate) is not available with sem='volatile'")
    if nc:
        V.require_global(op, "src", "for nc=True (ld.global.nc)")
    pe_val = V.remote_pe(src_pe, "src_pe", op, "src")
    args = [op.ptr] if pe_val is None else [op.ptr, pe_val]
    call = V.extern(dtype, f"tilescale::ld<{V.SCOPES[scope]}, {V.SEMS[sem]}, {_b(na)}, {_b(nc)}>", *args)
    if value is None:
        return call
    _store_into(value, call, "value")
    return None


def _store_into(value, expr, name):
    from tvm.tirx.script.builder import ir as IB

    if isinstance(value, tirx.Buffer):
        buf, idx = value, [tirx.IntImm("int32", 0) for _ in value.shape]
    elif isinstance(value, tirx.BufferLoad):
        buf, idx = value.buffer, list(value.indices)
    else:
        raise TypeError(
            f"{name} must be a local element to store into (v[0] or a T.alloc_var variable), got {type(value).__name__}"
        )
    if str(buf.dtype) != str(expr.dtype):
        expr = tirx.Cast(str(buf.dtype), expr)
    IB.buffer_store(buf, expr, idx)


def st(dst, value, scope: str = "gpu", sem: str = "weak", na: bool = False, dst_pe=-1):
    """Store ``value`` (converted to ``dst``'s 32/64-bit type) to ``dst`` on rank ``dst_pe``.

    Args:
        dst: the element to write (``buf[i]``, ``T.address_of(buf[i])``, buffer or region).
        value: scalar expression.
        scope: ``cta`` | ``gpu`` | ``sys`` (for relaxed/release).
        sem: ``weak`` | ``volatile`` | ``relaxed`` | ``release``.
        na: add ``.L1::no_allocate``.
        dst_pe: rank to write to; -1 keeps ``dst`` local.
    """
    op = V.operand(dst, "dst")
    dtype = V.require_dtype(op, "dst")
    scope = V.choice(scope, _SCOPES, "scope")
    sem = _sem(sem, _ST_SEMS, "sem", "store")
    na = V.const_bool(na, "na")
    if na and sem == "volatile":
        raise ValueError("na=True (.L1::no_allocate) is not available with sem='volatile'")
    val = V.cast_to(value, dtype, "value")
    pe_val = V.remote_pe(dst_pe, "dst_pe", op, "dst")
    args = [op.ptr, val] if pe_val is None else [op.ptr, val, pe_val]
    return V.extern("handle", f"tilescale::st<{V.SCOPES[scope]}, {V.SEMS[sem]}, {_b(na)}>", *args)


def atom_add(target, value, scope: str = "gpu", sem: str = "relaxed"):
    """Atomically add ``value`` to the uint32 at ``target``; returns the previous value (uint32).

    Args:
        target: a uint32 (or int32) element: ``buf[i]`` or ``T.address_of(buf[i])``.
        value: amount (converted to uint32).
        scope: ``gpu`` | ``sys``.
        sem: ``relaxed`` | ``acquire`` | ``release`` | ``acq_rel``.
    """
    op = V.operand(target, "target", as_value=True)
    dtype = V.require_dtype(op, "target", (32,))
    if dtype not in ("uint32", "int32"):
        raise TypeError(f"target must be a uint32 (or int32) element, got {dtype}")
    scope = V.choice(scope, ("gpu", "sys"), "scope")
    sem = _sem(sem, _ATOM_SEMS, "sem", "atom.add")
    val = V.cast_to(value, "uint32", "value")
    return V.extern("uint32", f"tilescale::atom_add<{V.SCOPES[scope]}, {V.SEMS[sem]}>", op.ptr, val)


def fence_cta():
    """``fence.acq_rel.cta``: order this thread's memory accesses for the block."""
    return V.extern("handle", "tilescale::fence_cta")


def fence_gpu():
    """``fence.acq_rel.gpu``: order this thread's memory accesses for the whole GPU."""
    return V.extern("handle", "tilescale::fence_gpu")


def fence_sys():
    """``fence.acq_rel.sys``: order this thread's memory accesses for the system (peers)."""
    return V.extern("handle", "tilescale::fence_sys")
