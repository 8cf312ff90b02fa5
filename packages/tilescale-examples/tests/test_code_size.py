"""The library stays readable: no module of tilescale_examples over 500 lines and no function
(kernel builders and their nested kernel bodies included) over 120 lines."""

import ast
from pathlib import Path

import pytest

import tilescale_examples

ROOT = Path(tilescale_examples.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 120


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            yield node.name, node.lineno, node.end_lineno - start + 1


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path):
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n") + 1
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_MODULE_LINES})"
    long = [f"{name} (line {line}): {n} lines" for name, line, n in _functions(ast.parse(text)) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
