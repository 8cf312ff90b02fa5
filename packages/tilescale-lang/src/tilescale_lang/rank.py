"""Rank queries: ``T.get_rank()`` and ``T.get_num_ranks()``.

Both read the module's metadata table, which ``kernel.initialize(allocator=...)`` fills, so a
compiled kernel stays rank-agnostic.
"""

from __future__ import annotations

from ._tvm import tirx

from .validation import extern


def get_rank() -> tirx.PrimExpr:
    """This process's rank in the allocator's group, as an int32 expression."""
    return extern("int32", "tilescale::get_rank")


def get_num_ranks() -> tirx.PrimExpr:
    """The number of ranks in the allocator's group, as an int32 expression."""
    return extern("int32", "tilescale::get_num_ranks")


def symm_at(ptr, pe) -> tirx.PrimExpr:
    """The address of ``ptr``'s symmetric counterpart on rank ``pe`` (a handle expression;
    ``pe`` = -1 keeps it local).  Like Triton-distributed's ``symm_at``."""
    from .validation import operand, remote_pe

    op = operand(ptr, "ptr")
    pe_val = remote_pe(pe, "pe", op, "ptr")  # only global (heap) memory has a counterpart
    if pe_val is None:
        return op.ptr
    return extern("handle", "tilescale::remap", op.ptr, pe_val)
