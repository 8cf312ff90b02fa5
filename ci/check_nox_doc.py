"""Check that docs/testing.md's "Nox sessions" list names every nox session, as ``nox -l``
names them, in that order.

Usage: ``nox -l --json | python ci/check_nox_doc.py [docs/testing.md]``. Exits 1 naming each
session the list lacks, each parametrised name it has that nox does not, or the first
session out of order.  The list is the file's ``## Nox sessions`` section (up to the next
``## `` heading); session names are in backticks.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

#: A parametrised session name as ``nox -l`` prints it: ``tests(package='core')``.
PARAMETRISED = re.compile(r"^[A-Za-z_][\w-]*\(\w+='[^']*'\)$")
#: The heading of the section that lists the sessions.
HEADING = "## Nox sessions"


def problems(sessions: list[str], doc: str) -> list[str]:
    """What is wrong with ``doc`` as the list of ``sessions`` (``nox -l`` order)."""
    named = re.findall(r"`+([^`]+)`+", doc)
    out = [f"the list does not name the session ``{s}``" for s in sessions if s not in named]
    out += [f"the list names ``{n}``, which nox does not list" for n in dict.fromkeys(named)
            if PARAMETRISED.match(n) and n not in sessions]
    first = [s for s in dict.fromkeys(n for n in named if n in sessions)]
    listed = [s for s in sessions if s in first]
    for mine, theirs in zip(first, listed):
        if mine != theirs:
            out.append(f"the list has ``{mine}`` where nox -l has ``{theirs}``")
            break
    return out


def section(text: str) -> str:
    """The :data:`HEADING` section of ``text`` (empty when there is none)."""
    _, found, rest = text.partition(f"\n{HEADING}\n")
    return rest.split("\n## ", 1)[0] if found else ""


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/testing.md")
    doc = section(path.read_text(encoding="utf-8"))
    sessions = [entry["session"] for entry in json.load(sys.stdin)]
    found = problems(sessions, doc) if doc else [f"no '{HEADING}' section"]
    for line in found:
        print(f"{path}: {line}", file=sys.stderr)
    if not found:
        print(f"{path}: the '{HEADING}' list names all {len(sessions)} sessions")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
