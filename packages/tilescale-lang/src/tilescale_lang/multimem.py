"""Multimem (NVLink multicast) operations: ``T.multimem_ld_reduce``, ``T.multimem_st``,
``T.multimem_red``, ``T.multimem_signal``, ``T.multimem_signal_add``,
``T.multimem_tma_store`` and :class:`MultimemReduceOp`.

The *multicast operand* (``src`` of ld_reduce; ``dst`` of st/red/signal/tma_store) is a
global buffer whose address lies in a multicast mapping (the allocator's multicast region);
it is used as is, never remapped through the metadata table.  The *local operand* is a
buffer or region of the same shape and dtype (fragment, shared, global or per-thread local).

Work distribution (element-wise ops): a loop over the region is generated in which every
iteration calls one PTX ``multimem`` instruction (``include/tilescale/multimem.cuh``) on one
32/64-bit element, or on one packed pair for float16/bfloat16.  The loop is ``T.Parallel``
(spread over the block's threads by stock TileLang, fragment layouts included) unless the
local operand is per-thread (``local``/``local.var`` scope), where every thread runs the whole
region serially.  Packed float16/bfloat16 regions must have an even, pair-aligned last
extent and a non-fragment local operand (see ``docs/lang.md``, Limits).

Legal PTX combinations (checked with ptxas 13.0, sm_90a); anything else is rejected here,
while the kernel is traced, with a ValueError naming ``reduce_op`` or the operand:

==================  =====================================  ==============================
op                  multimem_ld_reduce                     multimem_red
==================  =====================================  ==============================
ADD                 float32, float64, uint32, int32,       same as ld_reduce
                    uint64, int64 (as .u64), float16/
                    bfloat16 pairs (.acc::f32)
MIN / MAX           uint32, int32, uint64, int64,          uint32, int32, uint64, int64
                    float16/bfloat16 pairs
==================  =====================================  ==============================
"""

from __future__ import annotations

import enum
from typing import Any

from ._tvm import tirx

from . import validation as V


class MultimemReduceOp(enum.Enum):
    """Reduction of a multimem operation.

    ``NONE`` is kept for compatibility: for :func:`multimem_tma_store` it is the same as
    ``reduce_op=None`` (a plain store); the element-wise ops reject it.
    """

    ADD = "add"
    MIN = "min"
    MAX = "max"
    NONE = "none"


_OPS = {"add": "ADD", "min": "MIN", "max": "MAX", "none": "NONE"}
_MMOP = "tilescale::MMOp::"
_MMTYPE = "tilescale::MMType::"

# dtype -> PTX type tag for the element-wise reductions
_INT_TYPES = {"uint32": "U32", "int32": "S32", "uint64": "U64", "int64": "S64"}
_PACKED = {"float16": "F16X2", "bfloat16": "BF16X2"}
_LD_RED_LEGAL = {
    "add": {"float32": "F32", "float64": "F64", "uint32": "U32", "int32": "S32", "uint64": "U64",
            "int64": "U64", "float16": "F16X2", "bfloat16": "BF16X2"},
    "min": {**_INT_TYPES, **_PACKED},
    "max": {**_INT_TYPES, **_PACKED},
}
_RED_LEGAL = {
    "add": dict(_LD_RED_LEGAL["add"]),
    "min": dict(_INT_TYPES),
    "max": dict(_INT_TYPES),
}
_ST_TYPES = ("float32", "float64", "uint32", "int32", "uint64", "int64", "float16", "bfloat16")
_PER_THREAD_SCOPES = ("local", "local.var")


def _reduce_op(value: Any, name: str = "reduce_op", allow_none: bool = False) -> str:
    """``value`` (a :class:`MultimemReduceOp`, "add"/"min"/"max"/"none", or None) as a
    lower-case op name; None/NONE become ``"none"`` when ``allow_none``."""
    if value is None:
        if allow_none:
            return "none"
        raise ValueError(f"{name} must be MultimemReduceOp.ADD, MIN or MAX, got None")
    if isinstance(value, MultimemReduceOp):
        low = value.value
    elif isinstance(value, str):
        low = value.lower()
        if low not in _OPS:
            raise ValueError(f"{name} must be one of 'add', 'min', 'max' (or MultimemReduceOp), got {value!r}")
    else:
        raise TypeError(f"{name} must be a MultimemReduceOp or 'add'/'min'/'max', got {value!r}")
    if low == "none" and not allow_none:
        raise ValueError(f"{name}=NONE is only meaningful for multimem_tma_store; use ADD, MIN or MAX")
    return low


