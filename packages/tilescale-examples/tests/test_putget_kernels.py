"""The put/get benchmark's kernels lower with the intrinsics they promise (CPU, no nvcc)."""

from __future__ import annotations

from tilescale_lang.codegen import cuda_source

from tilescale_examples.benchmarks import putget


def test_copy_kernels_call_their_helper():
    for op in ("put_warp", "get_warp", "put_block", "get_block"):
        assert f"tilescale::{op}<" in cuda_source(putget.build_copy(op, 1 << 20, 8))


def test_overhead_kernels_differ_only_by_the_intrinsic():
    assert "tilescale::put_block<4>" in cuda_source(putget.build_overhead(True))
    assert "tilescale::" not in cuda_source(putget.build_overhead(False))
