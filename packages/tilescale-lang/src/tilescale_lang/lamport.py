"""The Lamport exchange: ``T.lamport_put``, ``T.lamport_get``, ``T.lamport_clear``.

Each moves one 16-byte vector (8 float16/bfloat16, 4 float32 or 2 float64 elements) whose
data carries its own readiness, so a small exchange needs no flag and no fence (the protocol
of NCCL's LL and TensorRT-LLM's one-shot all-reduce): a receive buffer starts filled with
the *sentinel* (every element all ones, a NaN in each of these types, written by
``T.lamport_clear`` or a host fill of 0xFF bytes); ``T.lamport_put`` stores a vector with any
sentinel element replaced by the type's canonical quiet NaN (still a NaN), and
``T.lamport_get`` polls a vector until none of its elements is the sentinel. A buffer is
reused only after every reader is done with it: rotate three buffers by call number and
clear the previous call's buffer in the next call (``docs/lang.md``, "Lamport exchange").

Both sides must be 16-byte aligned (a row of a ``(rows, 16 // itemsize)`` buffer is). The
waits honour ``TILESCALE_WAIT_TIMEOUT_MS`` like ``T.wait_*``.
"""

from __future__ import annotations

from ._tvm import tirx

from . import validation as V

__all__ = ["lamport_put", "lamport_get", "lamport_clear", "NAN_BITS", "VECTOR_BYTES", "EXPORTS"]

#: Bytes moved by one call.
VECTOR_BYTES = 16
#: Element type -> the canonical quiet NaN that replaces a sentinel element on a put.
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000, "float64": 0x7FF8000000000000}
_LOCAL = tirx.IntImm("int32", -1)


def _vector(x, name: str, kind: str) -> V.Operand:
    """``x`` as an operand of one 16-byte vector of a float type (a region or buffer that is
    known to hold fewer elements is rejected)."""
    op = V.operand(x, name)
    if op.dtype is None:
        raise TypeError(f"{kind}: {name}'s element type is unknown; pass a buffer region such as buf[r, 0:8]")
    if str(op.dtype) not in NAN_BITS:
        raise TypeError(f"{kind}: {name} must hold float16, bfloat16, float32 or float64 elements (the sentinel "
                        f"is a NaN pattern; integers have no spare value), got {op.dtype}")
    V.check_extent(VECTOR_BYTES // op.itemsize, x, name, "one 16-byte vector")
    return op


def _pair(kind: str, src, dst, pe, pe_name: str, remote: str):
    s, d = _vector(src, "src", kind), _vector(dst, "dst", kind)
    if s.dtype != d.dtype:
        raise TypeError(f"{kind}: src ({s.dtype}) and dst ({d.dtype}) element types differ")
    pe_val = V.remote_pe(pe, pe_name, s if remote == "src" else d, remote)
    return s, d, _LOCAL if pe_val is None else pe_val


def lamport_put(src, dst, dst_pe=-1):
    """Store the 16-byte vector at ``src`` (local or register memory) to ``dst`` on rank
    ``dst_pe`` (-1: local), any element equal to the sentinel replaced by the canonical NaN.

    Args:
        src, dst: buffer regions (``x[u, 0:8]``), elements or buffers of one float type, each
            the start of a 16-byte aligned vector; ``dst`` in global memory when ``dst_pe``
            selects a peer.
        dst_pe: destination rank (any integer expression); -1 keeps ``dst`` local.
    """
    s, d, pe = _pair("lamport_put", src, dst, dst_pe, "dst_pe", "dst")
    itemsize = s.itemsize
    template = f"{itemsize}, {NAN_BITS[str(s.dtype)]:#x}ull"
    return V.extern("handle", f"tilescale::lamport_put<{template}>", s.ptr, d.ptr, pe)


def lamport_get(src, dst, src_pe=-1):
    """Poll the 16-byte vector at ``src`` on rank ``src_pe`` (-1: local) until none of its
    elements is the sentinel, then write it to ``dst`` (local or register memory).

    Args:
        src, dst: as for :func:`lamport_put`; ``src`` in global memory when ``src_pe``
            selects a peer.
        src_pe: source rank (any integer expression); -1 reads locally.
    """
    s, d, pe = _pair("lamport_get", src, dst, src_pe, "src_pe", "src")
    return V.extern("handle", f"tilescale::lamport_get<{s.itemsize}>", s.ptr, d.ptr, pe)


def lamport_clear(dst, dst_pe=-1):
    """Write the sentinel (16 bytes of all ones) to the vector at ``dst`` on rank ``dst_pe``
    (-1: local), making it pending again for :func:`lamport_get`.

    Args:
        dst: as for :func:`lamport_put` (global memory).
        dst_pe: rank (any integer expression); -1 keeps ``dst`` local.
    """
    d = _vector(dst, "dst", "lamport_clear")
    V.require_global(d, "dst", "(a Lamport buffer is read with ld.global)")
    pe_val = V.remote_pe(dst_pe, "dst_pe", d, "dst")
    return V.extern("handle", "tilescale::lamport_clear", d.ptr, _LOCAL if pe_val is None else pe_val)


#: The names this module adds to ``tilelang.language``.
EXPORTS = {"lamport_put": lamport_put, "lamport_get": lamport_get, "lamport_clear": lamport_clear}
