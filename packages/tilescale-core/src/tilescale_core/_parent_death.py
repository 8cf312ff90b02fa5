"""Make a child process die with its parent (Linux ``PR_SET_PDEATHSIG``).

A rank started by ``tilescale-run`` or by :func:`tilescale_core.multiprocess.run_ranks` must
not outlive the process that watches it: if that process is killed (even with SIGKILL,
which it cannot forward), the kernel sends ``sig`` to the child.  Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["PARENT_PID_ENV", "die_with_parent"]

#: Environment variable through which a launcher passes its pid to the ranks it starts.
PARENT_PID_ENV = "TILESCALE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    Args:
        expected_parent: the parent's pid when known; if the parent already died before the
            request (a race at start-up), this process is signalled at once.
        sig: the signal to receive (default SIGKILL).

    Returns:
        True when the request was made (Linux), False elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True
