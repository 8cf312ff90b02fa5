"""Shared helpers of the tilescale-lang tests (CPU: codegen, nvcc; GPU: marked ``gpu``).

A module of its own, with a name no other package's tests use, so that one pytest run can
collect every package's tests (``conftest`` is not importable by name across packages)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    # /usr/local/bin/nvcc may be a shim that misleads TileLang's CUDA_HOME detection
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import tilelang  # noqa: E402  (the import hook attaches tilescale-lang)

from tilescale_lang.codegen import cuda_source  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
if not os.path.exists(NVCC):
    NVCC = shutil.which("nvcc") or NVCC


def have_nvcc() -> bool:
    return os.path.exists(NVCC) or shutil.which("nvcc") is not None


def have_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


needs_nvcc = pytest.mark.skipif(not have_nvcc(), reason="nvcc not found (set CUDA_HOME)")


def lower_source(func) -> str:
    """CUDA source of ``func`` without nvcc (the postproc include is applied)."""
    return cuda_source(func, TARGET)


def kernel_body(src: str) -> str:
    return src[src.index('extern "C" __global__') :]


def nvcc_ptx(src: str, tmp_path, extra=()) -> str:
    """PTX of a generated source, compiled the way TileLang compiles kernels."""
    from tilelang.contrib.nvcc import default_compile_options

    from tilescale_lang import headers

    cu = tmp_path / "k.cu"
    cu.write_text(src)
    out = tmp_path / "k.ptx"
    opts = default_compile_options(headers.compile_flags() + list(extra))
    cmd = [NVCC, "-ptx", "-arch=sm_90a", *opts, "-w", "-o", str(out), str(cu)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    return out.read_text()


def nvcc_registers(src: str, tmp_path) -> int:
    """Registers per thread of the one kernel in a generated source (ptxas -v, sm_90a)."""
    from tilelang.contrib.nvcc import default_compile_options

    from tilescale_lang import headers

    cu = tmp_path / "r.cu"
    cu.write_text(src)
    opts = default_compile_options(headers.compile_flags())
    cmd = [NVCC, "-cubin", "-arch=sm_90a", *opts, "-w", "-Xptxas", "-v", "-o", str(tmp_path / "r.cubin"), str(cu)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    found = re.findall(r"Used (\d+) registers", res.stdout + res.stderr)
    assert len(found) == 1, res.stdout + res.stderr
    return int(found[0])


class FakeAllocator:
    """Stand-in for tilescale-core's allocator: only ``table`` matters to initialize()."""

    def __init__(self, table, local_rank=0, num_ranks=1, device="cuda:0"):
        self.table = table
        self.local_rank = local_rank
        self.num_ranks = num_ranks
        self.device = device
