"""Atomics beyond ``T.atom_add``: ``T.atomic_cas`` (32/64-bit compare-and-swap on any rank).

Each call is one PTX ``atom{.sem}{.scope}.cas.b32/.b64`` on the (remapped) address; see
``include/tilescale/signal.cuh``.
"""

from __future__ import annotations

from ._tvm import tirx

from . import validation as V

_CAS_SEMS = ("relaxed", "acquire", "release", "acq_rel")
_CAS_SCOPES = ("cta", "gpu", "sys")
_CAS_DTYPES = ("int32", "uint32", "int64", "uint64")


def atomic_cas(ptr, compare, value, scope: str = "gpu", sem: str = "relaxed", pe=-1):
    """Atomically replace the word at ``ptr`` on rank ``pe`` (-1: local) by ``value`` if it
    equals ``compare``; returns the previous value (whether or not it was replaced).

    Args:
        ptr: a 32- or 64-bit integer element (``buf[i]``, ``T.address_of(buf[i])``); global
            memory when ``pe`` selects a peer.
        compare, value: converted to ``ptr``'s type.
        scope: ``cta`` | ``gpu`` | ``sys`` (``sys`` for words other ranks also update).
        sem: ``relaxed`` | ``acquire`` (take a lock) | ``release`` | ``acq_rel``.
        pe: rank whose copy of the word is updated; -1 keeps ``ptr`` local.

    Raises:
        TypeError: ``ptr`` is not a (u)int32/(u)int64 element (floats: compare their bits
            through an integer view of the buffer).
        ValueError: bad ``scope`` or ``sem``; ``pe`` below -1.
    """
    op = V.operand(ptr, "ptr")
    if op.dtype is None:
        raise TypeError("ptr: element type unknown (pass a buffer element such as buf[i] or T.address_of(buf[i]))")
    if op.dtype not in _CAS_DTYPES:
        raise TypeError(f"atomic_cas needs a 32- or 64-bit integer ptr ({', '.join(_CAS_DTYPES)}), got {op.dtype}")
    scope = V.choice(scope, _CAS_SCOPES, "scope")
    low = V.choice(sem, tuple(V.SEMS), "sem")
    if low not in _CAS_SEMS:
        raise ValueError(f"sem={low!r} is not a PTX atom semantic; atomic_cas supports {_CAS_SEMS}")
    pe_val = V.remote_pe(pe, "pe", op, "ptr")
    pe_arg = tirx.IntImm("int32", -1) if pe_val is None else pe_val
    cmp = V.cast_to(compare, op.dtype, "compare")
    val = V.cast_to(value, op.dtype, "value")
    name = f"tilescale::atomic_cas<{V.SCOPES[scope]}, {V.SEMS[low]}>"
    return V.extern(op.dtype, name, op.ptr, cmp, val, pe_arg)


#: Name -> object exported on ``tilelang.language`` by this module.
EXPORTS = {"atomic_cas": atomic_cas}
