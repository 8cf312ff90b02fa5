"""tilescale_core.interface.after_import: names added to a stock sub-module when, and only
when, the program imports it (issue 45: tilescale-host adds tilelang.testing.requires_distributed
this way; its own tests check that end to end)."""

from __future__ import annotations

import sys
import warnings

import pytest

from tilescale_core import _extension, interface


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throw-away package ``ts_after_pkg`` with a sub-module ``sub`` (not yet imported)."""
    root = tmp_path / "ts_after_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "sub.py").write_text("ORIGINAL = 1\nimported_at = 'own code'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ts_after_pkg.sub"
    for name in ("ts_after_pkg.sub", "ts_after_pkg"):
        sys.modules.pop(name, None)
    _extension._PENDING.pop("ts_after_pkg.sub", None)


def test_exported_through_interface():
    assert interface.after_import is _extension.after_import
    assert "after_import" in interface.__all__


def test_callback_runs_after_the_module_code_and_only_on_import(package):
    seen = []
    interface.after_import(package, lambda m: seen.append(m.ORIGINAL) or setattr(m, "ADDED", 2))
    assert seen == [] and package not in sys.modules  # registering imports nothing
    import importlib

    module = importlib.import_module(package)
    assert seen == [1] and module.ADDED == 2 and module.ORIGINAL == 1
    importlib.reload(module)  # callbacks run once per registration, not on every (re)load
    assert seen == [1]
    assert package not in _extension._PENDING


def test_a_module_already_imported_gets_the_callback_right_away(package):
    import importlib

    module = importlib.import_module(package)
    interface.after_import(package, lambda m: setattr(m, "LATE", True))
    assert module.LATE is True


def test_a_failing_callback_warns_and_the_import_still_works(package):
    import importlib

    def broken(module):
        raise KeyError("boom")

    interface.after_import(package, broken)
    interface.after_import(package, lambda m: setattr(m, "SECOND", True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(package)
    assert module.ORIGINAL == 1 and module.SECOND is True  # the next callback still ran
    assert any("failed and was skipped: KeyError" in str(w.message) for w in caught)


def test_the_finder_answers_only_for_pending_names(package):
    finder = _extension._AfterImportFinder()
    assert finder.find_spec("json", None) is None
    assert finder.find_spec("tilelang", None) is None
    interface.after_import(package, lambda m: None)
    import ts_after_pkg

    spec = finder.find_spec(package, ts_after_pkg.__path__)
    assert isinstance(spec.loader, _extension._AfterImportLoader)
