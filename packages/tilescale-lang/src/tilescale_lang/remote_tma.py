"""Remote TMA: ``T.tma_copy(..., src_pe=, dst_pe=)`` and ``T.atomic_add(..., use_tma=True, dst_pe=)``.

A TMA operation names its global tensor through a descriptor (``CUtensorMap``) that the host
builds before the launch, so a peer's copy of a tensor needs a descriptor of its own.  As the
TileScale API specifies, the descriptors cover PEs 0 through 7:

* **While tracing**, the operation becomes a dispatch on the PE: ``pe == -1`` runs the stock
  operation on the local tensor; ``pe == k`` (k = 0..7, and ``k < T.get_num_ranks()``) runs
  it on a view of the tensor whose base pointer is the variable ``tilescale_tma_peer<k>_<name>``.
  Any other PE (-2 and below included) issues no operation (with ``TILESCALE_CHECK_PE=1`` or
  ``TILESCALE_DEBUG=1`` at compile time it prints the rank, block and PE and traps instead).  A constant PE picks its branch while tracing; a
  constant PE above 7 is an error.
* **In the generated host code** (a pass after stock TileLang's ``LowerHopperIntrin``, see
  :mod:`.pipeline_hooks`), those variables are bound before the descriptors are encoded: one
  call per tensor and launch to the global function ``tilescale.tma_peer_addresses`` fills
  eight ``int64`` slots with the tensor's address in the heaps of PEs 0..7, computed from the
  heap table that ``kernel.initialize(allocator=...)`` registered
  (``ptr - base[rank] + base[pe]``).  Stock TileLang then encodes one descriptor per peer from
  them and passes each to the kernel as a ``__grid_constant__`` parameter.

The tensor must be a kernel parameter in the symmetric heap, and the kernel must be
initialised with that heap's allocator before its first launch (else the launch raises).
Remote TMA needs the default ``tvm_ffi`` execution backend (the others build descriptors from
a table that cannot hold a peer's address).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

from ._tvm import tirx

from . import validation as V
from .state import STATE

#: Descriptors cover PEs 0 .. MAX_TMA_PES - 1.
MAX_TMA_PES = 8
#: Prefix of the base-pointer variables of peer views (bound in the host code).
PEER_PREFIX = "tilescale_tma_peer"
#: The global function the host code calls once per remote tensor and launch.
ADDRESSES_FUNC = "tilescale.tma_peer_addresses"


# ------------------------------------------------------------------------------ heap registry
class _Heap:
    def __init__(self, allocator: Any, table: list[int], size: int):
        self.allocator = weakref.ref(allocator)
        self.rank, self.num_ranks = table[0], table[1]
        self.bases = table[2:]
        self.size = size

    @property
    def alive(self) -> bool:
        a = self.allocator()
        return a is not None and not getattr(a, "closed", False)

    def peer_addresses(self, ptr: int) -> list[int] | None:
        base = self.bases[self.rank]
        if not (base <= ptr < base + self.size):
            return None
        off = ptr - base
        return [self.bases[k] + off if k < self.num_ranks else ptr for k in range(MAX_TMA_PES)]


# The registered heaps live in the process-wide state (tilescale_lang.state).
_heaps: list[_Heap] = STATE.heaps
_lock = STATE.lock


def register_heap(allocator: Any, table: list[int]) -> None:
    """Remember ``allocator``'s heap for remote TMA descriptors (``kernel.initialize`` calls
    it).  Allocators without a ``size`` (stand-ins in tests) are not registered."""
    size = getattr(allocator, "size", None)
    if not isinstance(size, int) or len(table) < 3:
        return
    heap = _Heap(allocator, list(table), size)
    with _lock:
        _heaps[:] = [h for h in _heaps if h.alive and h.bases[h.rank] != heap.bases[heap.rank]]
        _heaps.append(heap)


def peer_addresses(ptr: int) -> list[int]:
    """The address of ``ptr`` in the heaps of PEs 0..7 (``ptr`` itself for PEs beyond the
    group, which the kernel never uses).

    Raises:
        RuntimeError: ``ptr`` is in no heap registered by ``kernel.initialize``.
    """
    with _lock:
        heaps = [h for h in _heaps if h.alive]
    for heap in heaps:
        found = heap.peer_addresses(ptr)
        if found is not None:
            return found
    raise RuntimeError(
        f"remote TMA: the tensor at 0x{ptr:x} is not in a symmetric heap registered by "
        "kernel.initialize(allocator=...); allocate it with tilelang.tensor(..., allocator=...) "
        "and initialise the kernel with that allocator before launching it"
    )


def _fill_addresses(ptr, slots) -> None:
    """``tilescale.tma_peer_addresses(ptr, slots)``: write the 8 peer addresses to ``slots``."""
    p = int(getattr(ptr, "value", ptr) or 0)
    s = int(getattr(slots, "value", slots) or 0)
    out = (ctypes.c_int64 * MAX_TMA_PES).from_address(s)
    for k, addr in enumerate(peer_addresses(p)):
        out[k] = addr - (1 << 64) if addr >= 1 << 63 else addr


def install() -> None:
    """Register ``tilescale.tma_peer_addresses`` (idempotent)."""
    import tvm_ffi

    if tvm_ffi.get_global_func(ADDRESSES_FUNC, allow_missing=True) is None:
        tvm_ffi.register_global_func(ADDRESSES_FUNC, f=_fill_addresses)


# ------------------------------------------------------------------------------ tracing
def peer_var_name(k: int, base_name: str) -> str:
    return f"{PEER_PREFIX}{k}_{base_name}"


_WHY = "a remote TMA operation (the peer's tensor)"


def _peer_view(x, k: int, name: str):
    """``x`` re-expressed on a global buffer whose base is peer ``k``'s copy (host-bound)."""
    from tvm import ir

    from .peer_copy import global_buffer, view_on

    buf = global_buffer(x, name, _WHY)
    var = tirx.Var(peer_var_name(k, buf.data.name), ir.PointerType(ir.PrimType(buf.dtype), "global"))
    return view_on(x, var, name, _WHY)


