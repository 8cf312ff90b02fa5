"""Entry point of one rank started by ``tilescale-run``: ``python -m tilescale_host._rank_main``.

It asks for SIGKILL when the launcher dies (``TILESCALE_PARENT_PID``), registers a faulthandler on SIGUSR1 (the launcher sends it before killing ranks that
overran the timeout, so their Python stacks show where they were waiting), then runs the
user's script (``path [args...]``) or module (``-m name [args...]``) as ``__main__`` with
``sys.argv`` set as if Python had been started on it directly.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys

from tilescale_core.interface import die_with_parent, parent_pid_from_env


def main(argv: list[str]) -> None:
    """Run ``argv`` (``script args...`` or ``-m module args...``) as ``__main__``.

    A bad ``TILESCALE_PARENT_PID`` is a one-line error and exit status 2, before the script runs.
    """
    try:
        pid = parent_pid_from_env()
    except ValueError as exc:
        sys.stderr.write(f"tilescale_host._rank_main: error: {exc}\n")
        raise SystemExit(2) from None
    if pid is not None:  # die with the launcher, even when it is SIGKILLed
        die_with_parent(pid)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
