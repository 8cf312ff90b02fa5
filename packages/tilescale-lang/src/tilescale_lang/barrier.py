"""Barriers and signals: ``T.init_barrier_gpu``, ``T.arrive_barrier_gpu``,
``T.wait_barrier_gpu``, ``T.sync_barrier_gpu`` (blocks of one grid), ``T.barrier_blocks`` /
``T.sync_blocks`` (all blocks of every rank) and ``T.notify``.

All barrier helpers are block-collective (every thread of the block calls them) and are
safe to repeat: they count generations instead of resetting, so there is no race between
initialisation and early arrivals.  Their storage must be zeroed once before first use
(allocator memory, or ``torch.zeros``).

* GPU barrier storage: two uint32 words in global memory (``bar[0]`` phase/arrivals,
  ``bar[1]`` expected count; block 0 must take part), or one uint32 word (phase, count and
  arrivals packed; every taking-part block initialises it) -- see :func:`init_barrier_gpu`.
* ``barrier_blocks``/``sync_blocks`` storage: a symmetric (allocator) buffer of
  ``num_ranks`` uint32 counters; needs ``kernel.initialize``; every rank launches the same
  number of blocks, all co-resident.
"""

from __future__ import annotations

from ._tvm import tirx

from . import validation as V

#: Largest block count of the one-word GPU barrier (bits 30..16 of the word).
ONE_WORD_MAX_BLOCKS = 32767


def _barrier(barrier, name: str = "barrier", min_elems: int = 1) -> V.Operand:
    op = V.operand(barrier, name)
    dtype = V.require_dtype(op, name, (32,))
    if dtype not in ("uint32", "int32"):
        raise TypeError(f"{name} must be uint32 (or int32) storage, got {dtype}")
    V.require_global(op, name, "(barriers synchronise blocks through global memory)")
    if min_elems > 1:
        avail = _available_elements(barrier)
        if avail is not None and avail < min_elems:
            raise ValueError(f"{name} needs at least {min_elems} uint32 elements from its start, got {avail}")
    return op


#: Kept for callers of the former private helper; see :func:`validation.available_elements`.
_available_elements = V.available_elements


def _gpu_barrier(barrier) -> tuple[V.Operand, str]:
    """The barrier operand and the helper-name suffix of its layout: ``"1"`` for the
    one-word form (storage of exactly one element from its start), ``""`` for two words."""
    op = _barrier(barrier)
    return op, "1" if _available_elements(barrier) == 1 else ""


def init_barrier_gpu(barrier, expected):
    """Set the number of blocks taking part in the GPU barrier at ``barrier``.

    Two layouts, chosen by the storage (zeroed once before first use):

    * two uint32 words (``bar[0]`` phase/arrivals, ``bar[1]`` the count written here):
      idempotent; block 0 must take part and run it before its first arrival (running it
      in every block is fine);
    * one uint32 word (upstream TileScale's ``T.Tensor([1], T.uint32)``; the count, 1 to
      32767, lives in bits 30..16): every taking-part block runs it before its first
      arrival, and the word keeps that count for its whole life (another count traps).

    ``expected`` is any integer expression (e.g. the grid size); a constant must be a block
    count (1..32767 for one word, 1..2**32-1 for two), a float is refused.  A buffer or
    region whose extent is unknown at trace time uses the two-word layout.
    """
    op, form = _gpu_barrier(barrier)
    count = V.cast_to(expected, "uint32", "expected")
    if isinstance(expected, tirx.IntImm):
        expected = int(expected.value)
    if isinstance(expected, int) and not isinstance(expected, bool):
        high = ONE_WORD_MAX_BLOCKS if form == "1" else (1 << 32) - 1
        if not 1 <= expected <= high:
            why = (f" (a negative count would become {expected & 0xFFFFFFFF:#x} and the barrier would "
                   "never complete)" if expected < 0 else "")
            raise ValueError(
                f"expected={expected} is not a number of blocks: the {'one' if form == '1' else 'two'}-word "
                f"GPU barrier takes 1..{high}{why}"
            )
    return V.extern("handle", f"tilescale::init_barrier_gpu{form}", op.ptr, count)


def arrive_barrier_gpu(barrier):
    """Arrive at the GPU barrier (release, gpu scope); pair with :func:`wait_barrier_gpu`."""
    op, form = _gpu_barrier(barrier)
    return V.extern("handle", f"tilescale::arrive_barrier_gpu{form}", op.ptr)


def wait_barrier_gpu(barrier):
    """Wait until every expected block arrived in this block's generation (acquire, gpu)."""
    op, form = _gpu_barrier(barrier)
    return V.extern("handle", f"tilescale::wait_barrier_gpu{form}", op.ptr)


def sync_barrier_gpu(barrier):
    """:func:`arrive_barrier_gpu` then :func:`wait_barrier_gpu`."""
    op, form = _gpu_barrier(barrier)
    return V.extern("handle", f"tilescale::sync_barrier_gpu{form}", op.ptr)


def barrier_blocks(barrier):
    """Rendezvous of all blocks of every rank, with system-scope release before arriving and
    acquire after (writes before the call are visible to every block of every rank after
    it).  ``barrier``: symmetric buffer of ``num_ranks`` zeroed uint32 counters."""
    return V.extern("handle", "tilescale::barrier_blocks", _barrier(barrier).ptr)


def sync_blocks(barrier):
    """Like :func:`barrier_blocks` but without memory ordering (a counter rendezvous)."""
    return V.extern("handle", "tilescale::sync_blocks", _barrier(barrier).ptr)


def notify(ptr, peer, signal=1, sig_op: str = "set"):
    """Signal the flag at ``ptr`` on rank ``peer`` (-1: local) with release semantics at
    system scope: ``sig_op="set"`` stores ``signal`` (converted to the flag's type, float
    flags included); ``"add"`` atomically adds it (32-bit integer flags only).  Pairs with
    ``T.wait_*`` on the receiving side."""
    op = V.operand(ptr, "ptr")
    dtype = V.require_dtype(op, "ptr")
    sig_op = V.choice(sig_op, ("set", "add"), "sig_op")
    if sig_op == "add" and not (V.is_int_dtype(dtype) and V.tvm_dtype(dtype).bits == 32):
        raise TypeError(
            f"sig_op='add' needs a 32-bit integer flag (it is an integer red.add), got {dtype}"
            + ("; adding to a float flag would add to its bit pattern" if not V.is_int_dtype(dtype) else "")
        )
    pe_val = V.remote_pe(peer, "peer", op, "ptr")
    pe_arg = pe_val if pe_val is not None else tirx.IntImm("int32", -1)
    add = "true" if sig_op == "add" else "false"
    return V.extern("handle", f"tilescale::notify<{add}>", op.ptr, pe_arg, V.cast_to(signal, dtype, "signal"))
