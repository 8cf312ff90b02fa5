"""Entry point of one rank started by ``tilescale-run``: ``python -m tilescale_host._rank_main``.

It asks for SIGKILL when the launcher dies (``TILESCALE_PARENT_PID``), registers a faulthandler on SIGUSR1 (the launcher sends it before killing ranks that
overran the timeout, so their Python stacks show where they were waiting), then runs the
user's script (``path [args...]``) or module (``-m name [args...]``) as ``__main__`` with
``sys.argv`` set as if Python had been started on it directly.  When the launcher names an
error file (``TILESCALE_RUN_ERROR_FILE``; ``tilescale-run`` without ``--verbose``), an exception
the script raises is written there as one line (``Type: message``) instead of a traceback, and
the rank exits with status 1: the launcher reports it once for all ranks.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys

from tilescale_core.interface import die_with_parent, parent_pid_from_env

#: Where the launcher wants the one-line summary of an exception the script raised.
ERROR_FILE_ENV = "TILESCALE_RUN_ERROR_FILE"


def error_line(exc: BaseException) -> str:
    """``exc`` as one line: ``Type: message``, the message's lines joined."""
    import traceback

    text = "".join(traceback.format_exception_only(type(exc), exc))
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


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
    error_file = os.environ.pop(ERROR_FILE_ENV, None)  # not for the script's own subprocesses
    try:
        if argv[:1] == ["-m"]:
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except Exception as exc:
        if not error_file:  # --verbose, or not under tilescale-run: the traceback
            raise
        with open(error_file, "w", encoding="utf-8") as f:
            f.write(error_line(exc) + "\n")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
