"""NVSHMEM's device names without NVSHMEM: the ``T.*`` spellings of upstream TileScale's
NVSHMEM examples, mapped onto the symmetric heap's own intrinsics.

Upstream TileScale lowers ``T.get_pe()``, ``T.putmem_nbi_block(...)`` ... to NVSHMEM's device
library (``nvshmem_my_pe``, ``nvshmemx_putmem_nbi_block``, ...).  Here each one is a thin layer
over an existing TileScale intrinsic, so those kernels compile and run over the heap that
``tilelang.get_allocator`` (or tilescale-host's ``pynvshmem``) made, with no NVSHMEM:

===============================================  ==============================================
upstream name (NVSHMEM's argument order)         TileScale intrinsic it lowers to
===============================================  ==============================================
``get_pe()``, ``get_pe_num()``                   ``T.get_rank()``, ``T.get_num_ranks()`` (int32)
``putmem_block/warp(dest, src, nelems, pe)``     sync, ``T.put_block/put_warp``, sync
``putmem_nbi_block/warp(...)``                   the same code (see "nbi" below)
``getmem_block/warp(dest, src, nelems, pe)``     sync, ``T.get_block/get_warp``, sync
``getmem_nbi_block/warp(...)``                   the same code
``putmem_signal_block/warp(...)``                sync, ``T.put_signal_block/warp`` (data, then
                                                 the signal by ``sig_op``), blocking form
``putmem_signal_nbi_block/warp(...)``            sync, ``T.put_signal_nbi_block/warp``
``signal_op``, ``signal_wait_until``,            TileScale's own (``tilescale_lang.signals``),
``fence``, ``quiet``                             which also take ``T.Amo`` / ``T.CmpType``
``Amo``, ``CmpType``                             NVSHMEM's constants (:mod:`.nvshmem_enums`)
===============================================  ==============================================

Semantics are NVSHMEM's:

* **Units**: ``nelems`` of every ``*mem*`` call counts **bytes**, as in NVSHMEM (TileScale's
  ``T.put_block`` counts elements).  ``dest`` and ``src`` are any operand TileScale takes
  (``T.address_of(buf[i])``, ``buf[i]``, a region or a buffer); the remote one (``dest`` of a
  put, ``src`` of a get) must be in global memory, the symmetric heap.  ``pe`` is required.
* **Collective**: the ``_block`` forms are called by every thread of the block with the same
  arguments, the ``_warp`` forms by the 32 lanes of a warp (never under a thread-dependent
  condition).  Each begins and ends with a block (warp) synchronisation, as NVSHMEM's
  thread-group calls do: the source may be shared memory that the block just wrote, and on
  return every thread's part of the copy has been issued.
* **nbi** (non-blocking): NVSHMEM promises delivery at the peer only after ``T.quiet()`` (or a
  barrier); ``T.fence()`` orders it before later puts and signals to the same PE.  Here the
  blocking and nbi forms are the same code -- weak stores issued by the time the call returns
  -- and ``T.quiet()`` (``fence.sc.sys``) / ``T.fence()`` (``fence.acq_rel.sys``) then a signal
  (a release at system scope) publish them, as TileScale's own nbi intrinsics document.
* **putmem_signal** (``putmem_signal[_nbi]_block/warp(dest, src, nelems, sig_addr, signal,
  sig_op, pe)``): the data is visible at ``pe`` before the signal ``sig_addr`` there is
  updated by ``sig_op`` (``T.Amo.SIGNAL_SET`` / ``SIGNAL_ADD``, 9 / 10, or ``"set"`` /
  ``"add"``), a release at system scope.  The blocking form returns once the signal was
  issued; the nbi form's threads other than the signalling one may return earlier.

Not provided (the heap has no equivalent without extra storage, or no example uses them):
the single-thread ``putmem`` / ``getmem`` (``T.st`` / ``T.ld`` with a PE, or ``T.copy`` with
``dst_pe``), device-side ``barrier_all*`` / ``sync_all*`` (``T.barrier_blocks(bar)`` over a
symmetric counter buffer), ``int_p``, ``broadcast*`` / ``fcollect*`` (``T.broadcast_block`` /
``T.fcollect_block`` over a team).  A name stock TileLang already has is left alone.
"""

from __future__ import annotations

from typing import Any

from ._tvm import tirx

from . import rank
from . import validation as V
from .nvshmem_enums import Amo, CmpType

_LOCAL = tirx.IntImm("int32", -1)
#: The remote operand of each direction and the copy helper (with its template) per scope.
_HELPERS = {
    ("put", "block"): "tilescale::put_block<4>",
    ("get", "block"): "tilescale::get_block<4>",
    ("put", "warp"): "tilescale::put_warp<4, false>",
    ("get", "warp"): "tilescale::get_warp<4, false>",
}


def get_pe() -> tirx.PrimExpr:
    """NVSHMEM's ``nvshmem_my_pe()``: this process's rank in the heap's group (int32); the
    same as ``T.get_rank()``."""
    return rank.get_rank()


def get_pe_num() -> tirx.PrimExpr:
    """NVSHMEM's ``nvshmem_n_pes()``: the number of ranks in the heap's group (int32); the
    same as ``T.get_num_ranks()``."""
    return rank.get_num_ranks()


