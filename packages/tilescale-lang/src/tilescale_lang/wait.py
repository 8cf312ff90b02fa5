"""Spin waits: ``T.wait_eq``, ``T.wait_ne``, ``T.wait_ge``, ``T.wait_le``, ``T.wait_gt``,
``T.wait_lt`` -- one generator, six names.

Each polls a 32- or 64-bit flag with ``ld.acquire.{sys,gpu}`` (semantics ``acquire``) or
``ld.volatile`` (``volatile``) until the relation holds; ``expected`` is converted to the
flag's type (so the comparison is signed for int flags, unsigned for uint flags).  With
``TILESCALE_WAIT_TIMEOUT_MS`` set at compile time, a wait that exceeds it prints the rank,
block, thread, address, expected and observed values and traps.
"""

from __future__ import annotations

import math

from ._tvm import tirx

from . import validation as V

_RELATIONS = {"eq": "==", "ne": "!=", "ge": ">=", "le": "<=", "gt": ">", "lt": "<"}


def wait(relation: str, value, expected, peer=-1, scope: str = "sys", semantics: str = "acquire"):
    """Spin until ``value <relation> expected``; the body of every ``T.wait_*``.

    Args:
        relation: ``eq`` | ``ne`` | ``ge`` | ``le`` | ``gt`` | ``lt``.
        value: the flag: ``flag[i]``, ``T.address_of(flag[i])``, a buffer or region (first
            element); 32- or 64-bit integer (or float) type.
        expected: value to compare with, converted to the flag's type.
        peer: poll the flag's counterpart on this rank; -1 polls the local flag.
        scope: ``sys`` | ``gpu``.
        semantics: ``acquire`` | ``volatile``.

    Raises:
        TypeError: a float ``expected`` (constant or not) for an integer flag (C would
            truncate it: ``T.float32(1.5)`` became ``1``).
        ValueError: a constant ``expected`` that does not fit the flag, or NaN (no wait on
            NaN completes: it compares unequal to everything).
    """
    relation = V.choice(relation, tuple(_RELATIONS), "relation")
    op = V.operand(value, "value", as_value=True)
    dtype = V.require_dtype(op, "value")
    scope = V.choice(scope, ("sys", "gpu"), "scope")
    semantics = V.choice(semantics, ("acquire", "volatile"), "semantics")
    exp = V.cast_to(expected, dtype, "expected")
    if isinstance(exp, tirx.FloatImm) and math.isnan(exp.value):
        raise ValueError(
            f"expected=nan: NaN compares unequal to everything, so wait_{relation} on it "
            f"{'returns at once' if relation == 'ne' else 'never completes'}"
        )
    pe_val = V.remote_pe(peer, "peer", op, "value")
    args = [op.ptr, exp] if pe_val is None else [op.ptr, exp, pe_val]
    name = f"tilescale::wait_until<tilescale::Cmp::{relation.upper()}, {V.SCOPES[scope]}, {V.SEMS[semantics]}>"
    return V.extern(dtype, name, *args)


def _make_wait(relation: str):
    op = _RELATIONS[relation]

    def wait_fn(value, expected, peer=-1, scope: str = "sys", semantics: str = "acquire"):
        return wait(relation, value, expected, peer, scope=scope, semantics=semantics)

    wait_fn.__name__ = wait_fn.__qualname__ = f"wait_{relation}"
    wait_fn.__doc__ = (
        f"Spin until ``value {op} expected`` (the flag read on rank ``peer``, -1: local); "
        "returns the value observed.  See :func:`tilescale_lang.wait.wait` for the arguments."
    )
    return wait_fn


wait_eq = _make_wait("eq")
wait_ne = _make_wait("ne")
wait_ge = _make_wait("ge")
wait_le = _make_wait("le")
wait_gt = _make_wait("gt")
wait_lt = _make_wait("lt")

WAITS = {f"wait_{r}": globals()[f"wait_{r}"] for r in _RELATIONS}
