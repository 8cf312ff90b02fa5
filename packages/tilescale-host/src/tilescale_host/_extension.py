"""The tilescale-host extension of stock tilelang (entry point ``host``).

Appends this wheel's ``_facade`` directory to ``tilelang.__path__`` so that
``tilelang.distributed.host`` and ``tilelang.distributed.utils`` (``_facade/distributed/``)
are found by the package that tilescale-core provides as ``tilelang.distributed``, and adds
``requires_distributed`` to stock ``tilelang.testing`` when, and only when, the program
imports that module (it imports pytest).  Cheap: imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

FACADE_DIR = Path(__file__).with_name("_facade")
#: Names this wheel adds to stock ``tilelang.testing`` (each only where stock has none).
TESTING_NAMES = ("requires_distributed",)


def add_testing_names(testing_module) -> None:
    """Give stock ``tilelang.testing`` the names of :data:`TESTING_NAMES` it lacks (and list
    them in its ``__all__``); a name stock already has is left alone."""
    from . import testing

    exported = getattr(testing_module, "__all__", None)
    for name in TESTING_NAMES:
        if hasattr(testing_module, name):
            continue
        setattr(testing_module, name, getattr(testing, name))
        if isinstance(exported, list) and name not in exported:
            exported.append(name)


def extend(tilelang_module) -> None:
    """Make ``tilelang.distributed.host`` / ``.utils`` importable; extend ``tilelang.testing``."""
    from tilescale_core.interface import add_facade_dir, after_import

    add_facade_dir(tilelang_module, FACADE_DIR)
    after_import("tilelang.testing", add_testing_names)


#: Position among the TileScale extensions (lower runs first; see ``tilescale_core._bootstrap``).
extend.order = 10
