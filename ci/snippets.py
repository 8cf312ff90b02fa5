"""The runnable snippets of README.md and docs/quickstart.md, with the install line each needs.

Every fenced ``python`` block of those documents carries a marker in an HTML comment on the line
before it, which renders as nothing:

* ``<!-- snippet: cpu -->``: runs as written on a machine without a GPU, after the latest
  ``pip install`` line above it; ``nox -s snippets`` runs it in a fresh environment built from
  ``dist/`` (``nox -s build`` first).
* ``<!-- snippet: gpu -->``: needs a GPU (run by hand or by the GPU sessions, not here).
* ``<!-- snippet: fragment -->``: a piece of a larger program (names defined elsewhere).

``python ci/snippets.py DOC`` prints the document's snippets as JSON; :func:`problems` lists
the python blocks without a marker (``ci/tests`` asserts there are none).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

#: The documents whose snippets are checked.
DOCS = ("README.md", "docs/quickstart.md")
KINDS = ("cpu", "gpu", "fragment")
#: A fenced block: its language, body and where it starts.
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!--\s*snippet:\s*(\w+)\s*-->\s*\n\Z")
INSTALL = re.compile(r"pip install [^\n`#]*")


@dataclass
class Snippet:
    """One python block: ``kind`` (a :data:`KINDS` value or None without a marker), the
    ``install`` line it follows (None: none above it), its ``code`` and 1-based ``line``."""

    kind: str | None
    install: str | None
    code: str
    line: int


def snippets(text: str) -> list[Snippet]:
    """Every fenced ``python`` block of ``text``, in order."""
    out, install, pos = [], None, 0
    for m in BLOCK.finditer(text):
        for inst in INSTALL.finditer(text, pos, m.end()):
            install = inst.group(0).strip()
        pos = m.end()
        if m.group(1) != "python":
            continue
        marker = MARKER.search(text[max(0, m.start() - 200):m.start()])
        out.append(Snippet(marker.group(1) if marker else None, install, m.group(2),
                           text.count("\n", 0, m.start()) + 1))
    return out


def problems(text: str, name: str = "document") -> list[str]:
    """Python blocks of ``text`` without a valid marker, and cpu snippets with no install line."""
    found = []
    for s in snippets(text):
        if s.kind not in KINDS:
            found.append(f"{name}:{s.line}: python block without a <!-- snippet: cpu|gpu|fragment --> marker")
        elif s.kind == "cpu" and s.install is None:
            found.append(f"{name}:{s.line}: cpu snippet with no pip install line above it")
    return found


def requirement(install: str) -> list[str]:
    """The pip arguments of an install line, without ``pip install`` and ``--find-links dist``."""
    args = re.findall(r'"[^"]+"|\S+', install)[2:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--find-links":
            skip = True
        else:
            out.append(a.strip('"'))
    return out


if __name__ == "__main__":
    doc = Path(sys.argv[1])
    print(json.dumps([asdict(s) for s in snippets(doc.read_text(encoding="utf-8"))], indent=2))