# ------------------------------------------------------------------------------ regions
class _Region:
    """A buffer region: buffer, per-dimension start and extent."""

    def __init__(self, buffer, mins, extents, name):
        self.buffer, self.mins, self.extents, self.name = buffer, list(mins), list(extents), name

    @property
    def dtype(self) -> str:
        return str(self.buffer.dtype)

    @property
    def scope(self) -> str:
        return str(self.buffer.scope())

    def at(self, idx) -> tirx.BufferLoad:
        return tirx.BufferLoad(self.buffer, self.indices(idx))

    def indices(self, idx) -> list:
        return [i if _const(m) == 0 else m + i for m, i in zip(self.mins, idx)]

    def addr(self, idx) -> tirx.PrimExpr:
        return tirx.address_of(self.at(idx))


def _region(x: Any, name: str) -> _Region:
    if isinstance(x, tirx.Buffer):
        zero = tirx.IntImm("int32", 0)
        return _Region(x, [zero] * len(x.shape), list(x.shape), name)
    if isinstance(x, tirx.BufferRegion):
        return _Region(x.buffer, [r.min for r in x.region], [r.extent for r in x.region], name)
    if isinstance(x, tirx.BufferLoad):
        if any(isinstance(i, tirx.Ramp) for i in x.indices):
            raise TypeError(f"{name}: use a region (buf[a:b]) instead of a vector element")
        one = tirx.IntImm("int32", 1)
        return _Region(x.buffer, list(x.indices), [one] * len(x.indices), name)
    raise TypeError(
        f"{name} must be a buffer, a buffer region (buf[a:b]) or a buffer element (buf[i]); got {type(x).__name__}: {x!r}"
    )


def _analyzer():
    from tilelang import tvm

    return tvm.arith.Analyzer()


