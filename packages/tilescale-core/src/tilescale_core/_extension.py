"""The tilescale-core extension of stock tilelang (entry point ``core``).

Adds ``tilelang.get_allocator``, ``tilelang.tensor`` and the ``tilelang.distributed``
package.  ``tilelang.distributed`` lives in ``_facade/`` beside this file: the directory is
appended to ``tilelang.__path__`` so that the package's own import system finds it, and
other TileScale wheels append their own ``_facade`` directories for their sub-modules
(for example ``tilelang.distributed.host``).
"""

from __future__ import annotations

from pathlib import Path

FACADE_DIR = Path(__file__).with_name("_facade")


def add_facade_dir(tilelang_module, facade_dir: Path) -> None:
    """Append ``facade_dir`` to ``tilelang.__path__`` (once)."""
    entry = str(facade_dir)
    if entry not in tilelang_module.__path__:
        tilelang_module.__path__.append(entry)


def extend(tilelang_module) -> None:
    """Attach the core names to ``tilelang``; cheap, imports nothing heavy."""
    import tilescale_core

    add_facade_dir(tilelang_module, FACADE_DIR)
    for name in ("get_allocator", "tensor"):
        if not hasattr(tilelang_module, name):
            setattr(tilelang_module, name, getattr(tilescale_core, name))


#: Position among the TileScale extensions (lower runs first; see ``tilescale_core._bootstrap``).
extend.order = 0
