"""The process's default symmetric heap: the allocator that a kernel launched without
``kernel.initialize(allocator=...)`` binds to, when one was set.

NVSHMEM programs never bind a kernel to a heap: NVSHMEM has one heap per process, and every
kernel sees it.  ``pynvshmem`` (tilescale-host's NVSHMEM-compatible host module) creates one
allocator when it is initialised and sets it here; tilescale-lang's launch guard then
initialises a kernel that reads the heap table with it at its first launch, instead of
refusing to launch.  Nothing is set by default, so programs written for TileScale keep the
explicit ``kernel.initialize`` and its error.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["default_allocator", "set_default_allocator"]

_lock = threading.Lock()
_default: list[Any] = [None]


def set_default_allocator(allocator: Any) -> Any:
    """Make ``allocator`` (anything with a ``table``, normally a
    :class:`~tilescale_core.allocator.BaseAllocator`) the process's default heap; None
    clears it.  Returns the previous default.

    Raises:
        TypeError: ``allocator`` is neither None nor an object with a ``table``.
    """
    if allocator is not None and not hasattr(allocator, "table"):
        raise TypeError(f"allocator must be a TileScale allocator (with a table) or None, got {type(allocator).__name__}")
    with _lock:
        previous, _default[0] = _default[0], allocator
    return previous


def default_allocator() -> Any:
    """The default heap set by :func:`set_default_allocator`, or None (also once it was
    closed: a closed heap binds no kernel)."""
    with _lock:
        allocator = _default[0]
    if allocator is not None and getattr(allocator, "closed", False):
        return None
    return allocator
