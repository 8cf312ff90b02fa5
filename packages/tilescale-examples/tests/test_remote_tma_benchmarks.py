"""The remote TMA and GPU barrier benchmarks on the CPU: their kernels lower with the
operations they measure, compile with nvcc, and bad sizes are refused (the timed part needs a
GPU: ``ci/device-check.sh bench-remote_tma bench-gpu_barrier``)."""

from __future__ import annotations

import pytest
from examples_helpers import TOOLKIT, kernel_body, lower_source, needs_nvcc, needs_toolkit

from tilescale_examples.benchmarks import gpu_barrier, remote_tma


def test_tma_put_stores_through_the_peer_descriptors_with_two_buffers():
    body = kernel_body(lower_source(remote_tma.build_tma_put(1 << 14, 132)))
    for k in range(8):
        assert f"tl::tma_store(tilescale_tma_peer{k}_B_desc" in body
    assert "tl::tma_load(A_desc" in body  # the local load
    assert "tl::tma_store_wait<1, true>();" in body  # two shared buffers in flight
    assert "(it & 1)" in body


def test_barrier_loop_picks_the_layout_by_storage():
    one = kernel_body(lower_source(gpu_barrier.build_barrier_loop(1, 132)))
    two = kernel_body(lower_source(gpu_barrier.build_barrier_loop(2, 132)))
    assert "tilescale::sync_barrier_gpu1(" in one and "tilescale::sync_barrier_gpu1(" not in two
    assert "tilescale::sync_barrier_gpu((&(Bar[0])));" in two


@needs_toolkit
def test_benchmark_kernels_compile(tmp_path):
    for i, func in enumerate((remote_tma.build_tma_put(1 << 14, 132), gpu_barrier.build_barrier_loop(1, 132))):
        TOOLKIT.compile(lower_source(func), tmp_path / f"k{i}", "ptx", "sm_90a")


def test_sizes_must_be_whole_tiles():
    with pytest.raises(SystemExit):
        remote_tma.main(["--max-bytes", str((1 << 20) + 16)])
