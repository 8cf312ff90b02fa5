"""Atomics beyond ``T.atom_add``:

* ``T.atomic_cas`` (32/64-bit compare-and-swap on any rank): one PTX
  ``atom{.sem}{.scope}.cas.b32/.b64`` on the (remapped) address (``include/tilescale/signal.cuh``);
* ``T.atomic_add(dst, value, ..., dst_pe=)`` and ``T.atomic_addx2(dst, value, dst_pe=)``: stock
  TileLang's atomics when no peer is given; with a peer, the scalar forms are one PTX
  ``atom{.sem}.sys.add`` on the peer's memory (``include/tilescale/atomic.cuh``), the
  tile-region form runs stock TileLang's lowering on a view of the peer's buffer, and
  ``use_tma=True`` is a TMA reduce through the peer's descriptor (:mod:`.remote_tma`).
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


# ------------------------------------------------------------------------------ remote atomic_add
#: PTX type of a scalar remote atomic add, by destination dtype.
_ADD_TYPES = {"int32": "S32", "uint32": "U32", "int64": "U64", "uint64": "U64", "float32": "F32",
              "float64": "F64", "float16": "F16", "bfloat16": "BF16"}
_PAIR_TYPES = {"float16": "F16X2", "bfloat16": "BF16X2"}
#: memory_order of TileLang's atomics -> the PTX semantic of the remote form.
_ORDERS = {None: "relaxed", "relaxed": "relaxed", "consume": "acquire", "acquire": "acquire",
           "release": "release", "acq_rel": "acq_rel"}


def _stock(name: str):
    from .state import STATE

    return STATE.stock[name]


def _order(memory_order) -> str:
    if memory_order is not None and not isinstance(memory_order, str):
        raise TypeError(f"memory_order must be a string or None, got {memory_order!r}")
    if memory_order not in _ORDERS:
        raise ValueError(
            f"memory_order={memory_order!r} is not available on a remote atomic_add; use one of "
            f"{[o for o in _ORDERS if o]} (PTX atomics have no seq_cst: add T.quiet() before)"
        )
    return _ORDERS[memory_order]


def _extent(x):
    from tilelang.language.utils import get_extent

    return get_extent(x)


def atomic_add(dst, value, memory_order=None, return_prev: bool = False, use_tma: bool = False,
               annotations=None, dst_pe=None):
    """``T.atomic_add`` with an optional peer (upstream TileScale's signature).

    Without ``dst_pe`` (or -1) this is stock TileLang's ``T.atomic_add``.  With a peer:

    * scalar form (``dst`` an element, ``value`` a scalar): one ``atom{.sem}.sys.add`` on
      ``dst``'s counterpart on ``dst_pe`` for int32, uint32, (u)int64, float32, float64,
      float16 and bfloat16; ``memory_order`` picks the semantic (relaxed by default; no
      seq_cst); ``return_prev=True`` returns the old value;
    * tile form (``dst`` a global region, ``value`` a fragment / shared / global region):
      stock TileLang's element-wise (vectorised) atomics on the peer's copy of ``dst``;
      they are atomic at the peer's memory (NVLink P2P atomics) and order nothing with
      other ranks by themselves: publish with ``T.quiet()`` and a signal;
    * ``use_tma=True``: a TMA reduce-add from shared memory into the peer's ``dst`` through
      its own descriptor (PEs 0-7, see ``T.tma_copy``).

    ``dst`` must be in global memory when ``dst_pe`` selects a peer.
    """
    pe_val = V.pe_expr(dst_pe, "dst_pe")
    if pe_val is None:
        return _stock("atomic_add")(dst, value, memory_order=memory_order, return_prev=return_prev,
                                    use_tma=use_tma, annotations=annotations)
    if use_tma:
        from .remote_tma import tma_reduce_add

        return tma_reduce_add(dst, value, pe_val, memory_order=memory_order, annotations=annotations)
    if _extent(dst) is None and _extent(value) is None:
        op = V.operand(dst, "dst")
        V.require_global(op, "dst", "when dst_pe selects a peer")
        if op.dtype not in _ADD_TYPES:
            raise TypeError(f"a remote scalar atomic_add needs dst of {sorted(_ADD_TYPES)}, got {op.dtype}")
        sem = _order(memory_order)
        name = f"tilescale::atomic_add_sys<{V.SEMS[sem]}, tilescale::AType::{_ADD_TYPES[op.dtype]}>"
        return V.extern(op.dtype if return_prev else "handle", name, op.ptr, V.cast_to(value, op.dtype, "value"), pe_val)
    if return_prev:
        raise ValueError("return_prev is only available for a scalar atomic_add (dst an element, value a scalar)")
    from .peer_copy import peer_view

    return _stock("atomic_add")(peer_view(dst, pe_val, "dst", "a remote atomic_add"), value,
                                memory_order=memory_order, annotations=annotations)


def atomic_addx2(dst, value, return_prev: bool = False, dst_pe=None):
    """``T.atomic_addx2`` (a float16 / bfloat16 pair) with an optional peer.

    Without ``dst_pe`` (or -1) this is stock TileLang's.  With a peer it is one
    ``atom.sys.add.noftz.{f16x2,bf16x2}`` (relaxed) of ``value[0:2]`` into ``dst[0:2]`` on
    ``dst_pe``: ``dst`` a global element or region starting at an even element (the pair
    must be 4-byte aligned), ``value`` any readable pair of the same dtype.
    """
    pe_val = V.pe_expr(dst_pe, "dst_pe")
    if pe_val is None:
        return _stock("atomic_addx2")(dst, value, return_prev=return_prev)
    if return_prev:
        raise ValueError("return_prev is not available on a remote atomic_addx2")
    d = V.operand(dst, "dst")
    v = V.operand(value, "value")
    V.require_global(d, "dst", "when dst_pe selects a peer")
    if d.dtype not in _PAIR_TYPES:
        raise TypeError(f"atomic_addx2 adds float16 or bfloat16 pairs, got dst of {d.dtype}")
    if v.dtype is not None and v.dtype != d.dtype:
        raise TypeError(f"atomic_addx2: value ({v.dtype}) and dst ({d.dtype}) dtypes differ")
    idx = d.indices[-1] if d.indices else None
    if idx is not None and isinstance(idx, tirx.IntImm) and int(idx.value) % 2:
        raise ValueError(f"atomic_addx2: dst must start at an even element (a 4-byte aligned pair), got index {idx}")
    name = f"tilescale::atomic_addx2_sys<{V.SEMS['relaxed']}, tilescale::AType::{_PAIR_TYPES[d.dtype]}>"
    return V.extern("handle", name, d.ptr, v.ptr, pe_val)


#: Name -> object exported on ``tilelang.language`` by this module.
EXPORTS = {"atomic_cas": atomic_cas}
#: Stock ``tilelang.language`` functions this module wraps (name -> wrapper).
WRAPPERS = {"atomic_add": atomic_add, "atomic_addx2": atomic_addx2}