def _check_bytes(nelems: Any, x: Any, op: V.Operand, name: str) -> None:
    """ValueError when a constant byte count exceeds what ``x`` holds from its start (both
    known while tracing)."""
    if isinstance(nelems, tirx.IntImm):
        nelems = int(nelems.value)
    if not isinstance(nelems, int) or isinstance(nelems, bool) or op.itemsize is None:
        return
    avail = V.available_elements(x)
    if avail is not None and nelems > avail * op.itemsize:
        raise ValueError(f"nelems={nelems} bytes exceeds {name}, which holds {avail * op.itemsize} bytes from its start")


def byte_operands(kind: str, dest: Any, src: Any, nelems: Any, pe: Any, remote: str):
    """Checked operands of an NVSHMEM-style copy: ``(src ptr, dest ptr, uint64 byte count,
    int32 PE)``.  ``nelems`` counts bytes; ``remote`` (``"dest"`` / ``"src"``) is the side
    that must be in global memory when ``pe`` selects a peer.  Errors name ``dest``, ``src``,
    ``nelems`` and ``pe``."""
    d = V.operand(dest, "dest")
    s = V.operand(src, "src")
    nbytes = V.size_bytes(nelems, 1, "nelems", kind)
    for x, op, name in ((src, s, "src"), (dest, d, "dest")):
        V.require_contiguous(x, name, kind)
        _check_bytes(nelems, x, op, name)
    pe_val = V.remote_pe(pe, "pe", d if remote == "dest" else s, remote)
    return s.ptr, d.ptr, nbytes, _LOCAL if pe_val is None else pe_val


def _collective(scope: str, call: tirx.PrimExpr, on_return: bool = True) -> None:
    """Emit ``call`` after a synchronisation of the block (``scope="block"``) or the warp,
    and (``on_return``) another one after it, as NVSHMEM's thread-group calls synchronise on
    entry and on return."""
    import tilelang.language as T
    from tvm.tirx.script.builder import ir as IB

    sync = T.sync_threads if scope == "block" else T.sync_warp
    IB.evaluate(sync())
    IB.evaluate(call)
    if on_return:
        IB.evaluate(sync())


def _mem(direction: str, scope: str, nbi: bool):
    """``putmem[_nbi]_{block,warp}`` / ``getmem[_nbi]_{block,warp}``."""
    name = f"{direction}mem{'_nbi' if nbi else ''}_{scope}"
    helper = _HELPERS[(direction, scope)]
    remote = "dest" if direction == "put" else "src"

    def fn(dest, src, nelems, pe):
        _collective(scope, V.extern("handle", helper, *byte_operands(name, dest, src, nelems, pe, remote)))

    who = "every thread of the block" if scope == "block" else "the 32 lanes of the calling warp"
    where = ("from local ``src`` to ``dest`` on rank ``pe``" if direction == "put"
             else "from ``src`` on rank ``pe`` to local ``dest``")
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"NVSHMEM's ``nvshmemx_{name}(dest, src, nelems, pe)``: {who} copies ``nelems`` "
        f"**bytes** {where} (-1: local).  Collective over the {scope}; synchronises it on entry "
        f"and on return.  {'Non-blocking: ' if nbi else ''}delivery at the peer is promised after "
        "``T.quiet()`` (then a signal or barrier publishes it), as in NVSHMEM.  See "
        ":mod:`tilescale_lang.nvshmem_names`."
    )
    return fn


def _mem_signal(scope: str, nbi: bool):
    """``putmem_signal[_nbi]_{block,warp}``."""
    from .signals import checked_signal, put_signal_call

    name = f"putmem_signal{'_nbi' if nbi else ''}_{scope}"

    def fn(dest, src, nelems, sig_addr, signal, sig_op, pe):
        operands = byte_operands(name, dest, src, nelems, pe, "dest")
        # put_signal synchronises before its signal (and, blocking, after it) itself.
        call = put_signal_call(scope, nbi, operands, *checked_signal(sig_addr, sig_op), signal)
        _collective(scope, call, on_return=False)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"NVSHMEM's ``nvshmemx_{name}(dest, src, nelems, sig_addr, signal, sig_op, pe)``: copy "
        f"``nelems`` **bytes** from local ``src`` to ``dest`` on rank ``pe``, then update the "
        f"signal ``sig_addr`` on ``pe`` with ``signal`` by ``sig_op`` (``T.Amo.SIGNAL_SET`` / "
        f"``T.Amo.SIGNAL_ADD``, 9 / 10, or ``'set'`` / ``'add'``; a release at system scope): "
        f"the data is visible at ``pe`` before the signal.  Collective over the {scope} "
        f"(synchronised on entry); "
        + ("threads other than the signalling one may return before the signal is issued."
           if nbi else "every thread returns after the signal was issued.")
    )
    return fn


def _exports() -> dict[str, Any]:
    names: dict[str, Any] = {"get_pe": get_pe, "get_pe_num": get_pe_num, "CmpType": CmpType, "Amo": Amo}
    for scope in ("block", "warp"):
        for nbi in (False, True):
            for direction in ("put", "get"):
                fn = _mem(direction, scope, nbi)
                names[fn.__name__] = fn
            fn = _mem_signal(scope, nbi)
            names[fn.__name__] = fn
    return names


#: Name -> object exported on ``tilelang.language`` by this module (only where stock
#: TileLang has no object of that name).
EXPORTS = _exports()
# The intrinsics by name on this module too (tilescale_lang.nvshmem_names.putmem_nbi_block, ...).
globals().update({name: obj for name, obj in EXPORTS.items() if name not in ("Amo", "CmpType")})
__all__ = sorted(EXPORTS)
