"""tilescale-lang refuses, at import, a tilescale-core that speaks another table layout."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from tilescale_lang import core_check


def test_installed_core_matches():
    import tilescale_core.interface as interface

    core_check.check_core()
    assert interface.TABLE_VERSION == core_check.TABLE_VERSION == 1


def test_other_table_version_is_a_clear_import_error(monkeypatch):
    fake = types.ModuleType("fake_core_interface")
    fake.TABLE_VERSION = 2
    monkeypatch.setitem(sys.modules, "fake_core_interface", fake)
    with pytest.raises(ImportError, match=r"metadata table version 1, but the installed tilescale-core "
                                          r"\(.*\) speaks version 2; install matching wheels"):
        core_check.check_core("fake_core_interface")


def test_core_without_interface_is_a_clear_import_error():
    with pytest.raises(ImportError, match=r"has no no_such_core\.interface .*install matching wheels"):
        core_check.check_core("no_such_core.interface")


def test_import_fails_with_the_message_when_core_is_too_old(tmp_path):
    """A fresh interpreter where tilescale_core.interface cannot be imported (as with a core
    that predates it): ``import tilescale_lang`` raises the ImportError, not a crash later."""
    code = ("import sys; sys.modules['tilescale_core.interface'] = None\n"
            "try:\n    import tilescale_lang\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"TILESCALE_DISABLE_HOOK": "1", **__import__("os").environ})
    assert "IMPORT-ERROR tilescale-lang 0.1.0 needs tilescale-core's metadata table version 1" in res.stdout, res.stdout + res.stderr
