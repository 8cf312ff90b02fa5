"""Signals and completion, after NVSHMEM's device API (Triton-distributed's ``libshmem_device``):

* ``T.put_signal_block`` / ``T.put_signal_warp`` and their ``_nbi`` forms: put data to a
  peer, then update a signal there so that a consumer waiting on the signal reads the data;
* ``T.signal_op(sig_addr, signal, sig_op, pe)`` and ``T.signal_wait_until(sig_addr, cmp, value)``;
* ``T.put_nbi_block`` / ``T.put_nbi_warp`` / ``T.get_nbi_block`` / ``T.get_nbi_warp``,
  completed by ``T.quiet()`` and ordered by ``T.fence()``.

Memory-model guarantees (PTX ISA memory consistency model; the device code is
``include/tilescale/signal.cuh``):

* A signal update is a *release* at system scope (``st.release.sys`` for ``"set"``,
  ``red.release.sys.add`` for ``"add"``); ``T.signal_wait_until`` polls with
  ``ld.acquire.sys``.  Whatever precedes the update in causality order is visible to the
  thread whose acquire observes it.
* ``put_signal_*``: the participating threads copy with weak stores, synchronise
  (``bar.sync`` for a block, ``bar.warp.sync`` for a warp) and one thread releases the
  signal.  The data is therefore in causality order before the signal: a consumer that
  reads the data right after ``T.signal_wait_until`` returns sees the new data.
* ``T.quiet()`` is ``fence.sc.sys``: every access the calling thread issued before it (the
  stores of its share of earlier nbi puts and gets among them) is performed at system
  scope before any access after it; combined with a later release (a signal) it publishes
  them.  ``T.fence()`` is ``fence.acq_rel.sys``: it orders the calling thread's accesses
  before it against those after it (puts before the fence are observed before puts after
  it by any thread that synchronises with the later ones).  Both act on the calling thread:
  for block-wide nbi operations, every thread calls ``T.quiet()`` and the block then
  synchronises (``T.sync_threads()``) before one thread signals -- or use ``put_signal``.

Signals are 32- or 64-bit integers in global memory (NVSHMEM uses ``uint64``).
"""

from __future__ import annotations

from ._tvm import tirx

from . import validation as V
from . import wait as W
from .nvshmem_enums import cmp_name, sig_op_name
from .peer_copy import copy_operands

#: ``sig_op`` values (Triton-distributed: ``NVSHMEM_SIGNAL_SET`` / ``NVSHMEM_SIGNAL_ADD``).
SIGNAL_SET = "set"
SIGNAL_ADD = "add"
SIG_OPS = (SIGNAL_SET, SIGNAL_ADD)
#: ``cmp`` values of :func:`signal_wait_until` (``NVSHMEM_CMP_EQ`` ...).
CMP_EQ, CMP_NE, CMP_GT, CMP_GE, CMP_LT, CMP_LE = "eq", "ne", "gt", "ge", "lt", "le"
CMPS = (CMP_EQ, CMP_NE, CMP_GT, CMP_GE, CMP_LT, CMP_LE)


def _signal(sig_addr, name: str = "sig_addr") -> tuple[V.Operand, str]:
    op = V.operand(sig_addr, name)
    dtype = V.require_dtype(op, name)
    if not V.is_int_dtype(dtype):
        raise TypeError(f"{name} must be a 32- or 64-bit integer signal, got {dtype}")
    V.require_global(op, name, "(signals are read and written by peers)")
    return op, dtype


def _sig_op(sig_op) -> bool:
    """True for ``"add"``; ValueError naming ``sig_op`` for anything but set/add (NVSHMEM's
    ``T.Amo.SIGNAL_SET`` / ``T.Amo.SIGNAL_ADD`` and their values 9 / 10 are set/add too)."""
    return V.choice(sig_op_name(sig_op), SIG_OPS, "sig_op") == SIGNAL_ADD


def checked_signal(sig_addr, sig_op) -> tuple[V.Operand, str, bool]:
    """``(signal operand, its dtype, add)`` of a put-with-signal's signal: ``sig_op`` checked
    first, then ``sig_addr`` (errors name them)."""
    add = _sig_op(sig_op)
    sig, dtype = _signal(sig_addr)
    return sig, dtype, add


