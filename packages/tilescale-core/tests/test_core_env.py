"""tilescale_core.env: one reading of boolean environment variables everywhere."""

from __future__ import annotations

import pytest

from tilescale_core.env import FALSE, TRUE, flag, parse_flag


@pytest.mark.parametrize("text", [*TRUE, "TRUE", " Yes ", "On"])
def test_on_spellings(text):
    assert parse_flag("X", text) is True
    assert flag("X", env={"X": text}) is True


@pytest.mark.parametrize("text", [*FALSE, "False", " NO", "OFF "])
def test_off_spellings(text):
    assert parse_flag("X", text, default=True) is False


@pytest.mark.parametrize("text,default", [(None, False), (None, True), ("", True), ("  ", False)])
def test_unset_or_blank_takes_the_default(text, default):
    assert parse_flag("X", text, default) is default
    assert flag("ABSENT_VARIABLE_OF_THE_TEST", default, env={}) is default


@pytest.mark.parametrize("text", ["2", "yy", "enable", "1.0", "tru", "-1"])
def test_anything_else_is_an_error_naming_the_variable(text):
    with pytest.raises(ValueError, match=rf"TILESCALE_X={text!r} is not a boolean: use one of 1/true/yes/on"):
        flag("TILESCALE_X", env={"TILESCALE_X": text})
