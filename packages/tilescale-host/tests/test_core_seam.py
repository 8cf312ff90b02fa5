"""tilescale-host reaches tilescale-core through public names only (CPU; reads the sources)."""

from __future__ import annotations

import re
from pathlib import Path

import tilescale_host

PRIVATE = re.compile(r"tilescale_core\._|from tilescale_core import _")


def test_host_imports_no_private_core_module():
    root = Path(tilescale_host.__file__).parent
    for path in root.rglob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not PRIVATE.search(code), f"{path}:{n} imports a private tilescale-core module: {line.strip()}"


def test_parent_death_names_are_public():
    from tilescale_core import interface

    from tilescale_host import launcher_env  # the ranks' environment of tilescale-run

    assert launcher_env.PARENT_PID_ENV == interface.PARENT_PID_ENV == "TILESCALE_PARENT_PID"
    assert callable(interface.die_with_parent)
