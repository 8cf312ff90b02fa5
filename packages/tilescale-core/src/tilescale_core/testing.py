"""CPU stand-ins for testing the allocator (and code built on it) without a GPU.

:class:`HostBackend` is a real symmetric heap in host memory: each rank's base is a
``memfd`` mapped shared; the descriptors travel between processes exactly like POSIX-fd
VMM handles (:mod:`tilescale_core._fd_exchange`), and each rank maps every peer's memfd.
Tensors over it are CPU tensors, and a write by one rank is visible in the others' peer
views.  Pass it as ``BaseAllocator(..., device="cpu", backend=HostBackend())``.

Linux only (``os.memfd_create``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

import torch

from ._backends import FdSharingBackend

__all__ = ["HostBackend", "register_gpu_marker"]

#: Description of a GPU test marker registered by :func:`register_gpu_marker`.
GPU_MARKER_HELP = "needs a CUDA GPU (skipped with a reason when none is visible)"


def register_gpu_marker(config, name: str = "gpu") -> None:
    """Register pytest marker ``name`` for GPU tests (call from ``pytest_configure``).

    When a loaded pytest plugin offers ``add_gpu_marker_alias`` (tilescale-host's
    ``tilescale`` plugin does, for its ``tilescale_gpu`` marker), ``name`` becomes an alias of
    that marker, which the plugin skips without a GPU and writes to its validation record.
    Otherwise (tilescale-host not installed, or ``-p no:tilescale``) ``name`` is a plain marker
    and a small plugin registered here skips its tests, with the reason, when
    ``torch.cuda.is_available()`` is False: either way a GPU test never fails for want of a GPU.
    """
    plugin = config.pluginmanager.get_plugin("tilescale")
    if plugin is not None and hasattr(plugin, "add_gpu_marker_alias"):
        plugin.add_gpu_marker_alias(config, name)
        return
    config.addinivalue_line("markers", f"{name}: {GPU_MARKER_HELP}")
    key = f"tilescale-gpu-skip-{name}"
    if config.pluginmanager.get_plugin(key) is None:
        config.pluginmanager.register(_SkipWithoutGpu(name), key)


class _SkipWithoutGpu:
    """The fallback of :func:`register_gpu_marker`: skips the tests marked ``name`` when no
    CUDA device is visible (imports torch only when such a test was collected)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def pytest_collection_modifyitems(self, config, items) -> None:
        marked = [item for item in items if item.get_closest_marker(self.name)]
        if not marked:
            return
        reason = _no_gpu_reason()
        if reason is None:
            return
        import pytest

        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def _no_gpu_reason() -> str | None:
    """None when torch sees a CUDA device; else why not, in one line."""
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except Exception as exc:  # a broken torch install reads as "no GPU", with the reason
        return f"needs a CUDA GPU: importing torch failed ({type(exc).__name__}: {exc})"
    from .probes import probe_driver

    return f"needs a CUDA GPU: torch.cuda.is_available() is False ({probe_driver().reason})"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, size: int) -> int:
    ptr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if ptr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return ptr


class HostBackend(FdSharingBackend):
    """Host-memory heap backend (memfd + shared mmap), sharing descriptors over Unix sockets.

    Attributes:
        mappings: ``{address: (size, memfd or None)}`` of live mappings, for leak checks.
    """

    device_type = "cpu"
    path = "host"

    def __init__(self) -> None:
        self.mappings: dict[int, tuple[int, int | None]] = {}

    def guard(self, device: torch.device) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device: torch.device) -> None:
        return None

    def allocate(self, size: int, device: torch.device) -> int:
        fd = os.memfd_create("tilescale-host-heap")
        try:
            os.ftruncate(fd, size)
            ptr = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.mappings[ptr] = (size, fd)
        return ptr

    def export_fd(self, ptr: int) -> int:
        return os.dup(self.mappings[ptr][1])

    def import_fd(self, fd: int, size: int, device: torch.device) -> int:
        ptr = _map(fd, size)
        self.mappings[ptr] = (size, None)
        return ptr

    def _unmap(self, ptr: int) -> int | None:
        size, fd = self.mappings.pop(ptr)
        if _libc.munmap(ptr, size) != 0:
            raise OSError(ctypes.get_errno(), "munmap failed")
        return fd

    def close_peer(self, ptr: int) -> None:
        self._unmap(ptr)

    def free(self, ptr: int) -> None:
        fd = self._unmap(ptr)
        if fd is not None:
            os.close(fd)
