"""Argument checks and operand normalisation shared by every TileScale intrinsic.

Everything here runs while the kernel is traced (inside ``@T.prim_func``), so a bad
argument is a Python ``TypeError``/``ValueError`` naming it, never an nvcc template error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilescale_core.table import HEADER_ENTRIES, MAX_TABLE_ENTRIES

from ._tvm import tirx

NS = "tilescale::"

#: Entries of the device metadata table ``[local_rank, num_ranks, base_0, ...]``
#: (:data:`tilescale_core.table.MAX_TABLE_ENTRIES`, ``TILESCALE_MAX_TABLE`` in common.cuh).
TABLE_ENTRIES = MAX_TABLE_ENTRIES
#: Largest PE a kernel can address (the table's last base pointer).
MAX_PE = TABLE_ENTRIES - HEADER_ENTRIES - 1
#: Environment variable (read at compile time) that compiles the run-time PE range check in.
CHECK_PE_ENV = "TILESCALE_CHECK_PE"

#: Helpers that read the metadata table whatever their arguments.
TABLE_HELPERS = frozenset({"get_rank", "get_num_ranks", "remap", "remap_ptr", "peer_base", "barrier_blocks", "sync_blocks",
                           "team_rank", "team_num_ranks", "team_translate_pe", "barrier_team", "broadcast_block",
                           "fcollect_block"})
#: ``helper -> index`` of its PE argument (after the name); a call whose PE there is not the
#: constant -1 reads the table.  New intrinsics that take a PE register it here.
PE_ARGUMENT: dict[str, int] = {
    "ld": 1, "st": 2, "wait_until": 2, "notify": 1,
    "put_warp": 3, "get_warp": 3, "put_block": 3, "get_block": 3, "put_rows_block": 6, "get_rows_block": 6,
    "put_signal": 5, "signal_op": 2, "atomic_cas": 3, "atomic_add_sys": 2, "atomic_addx2_sys": 2, "atom_add": 2,
    "lamport_put": 2, "lamport_get": 2, "lamport_clear": 1,
}

SCOPES = {"cta": "tilescale::Scope::CTA", "gpu": "tilescale::Scope::GPU", "sys": "tilescale::Scope::SYS"}
SEMS = {
    "weak": "tilescale::Sem::WEAK",
    "volatile": "tilescale::Sem::VOLATILE",
    "relaxed": "tilescale::Sem::RELAXED",
    "acquire": "tilescale::Sem::ACQUIRE",
    "release": "tilescale::Sem::RELEASE",
    "acq_rel": "tilescale::Sem::ACQ_REL",
}


@dataclass
class Operand:
    """A memory operand reduced to a pointer expression plus what is known about it."""

    ptr: tirx.PrimExpr
    dtype: str | None  # element type, when known
    scope: str | None  # storage scope ("global", "shared.dyn", ...), when known
    buffer: tirx.Buffer | None = None
    indices: list | None = None  # element indices, when the operand is one element

    @property
    def itemsize(self) -> int | None:
        if self.dtype is None:
            return None
        dt = tvm_dtype(self.dtype)
        return dt.bits * dt.lanes // 8


def tvm_dtype(dtype: Any):
    from tilelang import tvm

    return tvm.DataType(str(dtype))


def _addr(buffer: tirx.Buffer, indices, as_value: bool = False) -> tirx.PrimExpr:
    """The address of ``buffer[indices]``: ``address_of(buf[i])``, or for a global buffer
    indexed by an expression, where stock TileLang's passes would fail on that, a read-write
    ``tvm_access_ptr`` at the flat offset (printed as the same ``&buf[i]``, which those passes
    leave alone).  They fail on

    * the element of an intrinsic whose result is a value (``as_value``: ``T.ld``,
      ``T.wait_*``, ``T.atom_add``): the safe-memory pass wraps it in a bounds-guarded
      ``if_then_else``, which is not an lvalue (TVM ``InternalError`` in ``address_of``);
    * an index that is an odd multiple of 2**15 in some variable (a block index times 32768
      elements: one (512, 64) attention head): ``StorageRewrite`` takes that stride for a
      vector width and raises ``InternalError: Can't fetch the lanes of a scalable vector``.
    """
    indices = list(indices)
    if _scope_of(buffer) == "global" and not all(isinstance(i, tirx.IntImm) for i in indices):
        offset = _row_major_offset(buffer, indices)
        if as_value or _stride_of_2_15(offset):
            return buffer.access_ptr("rw", offset=offset, extent=1)
    return tirx.address_of(tirx.BufferLoad(buffer, indices))


def _stride_of_2_15(offset: tirx.PrimExpr) -> bool:
    """Whether the largest power of two dividing every multiple ``offset`` steps by is 2**15
    (``offset = c * x + b`` with ``c`` an odd multiple of 32768)."""
    from tvm import arith

    coeff = int(arith.Analyzer().modular_set(offset).coeff)
    return coeff != 0 and coeff & -coeff == 1 << 15


def _row_major_offset(buffer: tirx.Buffer, indices) -> tirx.PrimExpr:
    """Element offset of ``indices`` from the buffer's first element, in the indices' own
    integer type (so the printed address reads like TileLang's ``&buf[i]``)."""
    from tvm import arith

    dtype = str(indices[0].dtype) if len(indices) else "int32"
    strides = list(buffer.strides)
    if not strides:
        strides, acc = [], tirx.IntImm(dtype, 1)
        for extent in reversed(list(buffer.shape)):
            strides.insert(0, acc)
            acc = acc * (extent if str(extent.dtype) == dtype else tirx.Cast(dtype, extent))
    flat = None
    for index, stride in zip(indices, strides):
        index = index if str(index.dtype) == dtype else tirx.Cast(dtype, index)
        stride = stride if str(stride.dtype) == dtype else tirx.Cast(dtype, stride)
        term = index * stride
        flat = term if flat is None else flat + term
    return arith.Analyzer().simplify(flat)


def _scope_of(buffer: tirx.Buffer) -> str:
    return str(buffer.scope())


def operand(x: Any, name: str, as_value: bool = False) -> Operand:
    """Reduce ``x`` (Buffer, BufferRegion, BufferLoad, ``T.address_of(...)`` or a handle) to
    an :class:`Operand`.

    Raises:
        TypeError: ``x`` is not a memory operand.
    """
    if isinstance(x, tirx.Buffer):
        idx = [tirx.IntImm("int32", 0) for _ in x.shape] or [tirx.IntImm("int32", 0)]
        return Operand(_addr(x, idx), str(x.dtype), _scope_of(x), x, None)
    if isinstance(x, tirx.BufferRegion):
        idx = [r.min for r in x.region]
        return Operand(_addr(x.buffer, idx), str(x.buffer.dtype), _scope_of(x.buffer), x.buffer, None)
    if isinstance(x, tirx.BufferLoad):
        idx = [i.base if isinstance(i, tirx.Ramp) else i for i in x.indices]
        return Operand(_addr(x.buffer, idx, as_value), str(x.buffer.dtype), _scope_of(x.buffer), x.buffer, idx)
    if isinstance(x, tirx.Call) and getattr(x.op, "name", "") == "tirx.address_of":
        inner = x.args[0]
        if isinstance(inner, tirx.BufferLoad):
            idx = [i.base if isinstance(i, tirx.Ramp) else i for i in inner.indices]
            addr = _addr(inner.buffer, idx, as_value)
            if not as_value and getattr(addr.op, "name", "") == "tirx.address_of":
                return Operand(x, str(inner.buffer.dtype), _scope_of(inner.buffer), inner.buffer, list(inner.indices))
            return Operand(addr, str(inner.buffer.dtype), _scope_of(inner.buffer), inner.buffer, idx)
        return Operand(x, None, None)
    if isinstance(x, tirx.PrimExpr) and str(x.dtype) == "handle":
        dtype = scope = None
        ann = getattr(x, "type_annotation", None)
        elem = getattr(ann, "element_type", None)
        if elem is not None and hasattr(elem, "dtype"):
            dtype = str(elem.dtype)
            scope = str(getattr(ann, "storage_scope", "") or "") or None
        return Operand(x, dtype, scope)
    raise TypeError(
        f"{name} must be a buffer, a buffer region (buf[a:b]), a buffer element (buf[i]) or a "
        f"pointer (T.address_of(buf[i])); got {type(x).__name__}: {x!r}"
    )


def element_operand(x: Any, name: str) -> Operand:
    """An operand that designates one element (flags, ld/st targets); same forms as
    :func:`operand`, the element being the first one of a buffer or region."""
    return operand(x, name)


def require_dtype(op: Operand, name: str, allowed_bits=(32, 64)) -> str:
    """The operand's element type; TypeError when unknown or not 32/64-bit scalar."""
    if op.dtype is None:
        raise TypeError(f"{name}: element type unknown (pass a buffer element such as buf[i] or T.address_of(buf[i]))")
    dt = tvm_dtype(op.dtype)
    if dt.lanes != 1 or dt.bits not in allowed_bits:
        raise TypeError(f"{name} must be a {' or '.join(map(str, allowed_bits))}-bit scalar, got {op.dtype}")
    return op.dtype


def require_global(op: Operand, name: str, why: str) -> None:
    """Reject operands known not to live in global memory."""
    if op.scope is not None and op.scope not in ("global", ""):
        raise ValueError(f"{name} must be in global memory {why}, but it is in '{op.scope}' memory")


def choice(value: Any, allowed: tuple[str, ...], name: str) -> str:
    """``value`` as a lower-case string from ``allowed``; ValueError/TypeError otherwise."""
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):  # enums
        value = value.value
    if hasattr(value, "name") and not isinstance(value, str):
        value = value.name
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {allowed}, got {value!r}")
    low = value.lower()
    if low not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return low


