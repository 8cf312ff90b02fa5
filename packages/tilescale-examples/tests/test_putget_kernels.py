"""The put/get benchmark's kernels lower with the intrinsics they promise (CPU, no nvcc)."""

from __future__ import annotations

import math

import pytest

from tilescale_lang.codegen import cuda_source

from tilescale_examples.benchmarks import putget


def test_copy_kernels_call_their_helper():
    for op in ("put_warp", "get_warp", "put_block", "get_block"):
        assert f"tilescale::{op}<" in cuda_source(putget.build_copy(op, 1 << 20, 8))


def test_overhead_kernels_differ_only_by_the_intrinsic():
    assert "tilescale::put_block<4>" in cuda_source(putget.build_overhead(True))
    assert "tilescale::" not in cuda_source(putget.build_overhead(False))


def test_round_robin_units_loop_over_the_helper():
    src = cuda_source(putget.build_copy("put_block", 1 << 20, 8, unit_bytes=64 << 10))
    body = src[src.index('extern "C" __global__') :]
    assert "for (int k = 0;" in body and "tilescale::put_block<4>" in body
    assert "min(16384," in body  # 64 KiB units of int32


@pytest.mark.parametrize("unit_kib", [128, 160, 256])
def test_units_of_32768_or_more_elements_lower(unit_kib):
    # factors of 32768 (or more, modulo 65536) elements in an address break TileLang's pointer-type pass
    body = cuda_source(putget.build_copy("get_block", 1 << 26, 8, unit_bytes=unit_kib << 10))
    assert f"min({unit_kib << 8}," in body


def test_unit_bytes_must_keep_16_byte_alignment():
    with pytest.raises(ValueError, match="unit_bytes must be a multiple of 16"):
        putget.build_copy("get_block", 1 << 20, 8, unit_bytes=1000)


def test_time_columns_takes_the_columns_in_turn_and_keeps_each_ones_median_round():
    calls, barriers = [], []
    fake = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    columns = [("a", "fa"), ("b", "fb")]

    def timer(fn, iters):
        calls.append((fn, iters))
        return next(fake[fn[1]])

    got = putget.time_columns(columns, 3, 7, barrier=lambda: barriers.append(1), timer=timer)
    assert got == {"a": 3.0, "b": 4.0}
    assert calls == [("fa", 7), ("fb", 7)] * 3 and len(barriers) == 6
    # a column this rank does not run: NaN, but its barriers still happen
    calls.clear(), barriers.clear()
    fake["b"] = iter([2.0, 9.0, 4.0])
    got = putget.time_columns([("a", None), ("b", "fb")], 3, 7, barrier=lambda: barriers.append(1), timer=timer)
    assert math.isnan(got["a"]) and got["b"] == 4.0 and calls == [("fb", 7)] * 3 and len(barriers) == 6
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        putget.time_columns(columns, 0, 7)


def test_call_overhead_times_the_kernels_in_turns_and_keeps_each_ones_best_round(monkeypatch):
    import torch

    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: order.append("sync"))
    fns = [lambda: order.append("d"), lambda: order.append("s")]
    got = putget._host_us(fns, calls=3, rounds=4)
    assert len(got) == 2 and all(t >= 0 and math.isfinite(t) for t in got)
    assert order[:201] == ["d"] * 100 + ["s"] * 100 + ["sync"]  # warm-up of each
    rounds = [x for x in order[201:] if x != "sync"]
    # each round runs every kernel's calls back to back; the first kernel alternates
    assert rounds == ["d"] * 3 + ["s"] * 3 + ["s"] * 3 + ["d"] * 3 + ["d"] * 3 + ["s"] * 3 + ["s"] * 3 + ["d"] * 3
    assert order[201:].count("sync") == 8  # one per kernel and round
