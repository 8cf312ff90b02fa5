"""The put/get benchmark's kernels lower with the intrinsics they promise (CPU, no nvcc)."""

from __future__ import annotations

import math
from types import SimpleNamespace

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


def test_call_overhead_times_the_kernels_in_turns_and_keeps_each_ones_best_round(monkeypatch):
    """putget's call overhead (``_timing.host_us_rounds`` on ``perf_rounds``, host clock): 100
    warm-up calls of each kernel, then rounds that time each kernel's calls back to back,
    the first kernel alternating, each timing from an idle GPU to the end of its GPU work (a
    synchronisation before and after the calls); each kernel's best round."""
    import torch

    from tilescale_examples.benchmarks import _timing

    order = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # CUDA in use: the host clock waits for it
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(device="cuda:0"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: order.append("sync"))
    fns = [lambda: order.append("d"), lambda: order.append("s")]
    got = _timing.host_us_rounds(fns, calls=3, rounds=4)
    assert len(got) == 2 and all(t >= 0 and math.isfinite(t) for t in got)
    assert order[:201] == ["sync"] + ["d"] * 100 + ["s"] * 100  # idle GPU, then the warm-up of each
    rounds = [x for x in order[201:] if x != "sync"]
    # each round runs every kernel's calls back to back; the first kernel alternates
    assert rounds == ["d"] * 3 + ["s"] * 3 + ["s"] * 3 + ["d"] * 3 + ["d"] * 3 + ["s"] * 3 + ["s"] * 3 + ["d"] * 3
    timings = "".join("|" if x == "sync" else x for x in order[201:])
    assert timings == "||ddd|" "||sss|" "||sss|" "||ddd|" "||ddd|" "||sss|" "||sss|" "||ddd|"  # barrier, before, after