def const_int(value: Any, name: str, minimum: int | None = None) -> int:
    """A compile-time integer (Python int or IntImm)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        v = value
    elif isinstance(value, tirx.IntImm):
        v = int(value.value)
    else:
        raise TypeError(f"{name} must be a compile-time integer constant, got {value!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def const_bool(value: Any, name: str) -> bool:
    """A compile-time boolean (Python bool/int or IntImm)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, tirx.IntImm)):
        return bool(const_int(value, name))
    raise TypeError(f"{name} must be a compile-time boolean, got {value!r}")


def is_int_dtype(dtype: Any) -> bool:
    dt = tvm_dtype(dtype)
    return dt.lanes == 1 and (str(dtype).startswith("int") or str(dtype).startswith("uint"))


def pe_expr(pe: Any, name: str) -> tirx.PrimExpr | None:
    """Normalise a PE argument: None for local (omitted, None or constant -1), otherwise an
    int32 expression (a run-time -1 is local too, handled on the device).

    Raises:
        TypeError: ``pe`` is not an integer (float, bool, handle, ...).
        ValueError: a constant below -1.
    """
    if pe is None:
        return None
    if isinstance(pe, bool):
        raise TypeError(f"{name} must be an integer PE (or -1/None for local), got {pe!r}")
    if isinstance(pe, int):
        if pe < -1:
            raise ValueError(f"{name} must be -1 (local) or a rank >= 0, got {pe}")
        if pe > MAX_PE:
            raise ValueError(
                f"{name}={pe} is out of range: the metadata table holds at most {MAX_PE + 1} ranks "
                f"(PE 0..{MAX_PE}); a run-time PE is checked against num_ranks when compiled with "
                f"{CHECK_PE_ENV}=1"
            )
        return None if pe == -1 else tirx.IntImm("int32", pe)
    if isinstance(pe, tirx.Buffer):
        raise TypeError(f"{name} must be an integer expression, got buffer {pe.name!r} (did you mean {pe.name}[0]?)")
    if not isinstance(pe, tirx.PrimExpr):
        raise TypeError(f"{name} must be an integer PE expression, got {type(pe).__name__}: {pe!r}")
    if not is_int_dtype(pe.dtype):
        raise TypeError(f"{name} must be an integer expression, got dtype {pe.dtype}")
    if isinstance(pe, tirx.IntImm):
        return pe_expr(int(pe.value), name)
    return pe if str(pe.dtype) == "int32" else tirx.Cast("int32", pe)



