"""Memory backends of the symmetric heap: where one rank's base comes from and how peers map it.

A backend owns four steps, all collective where they take a :class:`~tilescale_core._comm.Comm`:

* ``allocate(size, device) -> ptr``: this rank's base allocation (``size`` bytes or more);
* ``share(comm, ptr, size, device) -> [ptr per rank]``: make every peer's base addressable
  here (index = rank, own entry = ``ptr``), through checked phases only;
* ``unshare(ptrs, rank)``: drop the peer mappings made by ``share``;
* ``free(ptr)``: release this rank's base.

:func:`make_backend` maps a path name (``"local"``, ``"ipc"``, ``"vmm-fabric"``,
``"vmm-fd"``) to its backend.  :mod:`tilescale_core.testing` adds a host-memory backend with
the same interface for CPU tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import _driver, _ipc, _vmm
from ._comm import Comm
from ._fd_exchange import exchange_fds

__all__ = [
    "FdSharingBackend",
    "HeapBackend",
    "IpcBackend",
    "LocalBackend",
    "VmmFabricBackend",
    "VmmFdBackend",
    "make_backend",
    "open_peers",
]


@contextlib.contextmanager
def cuda_device(device: torch.device) -> Iterator[None]:
    """Run the body with ``device`` current for torch, the runtime and the driver."""
    with torch.cuda.device(device.index):
        _driver.ensure_context(device.index)
        yield


def open_peers(
    comm: Comm,
    phase: str,
    payloads: Sequence[Any],
    own_ptr: int,
    open_one: Callable[[Any], int],
    close_one: Callable[[int], None],
) -> list[int]:
    """Checked phase: ``open_one(payloads[r])`` for every peer ``r``; return addresses by rank.

    When any rank fails, the mappings already opened here are closed again before the
    :class:`~tilescale_core._comm.SetupError` propagates.
    """
    opened: dict[int, int] = {}

    def step() -> None:
        for r, payload in enumerate(payloads):
            if r != comm.rank:
                opened[r] = open_one(payload)

    try:
        comm.phase(phase, step)
    except BaseException:
        for ptr in opened.values():
            with contextlib.suppress(Exception):
                close_one(ptr)
        raise
    return [own_ptr if r == comm.rank else opened[r] for r in range(comm.world_size)]


class HeapBackend:
    """Interface of a heap backend (see the module docstring). ``device_type``: ``"cuda"`` or ``"cpu"``."""

    device_type = "cuda"

    def guard(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Context in which this backend's calls for ``device`` run."""
        return cuda_device(device)

    def allocate(self, size: int, device: torch.device) -> int:
        """Allocate at least ``size`` bytes for this rank; return the base address."""
        raise NotImplementedError

    def share(self, comm: Comm, ptr: int, size: int, device: torch.device) -> list[int]:
        """Collective: return every rank's base as mapped in this process (index = rank)."""
        raise NotImplementedError

    def close_peer(self, ptr: int) -> None:
        """Drop one peer mapping made by :meth:`share`."""
        raise NotImplementedError

    def free(self, ptr: int) -> None:
        """Release this rank's base allocation."""
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        """Wait for outstanding work that may touch the heap (before teardown)."""
        torch.cuda.synchronize(device)

    def unshare(self, ptrs: Sequence[int], rank: int) -> None:
        """Drop every peer mapping in ``ptrs`` (skipping this rank's own entry)."""
        for r, ptr in enumerate(ptrs):
            if r != rank:
                self.close_peer(ptr)


class LocalBackend(HeapBackend):
    """Single-rank heap on ``cudaMalloc`` memory; nothing to share."""

    def allocate(self, size: int, device: torch.device) -> int:
        return _ipc.malloc(size)

    def share(self, comm: Comm, ptr: int, size: int, device: torch.device) -> list[int]:
        if comm.world_size != 1:
            raise ValueError("the local backend serves one rank only")
        return [ptr]

    def close_peer(self, ptr: int) -> None:
        raise AssertionError("a local heap has no peers")

    def free(self, ptr: int) -> None:
        _ipc.free(ptr)


