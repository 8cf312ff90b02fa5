"""The heap table: the one contract between the allocator, ``kernel.initialize`` and the device.

Every TileScale kernel module holds one ``__constant__ unsigned long long meta_data[1024]``
(``include/tilescale/common.cuh`` of tilescale-lang, ``TILESCALE_MAX_TABLE``) that device code
reads to find its rank and every peer's heap.  Its layout, in uint64 entries::

    [local_rank, num_ranks, base_0, base_1, ..., base_{num_ranks-1}]

``base_r`` is the address, in this process, of rank ``r``'s heap base; a peer address is
``ptr - base_{local_rank} + base_r``.  The allocator builds the table with :func:`build_table`
(a CPU ``torch.uint64`` tensor, its ``table`` attribute); ``kernel.initialize(allocator=...)``
reads it back with :func:`table_from_allocator`, which validates it, and copies the values into
the module.  :data:`TABLE_VERSION` numbers this layout: tilescale-lang refuses at import a
tilescale-core that speaks another one.

Importing this module needs the standard library only (torch is imported on first use).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "HEADER_ENTRIES",
    "MAX_RANKS",
    "MAX_TABLE_ENTRIES",
    "TABLE_LAYOUT",
    "TABLE_VERSION",
    "build_table",
    "check_num_ranks",
    "table_from_allocator",
    "table_values",
]

#: Version of the table layout (:data:`TABLE_LAYOUT`). A change of layout bumps it.
TABLE_VERSION = 1
#: The layout, entry by entry (uint64 each).
TABLE_LAYOUT = ("local_rank", "num_ranks", "base_0 .. base_{num_ranks-1}")
#: Capacity of a kernel module's table, uint64 entries (``TILESCALE_MAX_TABLE`` in common.cuh).
MAX_TABLE_ENTRIES = 1024
#: Entries before the base pointers (``local_rank``, ``num_ranks``).
HEADER_ENTRIES = 2
#: Most ranks a table can describe.
MAX_RANKS = MAX_TABLE_ENTRIES - HEADER_ENTRIES

_U64 = 0xFFFFFFFFFFFFFFFF


def check_num_ranks(num_ranks: int) -> None:
    """Raise ValueError when ``num_ranks`` ranks do not fit a table (more than :data:`MAX_RANKS`)."""
    if HEADER_ENTRIES + num_ranks > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"{num_ranks} ranks need a {HEADER_ENTRIES + num_ranks}-entry table; the limit is {MAX_TABLE_ENTRIES}"
        )


def table_values(values: Sequence[int], what: str = "the table") -> list[int]:
    """Check that ``values`` is a well-formed table and return it as a list of Python ints.

    Raises:
        ValueError: fewer than 2 entries, more than :data:`MAX_TABLE_ENTRIES`, or inconsistent
            (``num_ranks`` must equal the number of base pointers and ``local_rank < num_ranks``).
    """
    values = [int(v) & _U64 for v in values]
    if len(values) < HEADER_ENTRIES:
        raise ValueError(f"{what} must hold at least [local_rank, num_ranks]; got {len(values)} entries")
    if len(values) > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"{what} has {len(values)} entries; the kernel's meta_data holds at most "
            f"{MAX_TABLE_ENTRIES} (at most {MAX_RANKS} ranks)"
        )
    rank, num_ranks = values[0], values[1]
    if num_ranks != len(values) - HEADER_ENTRIES or not (0 <= rank < max(num_ranks, 1)):
        raise ValueError(
            f"{what} is inconsistent: local_rank={rank}, num_ranks={num_ranks}, "
            f"{len(values) - HEADER_ENTRIES} base pointers"
        )
    return values


def build_table(local_rank: int, num_ranks: int, bases: Sequence[int]):
    """The table of rank ``local_rank`` of ``num_ranks`` whose heaps start at ``bases``.

    Args:
        local_rank: this rank, ``0 <= local_rank < num_ranks``.
        num_ranks: number of ranks (at most :data:`MAX_RANKS`).
        bases: ``num_ranks`` heap base addresses in this process (bytes), index = rank.

    Returns:
        a 1-D CPU ``torch.uint64`` tensor of ``2 + num_ranks`` entries.

    Raises:
        ValueError: too many ranks, or ``bases``/``local_rank`` disagree with ``num_ranks``.
    """
    import torch

    check_num_ranks(num_ranks)
    return torch.tensor(table_values([local_rank, num_ranks, *bases]), dtype=torch.uint64)


def table_from_allocator(allocator: Any) -> list[int]:
    """Validate ``allocator.table`` and return it as a list of Python ints (uint64 values).

    ``allocator`` is a tilescale-core allocator or any object with a ``table`` (a 1-D CPU
    uint64/int64 tensor or a sequence of ints) in the layout above.

    Raises:
        TypeError: ``allocator`` is missing/None or has no usable ``table``.
        ValueError: the table is empty, too large (> 1024 entries) or inconsistent
            (``table[1]`` must equal ``len(table) - 2`` and ``table[0] < table[1]``).
    """
    if allocator is None:
        raise TypeError("initialize() needs allocator=<tilescale allocator>; got None")
    table = getattr(allocator, "table", None)
    if table is None:
        raise TypeError(
            f"allocator {type(allocator).__name__!r} has no 'table' (expected the distributed "
            "allocator's CPU uint64 metadata table [local_rank, num_ranks, base_0, ...])"
        )
    return table_values(_to_ints(table), "allocator.table")


def _to_ints(table: Any) -> list[int]:
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(table, torch.Tensor):
        if table.device.type != "cpu":
            table = table.cpu()
        if table.dim() != 1:
            raise ValueError(f"allocator.table must be 1-D, got shape {tuple(table.shape)}")
        if table.dtype in (torch.uint64, torch.int64):
            return [v & _U64 for v in table.view(torch.int64).tolist()]
        raise TypeError(f"allocator.table must be a uint64 (or int64) tensor, got {table.dtype}")
    try:
        return [int(v) & _U64 for v in table]
    except TypeError:
        raise TypeError(f"allocator.table must be a sequence of integers, got {type(table).__name__}") from None
