"""Peer copies: ``T.put_warp``, ``T.get_warp``, ``T.put_block``, ``T.get_block``, the strided
``T.put_rows_block`` / ``T.get_rows_block`` and the remote forms of ``T.copy`` /
``T.tma_copy`` (the latter in :mod:`.remote_tma`).

``size`` counts elements of the source's element type (the destination's when the source
is an untyped pointer).  A PE of -1 (or omitted) keeps the address local; a PE >= 0 remaps
the remote side by allocator-relative offset: ``ptr - base[rank] + base[pe]``.
"""

from __future__ import annotations

from typing import Any

from ._tvm import tirx

from . import validation as V

_LOCAL = tirx.IntImm("int32", -1)


def copy_operands(kind: str, src, dst, size, pe, pe_name: str, remote_side: str):
    """Checked operands of a peer copy: ``(src ptr, dst ptr, byte count, int32 PE)``.

    ``size`` counts elements of the source's type (the destination's for an untyped
    source); ``remote_side`` (``"src"``/``"dst"``) must be global memory when ``pe`` selects
    a peer.  Used by every put/get intrinsic (plain, nbi and with signal).
    """
    s = V.operand(src, "src")
    d = V.operand(dst, "dst")
    nbytes = V.copy_bytes(kind, src, s, dst, d, size)
    pe_val = V.remote_pe(pe, pe_name, s if remote_side == "src" else d, remote_side)
    return s.ptr, d.ptr, nbytes, _LOCAL if pe_val is None else pe_val


def _peer_copy(kind: str, src, dst, size, pe, pe_name: str, remote_side: str, template: str):
    args = copy_operands(kind, src, dst, size, pe, pe_name, remote_side)
    return V.extern("handle", f"tilescale::{kind}<{template}>", *args)


def _unroll(unroll_factor, aggressive) -> str:
    u = V.const_int(unroll_factor, "unroll_factor", minimum=1)
    a = V.const_bool(aggressive, "enable_aggressive_vectorize")
    return f"{u}, {'true' if a else 'false'}"


def put_warp(src, dst, size, dst_pe=-1, unroll_factor: int = 4, enable_aggressive_vectorize: bool = False):
    """Warp-scope put: the 32 lanes of the calling warp copy ``size`` elements from local
    ``src`` to ``dst`` on rank ``dst_pe`` (-1: local).

    Args:
        src, dst: buffers, regions (``buf[a:b]``), elements (``buf[i]``) or pointers
            (``T.address_of(buf[i])``); the copy starts at their first element.
        size: number of elements (any integer expression).
        dst_pe: destination rank, any integer expression; -1 keeps ``dst`` local.
        unroll_factor: 16-byte vectors each lane keeps in flight (compile-time int >= 1).
        enable_aggressive_vectorize: assume 16-byte aligned addresses and skip the run-time
            alignment check (otherwise the widest legal vector width is chosen at run time;
            any size is exact thanks to a scalar tail).
    """
    return _peer_copy("put_warp", src, dst, size, dst_pe, "dst_pe", "dst", _unroll(unroll_factor, enable_aggressive_vectorize))


def get_warp(src, dst, size, src_pe=-1, unroll_factor: int = 4, enable_aggressive_vectorize: bool = False):
    """Warp-scope get: copy ``size`` elements from ``src`` on rank ``src_pe`` (-1: local) to
    local ``dst``.  Arguments as in :func:`put_warp`."""
    return _peer_copy("get_warp", src, dst, size, src_pe, "src_pe", "src", _unroll(unroll_factor, enable_aggressive_vectorize))


def put_block(src, dst, size, dst_pe=-1):
    """Block-scope put: all threads of the block copy ``size`` elements from local ``src``
    to ``dst`` on rank ``dst_pe`` (-1: local)."""
    return _peer_copy("put_block", src, dst, size, dst_pe, "dst_pe", "dst", "4")


def get_block(src, dst, size, src_pe=-1):
    """Block-scope get: all threads of the block copy ``size`` elements from ``src`` on rank
    ``src_pe`` (-1: local) to local ``dst``."""
    return _peer_copy("get_block", src, dst, size, src_pe, "src_pe", "src", "4")


