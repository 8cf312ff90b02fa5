"""TileScale core: the symmetric heap (CUDA IPC and VMM), its tensors and the shared-memory FFI.

Importing this package is cheap (standard library only); the public names below load their
modules, and with them torch and cuda-python, on first use.  The same names are reachable
through stock TileLang's namespace once the package is installed: ``tilelang.get_allocator``,
``tilelang.tensor`` and ``tilelang.distributed``.
"""

from ._lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __all__ = lazy_exports(globals(), {
    "allocator": ("BaseAllocator", "get_allocator"),
    "driver": ("CudaError", "CudaUnavailableError"),
    "tensors": ("tensor", "tensor_from_ptr"),
})