def _const(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else (e if isinstance(e, int) else None)


def _same_shape(a: _Region, b: _Region, name: str) -> None:
    """Same rank and extents (ValueError naming ``name`` otherwise)."""
    ana = _analyzer()
    if len(a.extents) != len(b.extents) or not all(
        ana.can_prove_equal(x, y) for x, y in zip(a.extents, b.extents)
    ):
        raise ValueError(
            f"{name} region shape {[str(e) for e in b.extents]} does not match "
            f"{a.name} region shape {[str(e) for e in a.extents]} (rank and extents must match)"
        )


def _same_dtype(a: _Region, b: _Region, name: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{name} dtype {b.dtype} does not match {a.name} dtype {a.dtype}")


def _require_multicast(r: _Region) -> None:
    if r.scope not in ("global", ""):
        raise ValueError(
            f"{r.name} is the multicast operand and must be a global buffer mapped from the "
            f"allocator's multicast region, but it is in '{r.scope}' memory"
        )


def _provably_multiple(expr, k: int) -> bool:
    c = _const(expr)
    if c is not None:
        return c % k == 0
    ms = _analyzer().modular_set(expr)
    return int(ms.coeff) % k == 0 and int(ms.base) % k == 0


def _check_pairs(mc: _Region, local: _Region) -> None:
    """Packed float16/bfloat16: even, pair-aligned last extent; no fragment local operand."""
    for r in (mc, local):
        last = r.extents[-1] if r.extents else 1
        if _const(last) is None or _const(last) % 2:
            raise ValueError(
                f"{r.name}: packed {r.dtype} multimem operations need an even last extent, got {last}"
            )
        row = _const(r.buffer.shape[-1])
        if row is None or row % 2 or not _provably_multiple(r.mins[-1], 2):
            raise ValueError(
                f"{r.name}: packed {r.dtype} multimem operations need pair-aligned rows (an even row "
                f"length and an even start column), got row length {r.buffer.shape[-1]} and start {r.mins[-1]}"
            )
    if local.scope == "local.fragment":
        raise ValueError(
            f"{local.name}: packed {local.dtype} multimem operations do not accept a fragment "
            "local operand (pair ownership cannot be proven); stage it through shared memory"
        )


def _loop(local: _Region, extents, body) -> None:
    """Call ``body(idx)`` for every index of ``extents``: ``T.Parallel`` over the block, or
    a serial loop when ``local`` is per-thread storage."""
    import tilelang.language as T

    if not extents:
        body([])
        return
    frame = T.grid(*extents) if local.scope in _PER_THREAD_SCOPES else T.Parallel(*extents)
    with frame as idx:
        body([idx] if isinstance(idx, tirx.PrimExpr) else list(idx))


def _elementwise(kind: str, mc: _Region, local: _Region, emit_one, emit_pair, packed: bool) -> None:
    from tvm.tirx.script.builder import ir as IB  # noqa: F401

    extents = list(local.extents)
    if packed:
        extents[-1] = _const(extents[-1]) // 2

        def body(idx):
            full = idx[:-1] + [idx[-1] * 2]
            emit_pair(full)

    else:
        body = emit_one
    _loop(local, extents, body)


def _prepare(mc_x, local_x, mc_name, local_name):
    mc = _region(mc_x, mc_name)
    local = _region(local_x, local_name)
    _require_multicast(mc)
    _same_dtype(mc, local, local_name)
    _same_shape(mc, local, local_name)
    return mc, local


def _reduction(legal: dict, op: str, mc, local, instr: str, operand: str) -> tuple[str, bool]:
    """``(template arguments, packed)`` of a reduction ``op`` on ``mc``'s dtype, checked against
    ``legal`` (op -> dtype -> PTX type); a pair PTX lacks is a ValueError naming ``reduce_op``."""
    ptx = legal[op].get(mc.dtype)
    if ptx is None:
        raise ValueError(
            f"reduce_op={op.upper()} is not a PTX {instr} operation for dtype {mc.dtype} ({operand}); "
            f"supported: {sorted(legal[op])}"
        )
    packed = mc.dtype in _PACKED
    if packed:
        _check_pairs(mc, local)
    return f"{_MMOP}{op.upper()}, {_MMTYPE}{ptx}", packed


def multimem_ld_reduce(src, dst, reduce_op=MultimemReduceOp.ADD):
    """Reduce-load: ``dst[...] = reduce over all replicas of src[...]``, element-wise.

    One ``multimem.ld_reduce.relaxed.sys.global`` per element (per packed pair for
    float16/bfloat16, with ``.acc::f32`` for ADD).

    Args:
        src: the multicast region: a global buffer, region (``buf[a:b, c:d]``) or element
            mapped from the allocator's multicast region.
        dst: the local result region, same rank, extents and dtype as ``src`` (fragment,
            shared, global, or per-thread ``local``).
        reduce_op: :class:`MultimemReduceOp` ADD (float32/float64/uint32/int32/uint64/int64,
            float16/bfloat16 pairs), MIN or MAX (uint32/int32/uint64/int64, float16/bfloat16
            pairs); or the strings "add"/"min"/"max".

    Raises:
        ValueError: ``src`` not global, shape/dtype mismatch (naming ``dst``), a
            dtype/``reduce_op`` pair PTX lacks (naming ``reduce_op``), bad packed region.
    """
    from tvm.tirx.script.builder import ir as IB

    op = _reduce_op(reduce_op)
    mc, local = _prepare(src, dst, "src", "dst")
    tmpl, packed = _reduction(_LD_RED_LEGAL, op, mc, local, "multimem.ld_reduce", "src")

    def one(idx):
        IB.buffer_store(local.buffer, V.extern(mc.dtype, f"tilescale::multimem_ld_reduce<{tmpl}>", mc.addr(idx)),
                        local.indices(idx))

    def pair(idx):
        IB.evaluate(V.extern("handle", f"tilescale::multimem_ld_reduce_x2<{tmpl}>", mc.addr(idx), local.addr(idx)))

    _elementwise("multimem_ld_reduce", mc, local, one, pair, packed)


def multimem_st(src, dst):
    """Broadcast store: ``dst[...] = src[...]`` on every replica of the multicast ``dst``.

    One ``multimem.st.relaxed.sys.global.{b32,b64}`` per element (per pair for
    float16/bfloat16).

    Args:
        src: the local region (fragment, shared, global or per-thread ``local``).
        dst: the multicast region (global, from the allocator's multicast region), same rank,
            extents and dtype; dtypes float32/float64/(u)int32/(u)int64, float16/bfloat16 pairs.
    """
    from tvm.tirx.script.builder import ir as IB

    mc, local = _prepare(dst, src, "dst", "src")
    if mc.dtype not in _ST_TYPES:
        raise ValueError(f"dst dtype {mc.dtype} is not supported by multimem_st; supported: {list(_ST_TYPES)}")
    packed = mc.dtype in _PACKED
    if packed:
        _check_pairs(mc, local)

    def one(idx):
        IB.evaluate(V.extern("handle", "tilescale::multimem_st", mc.addr(idx), local.at(idx)))

    def pair(idx):
        IB.evaluate(V.extern("handle", "tilescale::multimem_st_x2", mc.addr(idx), local.addr(idx)))

    _elementwise("multimem_st", mc, local, one, pair, packed)


def multimem_red(src, dst, reduce_op=MultimemReduceOp.ADD):
    """Reduce-store: ``dst[...] = reduce_op(dst[...], src[...])`` on every replica of the
    multicast ``dst``, element-wise (``multimem.red.relaxed.sys.global``).

    Args:
        src: the local region (fragment, shared, global or per-thread ``local``).
        dst: the multicast region, same rank, extents and dtype.
        reduce_op: ADD (float32/float64/uint32/int32/uint64/int64, float16/bfloat16 pairs),
            MIN or MAX (uint32/int32/uint64/int64 only: PTX has no floating-point
            multimem.red min/max).
    """
    from tvm.tirx.script.builder import ir as IB

    op = _reduce_op(reduce_op)
    mc, local = _prepare(dst, src, "dst", "src")
    tmpl, packed = _reduction(_RED_LEGAL, op, mc, local, "multimem.red", "dst")

    def one(idx):
        IB.evaluate(V.extern("handle", f"tilescale::multimem_red<{tmpl}>", mc.addr(idx), local.at(idx)))

    def pair(idx):
        IB.evaluate(V.extern("handle", f"tilescale::multimem_red_x2<{tmpl}>", mc.addr(idx), local.addr(idx)))

    _elementwise("multimem_red", mc, local, one, pair, packed)


def _signal_target(addr, allowed):
    op = V.operand(addr, "addr")
    if op.dtype is None:
        raise TypeError("addr: element type unknown (pass a buffer element such as flags[i])")
    if op.dtype not in allowed:
        raise TypeError(f"addr must be a {' or '.join(allowed)} multicast flag, got {op.dtype}")
    V.require_global(op, "addr", "(a multicast address from the allocator's multicast region)")
    return op


def multimem_signal(addr, value):
    """Store the signal ``value`` to every replica of the multicast flag ``addr``
    (``multimem.st.release.sys.global.{u32,u64}``; the type follows ``addr``'s dtype).

    Args:
        addr: a uint32 or uint64 multicast element (``flags[i]``, ``T.address_of(flags[i])``).
        value: scalar, converted to ``addr``'s dtype.
    """
    op = _signal_target(addr, ("uint32", "uint64"))
    return V.extern("handle", "tilescale::multimem_signal", op.ptr, V.cast_to(value, op.dtype, "value"))


def multimem_signal_add(addr, value):
    """Add ``value`` to every replica of the multicast flag ``addr``
    (``multimem.red.release.sys.global.add.{u32,s32,u64}``).

    Args:
        addr: a uint32, int32 or uint64 multicast element.
        value: scalar, converted to ``addr``'s dtype.
    """
    op = _signal_target(addr, ("uint32", "int32", "uint64"))
    tag = {"uint32": "U32", "int32": "S32", "uint64": "U64"}[op.dtype]
    return V.extern("handle", f"tilescale::multimem_signal_add<{_MMTYPE}{tag}>", op.ptr, V.cast_to(value, op.dtype, "value"))


# ------------------------------------------------------------------------------ bulk store
_BULK_RED = {"add": {"float32": "F32", "float16": "F16X2", "bfloat16": "BF16X2"},
             "min": {"float16": "F16X2", "bfloat16": "BF16X2"},
             "max": {"float16": "F16X2", "bfloat16": "BF16X2"}}


def _contiguous_offset(r: _Region):
    """Linear element offset of a physically contiguous row-major region; ValueError when the
    region is not contiguous or has non-constant extents."""
    ext = [_const(e) for e in r.extents]
    shape = [_const(s) for s in r.buffer.shape]
    if any(e is None for e in ext) or any(s is None for s in shape):
        raise ValueError(f"{r.name}: multimem_tma_store needs compile-time extents and buffer shape")
    if r.buffer.strides and len(r.buffer.strides) > 0:
        compact, acc = [], 1
        for s_ in reversed(shape):
            compact.insert(0, acc)
            acc *= s_
        if [_const(x) for x in r.buffer.strides] != compact:
            raise ValueError(f"{r.name}: multimem_tma_store needs a compact row-major buffer, got strides {list(r.buffer.strides)}")
    nonunit = [i for i, e in enumerate(ext) if e != 1]
    if nonunit:
        first = nonunit[0]
        for d in range(first + 1, len(ext)):
            if ext[d] != shape[d]:
                raise ValueError(
                    f"{r.name}: multimem_tma_store region is not physically contiguous (dimension {d} "
                    f"covers {ext[d]} of {shape[d]} elements)"
                )
    for d, (m, e, s) in enumerate(zip(r.mins, ext, shape)):
        mc = _const(m)
        if mc is not None and (mc < 0 or mc + e > s):
            raise ValueError(f"{r.name}: multimem_tma_store region is out of bounds in dimension {d}")
    offset = tirx.IntImm("int64", 0)
    stride = 1
    for m, s in reversed(list(zip(r.mins, shape))):
        offset = offset + tirx.Cast("int64", m) * stride if not isinstance(m, int) else offset + m * stride
        stride *= s
    return _analyzer().simplify(offset)


def multimem_tma_store(src, dst, reduce_op=None):
    """Bulk store (``reduce_op`` None/NONE) or bulk reduce-store (ADD/MIN/MAX) of a shared
    memory region into a multicast region, issued by the calling thread as one async bulk
    operation (``multimem.cp{.reduce}.async.bulk...bulk_group``, CUDA Toolkit 13.1+).

    Call it from one elected thread after ``T.fence_proxy_async()`` and ``T.sync_threads()``,
    then ``T.tma_store_arrive()`` and ``T.tma_store_wait(0, False)``.

    Args:
        src: shared-memory region (identity layout: not a swizzled T.gemm operand).
        dst: global multicast region; same rank, extents and dtype as ``src``.
        reduce_op: None/NONE (plain store, any dtype), ADD (float32/float16/bfloat16),
            MIN/MAX (float16/bfloat16).

    Both regions must be in bounds and physically contiguous, start 16-byte aligned
    (provably, at trace time) and move a positive multiple of 16 bytes (< 2**32).  With
    nvcc older than 13.1 the kernel fails to compile with a clear static_assert.
    """
    op = _reduce_op(reduce_op, allow_none=True)
    s = _region(src, "src")
    d = _region(dst, "dst")
    if s.scope not in ("shared", "shared.dyn"):
        raise ValueError(f"src of multimem_tma_store must be in shared memory, but it is in '{s.scope}' memory")
    _require_multicast(d)
    _same_dtype(s, d, "dst")
    _same_shape(s, d, "dst")
    if op == "none":
        ptx = "B32"
    else:
        ptx = _BULK_RED[op].get(s.dtype)
        if ptx is None:
            raise ValueError(
                f"reduce_op={op.upper()} is not supported by multimem_tma_store for dtype {s.dtype}; "
                f"supported: {sorted(_BULK_RED[op])}"
            )
    itemsize = V.tvm_dtype(s.dtype).bits * V.tvm_dtype(s.dtype).lanes // 8
    if itemsize == 0:
        raise ValueError(f"src dtype {s.dtype} is not byte-addressable")
    n = 1
    for e in s.extents:
        n *= _const(e) if _const(e) is not None else 0
    nbytes = n * itemsize
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(
            f"multimem_tma_store size must be a positive multiple of 16 bytes, got {nbytes} bytes "
            f"({n} x {s.dtype}; src/dst)"
        )
    if nbytes >= 1 << 32:
        raise ValueError(f"multimem_tma_store size {nbytes} bytes does not fit a 32-bit byte count (src/dst)")
    for r in (s, d):
        off = _contiguous_offset(r)
        if not _provably_multiple(off * itemsize if _const(off) is None else _const(off) * itemsize, 16):
            raise ValueError(f"{r.name}: multimem_tma_store region does not start at a provably 16-byte aligned address")
    return V.extern(
        "handle",
        f"tilescale::multimem_tma_store<{_MMOP}{op.upper()}, {_MMTYPE}{ptx}>",
        d.addr([0] * len(d.extents)),
        s.addr([0] * len(s.extents)),
        tirx.IntImm("uint32", nbytes),
    )
