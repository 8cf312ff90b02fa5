"""``tilelang.distributed``: TileScale's distributed API inside TileLang's namespace.

This package is provided by the tilescale-core wheel (see ``docs/mechanism.md``).  Its
sub-modules may come from several TileScale wheels: every ``_facade/distributed`` directory
that an installed wheel appended to ``tilelang.__path__`` is part of this package's path.
"""

from __future__ import annotations

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

# The host utilities are re-exported here when tilescale-host is installed.
if importlib.util.find_spec(__name__ + ".host") is not None:
    from . import host  # noqa: E402
    from .host import *  # noqa: E402,F401,F403

    __all__ += ["host", *host.__all__]
