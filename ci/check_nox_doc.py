"""Check that noxfile.py's docstring lists every nox session, as ``nox -l`` names them, in that order.

Usage: ``nox -l --json | python ci/check_nox_doc.py [noxfile.py]``. Exits 1 naming each
session the docstring lacks, each parametrised name it has that nox does not, or the first
session out of order.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

#: A parametrised session name as ``nox -l`` prints it: ``tests(package='core')``.
PARAMETRISED = re.compile(r"^[A-Za-z_][\w-]*\(\w+='[^']*'\)$")


def problems(sessions: list[str], doc: str) -> list[str]:
    """What is wrong with ``doc`` as the list of ``sessions`` (``nox -l`` order)."""
    named = re.findall(r"``([^`]+)``", doc)
    out = [f"the docstring does not name the session ``{s}``" for s in sessions if s not in named]
    out += [f"the docstring names ``{n}``, which nox does not list" for n in dict.fromkeys(named)
            if PARAMETRISED.match(n) and n not in sessions]
    first = [s for s in dict.fromkeys(n for n in named if n in sessions)]
    listed = [s for s in sessions if s in first]
    for mine, theirs in zip(first, listed):
        if mine != theirs:
            out.append(f"the docstring lists ``{mine}`` where nox -l lists ``{theirs}``")
            break
    return out


def main() -> int:
    noxfile = Path(sys.argv[1] if len(sys.argv) > 1 else "noxfile.py")
    doc = ast.get_docstring(ast.parse(noxfile.read_text(encoding="utf-8"))) or ""
    sessions = [entry["session"] for entry in json.load(sys.stdin)]
    found = problems(sessions, doc)
    for line in found:
        print(f"{noxfile}: {line}", file=sys.stderr)
    if not found:
        print(f"{noxfile}: the docstring lists all {len(sessions)} sessions")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
