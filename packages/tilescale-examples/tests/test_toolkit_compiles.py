"""Every example kernel compiles for sm_90a with the CUDA toolkit of $CUDA_HOME: nvcc, or
NVRTC + ptxas (the CUDA 12.1/12.2 entries of ``nox -s matrix``, whose wheels have no nvcc)."""

from __future__ import annotations

import pytest
from examples_helpers import TOOLKIT, lower_source, lower_with, needs_toolkit

from tilescale_examples.moe import kernels as moe_kernels

from tilescale_examples.collectives import reduce_engine
from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel
from tilescale_examples.collectives.allgather import build_allgather_kernel, plan_chunks
from tilescale_examples.collectives.alltoall import build_alltoall_kernel
from tilescale_examples.overlap.gemm_rs import build_gemm_rs_kernel
from tilescale_examples.overlap.gemm_rs import build_reduce_kernel as build_gemm_rs_reduce_kernel
from tilescale_examples.tutorials.ring_put import build_ring_put

W = 4
#: name -> (kernel builder, TileLang pass configs the example compiles it with, or None)
KERNELS = {
    "ring_put": (lambda: build_ring_put(4096, "float32"), None),
    "allgather": (lambda: build_allgather_kernel(1 << 16, "float16", W, *plan_chunks(1 << 16, 2, W)), None),
    "alltoall": (lambda: build_alltoall_kernel(1 << 16, "bfloat16", W, *plan_chunks(1 << 16, 2, W)), None),
    **{f"reduce_{mode}": ((lambda mode=mode: reduce_engine.build_reduce_kernel(mode, "bfloat16", W)),
                          reduce_engine.PASS_CONFIGS) for mode in reduce_engine.MODES},
    "ag_gemm": (lambda: build_ag_gemm_kernel(256, 128, 256, W, 2, "bfloat16"), None),
    "gemm_rs": (lambda: build_gemm_rs_kernel(256, 128, 256, W, "bfloat16"), None),
    "gemm_rs_reduce": (lambda: build_gemm_rs_reduce_kernel(256, 256, W, "bfloat16"), None),
    "moe_dispatch": (lambda: moe_kernels.build_dispatch_kernel(64, 8, 7168, 4096, blocks=132),
                     moe_kernels.PASS_CONFIGS),
    "moe_combine": (lambda: moe_kernels.build_combine_kernel(64, 8, 7168, 4096, blocks=132, threads=512),
                    moe_kernels.PASS_CONFIGS),
}


@needs_toolkit
@pytest.mark.parametrize("name", list(KERNELS))
def test_example_kernel_compiles(name, tmp_path):
    build, pass_configs = KERNELS[name]
    src = lower_source(build()) if pass_configs is None else lower_with(build(), pass_configs)
    if name != "gemm_rs_reduce":  # the one example kernel that only reads local memory
        assert "tilescale::" in src
    out, _, _ = TOOLKIT.compile(src, tmp_path, "cubin", "sm_90a")
    assert out.read_bytes()[:4] == b"\x7fELF"