class IpcBackend(LocalBackend):
    """``cudaMalloc`` bases shared as CUDA IPC handles, opened with lazy peer access."""

    def share(self, comm: Comm, ptr: int, size: int, device: torch.device) -> list[int]:
        handles = comm.phase("ipc: export handles", lambda: _ipc.get_handle(ptr))
        return open_peers(comm, "ipc: open peer handles", handles, ptr, _ipc.open_handle, self.close_peer)

    def close_peer(self, ptr: int) -> None:
        _ipc.close_handle(ptr)


class _VmmBackend(HeapBackend):
    kind = ""

    def allocate(self, size: int, device: torch.device) -> int:
        return _vmm.create(size, device.index, self.kind)

    def close_peer(self, ptr: int) -> None:
        _vmm.release(ptr, owner=False)

    def free(self, ptr: int) -> None:
        _vmm.release(ptr, owner=True)


class VmmFabricBackend(_VmmBackend):
    """VMM memory shared as fabric handles (needs an IMEX channel)."""

    kind = _vmm.FABRIC

    def share(self, comm: Comm, ptr: int, size: int, device: torch.device) -> list[int]:
        handles = comm.phase("vmm-fabric: export handles", lambda: _vmm.export_handle(ptr))
        return open_peers(
            comm,
            "vmm-fabric: import peer handles",
            handles,
            ptr,
            lambda h: _vmm.import_handle(h, device.index),
            self.close_peer,
        )


class FdSharingBackend(HeapBackend):
    """Base of backends whose allocations are shared as file descriptors over Unix sockets.

    Subclasses implement :meth:`export_fd` (a new descriptor for the allocation at ``ptr``)
    and :meth:`import_fd` (map a peer descriptor of ``size`` bytes; return its address).
    """

    path = ""

    def export_fd(self, ptr: int) -> int:
        """Return a new descriptor for this rank's allocation at ``ptr`` (the caller closes it)."""
        raise NotImplementedError

    def import_fd(self, fd: int, size: int, device: torch.device) -> int:
        """Map a peer's descriptor; return the address in this process."""
        raise NotImplementedError

    def share(self, comm: Comm, ptr: int, size: int, device: torch.device) -> list[int]:
        own: list[int] = []

        def export() -> int:
            own.append(self.export_fd(ptr))
            return self.mapped_size(ptr, size)

        try:  # the exported descriptor is closed on every path, a peer's failure included
            sizes = comm.phase(f"{self.path}: export descriptor", export)
            fds = exchange_fds(comm, own[0])
        finally:
            for exported in own:
                os.close(exported)
        try:
            return open_peers(
                comm,
                f"{self.path}: map peer descriptors",
                list(zip(fds, sizes)),
                ptr,
                lambda p: self.import_fd(p[0], p[1], device),
                self.close_peer,
            )
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    def mapped_size(self, ptr: int, size: int) -> int:
        """Bytes a peer must map for this rank's allocation at ``ptr`` (default ``size``)."""
        return size


class VmmFdBackend(FdSharingBackend, _VmmBackend):
    """VMM memory shared as POSIX file descriptors (works without IMEX on one host)."""

    kind = _vmm.POSIX_FD
    path = "vmm-fd"

    def export_fd(self, ptr: int) -> int:
        return _vmm.export_fd(ptr)

    def import_fd(self, fd: int, size: int, device: torch.device) -> int:
        return _vmm.import_fd(fd, size, device.index)

    def mapped_size(self, ptr: int, size: int) -> int:
        return _vmm.lookup(ptr).size


_BACKENDS: dict[str, type[HeapBackend]] = {
    "local": LocalBackend,
    "ipc": IpcBackend,
    "vmm-fabric": VmmFabricBackend,
    "vmm-fd": VmmFdBackend,
}


def make_backend(path: str) -> HeapBackend:
    """Return a new backend for memory path ``path``."""
    try:
        return _BACKENDS[path]()
    except KeyError:
        raise ValueError(f"unknown memory path {path!r}; expected one of {sorted(_BACKENDS)}") from None
