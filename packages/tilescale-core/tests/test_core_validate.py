"""tilescale_core.validate: the shared argument checks, their wording, and their export."""

from __future__ import annotations

import enum
import fractions
import math

import pytest

from tilescale_core import interface, validate
from tilescale_core.validate import check_choice, check_non_negative_int, check_positive_int, check_seconds

_NOT_INTS = [True, False, 1.0, 2.5, "3", None, [1], math.nan]


class _Color(enum.IntEnum):
    RED = 3


def test_exported_through_interface():
    for name in validate.__all__:
        assert name in interface.__all__
        assert getattr(interface, name) is getattr(validate, name)


@pytest.mark.parametrize("value", [1, 2, 10**30])
def test_positive_int_accepts_and_returns_an_int(value):
    assert check_positive_int("n", value) == value
    assert type(check_positive_int("n", value)) is int


#: The integer checks: (check, the name they are called with here, what they require).
_INT_CHECKS = {"positive": (check_positive_int, "n", "a positive int"),
               "non_negative": (check_non_negative_int, "warmup", "a non-negative int")}


@pytest.mark.parametrize("which,value", [("positive", v) for v in [0, -1, *_NOT_INTS]]
                         + [("non_negative", v) for v in [-1, *_NOT_INTS]])
def test_int_checks_reject(which, value):
    check, name, kind = _INT_CHECKS[which]
    with pytest.raises(ValueError, match=rf"^{name} must be {kind}, got {re_repr(value)}$"):
        check(name, value)


@pytest.mark.parametrize("value", [0, 1, 7])
def test_non_negative_int_accepts_zero(value):
    assert check_non_negative_int("warmup", value) == value


@pytest.mark.parametrize("which,name,good,bad", [("positive", "blocks", (8, 8), (9, 8)),
                                                 ("non_negative", "rank", (0, 0), (4, 3))])
def test_int_checks_upper_bound_is_inclusive(which, name, good, bad):
    """``(value, upper)``: ``good`` passes (a value at the bound), ``bad`` is past it; as a
    float ``bad`` is refused for its type, which is checked first."""
    check, _, kind = _INT_CHECKS[which]
    assert check(name, good[0], upper=good[1]) == good[0]
    with pytest.raises(ValueError, match=rf"^{name} must be at most {bad[1]}, got {bad[0]}$"):
        check(name, bad[0], upper=bad[1])
    with pytest.raises(ValueError, match=f"must be {kind}"):
        check(name, float(bad[0]), upper=bad[1])


def test_int_enum_is_an_int_and_comes_back_plain():
    got = check_positive_int("n", _Color.RED)
    assert got == 3 and type(got) is int


def test_numpy_integers_are_accepted_as_plain_ints():
    """Decision: any numbers.Integral but bool counts (numpy.int64 from a shape or an argmax
    is a count); the result is a plain int, so it pickles and hashes like one on every rank."""
    np = pytest.importorskip("numpy")
    for value in (np.int64(5), np.int32(5), np.uint8(5)):
        got = check_positive_int("n", value)
        assert got == 5 and type(got) is int
        assert type(check_non_negative_int("n", value)) is int
    with pytest.raises(ValueError, match="n must be a positive int"):
        check_positive_int("n", np.int64(0))
    for value in (np.bool_(True), np.float64(2.0)):  # numpy's bool is no Integral; floats never count
        with pytest.raises(ValueError, match="n must be a positive int"):
            check_positive_int("n", value)


@pytest.mark.parametrize("value", [1, 0.5, 1e9, fractions.Fraction(1, 2)])
def test_seconds_accepts_positive_reals_as_float(value):
    got = check_seconds("timeout", value)
    assert got == float(value) and type(got) is float


@pytest.mark.parametrize("value", [0, 0.0, -1, math.nan, math.inf, -math.inf, True, False, "10", None, 10**400])
def test_seconds_rejects(value):
    with pytest.raises(ValueError, match=rf"^timeout must be a positive, finite number of seconds, got {re_repr(value)}$"):
        check_seconds("timeout", value)


def test_seconds_non_negative_accepts_zero():
    assert check_seconds("grace", 0, positive=False) == 0.0
    with pytest.raises(ValueError, match=r"^grace must be a non-negative, finite number of seconds, got -0\.5$"):
        check_seconds("grace", -0.5, positive=False)
    with pytest.raises(ValueError, match="grace must be a non-negative, finite number"):
        check_seconds("grace", math.inf, positive=False)


def test_seconds_numpy_floats():
    np = pytest.importorskip("numpy")
    assert check_seconds("t", np.float32(0.25)) == 0.25
    with pytest.raises(ValueError):
        check_seconds("t", np.float64("nan"))


def test_choice_returns_the_value_and_lists_the_choices():
    assert check_choice("aggregate", "max", ("max", "mean")) == "max"
    assert check_choice("mode", "b", {"a": 1, "b": 2}) == "b"  # a dict's keys
    with pytest.raises(ValueError, match=r"^aggregate must be one of \('max', 'mean'\), got 'sum'$"):
        check_choice("aggregate", "sum", ("max", "mean"))
    with pytest.raises(ValueError, match=r"must be one of \('a', 'b'\), got 'c'"):
        check_choice("mode", "c", ["a", "b"])


def test_choice_keeps_bools_and_ints_apart():
    assert check_choice("flag", True, (True, False)) is True
    with pytest.raises(ValueError, match=r"^level must be one of \(0, 1\), got True$"):
        check_choice("level", True, (0, 1))
    with pytest.raises(ValueError, match=r"got 1$"):
        check_choice("flag", 1, (True, False))


def test_choice_of_an_unhashable_or_array_value():
    assert check_choice("shape", [1, 2], ([1, 2], [3])) == [1, 2]
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="must be one of"):
        check_choice("x", np.array([1, 2]), (1, 2))


def re_repr(value) -> str:
    """``repr(value)`` escaped for a regular expression."""
    import re

    return re.escape(repr(value))
