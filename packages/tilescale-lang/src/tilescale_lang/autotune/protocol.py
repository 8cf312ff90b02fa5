"""How the ranks of a tuning agree: one collective primitive, and decisions sent by the root.

Every exchange is ``torch.distributed.all_gather_object`` over the tuning group (group ranks,
so no global-rank translation), entered by every rank in the same order. Whatever the root
decides reaches the others as the root's object (:meth:`Comm.from_root`); a rank never
adopts a value it computed itself when the root's differs. Work a rank does between two
exchanges is wrapped (:func:`guarded`) so that a failure becomes a value sent in the next
exchange, not an exception that leaves the peers waiting in it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ROOT", "Comm", "guarded"]

#: The group rank that reads and writes the cache, times under ``policy="root"`` and decides.
ROOT = 0


@dataclass(frozen=True)
class Comm:
    """This process's place in the tuning group.

    Attributes:
        group: the ``torch.distributed`` group, or None for a single process (no collective).
        rank: this process's rank in ``group`` (0 alone).
        size: ranks in ``group`` (1 alone).
    """

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any) -> "Comm":
        """The group to tune over: ``group``, else the world group when ``torch.distributed``
        is initialised, else this process alone.

        Raises:
            ValueError: naming ``group``: given while ``torch.distributed`` is not initialised,
                or this process is not one of its members.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("group was given but torch.distributed is not initialised")
            return cls(None, 0, 1)
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not one of its members")
        return cls(group, rank, dist.get_world_size(group))

    @property
    def is_root(self) -> bool:
        """Whether this process is the group's :data:`ROOT`."""
        return self.rank == ROOT

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in group-rank order (a collective: every rank calls it)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_root(self, obj: Any) -> Any:
        """The root's ``obj`` on every rank (the others' ``obj`` is not sent: pass None)."""
        return self.gather(obj if self.is_root else None)[ROOT]


def guarded(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, "<exception and traceback>")`` when ``fn`` raises an
    ``Exception``: a failure to send to the peers instead of leaving them in a collective."""
    try:
        return True, fn()
    except Exception as exc:  # sent to every rank by the caller
        return False, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