# ------------------------------------------------------------------------------ strided rows
def rows_operands(kind: str, src, dst, rows, row_size, src_stride, dst_stride, pe, pe_name: str, remote_side: str):
    """Checked operands of a strided block copy: ``(src ptr, dst ptr, rows, row bytes, src
    stride bytes, dst stride bytes, int32 PE)`` (counts uint64).

    ``row_size`` and the strides count elements of the source's type (the destination's for
    an untyped source); ``rows`` counts rows. Constant arguments are checked while tracing:
    each is a non-negative integer, ``dst_stride >= row_size`` (rows written apart, so no two
    threads store one element), and a side whose extent is known holds the last row's end.
    """
    s = V.operand(src, "src")
    d = V.operand(dst, "dst")
    itemsize = V.element_size(kind, s, d)
    counts = (V.size_bytes(rows, 1, "rows", kind), V.size_bytes(row_size, itemsize, "row_size", kind),
              V.size_bytes(src_stride, itemsize, "src_stride", kind),
              V.size_bytes(dst_stride, itemsize, "dst_stride", kind))
    fixed = [V.static_int(x) for x in (rows, row_size, src_stride, dst_stride)]
    n_rows, row, s_stride, d_stride = fixed
    if row is not None and d_stride is not None and (n_rows is None or n_rows > 1) and d_stride < row:
        raise ValueError(f"{kind}: dst_stride={d_stride} is below row_size={row}: the rows written would overlap")
    if None not in fixed and n_rows > 0:
        for x, name, stride in ((src, "src", s_stride), (dst, "dst", d_stride)):
            V.check_extent((n_rows - 1) * stride + row, x, name, f"(rows - 1) * {name}_stride + row_size")
    pe_val = V.remote_pe(pe, pe_name, s if remote_side == "src" else d, remote_side)
    return (s.ptr, d.ptr, *counts, _LOCAL if pe_val is None else pe_val)


def _rows_copy(kind: str, src, dst, rows, row_size, src_stride, dst_stride, pe, pe_name: str, remote_side: str,
               unroll_factor):
    u = V.const_int(unroll_factor, "unroll_factor", minimum=1)
    args = rows_operands(kind, src, dst, rows, row_size, src_stride, dst_stride, pe, pe_name, remote_side)
    return V.extern("handle", f"tilescale::{kind}<{u}>", *args)


def put_rows_block(src, dst, rows, row_size, src_stride, dst_stride, dst_pe=-1, unroll_factor: int = 4):
    """Block-scope strided put: all threads of the block copy ``rows`` rows of ``row_size``
    elements, row ``r`` from local ``src + r * src_stride`` to ``dst + r * dst_stride`` on rank
    ``dst_pe`` (-1: local): a slice of a wider tensor (an all-to-all's heads of every position)
    in one call, with every thread's loads in flight across rows.

    Args:
        src, dst: buffers, regions, elements or pointers, as for :func:`put_block`; the copy
            starts at their first element.
        rows: number of rows (any integer expression).
        row_size: elements per row (any integer expression).
        src_stride, dst_stride: elements from one row's start to the next's (integer
            expressions; ``dst_stride >= row_size``).
        dst_pe: destination rank, any integer expression; -1 keeps ``dst`` local.
        unroll_factor: words each thread loads before storing them (compile-time int >= 1);
            4 needs at most 64 registers per thread (two 512-thread blocks per SM), 8 about 72
            (one 512-thread block per SM, the same bytes in flight).

    The word is the widest of 16, 8, 4, 2 and 1 bytes dividing both addresses, the row size and
    both strides (decided at run time), so every size is exact.
    """
    return _rows_copy("put_rows_block", src, dst, rows, row_size, src_stride, dst_stride, dst_pe, "dst_pe", "dst",
                      unroll_factor)


def get_rows_block(src, dst, rows, row_size, src_stride, dst_stride, src_pe=-1, unroll_factor: int = 4):
    """Block-scope strided get: rows from ``src`` on rank ``src_pe`` (-1: local) into local
    ``dst``.  Arguments as in :func:`put_rows_block`."""
    return _rows_copy("get_rows_block", src, dst, rows, row_size, src_stride, dst_stride, src_pe, "src_pe", "src",
                      unroll_factor)


# ------------------------------------------------------------------------------ T.copy
def global_buffer(x, name: str, context: str):
    """The global buffer behind ``x`` (a buffer, region or element) of ``context`` (say "a
    remote T.copy"); errors name ``name``."""
    if isinstance(x, tirx.Buffer):
        buf = x
    elif isinstance(x, (tirx.BufferRegion, tirx.BufferLoad)):
        buf = x.buffer
    else:
        raise TypeError(f"{name} of {context} must be a buffer, region or element, got {type(x).__name__}")
    V.require_global(V.operand(x, name), name, f"for {context}")
    return buf


