"""Run a blocking call with a deadline: ``call_with_deadline(fn, timeout, what)``.

Collectives of a ``torch.distributed`` group and device synchronisation have no timeout of
their own that a caller can pick per call.  The call runs in a daemon thread; when it has
not returned after ``timeout`` seconds a :class:`TimeoutError` naming ``what`` is raised in
the caller (the thread is abandoned: the group is unusable afterwards, which the message
says).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["call_with_deadline"]

T = TypeVar("T")


def call_with_deadline(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Return ``fn()``, or raise TimeoutError naming ``what`` after ``timeout`` seconds.

    Exceptions of ``fn`` are re-raised in the caller.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"tilescale-deadline: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(
            f"{what} did not finish within {timeout:g} s (a peer rank is gone or stuck); "
            "this process group cannot be used any more"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]
