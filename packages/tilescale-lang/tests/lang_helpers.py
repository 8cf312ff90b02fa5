"""Shared helpers of the tilescale-lang tests (CPU: codegen, nvcc; GPU: marked ``gpu``).

A module of its own, with a name no other package's tests use, so that one pytest run can
collect every package's tests (``conftest`` is not importable by name across packages)."""

from __future__ import annotations

import os
import re

import pytest

if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    # /usr/local/bin/nvcc may be a shim that misleads TileLang's CUDA_HOME detection
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import tilelang  # noqa: E402  (the import hook attaches tilescale-lang)

from tilescale_lang.codegen import cuda_source  # noqa: E402

from tilescale_lang.toolkit import find_toolkit  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
#: The CUDA toolkit the compile tests use ($CUDA_HOME): nvcc, or NVRTC + ptxas (CUDA 12.1/12.2
#: from the registry's wheels, which have no nvcc driver); None when there is none.
TOOLKIT = find_toolkit()
NVCC = TOOLKIT.nvcc if TOOLKIT and TOOLKIT.nvcc else os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def have_nvcc() -> bool:
    """Whether the toolkit has the nvcc driver (``tilelang.compile`` with nvcc works)."""
    return TOOLKIT is not None and TOOLKIT.nvcc is not None


#: Tests that run ``tilelang.compile`` (TileLang calls nvcc).
needs_nvcc = pytest.mark.skipif(not have_nvcc(), reason=f"needs the nvcc driver (toolkit: {TOOLKIT or 'none; set CUDA_HOME'})")
#: Tests that compile generated CUDA with the toolkit, by nvcc or by NVRTC + ptxas.
needs_toolkit = pytest.mark.skipif(TOOLKIT is None, reason="no CUDA toolkit found (set CUDA_HOME)")


def lower_source(func) -> str:
    """CUDA source of ``func`` without nvcc (the postproc include is applied)."""
    return cuda_source(func, TARGET)


def kernel_body(src: str) -> str:
    return src[src.index('extern "C" __global__') :]


def nvcc_ptx(src: str, tmp_path, extra=()) -> str:
    """PTX of a generated source, compiled by the toolkit the way TileLang compiles kernels."""
    out, _, _ = TOOLKIT.compile(src, tmp_path / "ptx", "ptx", TARGET["arch"], extra)
    return out.read_text(encoding="utf-8")


def nvcc_registers(src: str, tmp_path) -> int:
    """Registers per thread of the one kernel in a generated source (ptxas -v, sm_90a)."""
    _, log, _ = TOOLKIT.compile(src, tmp_path / "cubin", "cubin", TARGET["arch"], ptxas_verbose=True)
    found = re.findall(r"Used (\d+) registers", log)
    assert len(found) == 1, log
    return int(found[0])


class FakeAllocator:
    """Stand-in for tilescale-core's allocator: only ``table`` matters to initialize()."""

    def __init__(self, table, local_rank=0, num_ranks=1, device="cuda:0"):
        self.table = table
        self.local_rank = local_rank
        self.num_ranks = num_ranks
        self.device = device
