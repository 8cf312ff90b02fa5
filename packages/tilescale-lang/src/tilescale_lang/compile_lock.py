"""Compile a kernel once per host: ranks take turns through a file lock beside TileLang's cache.

``tilelang.compile(..., compile_once=True)`` runs the compile under an exclusive
``fcntl.flock`` on ``<TILELANG_CACHE_DIR>/tilescale-locks-<uid>/tilescale-compile.lock``.  The first process to take
the lock compiles and fills TileLang's disk cache; every later one finds a cache hit, because
TileScale kernels are rank-agnostic (the rank lives only in the metadata table) and so have
the same cache key on every rank.

Unlike a barrier, the lock is not a collective: a rank may compile a kernel that its peers
never compile (say, one only rank 0 launches) without pairing with anything, and a rank that
dies releases the lock with its process.  (``compile_once=True`` together with a
``compile_group`` is the collective form instead: the group's rank 0 compiles, see
:mod:`tilescale_lang.compile_root`.)  Waiting has a deadline; past it a TimeoutError names
the lock file and the process holding it.

The lock lives in a per-user directory (mode 0700, owned by the caller, not a symlink: a
directory open to group or others is refused) and is created 0600 and opened with
``O_NOFOLLOW``; a lock file that is not a regular file of the caller with mode 0600 is refused.
Another local user can neither hold it to stall compiles nor plant a symlink that makes the
holder overwrite one of the caller's files.  The holder named in a timeout comes from the
kernel's lock table (``/proc/locks``), not from text in the file, so it cannot be forged.
An empty ``TILELANG_CACHE_DIR`` is an error (the lock would follow the working directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
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
    ``tilescale-locks-<uid>`` / :data:`LOCK_NAME`, as an absolute path.

    Raises:
        ValueError: the directory is empty or blank (``TILELANG_CACHE_DIR=""`` would put the
            lock in whatever directory each process happens to run in).
    """
    source = "cache_dir"
    if cache_dir is None:
        from tilelang.env import env

        cache_dir, source = env.TILELANG_CACHE_DIR, "TILELANG_CACHE_DIR"
    text = os.fspath(cache_dir)
    if not str(text).strip():
        raise ValueError(
            f"{source} is empty: the compile lock (and TileLang's cache) would land in the working "
            "directory of each process; unset TILELANG_CACHE_DIR for TileLang's default "
            "(~/.tilelang/cache) or set it to a directory"
        )
    return Path(text).expanduser().absolute() / f"tilescale-locks-{os.getuid()}" / LOCK_NAME


def _private_dir(directory: Path) -> None:
    """Create ``directory`` 0700 if missing; refuse one that is a symlink, another user's, or
    open to other users (group or other permission bits)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"compile lock directory {directory} is not a plain directory (a symlink?); refusing it")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"compile lock directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()}); refusing it"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"compile lock directory {directory} has mode {mode:04o}: other users could plant or hold "
            f"its lock; it must be 0700 (chmod 700 it, or remove it to have it re-created)"
        )


def _check_lock_file(fd: int, path: Path) -> None:
    """Refuse a lock file that is not a regular file of this user closed to others (another
    user could hold it to stall every compile)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"compile lock {path} is not a regular file; refusing it")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"compile lock {path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
            "refusing it (another user could hold it to stall every compile)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"compile lock {path} has mode {mode:04o}: other users could open and hold it; it must be "
            "0600 (chmod 600 it, or remove it to have it re-created)"
        )


def _lock_holders(fd: int) -> list[int] | None:
    """Pids holding a flock on ``fd``'s file according to the kernel (``/proc/locks``); None
    when that table cannot be read.  Unlike the pid the holder writes into the file, these
    cannot be forged."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            table = f.read()
    except OSError:
        return None
    pids = []
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 20045 fe:00:2146458 0 EOF"; waiters have "->" after "1:"
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        dev = fields[5].split(":")
        try:
            major, minor, inode = int(dev[0], 16), int(dev[1], 16), int(dev[2])
            pid = int(fields[4])
        except (ValueError, IndexError):
            continue
        if (major, minor, inode) == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
            pids.append(pid)
    return pids


#: The pid text a holder writes: ASCII digits, no more than pid_max (2**22) allows.
_PID_TEXT = re.compile(r"[0-9]{1,7}")


def _holder(fd: int) -> str:
    """Who holds the lock: the kernel's record (``/proc/locks``) where it can be read; else
    the pid written into the lock file, checked to be plain digits and alive."""
    pids = _lock_holders(fd)
    if pids:
        return ", ".join(f"pid {p}" if p > 0 else "a process outside this pid namespace" for p in pids)
    if pids == []:
        return "unknown (the kernel lists no holder: released just now?)"
    text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
    if not _PID_TEXT.fullmatch(text):
        return "unknown (no valid pid recorded)"
    pid = int(text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"unknown (pid {pid} recorded, but it has exited)"
    except (PermissionError, OverflowError):
        pass
    return f"pid {pid} (as recorded in the lock file)"


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
        _check_lock_file(fd, path)
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
        group: ignored here: the lock covers every process on this host that shares the
            cache directory, so no collective is made (``tilelang.compile`` sends a
            ``compile_group`` to :func:`tilescale_lang.compile_root.compile_from_root`
            instead).
        cache_dir: directory of the lock (default: TileLang's cache directory).
        timeout: seconds to wait for the lock.
    """
    del group  # see the docstring: the lock needs no process group
    with compile_lock(lock_path(cache_dir), timeout):
        return build()
