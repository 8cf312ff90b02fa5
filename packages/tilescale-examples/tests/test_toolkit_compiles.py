"""Every example kernel compiles for sm_90a with the CUDA toolkit of $CUDA_HOME: nvcc, or
NVRTC + ptxas (the CUDA 12.1/12.2 entries of ``nox -s matrix``, whose wheels have no nvcc)."""

from __future__ import annotations

import pytest
from examples_helpers import TOOLKIT, lower_source, needs_toolkit

from tilescale_examples.ag_gemm import build_gemm_kernel
from tilescale_examples.allgather import build_allgather_kernel, plan_chunks
from tilescale_examples.alltoall import build_alltoall_kernel
from tilescale_examples.reducescatter import build_reducescatter_kernel
from tilescale_examples.ring_put import build_ring_put

W = 4
KERNELS = {
    "ring_put": lambda: build_ring_put(4096, "float32"),
    "allgather": lambda: build_allgather_kernel(1 << 16, "float16", W, *plan_chunks(1 << 16, 2, W)),
    "alltoall": lambda: build_alltoall_kernel(1 << 16, "bfloat16", W, *plan_chunks(1 << 16, 2, W)),
    "reducescatter": lambda: build_reducescatter_kernel(1 << 16, "float16", W, *plan_chunks(1 << 16, 2, W, 32)),
    "ag_gemm": lambda: build_gemm_kernel(256, 512, 256, W, *plan_chunks(256 * 512, 2, W, 16, 128 * 512 * 2), "bfloat16"),
}


@needs_toolkit
@pytest.mark.parametrize("name", list(KERNELS))
def test_example_kernel_compiles(name, tmp_path):
    src = lower_source(KERNELS[name]())
    assert "tilescale::" in src
    out, _, _ = TOOLKIT.compile(src, tmp_path, "cubin", "sm_90a")
    assert out.read_bytes()[:4] == b"\x7fELF"
