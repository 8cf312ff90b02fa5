"""The tilescale-host extension of stock tilelang (entry point ``host``).

Appends this wheel's ``_facade`` directory to ``tilelang.__path__`` so that
``tilelang.distributed.host`` (``_facade/distributed/host.py``) is found by the package that
tilescale-core provides as ``tilelang.distributed``.  Cheap: imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

FACADE_DIR = Path(__file__).with_name("_facade")


def extend(tilelang_module) -> None:
    """Make ``tilelang.distributed.host`` importable."""
    from tilescale_core.interface import add_facade_dir

    add_facade_dir(tilelang_module, FACADE_DIR)


#: Position among the TileScale extensions (lower runs first; see ``tilescale_core._bootstrap``).
extend.order = 10