def remote_pe(pe: Any, name: str, op: Operand, operand_name: str) -> tirx.PrimExpr | None:
    """:func:`pe_expr` of ``pe``; when it selects a peer, also require that ``op`` (the
    operand called ``operand_name``) is in global memory, the only memory a peer can map."""
    pe_val = pe_expr(pe, name)
    if pe_val is not None:
        require_global(op, operand_name, f"when {name} selects a peer")
    return pe_val

def reads_table(call: tirx.Call) -> str | None:
    """The helper's name when the ``call_extern`` ``call`` reads the metadata table (a peer
    intrinsic or a rank query); None otherwise (local-only helpers, non-TileScale calls)."""
    if getattr(call.op, "name", "") != "tirx.call_extern" or not call.args:
        return None
    head = call.args[0]
    if not isinstance(head, tirx.StringImm) or not head.value.startswith(NS):
        return None
    base = head.value[len(NS):].split("<", 1)[0]
    if base in TABLE_HELPERS:
        return base
    index = PE_ARGUMENT.get(base)
    if index is None or len(call.args) <= index + 1:
        return None
    pe = call.args[index + 1]
    if isinstance(pe, tirx.IntImm) and int(pe.value) < 0:
        return None
    return base


def _static(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def flat_index(buffer: tirx.Buffer, indices) -> tirx.PrimExpr:
    """``indices`` of ``buffer`` as one element offset from its data pointer (simplified)."""
    from tvm import arith

    return arith.Analyzer().simplify(buffer.offset_of(list(indices))[0])


def available_elements(x: Any) -> int | None:
    """Elements from ``x``'s start to the end of its region/buffer, when static (else None).

    A buffer counts all its elements, a region ``buf[a:b]`` its extents' product, an element
    ``buf[i]`` (or ``T.address_of(buf[i])``) the elements from ``i`` to the buffer's end."""
    if isinstance(x, tirx.BufferRegion):
        total = 1
        for r in x.region:
            e = _static(r.extent)
            if e is None:
                return None
            total *= e
        return total
    if isinstance(x, tirx.Call) and x.args and isinstance(x.args[0], tirx.BufferLoad):
        return available_elements(x.args[0])
    buf = x if isinstance(x, tirx.Buffer) else getattr(x, "buffer", None)
    if buf is None:
        return None
    total = 1
    for e in buf.shape:
        e = _static(e)
        if e is None:
            return None
        total *= e
    if isinstance(x, tirx.BufferLoad):
        try:
            flat = _static(flat_index(buf, x.indices))
        except Exception:  # vector (Ramp) indices and the like: not a static element
            return None
        return None if flat is None else total - (flat - (_static(buf.elem_offset) or 0))
    return total


def _region_text(region: tirx.BufferRegion) -> str:
    parts = []
    for r in region.region:
        lo, ext = _static(r.min), _static(r.extent)
        if lo is not None and ext is not None:
            parts.append(f"{lo}:{lo + ext}")
        else:
            parts.append(f"{r.min}:{r.min} + {r.extent}")
    return f"{region.buffer.name}[{', '.join(parts)}]"


def require_contiguous(x: Any, name: str, kind: str) -> None:
    """ValueError when ``x`` is a region (``buf[a:b, c:d]``) whose elements are not one
    contiguous span of memory: ``kind`` copies a flat span from the region's first element,
    so ``M[0:2, 0:4]`` of an 8x8 ``M`` would copy ``M[0, 0:8]``.  Regions whose layout is not
    known at trace time are accepted."""
    if not isinstance(x, tirx.BufferRegion):
        return
    buf = x.buffer
    extents = [_static(r.extent) for r in x.region]
    if buf.strides:
        strides = [_static(st) for st in buf.strides]
    else:
        shape = [_static(e) for e in buf.shape]
        strides, acc = [], 1
        for e in reversed(shape):
            strides.insert(0, acc)
            acc = None if (acc is None or e is None) else acc * e
    dims = [i for i, e in enumerate(extents) if e != 1]  # dims that move (unknown extents too)
    if not dims:
        return
    if any(extents[i] is None or strides[i] is None for i in dims):
        return
    expected = 1
    for i in reversed(dims):
        if strides[i] != expected:
            raise ValueError(
                f"{name}: region {_region_text(x)} is not contiguous in memory (its rows are apart), "
                f"but {kind} copies one flat span from its first element; pass a contiguous region "
                f"(whole trailing rows, e.g. {buf.name}[a:b, :]) or copy row by row"
            )
        expected *= extents[i]


def check_extent(size: Any, x: Any, name: str, size_name: str = "size") -> None:
    """ValueError when the constant element count ``size`` exceeds what ``x`` holds from its
    start (both known at trace time); nothing when either is dynamic."""
    if isinstance(size, tirx.IntImm):
        size = int(size.value)
    if not isinstance(size, int) or isinstance(size, bool):
        return
    avail = available_elements(x)
    if avail is not None and size > avail:
        raise ValueError(
            f"{size_name}={size} elements exceeds {name}, which holds {avail} elements from its start"
        )


#: Largest byte count a constant size may give: TVM immediates are signed 64-bit, and no
#: device holds 2**63 bytes.
MAX_BYTES = (1 << 63) - 1


#: Device helper that checks a signed run-time element count (``debug.cuh``).
CHECKED_COUNT = NS + "checked_count"


def size_bytes(size: Any, itemsize: int, name: str = "size", kind: str | None = None) -> tirx.PrimExpr:
    """``size`` elements of ``itemsize`` bytes, as a uint64 byte count.

    A constant ``size`` is checked here, while tracing.  A run-time ``size`` of a signed type
    that may be negative (``n - 100``) is wrapped in ``tilescale::checked_count(size,
    "<kind> <name>")`` before its conversion to uint64: compiled with ``TILESCALE_CHECK_PE=1`` or
    ``TILESCALE_DEBUG=1``, a negative count traps on the device, printing ``kind`` (the
    intrinsic), ``name``, the value, the rank, the block and the thread.  With the checks off
    the helper returns its argument, so correct programs keep their machine code, and a negative
    count is deliberately *not* clamped to 0: it stays a huge unsigned byte count (undefined,
    like an out-of-range PE without the check) rather than a silent copy of nothing that would
    still set the signal; build with the checks to find it (docs/reliability.md, Truncation).
    Unsigned sizes, and signed ones known to be non-negative, are converted as they are.

    Raises:
        TypeError: ``size`` is not an integer.
        ValueError: a negative constant (it would become a huge unsigned count) or one whose
            byte count does not fit 63 bits; both name ``name``.
    """
    if isinstance(size, bool):
        raise TypeError(f"{name} must be an integer number of elements, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"{name} must be >= 0, got {size}")
        if size * itemsize > MAX_BYTES:
            raise ValueError(
                f"{name}={size} elements of {itemsize} bytes ({size * itemsize} bytes) is too large: "
                f"a byte count must fit 63 bits (< 2**63)"
            )
        return tirx.IntImm("uint64", size * itemsize)
    if not isinstance(size, tirx.PrimExpr) or not is_int_dtype(size.dtype):
        raise TypeError(f"{name} must be an integer number of elements, got {size!r}")
    if isinstance(size, tirx.IntImm):
        return size_bytes(int(size.value), itemsize, name, kind)
    if str(size.dtype).startswith("int") and not _non_negative(size):
        what = f"{kind} {name}" if kind else name
        size = tirx.call_extern(str(size.dtype), CHECKED_COUNT, size, tirx.StringImm(what))
    return tirx.Cast("uint64", size) * tirx.IntImm("uint64", itemsize)


def element_size(kind: str, s: Operand, d: Operand) -> int:
    """Bytes per element of a copy from operand ``s`` to ``d``: either side's element size
    (an untyped pointer takes the other's).

    Raises:
        TypeError: the element sizes differ, or neither side's element type is known.
    """
    if s.itemsize is not None and d.itemsize is not None and s.itemsize != d.itemsize:
        raise TypeError(f"{kind}: src ({s.dtype}) and dst ({d.dtype}) element sizes differ")
    itemsize = s.itemsize or d.itemsize
    if itemsize is None:
        raise TypeError(f"{kind}: element type unknown for both src and dst; pass typed pointers "
                        "(T.address_of(buf[i]))")
    return itemsize


def static_int(x: Any) -> int | None:
    """``x`` as a Python int when it is a constant integer (an int or an ``IntImm``), else None."""
    if isinstance(x, bool):
        return None
    return x if isinstance(x, int) else _static(x)


def copy_bytes(kind: str, src: Any, s: Operand, dst: Any, d: Operand, size: Any,
               size_name: str = "size") -> tirx.PrimExpr:
    """The uint64 byte count of a flat copy of ``size`` elements from ``src`` to ``dst``
    (their operands ``s``, ``d``), checked the one way every copy intrinsic checks it: the two
    element sizes agree (either side may be an untyped pointer), ``size`` is a valid count
    (:func:`size_bytes`), and each side is one contiguous span (:func:`require_contiguous`)
    that holds ``size`` elements (:func:`check_extent`).

    Raises:
        TypeError: the element sizes differ, or neither side's element type is known.
        ValueError: see :func:`size_bytes`, :func:`require_contiguous` and :func:`check_extent`.
    """
    nbytes = size_bytes(size, element_size(kind, s, d), size_name, kind)
    for x, name in ((src, "src"), (dst, "dst")):
        require_contiguous(x, name, kind)
        check_extent(size, x, name, size_name)
    return nbytes


def _non_negative(e: tirx.PrimExpr) -> bool:
    """Whether the integer expression ``e`` is provably >= 0 (e.g. an unsigned value cast to a
    wider signed type)."""
    from tvm import arith

    try:
        return arith.Analyzer().const_int_bound(e).min_value >= 0
    except Exception:  # an expression the analyser cannot bound
        return False


def _int_imm(value: int, dtype: str) -> tirx.PrimExpr:
    """An immediate of integer type ``dtype`` holding ``value`` (already in range); uint64
    values of 2**63 and above need TVM's large-uint form (IntImm is signed 64-bit)."""
    if value >= 1 << 63:
        return tirx.const(value, dtype)
    return tirx.IntImm(dtype, value)


def cast_to(value: Any, dtype: str, name: str) -> tirx.PrimExpr:
    """``value`` converted to ``dtype`` (Python numbers and TVM constants become immediates).

    Constants are checked while tracing (TVM constants like ``T.int64(5)`` and
    ``T.float32(1.5)`` as their Python values): an integer type takes integers that fit its
    width in either signed or unsigned reading; a float for an integer type, constant or
    not, is a TypeError (C would truncate it: ``T.float32(1.5)`` would become ``1``).

    Raises:
        TypeError: a buffer, a non-scalar, or a float for an integer ``dtype``.
        ValueError: an integer constant that does not fit ``dtype``.
    """
    if isinstance(value, tirx.Buffer):
        raise TypeError(f"{name} must be a scalar expression, got buffer {value.name!r}")
    is_int = str(dtype).startswith(("int", "uint"))
    if isinstance(value, tirx.IntImm):
        value = int(value.value)
    elif isinstance(value, tirx.FloatImm):
        value = float(value.value)
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, (int, float)):
        dt = tvm_dtype(dtype)
        if is_int:
            if isinstance(value, float):
                raise TypeError(f"{name} must be an integer for a {dtype} flag, got {value!r}")
            low, high = -(1 << (dt.bits - 1)), (1 << dt.bits) - 1
            if not low <= value <= high:
                raise ValueError(
                    f"{name}={value} does not fit the {dtype} flag ({dt.bits} bits: {low}..{high}); "
                    "it would be truncated"
                )
            mask = (1 << dt.bits) - 1
            v = value & mask
            if str(dtype).startswith("int") and v >= 1 << (dt.bits - 1):
                v -= 1 << dt.bits
            return _int_imm(v, dtype)
        try:
            return tirx.FloatImm(dtype, float(value))
        except (ValueError, RuntimeError):  # TVM: "Literal value 1e+40 exceeds maximum of float32"
            raise ValueError(f"{name}={value!r} does not fit the {dtype} flag (beyond its largest finite value)") from None
    if not isinstance(value, tirx.PrimExpr):
        raise TypeError(f"{name} must be a scalar expression, got {type(value).__name__}")
    if is_int and str(value.dtype).startswith(("float", "bfloat")):
        raise TypeError(
            f"{name} is a {value.dtype} expression but the flag is {dtype}: C would truncate it; "
            f"convert it explicitly (T.cast({name}, \"{dtype}\")) if that is what you mean"
        )
    return value if str(value.dtype) == dtype else tirx.Cast(dtype, value)


def extern(dtype: str, name: str, *args) -> tirx.PrimExpr:
    """``T.call_extern(dtype, name, *args)``."""
    return tirx.call_extern(dtype, name, *args)
