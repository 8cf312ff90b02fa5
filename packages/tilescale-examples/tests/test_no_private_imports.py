"""tilescale-examples uses only the other wheels' public modules: no import of
``tilescale_core._*``, ``tilescale_host._*`` or ``tilescale_lang._*`` anywhere in its source
(``tilescale_core.interface`` says the wheels above core use only its public interface;
the public faces ``tilescale_core.driver``, ``tilescale_core.ipc`` and ``tilescale_host.cuda``
name what the examples need)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tilescale_examples

WHEELS = ("tilescale_core", "tilescale_host", "tilescale_lang")
SOURCE = Path(tilescale_examples.__file__).parent


def private_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``tree`` that reaches a private module (a
    component starting with ``_``) of one of :data:`WHEELS`: ``import w._m``, ``from w._m
    import x``, ``from w import _m``, and ``importlib.import_module("w._m")`` with a literal."""
    found = []

    def check(line: int, dotted: str) -> None:
        parts = dotted.split(".")
        if parts[0] in WHEELS and any(p.startswith("_") for p in parts[1:]):
            found.append((line, dotted))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            check(node.lineno, node.module)
            for alias in node.names:
                check(node.lineno, f"{node.module}.{alias.name}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            check(node.lineno, node.args[0].value)
    return found


@pytest.mark.parametrize("code,hits", [
    ("import tilescale_core._driver", ["tilescale_core._driver"]),
    ("from tilescale_core._ipc import malloc", ["tilescale_core._ipc", "tilescale_core._ipc.malloc"]),
    ("from tilescale_host import _cuda, bench", ["tilescale_host._cuda"]),
    ("import importlib\nimportlib.import_module('tilescale_lang._extension')", ["tilescale_lang._extension"]),
    ("from tilescale_core import driver, ipc\nfrom tilescale_host import cuda\nimport tilelang._x", []),
    ("from . import _report\nfrom tilescale_examples import _demo", []),  # this wheel's own modules
])
def test_the_scan_finds_every_form_of_private_import(code, hits):
    assert [name for _, name in private_imports(ast.parse(code))] == hits


def test_examples_import_no_private_module_of_another_wheel():
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) > 40  # the whole package, subpackages included
    bad = [f"{path.relative_to(SOURCE.parent)}:{line}: {name}"
           for path in files for line, name in private_imports(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, "private imports of another wheel (use its public module):\n" + "\n".join(bad)
