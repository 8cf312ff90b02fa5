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

__all__ = ["PARENT_PID_ENV", "die_with_parent", "parent_pid_from_env"]

#: Environment variable through which a launcher passes its pid to the ranks it starts.
PARENT_PID_ENV = "TILESCALE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def parent_pid_from_env(env=None) -> int | None:
    """The launcher's pid from :data:`PARENT_PID_ENV` in ``env`` (default ``os.environ``);
    None when unset or blank.  Read it first thing, so that a bad value fails before any work.

    Raises:
        ValueError: the value is not a positive integer, naming the variable and the value.
    """
    text = (os.environ if env is None else env).get(PARENT_PID_ENV)
    if text is None or not text.strip():
        return None
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit()) or int(stripped) < 1:
        raise ValueError(f"{PARENT_PID_ENV}={text!r} is not a process id (a positive integer); it is set by "
                         "tilescale-run for the ranks it starts: unset it, or set it to the launcher's pid")
    return int(stripped)


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
