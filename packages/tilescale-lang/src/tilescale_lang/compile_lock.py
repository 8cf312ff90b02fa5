"""Compile a kernel once per host: ranks take turns through a file lock beside TileLang's cache.

``tilelang.compile(..., compile_once=True)`` runs the compile under an exclusive
``fcntl.flock`` on ``<TILELANG_CACHE_DIR>/tilescale-compile.lock``.  The first process to take
the lock compiles and fills TileLang's disk cache; every later one finds a cache hit, because
TileScale kernels are rank-agnostic (the rank lives only in the metadata table) and so have
the same cache key on every rank.

Unlike a barrier, the lock is not a collective: a rank may compile a kernel that its peers
never compile (say, one only rank 0 launches) without pairing with anything, and a rank that
dies releases the lock with its process.  Waiting has a deadline; past it a TimeoutError names
the lock file and the process holding it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["LOCK_NAME", "DEFAULT_TIMEOUT_S", "compile_lock", "compile_once", "lock_path"]

#: File name of the lock inside TileLang's cache directory.
LOCK_NAME = "tilescale-compile.lock"
#: Seconds a process waits for the lock before giving up.
DEFAULT_TIMEOUT_S = 900.0

T = TypeVar("T")


def lock_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The lock file: ``cache_dir`` (default: TileLang's ``TILELANG_CACHE_DIR``) / :data:`LOCK_NAME`."""
    if cache_dir is None:
        from tilelang.env import env

        cache_dir = env.TILELANG_CACHE_DIR
    return Path(cache_dir).expanduser() / LOCK_NAME


@contextlib.contextmanager
def compile_lock(path: str | os.PathLike, timeout: float = DEFAULT_TIMEOUT_S,
                 poll_interval: float = 0.05) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block.

    Args:
        path: the lock file.
        timeout: seconds to wait for the lock, > 0.
        poll_interval: seconds between attempts.

    Raises:
        ValueError: ``timeout`` is not positive.
        TimeoutError: another process held the lock for longer than ``timeout``.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise TimeoutError(
                        f"waited {timeout:g} s for the TileScale compile lock {path} "
                        f"(held by pid {holder})"
                    ) from None
                time.sleep(poll_interval)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def compile_once(build: Callable[[], T], group: Any = None, *, cache_dir: str | os.PathLike | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> T:
    """Run ``build()`` (a TileLang compile) under the host-wide compile lock and return its result.

    Args:
        build: the compile, e.g. ``lambda: tilelang.compile(func, ...)``.
        group: accepted for ``compile_group=`` and unused: the lock already covers every
            process on this host that shares the cache directory, so no collective is made.
        cache_dir: directory of the lock (default: TileLang's cache directory).
        timeout: seconds to wait for the lock.
    """
    del group  # see the docstring: the lock needs no process group
    with compile_lock(lock_path(cache_dir), timeout):
        return build()
