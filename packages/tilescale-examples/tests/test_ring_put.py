"""The quick-start program (tilescale_examples.tutorials.ring_put): its kernel on CPU, the whole program on a GPU."""

from __future__ import annotations

import os

import pytest
from examples_helpers import needs_nvcc
from tilescale_lang.codegen import cuda_source

from tilescale_examples.tutorials.ring_put import build_ring_put


def test_kernel_puts_to_the_next_rank():
    src = cuda_source(build_ring_put(1000))
    body = src[src.index('extern "C" __global__') :]
    assert "tilescale::put_block<" in body
    assert "tilescale::get_rank()" in body and "tilescale::get_num_ranks()" in body
    assert "4000" in body  # 1000 float32 elements, in bytes


def test_kernel_is_named_ring_put_kernel():
    """TileLang names the CUDA kernel after the prim_func plus ``_kernel``: ``ring_put_kernel``
    (not ``ring_put_kernel_kernel``)."""
    import re

    func = build_ring_put(1000)
    assert func.attrs["global_symbol"] == "ring_put"
    names = re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(", cuda_source(func))
    assert set(names) == {"ring_put_kernel"}, names  # a declaration, then the definition


def _ring_put_body(rank, world_size):
    import torch
    import torch.distributed as dist

    from tilescale_examples.tutorials.ring_put import ring_put

    torch.cuda.set_device(rank % torch.cuda.device_count())
    ring_put(rank, world_size, dist.group.WORLD)
    return "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_ring_put_on_ranks_sharing_a_gpu(world, tmp_path):
    from tilescale_core.multiprocess import run_ranks

    env = {"TILELANG_CACHE_DIR": str(tmp_path)}
    assert run_ranks(_ring_put_body, world, backend="gloo", timeout=180, env=env) == ["ok"] * world


@needs_nvcc
def test_kernel_compiles_with_nvcc(tmp_path, monkeypatch):
    import tilelang

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    if "CUDA_HOME" not in os.environ:
        monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    kernel = tilelang.compile(build_ring_put(1000), target={"kind": "cuda", "arch": "sm_90a"}, compile_once=True)
    assert "tilescale::put_block<" in kernel.get_kernel_source()
