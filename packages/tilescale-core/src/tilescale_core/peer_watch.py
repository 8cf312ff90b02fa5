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

Example::

    watch = PeerWatch(group=dist.group.WORLD)   # collective, once, after init_dist
    ...                                         # collectives, kernels
    watch.stop()                                # before the ranks exit normally
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_PEER_DIED", "PeerWatch", "process_alive"]

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


class PeerWatch:
    """Watch every other rank's process; collective constructor (all ranks, same group).

    Args:
        group: a ``torch.distributed`` group (default: the world group).
        interval: seconds between polls (> 0); a death is noticed within about this long.
        on_death: called with ``(dead_rank, pid, message)`` instead of printing and exiting.

    Attributes: ``rank``, ``pids`` (index = rank), ``dead`` (rank found dead, or None).
    """

    def __init__(self, group=None, interval: float = 0.1,
                 on_death: Callable[[int, int, str], None] | None = None):
        import torch.distributed as dist

        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        pids: list = [None] * world
        dist.all_gather_object(pids, os.getpid(), group=group)
        self.pids = [int(p) for p in pids]
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

    def _note_path(self, rank: int) -> str:
        import tempfile

        job = f"tilescale-peer-watch-{os.getuid()}-{self.pids[0]}"
        return os.path.join(tempfile.gettempdir(), job, f"rank{rank}.{self.pids[rank]}")

    def _root_cause(self, rank: int, pid: int) -> tuple[int, int, str]:
        """A rank that stopped because of another one's death left a note naming it: follow
        it, so that every survivor names the rank that really died."""
        via = ""
        for _ in range(len(self.pids)):
            try:
                with open(self._note_path(rank)) as f:
                    cause, cause_pid = (int(v) for v in f.read().split())
            except (OSError, ValueError):
                break
            via = f" (rank {rank} stopped because of it)" if not via else via
            rank, pid = cause, cause_pid
        return rank, pid, via

    def _leave_note(self, rank: int, pid: int) -> None:
        path = self._note_path(self.rank)
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(path, "w") as f:
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
        taken for a death)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
