"""Host-side exchange between the ranks of an allocator, with failures broadcast.

All set-up traffic of an allocator goes through :meth:`Comm.phase`: every rank runs a step
locally, catches any exception, and then all ranks all-gather ``(ok, value-or-error)``.  A
rank whose step failed therefore still reaches the collective, and every rank raises the
same :class:`SetupError` naming the failing ranks, instead of hanging in the next
collective.  Objects travel through ``torch.distributed.all_gather_object`` (any backend;
gloo keeps them on the CPU).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

__all__ = ["Comm", "SetupError"]


class SetupError(RuntimeError):
    """A step of a collective set-up failed on one or more ranks (raised on every rank).

    Attributes:
        phase: the name of the step.
        failures: ``{rank: error text}`` of the ranks that failed.
    """

    def __init__(self, phase: str, failures: dict[int, str]):
        self.phase = phase
        self.failures = dict(failures)
        ranks = sorted(failures)
        details = "\n".join(f"--- rank {r} ---\n{failures[r].rstrip()}" for r in ranks)
        super().__init__(
            f"allocator set-up step {phase!r} failed on rank(s) {ranks}; every rank stops here.\n"
            f"{details}"
        )


class Comm:
    """The allocator's view of its process group: ``rank``, ``world_size`` and exchanges.

    Args:
        group: a ``torch.distributed`` process group, or None for a single process.
        rank: this process's rank in ``group``.
        world_size: the group's size.
    """

    def __init__(self, group: Any, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj`` (index = rank); unchecked, all ranks must call it."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        """Wait until every rank arrives (an all-gather of nothing, works on every backend)."""
        self.all_gather(None)

    def phase(self, name: str, step: Callable[[], Any], reraise_own: bool = False) -> list[Any]:
        """Run ``step()`` here, then share the outcome; return every rank's value.

        Args:
            name: the step's name, for error messages.
            step: the local work; its return value must be picklable.
            reraise_own: a rank whose own step failed re-raises its exception (for example
                a ``ValueError`` about its arguments) instead of the :class:`SetupError`.

        Raises:
            SetupError: on every rank, when ``step`` raised on any rank.
        """
        own_error: Exception | None = None
        try:
            outcome = (True, step())
        except Exception as exc:
            own_error = exc
            outcome = (False, traceback.format_exc())
        gathered = self.all_gather(outcome)
        failures = {r: value for r, (ok, value) in enumerate(gathered) if not ok}
        if failures:
            error = SetupError(name, failures)
            if reraise_own and own_error is not None:
                raise own_error from error if self.world_size > 1 else None
            raise error
        return [value for _, value in gathered]