def view_on(x, data, name: str, context: str):
    """``x`` re-expressed on a global buffer with ``x``'s buffer's shape and layout whose base
    pointer is ``data``: a ``tirx.Var`` (bound elsewhere) or an expression, which is bound
    here first.  Emits the ``DeclBuffer`` (and ``Bind``) into the current frame."""
    from tilelang import tvm  # noqa: F401
    from tvm import ir
    from tvm.tirx.script.builder import ir as IB

    buf = global_buffer(x, name, context)
    if not isinstance(data, tirx.Var):
        data = IB.bind(data, type_annotation=ir.PointerType(ir.PrimType(buf.dtype), "global"))
    view = IB.decl_buffer(buf.shape, buf.dtype, data=data, strides=buf.strides, elem_offset=buf.elem_offset,
                          scope="global")
    return _rebind(x, view)


def peer_view(x, pe_val, name: str, context: str):
    """``x`` re-expressed on its buffer's counterpart on rank ``pe_val`` (base pointer
    ``tilescale::remap_ptr(data, pe)``, computed on the device)."""
    buf = global_buffer(x, name, context)
    return view_on(x, V.extern("handle", "tilescale::remap_ptr", buf.data, pe_val), name, context)


def _rebind(x, new_buf):
    if isinstance(x, tirx.Buffer):
        return new_buf
    if isinstance(x, tirx.BufferRegion):
        return tirx.BufferRegion(new_buf, x.region)
    return tirx.BufferLoad(new_buf, x.indices)


def pe_pair(src_pe, dst_pe, op: str):
    """``(src PE, dst PE)`` as int32 expressions or None (local); None when both are local.

    Raises:
        ValueError: both select a peer (one side of ``op`` must stay local).
    """
    s_pe = V.pe_expr(src_pe, "src_pe")
    d_pe = V.pe_expr(dst_pe, "dst_pe")
    if s_pe is None and d_pe is None:
        return None
    if s_pe is not None and d_pe is not None:
        raise ValueError(f"{op}: src_pe and dst_pe cannot both select a peer (one side must stay local)")
    return s_pe, d_pe


def _stock(name: str):
    from .state import STATE

    return STATE.stock[name]


def copy(src, dst, src_pe=None, dst_pe=None, **kwargs):
    """``T.copy`` with optional peers.

    With neither ``src_pe`` nor ``dst_pe`` (or both -1) this is stock ``T.copy`` untouched.
    With one of them, the remote side (a global buffer, region or element) is re-addressed
    on that rank and the copy is lowered by stock TileLang as a SIMT copy (TMA is disabled:
    a TMA descriptor cannot follow a run-time peer address).  Both sides remote is an error.
    """
    stock = _stock("copy")
    pes = pe_pair(src_pe, dst_pe, "T.copy")
    if pes is None:
        return stock(src, dst, **kwargs)
    s_pe, d_pe = pes
    kwargs["disable_tma"] = True
    name, x, pe_val = ("src", src, s_pe) if s_pe is not None else ("dst", dst, d_pe)
    from tvm.tirx.script.builder import ir as IB

    new_x = peer_view(x, pe_val, name, "a remote T.copy")
    call = stock(new_x, dst, **kwargs) if name == "src" else stock(src, new_x, **kwargs)
    if isinstance(call, tirx.PrimExpr):
        IB.evaluate(call)
    elif isinstance(call, tirx.Stmt):
        _emit_stmt(call, IB)
    return None


def _emit_stmt(stmt, IB):
    if isinstance(stmt, tirx.BufferStore):
        IB.buffer_store(stmt.buffer, stmt.value, stmt.indices)
    else:  # pragma: no cover - stock copy returns a call or a BufferStore
        raise TypeError(f"unexpected statement from T.copy: {type(stmt).__name__}")


def tma_copy(src, dst, src_pe=None, dst_pe=None, **kwargs):
    """``T.tma_copy`` with optional peers.

    Without a peer (None or -1) it is stock ``T.tma_copy``.  With ``src_pe`` (a TMA load of
    a peer's global tensor into shared memory) or ``dst_pe`` (a TMA store of shared memory
    into a peer's tensor) the copy goes through that peer's own descriptor, built in the
    generated host code from the heap table; descriptors cover PEs 0..7, and any other PE
    issues no operation (traps with ``TILESCALE_CHECK_PE=1`` or ``TILESCALE_DEBUG=1``).  See :mod:`tilescale_lang.remote_tma`.
    """
    from . import remote_tma

    return remote_tma.tma_copy(_stock("tma_copy"), src, dst, src_pe=src_pe, dst_pe=dst_pe, **kwargs)