def put_signal_call(scope: str, nbi: bool, operands, sig: V.Operand, dtype: str, add: bool, signal):
    """The ``tilescale::put_signal`` call of checked copy ``operands`` ``(src ptr, dst ptr,
    byte count, int32 PE)`` and checked signal ``sig`` / ``dtype`` / ``add``
    (:func:`checked_signal`): data first, then the signal set to (or increased by) ``signal``
    (``scope`` ``"block"`` or ``"warp"``; ``nbi`` the non-blocking form)."""
    template = f"4, {'true' if scope == 'warp' else 'false'}, {'true' if nbi else 'false'}, {'true' if add else 'false'}"
    value = V.cast_to(signal, dtype, "signal")
    s, d, nbytes, pe = operands
    return V.extern("handle", f"tilescale::put_signal<{template}>", s, d, nbytes, sig.ptr, value, pe)


def _put_signal(scope: str, nbi: bool, src, dst, size, sig_addr, signal, sig_op, dst_pe):
    kind = f"put_signal{'_nbi' if nbi else ''}_{scope}"
    checked = checked_signal(sig_addr, sig_op)  # before the copy operands
    operands = copy_operands(kind, src, dst, size, dst_pe, "dst_pe", "dst")
    return put_signal_call(scope, nbi, operands, *checked, signal)


def put_signal_block(src, dst, size, sig_addr, signal, sig_op: str = "set", dst_pe=-1):
    """Block-scope put with signal: every thread of the block copies ``size`` elements from
    local ``src`` to ``dst`` on rank ``dst_pe`` (-1: local); then one thread updates the
    signal ``sig_addr`` on ``dst_pe`` (release, system scope) -- the data is visible there
    before the signal.  Every thread returns after the signal was issued.

    Args:
        src, dst: buffers, regions, elements or typed pointers (the copy starts at their
            first element); ``dst`` in global memory when ``dst_pe`` selects a peer.
        size: number of elements of ``src``'s type (any integer expression).
        sig_addr: the signal: a 32/64-bit integer element in global memory (symmetric).
        signal: value to set or add, converted to the signal's type.
        sig_op: ``"set"`` (``T.SIGNAL_SET``) or ``"add"`` (``T.SIGNAL_ADD``).
        dst_pe: destination rank; -1 keeps ``dst`` and the signal local.
    """
    return _put_signal("block", False, src, dst, size, sig_addr, signal, sig_op, dst_pe)


def put_signal_warp(src, dst, size, sig_addr, signal, sig_op: str = "set", dst_pe=-1):
    """Warp-scope :func:`put_signal_block`: the 32 lanes of the calling warp copy, lane 0
    signals, every lane returns after the signal was issued."""
    return _put_signal("warp", False, src, dst, size, sig_addr, signal, sig_op, dst_pe)


def put_signal_nbi_block(src, dst, size, sig_addr, signal, sig_op: str = "set", dst_pe=-1):
    """Non-blocking :func:`put_signal_block`: the same data-before-signal ordering, but the
    threads other than the signalling one may return before the signal is issued."""
    return _put_signal("block", True, src, dst, size, sig_addr, signal, sig_op, dst_pe)


def put_signal_nbi_warp(src, dst, size, sig_addr, signal, sig_op: str = "set", dst_pe=-1):
    """Non-blocking :func:`put_signal_warp` (lanes other than lane 0 may return early)."""
    return _put_signal("warp", True, src, dst, size, sig_addr, signal, sig_op, dst_pe)


def signal_op(sig_addr, signal, sig_op: str = "set", pe=-1):
    """Update the signal ``sig_addr`` on rank ``pe`` (-1: local): store (``"set"``) or
    atomically add (``"add"``) ``signal``, as a release at system scope (this thread's
    earlier accesses are visible to whoever acquires the new value).  Single-thread
    operation: guard it with a thread condition.  ``sig_op`` may also be NVSHMEM's
    ``T.Amo.SIGNAL_SET`` / ``T.Amo.SIGNAL_ADD`` or their values 9 / 10 (upstream's spelling).
    """
    add = _sig_op(sig_op)
    sig, dtype = _signal(sig_addr)
    pe_val = V.remote_pe(pe, "pe", sig, "sig_addr")
    pe_arg = tirx.IntImm("int32", -1) if pe_val is None else pe_val
    value = V.cast_to(signal, dtype, "signal")
    return V.extern("handle", f"tilescale::signal_op<{'true' if add else 'false'}>", sig.ptr, value, pe_arg)


