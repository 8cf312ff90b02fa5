import io

import pytest

from tilescale_examples.benchmarks._report import (format_bytes, format_table, gb_per_s, print_table, ratio, save_tables,
                                                   size_sweep, table_name)


def test_format_bytes_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(4096) == "4 KiB"
    assert format_bytes(64 * 2**20) == "64 MiB"
    assert format_bytes(2**30) == "1 GiB"
    with pytest.raises(ValueError, match="nbytes"):
        format_bytes(-1)


def test_bandwidth_and_ratio():
    assert gb_per_s(2e9, 1000.0) == pytest.approx(2.0)
    assert ratio(3.0, 4.0) == 0.75
    assert ratio(1.0, 0.0) != ratio(1.0, 0.0)  # NaN
    with pytest.raises(ValueError, match="milliseconds"):
        gb_per_s(1, 0)


def test_size_sweep():
    assert size_sweep(4096, 2**20) == [4096, 16384, 65536, 262144, 1048576]
    with pytest.raises(ValueError):
        size_sweep(0, 10)


def test_table_alignment_and_errors():
    text = format_table(["size", "GB/s"], [["4 KiB", 1.23456], ["1 GiB", 4200.0]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert "1.235" in text and "4200.0" in text
    with pytest.raises(ValueError, match="cells"):
        format_table(["a", "b"], [[1]])
    buf = io.StringIO()
    print_table("t", ["a"], [[1]], file=buf)
    assert buf.getvalue().startswith("\n== t\n")


def test_saved_tables_are_named_after_the_benchmark_in_print_order(tmp_path):
    assert [table_name("putget", i) for i in (1, 2, 3)] == ["putget", "putget_2", "putget_3"]
    with pytest.raises(ValueError, match="index must be >= 1"):
        table_name("putget", 0)
    with pytest.raises(ValueError, match="needs the benchmark's name"):
        save_tables(tmp_path)
    buf = io.StringIO()
    save_tables(tmp_path / "a", "signals")
    try:
        first = print_table("t1", ["operation", "x us"], [["flag write", 1.5]], file=buf)
        second = print_table("t2", ["operation", "x us"], [["ping-pong", 2.5]], file=buf)
        save_tables(tmp_path / "b", "heap")  # a new directory and benchmark: the count starts again
        third = print_table("t3", ["a"], [[1]], file=buf)
    finally:
        save_tables(None)
    assert [p.name for p in first[:2]] == ["signals.csv", "signals.json"]
    assert [p.name for p in second[:2]] == ["signals_2.csv", "signals_2.json"]
    assert [p.name for p in third[:2]] == ["heap.csv", "heap.json"] and third[0].parent == tmp_path / "b"
    assert buf.getvalue().count("saved: ") == 3
    assert print_table("t4", ["a"], [[1]], file=io.StringIO()) == []  # saving stopped
