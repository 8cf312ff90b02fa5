"""NVSHMEM's constants under upstream TileScale's names: ``T.CmpType`` and ``T.Amo``.

Upstream TileScale (``tilelang/language/tir/ir.py``, the same values in its ``pynvshmem``)
spells NVSHMEM's ``NVSHMEM_CMP_*`` and ``NVSHMEM_SIGNAL_*`` constants as two ``IntEnum``\\ s,
and its NVSHMEM examples pass either a member (``T.CmpType.GE``, ``T.Amo.SIGNAL_ADD``) or the
bare integer (``T.signal_wait_until(flag, 0, 99)``, ``T.signal_op(flag, 1, 10, pe)``).  The
values here are NVSHMEM's (``nvshmem_constants.h``), so both spellings mean what they mean
to NVSHMEM.  :func:`cmp_name` and :func:`sig_op_name` turn any of them into the names
TileScale's own intrinsics take (``"ge"``, ``"add"``), which stay accepted as before.
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any

__all__ = ["Amo", "CmpType", "cmp_name", "sig_op_name"]


class CmpType(IntEnum):
    """NVSHMEM's comparisons (``NVSHMEM_CMP_*``) for ``T.signal_wait_until``."""

    EQ = 0
    NE = 1
    GT = 2
    LE = 3
    LT = 4
    GE = 5
    SENTINEL = sys.maxsize


class Amo(IntEnum):
    """NVSHMEM's atomic memory operations (``NVSHMEMI_AMO_*``); the signal operations
    ``SIGNAL_SET`` (9) and ``SIGNAL_ADD`` (10) are the ones ``T.signal_op`` and
    ``T.putmem_signal_*`` take."""

    AMO_ACK = 1
    AMO_INC = 2
    AMO_SET = 3
    AMO_ADD = 4
    AMO_AND = 5
    AMO_OR = 6
    AMO_XOR = 7
    AMO_SIGNAL = 8
    SIGNAL_SET = 9
    SIGNAL_ADD = 10
    AMO_SIGNAL_SET = 9  # the same as SIGNAL_SET
    AMO_SIGNAL_ADD = 10  # the same as SIGNAL_ADD
    AMO_END_OF_NONFETCH = 11
    AMO_FETCH = 12
    AMO_FETCH_INC = 13
    AMO_FETCH_ADD = 14
    AMO_FETCH_AND = 15
    AMO_FETCH_OR = 16
    AMO_FETCH_XOR = 17
    AMO_SWAP = 18
    AMO_COMPARE_SWAP = 19
    AMO_OP_SENTINEL = sys.maxsize


#: NVSHMEM comparison value -> TileScale relation name.
_CMP_NAMES = {CmpType.EQ: "eq", CmpType.NE: "ne", CmpType.GT: "gt", CmpType.LE: "le", CmpType.LT: "lt", CmpType.GE: "ge"}
#: NVSHMEM signal operation value -> TileScale ``sig_op`` name.
_SIG_NAMES = {Amo.SIGNAL_SET: "set", Amo.SIGNAL_ADD: "add"}


def _integer(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer constant (int, IntEnum member, TIR
    ``IntImm``); None for anything else (strings, expressions).  Booleans are not integers
    here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    from ._tvm import tirx

    if isinstance(value, tirx.IntImm) and str(value.dtype) != "bool":
        return int(value.value)
    return None


def cmp_name(cmp: Any) -> Any:
    """The TileScale relation name (``"eq"`` ... ``"ge"``) of an NVSHMEM comparison: a
    :class:`CmpType` member or its integer value (``0`` is ``NVSHMEM_CMP_EQ``).  Anything
    that is not an integer is returned unchanged, for the caller's own check of names.

    Raises:
        ValueError: an integer that is not one of NVSHMEM's six comparisons (names ``cmp``).
    """
    value = _integer(cmp)
    if value is None:
        return cmp
    if value in _CMP_NAMES:  # IntEnum members hash and compare as their values
        return _CMP_NAMES[value]
    raise ValueError(
        f"cmp={cmp!r} is not an NVSHMEM comparison; use T.CmpType.EQ/NE/GT/LE/LT/GE (0..5) or "
        f"'eq', 'ne', 'gt', 'ge', 'lt', 'le'"
    )


def sig_op_name(sig_op: Any) -> Any:
    """The TileScale ``sig_op`` name (``"set"`` / ``"add"``) of an NVSHMEM signal operation:
    ``T.Amo.SIGNAL_SET`` / ``T.Amo.SIGNAL_ADD`` or their values 9 / 10.  Anything that is not
    an integer is returned unchanged, for the caller's own check of names.

    Raises:
        ValueError: any other integer or ``Amo`` member (names ``sig_op``).
    """
    value = _integer(sig_op)
    if value is None:
        return sig_op
    if value in _SIG_NAMES:
        return _SIG_NAMES[value]
    raise ValueError(
        f"sig_op={sig_op!r} is not a signal operation; use T.Amo.SIGNAL_SET (9), T.Amo.SIGNAL_ADD (10), "
        f"'set' or 'add'"
    )
