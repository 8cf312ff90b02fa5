"""``tilelang.distributed``: TileScale's distributed API inside TileLang's namespace.

This package is provided by the tilescale-core wheel (see ``docs/mechanism.md``).  Its
sub-modules may come from several TileScale wheels: every ``_facade/distributed`` directory
that an installed wheel appended to ``tilelang.__path__`` is part of this package's path, and
a wheel that lists a sub-module in the entry-point group :data:`MODULES_GROUP` has its names
re-exported here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os as _os

import tilelang as _tilelang

__path__ = [  # noqa: F811 - merge the distributed/ directories of every installed wheel
    _d
    for _d in (_os.path.join(_p, "distributed") for _p in _tilelang.__path__)
    if _os.path.isdir(_d)
]

from tilescale_core.allocator import BaseAllocator, get_allocator  # noqa: E402
from tilescale_core.tensors import tensor, tensor_from_ptr  # noqa: E402

from . import shared_memory  # noqa: E402

__all__ = ["BaseAllocator", "get_allocator", "tensor", "tensor_from_ptr", "shared_memory"]

#: Entry-point group through which other wheels re-export a sub-module's names here
#: (tilescale-host: ``host = "tilelang.distributed.host"``).  tilescale-core names none of them.
MODULES_GROUP = "tilescale.distributed_modules"


def _reexport() -> None:
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=MODULES_GROUP), key=lambda ep: ep.name):
        if not ep.value.startswith(__name__ + ".") or importlib.util.find_spec(ep.value) is None:
            continue  # not one of ours, or its wheel's facade directory is not on the path
        module = importlib.import_module(ep.value)
        names = list(getattr(module, "__all__", ()))
        globals().update({name: getattr(module, name) for name in names})
        __all__.extend([ep.value.rsplit(".", 1)[1], *names])


_reexport()
