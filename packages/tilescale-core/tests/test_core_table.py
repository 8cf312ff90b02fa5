"""tilescale_core.table: the heap-table layout, capacity and the one builder/reader (CPU)."""

from __future__ import annotations

import pytest
import torch

from tilescale_core import allocator, interface, table


def test_one_capacity_everywhere():
    assert table.MAX_TABLE_ENTRIES == 1024
    assert table.MAX_RANKS == table.MAX_TABLE_ENTRIES - table.HEADER_ENTRIES
    assert allocator.MAX_TABLE_ENTRIES is table.MAX_TABLE_ENTRIES
    assert interface.TABLE_VERSION is table.TABLE_VERSION
    assert interface.TABLE_LAYOUT is table.TABLE_LAYOUT


def test_build_table_layout_and_round_trip():
    bases = [0x7F0000000000 + r * 2**30 for r in range(4)]
    t = table.build_table(2, 4, bases)
    assert t.dtype == torch.uint64 and t.device.type == "cpu" and t.shape == (6,)

    class Holder:
        pass

    holder = Holder()
    holder.table = t
    assert table.table_from_allocator(holder) == [2, 4, *bases]


@pytest.mark.parametrize(
    "rank,num_ranks,bases,match",
    [
        (0, 2, [1], "inconsistent"),
        (2, 2, [1, 2], "inconsistent"),
        (0, table.MAX_RANKS + 1, [1] * (table.MAX_RANKS + 1), "limit is 1024"),
    ],
)
def test_build_table_rejects(rank, num_ranks, bases, match):
    with pytest.raises(ValueError, match=match):
        table.build_table(rank, num_ranks, bases)


def test_largest_table_fits():
    t = table.build_table(0, table.MAX_RANKS, list(range(1, table.MAX_RANKS + 1)))
    assert t.numel() == table.MAX_TABLE_ENTRIES


def test_table_from_allocator_errors():
    with pytest.raises(TypeError, match="needs allocator"):
        table.table_from_allocator(None)
    with pytest.raises(TypeError, match="has no 'table'"):
        table.table_from_allocator(object())

    class Bad:
        table = torch.zeros(3, dtype=torch.float32)

    with pytest.raises(TypeError, match="uint64"):
        table.table_from_allocator(Bad())
