"""Argument checks shared by every TileScale wheel, with one wording for each mistake.

Each check returns the value it accepted (normalised: a plain ``int`` or ``float``) and
raises ``ValueError`` naming the argument otherwise, a wrong type included, so one
``except ValueError`` catches every bad value.  The other wheels reach these names through
:mod:`tilescale_core.interface`.

Integers: any ``numbers.Integral`` (``int``, ``numpy.int64``, an ``IntEnum``, ...) except
``bool`` (``True`` is not a count), returned as a plain ``int``; floats are refused even when
whole (``2.0``).  Seconds: any ``numbers.Real`` except ``bool``, returned as a ``float``.

* :func:`check_positive_int`: ``{name} must be a positive int, got {value!r}``
* :func:`check_non_negative_int`: ``{name} must be a non-negative int, got {value!r}``
* both with ``upper``: ``{name} must be at most {upper}, got {value}``
* :func:`check_seconds`: ``{name} must be a positive, finite number of seconds, got {value!r}``
  (``non-negative`` with ``positive=False``)
* :func:`check_choice`: ``{name} must be one of {choices!r}, got {value!r}``

Importing this module costs only the standard library.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["check_choice", "check_non_negative_int", "check_positive_int", "check_seconds"]

_T = TypeVar("_T")


def _as_int(value: Any) -> int | None:
    """``value`` as a plain int when it is an integer other than a bool, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def _check_upper(name: str, value: int, upper: int | None) -> int:
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be at most {upper}, got {value}")
    return value


def _as_float(value: Any) -> float:
    """``value`` as a float when it is a real number other than a bool, else NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return math.inf if value > 0 else -math.inf


def _same(a: Any, b: Any) -> bool:
    """``a == b``, except that a bool equals only a bool (``True`` is not the choice ``1``)."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. an array, whose == is elementwise
        return False


def check_positive_int(name: str, value: Any, *, upper: int | None = None) -> int:
    """Return ``value`` as a plain ``int`` if it is an integer >= 1 (and <= ``upper``).

    Args:
        name: the argument's name, as the caller spells it (goes into the message).
        value: the value to check; a bool or a float (even ``2.0``) is refused.
        upper: the largest value accepted (inclusive); None for no bound.

    Raises:
        ValueError: ``"{name} must be a positive int, got {value!r}"``, or ``"{name} must be
            at most {upper}, got {value}"``.
    """
    number = _as_int(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return _check_upper(name, number, upper)


def check_non_negative_int(name: str, value: Any, *, upper: int | None = None) -> int:
    """Return ``value`` as a plain ``int`` if it is an integer >= 0 (and <= ``upper``).

    Args:
        name: the argument's name (goes into the message).
        value: the value to check; a bool or a float is refused.
        upper: the largest value accepted (inclusive); None for no bound.

    Raises:
        ValueError: ``"{name} must be a non-negative int, got {value!r}"``, or ``"{name} must
            be at most {upper}, got {value}"``.
    """
    number = _as_int(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return _check_upper(name, number, upper)


def check_seconds(name: str, value: Any, *, positive: bool = True) -> float:
    """Return ``value`` as a ``float`` number of seconds if it is a finite real number in range.

    Infinity is refused: Python's own waits (``threading.Event.wait``, ``Thread.join``,
    ``time.sleep``) raise OverflowError on it, so "wait forever" is spelled otherwise (None)
    by the callers that offer it.

    Args:
        name: the argument's name (goes into the message).
        value: seconds; any real number but a bool (``int``, ``float``, ``numpy.float32``, ...).
            NaN and infinity are refused.
        positive: True: > 0 s; False: >= 0 s.

    Raises:
        ValueError: ``"{name} must be a positive, finite number of seconds, got {value!r}"``
            (``non-negative`` when ``positive`` is False).
    """
    seconds = _as_float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a {sign}, finite number of seconds, got {value!r}")
    return seconds


def check_choice(name: str, value: _T, choices: Iterable[Any]) -> _T:
    """Return ``value`` unchanged if it is one of ``choices`` (compared with ``==``; a bool
    matches only a bool, so ``True`` is not the choice ``1``).

    Args:
        name: the argument's name (goes into the message).
        value: the value to check.
        choices: the accepted values (a tuple, list, set, or a dict's keys); listed in the
            message in this order.

    Raises:
        ValueError: ``"{name} must be one of {choices!r}, got {value!r}"`` with ``choices`` as
            a tuple, e.g. ``aggregate must be one of ('max', 'mean'), got 'sum'``.
    """
    options = tuple(choices)
    if not any(_same(value, c) for c in options):
        raise ValueError(f"{name} must be one of {options!r}, got {value!r}")
    return value
