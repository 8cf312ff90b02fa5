"""Compile a kernel once per host: ranks take turns through a file lock beside TileLang's cache.

``tilelang.compile(..., compile_once=True)`` runs the compile under an exclusive
``fcntl.flock`` on ``<TILELANG_CACHE_DIR>/tilescale-locks-<uid>/tilescale-compile.lock``.  The first process to take
the lock compiles and fills TileLang's disk cache; every later one finds a cache hit, because
TileScale kernels are rank-agnostic (the rank lives only in the metadata table) and so have
the same cache key on every rank.

Unlike a barrier, the lock is not a collective: a rank may compile a kernel that its peers
never compile (say, one only rank 0 launches) without pairing with anything, and a rank that
dies releases the lock with its process.  Waiting has a deadline; past it a TimeoutError names
the lock file and the process holding it.

The lock lives in a per-user directory (mode 0700, owned by the caller, not a symlink) and is
created 0600 and opened with ``O_NOFOLLOW``: another local user can neither hold it to stall
compiles nor plant a symlink that makes the holder overwrite one of the caller's files.
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
    """The lock file: ``cache_dir`` (default: TileLang's ``TILELANG_CACHE_DIR``) /
    ``tilescale-locks-<uid>`` / :data:`LOCK_NAME`."""
    if cache_dir is None:
        from tilelang.env import env

        cache_dir = env.TILELANG_CACHE_DIR
    return Path(cache_dir).expanduser() / f"tilescale-locks-{os.getuid()}" / LOCK_NAME


def _private_dir(directory: Path) -> None:
    """Create ``directory`` 0700 if missing; refuse one that is a symlink or another user's."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    import stat

    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"compile lock directory {directory} is not a plain directory (a symlink?); refusing it")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"compile lock directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()}); refusing it"
        )


def _holder(fd: int) -> str:
    """The pid written by the process holding the lock, checked to be alive."""
    text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    if not text.isdigit():
        return "unknown (no pid recorded yet)"
    pid = int(text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"unknown (pid {pid} recorded, but it has exited)"
    except PermissionError:
        pass
    return f"pid {pid}"


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
    if path.parent.name.startswith("tilescale-locks-"):
        _private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise PermissionError(f"compile lock {path} is a symlink; refusing to follow it") from None
        raise OSError(exc.errno, f"cannot open the compile lock {path}: {exc.strerror}") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout:g} s for the TileScale compile lock {path} "
                        f"(held by {_holder(fd)})"
                    ) from None
                time.sleep(poll_interval)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # no stale pid for the next waiter to report
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
