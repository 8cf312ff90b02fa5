"""Every Python file of the repository reads text with an explicit encoding: the CUDA 12.1
matrix session runs under an ASCII locale, where reading a file as text without one fails on
the first non-ASCII byte (twice so far, each time in a test that read a source file)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A ``read_text`` call with no argument (so no ``encoding=``).
BARE = re.compile(r"\.read_text\(\s*\)")


def _python_files():
    for folder in ("packages", "ci"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).parts
            if not any(part.startswith(".") for part in parts) and path != Path(__file__).resolve():
                yield path
    yield ROOT / "noxfile.py"


def test_text_is_read_with_an_explicit_encoding():
    bare = []
    for path in _python_files():
        text = path.read_text(encoding="utf-8")
        bare += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for m in BARE.finditer(text)]
    assert not bare, "read_text without encoding='utf-8' at:\n" + "\n".join(bare)


def test_the_pattern():
    assert BARE.search("x = p.read_text()") and not BARE.search('p.read_text(encoding="utf-8")')
