"""TileScale core: the symmetric heap (CUDA IPC and VMM), its tensors and the shared-memory FFI.

Importing this package is cheap (standard library only); the public names below load their
modules, and with them torch and cuda-python, on first use.  The same names are reachable
through stock TileLang's namespace once the package is installed: ``tilelang.get_allocator``,
``tilelang.tensor`` and ``tilelang.distributed``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "BaseAllocator": "tilescale_core.allocator",
    "get_allocator": "tilescale_core.allocator",
    "tensor": "tilescale_core.tensors",
    "tensor_from_ptr": "tilescale_core.tensors",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tilescale_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
