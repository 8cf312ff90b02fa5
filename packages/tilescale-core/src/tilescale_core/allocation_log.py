"""The allocation sequence of a symmetric heap (:class:`AllocationLog`: records and a running
SHA-256 digest, compared across ranks) and the error a difference raises
(:class:`AllocationMismatchError`): every rank must allocate the same sizes in the same
order."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["AllocationLog", "AllocationMismatchError"]


class AllocationMismatchError(RuntimeError):
    """Ranks allocated different sizes or in a different order (raised on every rank).

    Attributes: ``index`` (0-based allocation number), ``ranks`` (the ranks that differ from
    rank 0), ``records`` (``{rank: (region, nbytes, alignment) or None}``).
    """

    def __init__(self, index: int, records: dict[int, tuple | None], when: str):
        self.index = index
        self.records = dict(records)
        reference = records[0]
        self.ranks = [r for r, rec in sorted(records.items()) if rec != reference]
        lines = [
            f"rank {r} {_describe_record(rec)}" + ("" if r == 0 or rec == reference else "  <- differs from rank 0")
            for r, rec in sorted(records.items())
        ]
        super().__init__(
            f"allocation sequence differs across ranks ({when}): first difference at allocation "
            f"#{index}, on rank(s) {self.ranks}:\n  " + "\n  ".join(lines)
            + "\nevery rank must allocate the same sizes in the same order"
        )


def _describe_record(record: tuple | None) -> str:
    if record is None:
        return "made no such allocation"
    region, nbytes, alignment = record
    return f"allocated {nbytes} bytes (alignment {alignment}) in the {region}"


@dataclass
class AllocationLog:
    """The allocation sequence of one allocator: records and a running SHA-256 digest.

    A record is ``(region, nbytes, alignment)``; region is ``"heap"`` or ``"multicast heap"``.
    """

    records: list[tuple[str, int, int]] = field(default_factory=list)
    digest: str = hashlib.sha256(b"tilescale-allocations").hexdigest()

    @staticmethod
    def chain(digest: str, record: tuple[str, int, int]) -> str:
        """The digest after appending ``record`` to a log whose digest is ``digest``."""
        return hashlib.sha256(f"{digest}|{record[0]}:{record[1]}:{record[2]}".encode()).hexdigest()

    def append(self, record: tuple[str, int, int]) -> None:
        """Append ``record`` and advance the digest."""
        self.records.append(record)
        self.digest = self.chain(self.digest, record)

    @staticmethod
    def first_difference(logs: Sequence[Sequence[tuple]]) -> tuple[int, dict[int, tuple | None]]:
        """Index of the first position where ``logs`` (one per rank) differ, and each rank's record there."""
        longest = max(len(log) for log in logs)
        for i in range(longest):
            at = {r: (tuple(log[i]) if i < len(log) else None) for r, log in enumerate(logs)}
            if len(set(at.values())) > 1:
                return i, at
        raise ValueError("the logs do not differ")