def _emit(result) -> None:
    from tvm.tirx.script.builder import ir as IB

    if isinstance(result, tirx.PrimExpr):
        IB.evaluate(result)
    elif result is not None:  # pragma: no cover - stock TMA ops return a call
        raise TypeError(f"unexpected statement from a TMA operation: {type(result).__name__}")


def _bad_pe(pe) -> None:
    from tvm.tirx.script.builder import ir as IB

    IB.evaluate(V.extern("handle", "tilescale::tma_bad_pe", pe))


def dispatch(pe_val, name: str, remote, local, peer) -> None:
    """Emit the PE dispatch of a remote TMA operation.

    Args:
        pe_val: int32 PE expression (from :func:`validation.pe_expr`; not None).
        name: the PE argument's name, for errors.
        remote: the global operand on the peer.
        local(): emits the operation on the local operand.
        peer(view): emits the operation on ``view``, the operand re-expressed on a peer.
    """
    from tvm.tirx.script.builder import ir as IB

    from .rank import get_num_ranks

    from .peer_copy import global_buffer

    global_buffer(remote, "dst" if name == "dst_pe" else "src", _WHY)
    if isinstance(pe_val, tirx.IntImm):
        k = int(pe_val.value)
        if k >= MAX_TMA_PES:
            raise ValueError(
                f"{name}={k}: remote TMA descriptors cover PEs 0..{MAX_TMA_PES - 1} (use T.copy with "
                f"{name} for other PEs)"
            )
        with IB.If(pe_val < get_num_ranks()):
            with IB.Then():
                peer(_peer_view(remote, k, name))
            with IB.Else():
                _bad_pe(pe_val)
        return
    with IB.If(pe_val == -1):  # only -1 is local; -2 and below are bad PEs, not local ones
        with IB.Then():
            local()
        with IB.Else():
            with IB.If(tirx.all(0 <= pe_val, pe_val < MAX_TMA_PES, pe_val < get_num_ranks())):
                with IB.Then():
                    _chain(pe_val, 0, remote, name, peer)
                with IB.Else():
                    _bad_pe(pe_val)


def _chain(pe_val, k: int, remote, name: str, peer) -> None:
    from tvm.tirx.script.builder import ir as IB

    if k == MAX_TMA_PES - 1:
        peer(_peer_view(remote, k, name))
        return
    with IB.If(pe_val == k):
        with IB.Then():
            peer(_peer_view(remote, k, name))
        with IB.Else():
            _chain(pe_val, k + 1, remote, name, peer)


def tma_copy(stock, src, dst, src_pe=None, dst_pe=None, **kwargs):
    """``T.tma_copy`` with a peer (see the module docstring); ``stock`` is stock TileLang's."""
    from .peer_copy import pe_pair

    pes = pe_pair(src_pe, dst_pe, "T.tma_copy")
    if pes is None:
        return stock(src, dst, **kwargs)
    s_pe, d_pe = pes
    if s_pe is not None:
        dispatch(s_pe, "src_pe", src, lambda: _emit(stock(src, dst, **kwargs)),
                 lambda view: _emit(stock(view, dst, **kwargs)))
    else:
        dispatch(d_pe, "dst_pe", dst, lambda: _emit(stock(src, dst, **kwargs)),
                 lambda view: _emit(stock(src, view, **kwargs)))
    return None


def tma_reduce_add(dst, value, pe_val, memory_order=None, annotations=None):
    """``T.atomic_add(dst, value, use_tma=True, dst_pe=pe)``: a TMA reduce-add of shared
    ``value`` into ``dst`` on ``pe`` through that peer's descriptor."""
    from .state import STATE

    stock = STATE.stock["atomic_add"]

    def run(target):
        return _emit(stock(target, value, memory_order=memory_order, use_tma=True, annotations=annotations))

    dispatch(pe_val, "dst_pe", dst, lambda: run(dst), run)
    return None