def signal_wait_until(sig_addr, cmp, value):
    """Spin until ``sig_addr <cmp> value`` holds for the local signal, polling with
    ``ld.acquire.sys``; returns the value observed.  ``cmp`` is one of ``"eq"``, ``"ne"``,
    ``"gt"``, ``"ge"``, ``"lt"``, ``"le"`` (``T.CMP_EQ`` ...), or NVSHMEM's comparison as
    upstream TileScale spells it: a ``T.CmpType`` member or its value (``0`` is EQ, ``5`` GE).  The comparison is signed for
    int signals and unsigned for uint signals.  Honours ``TILESCALE_WAIT_TIMEOUT_MS``."""
    relation = V.choice(cmp_name(cmp), CMPS, "cmp")
    _, dtype = _signal(sig_addr)
    V.cast_to(value, dtype, "value")  # a bad value is an error naming ``value`` (wait calls it expected)
    return W.wait(relation, sig_addr, value, -1, scope="sys", semantics="acquire")


def quiet():
    """``fence.sc.sys``: every memory access the calling thread issued before it (its part
    of earlier nbi puts/gets included) is performed at system scope before any access after
    it.  Per thread: for block-wide nbi operations every thread calls it, then the block
    synchronises."""
    return V.extern("handle", "tilescale::quiet")


def fence():
    """``fence.acq_rel.sys``: orders the calling thread's accesses before it against those
    after it, for observers that synchronise with it at system scope (puts to a PE before
    the fence are seen before puts after it)."""
    return V.extern("handle", "tilescale::fence")


def _nbi(name: str, blocking, doc: str):
    from . import peer_copy as P

    # The blocking form's code (same helper, kind and template), with errors naming ``pe``,
    # the argument's name here (the blocking form would call it dst_pe / src_pe).
    kind = blocking.__name__
    side = "dst" if name.startswith("put") else "src"
    template = P._unroll(4, False) if kind.endswith("_warp") else "4"

    def fn(src, dst, size, pe=-1):
        return P._peer_copy(kind, src, dst, size, pe, "pe", side, template)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def _nbi_ops():
    from . import peer_copy as P

    common = (
        " The stores of each thread are issued before it returns, but nothing is promised "
        "about their completion at the peer until the thread calls T.quiet() (then, for a "
        "peer to rely on it, a release such as T.signal_op). Same operands as the blocking form."
    )
    return {
        "put_nbi_block": _nbi("put_nbi_block", P.put_block, "Non-blocking T.put_block(src, dst, size, pe)." + common),
        "put_nbi_warp": _nbi("put_nbi_warp", P.put_warp, "Non-blocking T.put_warp(src, dst, size, pe)." + common),
        "get_nbi_block": _nbi("get_nbi_block", P.get_block, "Non-blocking T.get_block(src, dst, size, pe)." + common),
        "get_nbi_warp": _nbi("get_nbi_warp", P.get_warp, "Non-blocking T.get_warp(src, dst, size, pe)." + common),
    }


NBI = _nbi_ops()
put_nbi_block = NBI["put_nbi_block"]
put_nbi_warp = NBI["put_nbi_warp"]
get_nbi_block = NBI["get_nbi_block"]
get_nbi_warp = NBI["get_nbi_warp"]

#: Name -> object exported on ``tilelang.language`` by this module.
EXPORTS = {
    "put_signal_block": put_signal_block,
    "put_signal_warp": put_signal_warp,
    "put_signal_nbi_block": put_signal_nbi_block,
    "put_signal_nbi_warp": put_signal_nbi_warp,
    "signal_op": signal_op,
    "signal_wait_until": signal_wait_until,
    "quiet": quiet,
    "fence": fence,
    **NBI,
    "SIGNAL_SET": SIGNAL_SET,
    "SIGNAL_ADD": SIGNAL_ADD,
    "CMP_EQ": CMP_EQ,
    "CMP_NE": CMP_NE,
    "CMP_GT": CMP_GT,
    "CMP_GE": CMP_GE,
    "CMP_LT": CMP_LT,
    "CMP_LE": CMP_LE,
}
