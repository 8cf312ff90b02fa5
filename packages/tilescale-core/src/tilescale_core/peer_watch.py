"""Stop this rank, naming the culprit, as soon as a peer rank's process dies.

A rank whose peer died would otherwise wait on it: in a kernel spinning on a flag the dead
rank will never set (until a wait timeout, if one was compiled in), or in a collective of the
process group (until its timeout, 30 minutes by default in torch).  :class:`PeerWatch`
exchanges the ranks' process ids once (all ranks run on one host, as TileScale requires) and
polls them from a daemon thread; when one is gone it prints
``[tilescale] rank R: peer rank D (pid P) died; stopping this rank`` to stderr and ends the
process with :data:`EXIT_PEER_DIED` -- from the thread, because the main thread may be blocked
in a device synchronisation that never returns.  A custom ``on_death`` callback replaces the
exit.

A rank stopped that way leaves a note naming the rank that died, so that a survivor which
notices it first still names the real culprit.  The notes live in a private directory that
rank 0 creates with a random name (``tempfile.mkdtemp``: mode 0700, never an existing one)
under the user's runtime directory ``$XDG_RUNTIME_DIR`` when it is this user's and closed to
others, else under the temporary directory; every rank checks the directory's owner and mode
before using it, and writes and reads notes with ``O_NOFOLLOW`` (``O_EXCL`` for writes), so
another local user can neither plant a directory nor redirect a note through a symlink.
:meth:`PeerWatch.stop` (or the interpreter's exit) removes the directory; a rank ended by
a peer's death leaves its note (the survivors read it), in the private directory.

Example::

    watch = PeerWatch(group=dist.group.WORLD)   # collective, once, after init_dist
    ...                                         # collectives, kernels
    watch.stop()                                # before the ranks exit normally
"""

from __future__ import annotations

import atexit
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from .validate import check_seconds

__all__ = ["EXIT_PEER_DIED", "PeerWatch", "check_private_dir", "process_alive", "runtime_dir"]

#: Exit status of a rank stopped because a peer died.
EXIT_PEER_DIED = 75


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


def check_private_dir(path: str) -> None:
    """Check that ``path`` is a directory (not a symlink) owned by this user and closed to
    group and others.

    Raises:
        PermissionError: naming ``path`` and what is wrong with it.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"{path} is a symbolic link, not a private directory")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} has mode {oct(st.st_mode & 0o777)}: group or others may use it")


def runtime_dir() -> str:
    """The user's runtime directory ``$XDG_RUNTIME_DIR`` when it is set and private (see
    :func:`check_private_dir`), else :func:`tempfile.gettempdir`."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(base):
        try:
            check_private_dir(base)
            return base
        except OSError:
            pass
    return tempfile.gettempdir()


def _make_notes_dir() -> str | None:
    try:
        return tempfile.mkdtemp(prefix=f"tilescale-peer-watch-{os.getuid()}-", dir=runtime_dir())
    except OSError:
        return None  # no notes: a survivor then names the first death it sees


def _remove_notes_dir(path: str) -> None:
    """Remove the notes (never following a link) and the directory."""
    try:
        check_private_dir(path)
        for entry in os.scandir(path):
            os.unlink(entry.path)
        os.rmdir(path)
    except OSError:
        pass


class PeerWatch:
    """Watch every other rank's process; collective constructor (all ranks, same group).

    Args:
        group: a ``torch.distributed`` group (default: the world group).
        interval: seconds between polls (> 0, finite); a death is noticed within about this long.
        on_death: called with ``(dead_rank, pid, message)`` instead of printing and exiting.

    Attributes: ``rank``, ``pids`` (index = rank), ``dead`` (rank found dead, or None).
    """

    def __init__(self, group=None, interval: float = 0.1,
                 on_death: Callable[[int, int, str], None] | None = None):
        import torch.distributed as dist

        interval = check_seconds("interval", interval)
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        notes = _make_notes_dir() if self.rank == 0 else None
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (os.getpid(), notes), group=group)
        self.pids = [int(pid) for pid, _ in gathered]
        self._notes: str | None = gathered[0][1]
        if self._notes is not None:
            try:
                check_private_dir(self._notes)
            except OSError:
                self._notes = None
        if notes is not None:
            atexit.register(_remove_notes_dir, notes)
        self.dead: int | None = None
        self._interval = interval
        self._on_death = on_death
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tilescale-peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for rank, pid in enumerate(self.pids):
                if rank != self.rank and not process_alive(pid):
                    self._died(rank, pid)
                    return

    def _note_path(self, rank: int) -> str | None:
        if self._notes is None:
            return None
        return os.path.join(self._notes, f"rank{rank}.{self.pids[rank]}")

    def _root_cause(self, rank: int, pid: int) -> tuple[int, int, str]:
        """A rank that stopped because of another one's death left a note naming it: follow
        it, so that every survivor names the rank that really died."""
        via = ""
        for _ in range(len(self.pids)):
            path = self._note_path(rank)
            try:
                if path is None:
                    break
                check_private_dir(self._notes)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd) as f:
                    cause, cause_pid = (int(v) for v in f.read(64).split())
            except (OSError, ValueError):
                break
            via = f" (rank {rank} stopped because of it)" if not via else via
            rank, pid = cause, cause_pid
        return rank, pid, via

    def _leave_note(self, rank: int, pid: int) -> None:
        path = self._note_path(self.rank)
        if path is None:
            return
        try:
            check_private_dir(self._notes)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{rank} {pid}")
        except OSError:
            pass

    def _died(self, rank: int, pid: int) -> None:
        time.sleep(self._interval)  # let a cascading survivor leave its note
        rank, pid, via = self._root_cause(rank, pid)
        self.dead = rank
        message = f"[tilescale] rank {self.rank}: peer rank {rank} (pid {pid}) died{via}; stopping this rank"
        self._leave_note(rank, pid)
        if self._on_death is not None:
            self._on_death(rank, pid, message)
            return
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(EXIT_PEER_DIED)

    def stop(self) -> None:
        """Stop watching (call it before ranks exit normally, so a peer's normal exit is not
        taken for a death); rank 0 removes the notes directory."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self._notes is not None and self.rank == 0:
            _remove_notes_dir(self._notes)

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
