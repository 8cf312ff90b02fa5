"""Upstream TileScale compatibility on CPU: the one-word GPU barrier, remote atomics,
remote TMA (generated code, PTX, rejections)."""

from __future__ import annotations

import pytest
import tilelang.language as T
from lang_helpers import kernel_body, lower_source, needs_nvcc, nvcc_ptx


# ------------------------------------------------------------------------------ one-word barrier
def _upstream_barrier_kernel(words: int = 1):
    """Upstream's test_barrier_gpu kernel, as its users write it."""
    num_blocks, threads = 64, 128

    @T.prim_func
    def main(A: T.Tensor([threads], "int32"), bar: T.Tensor([words], "uint32"), B: T.Tensor([num_blocks, threads], "int32")):
        with T.Kernel(num_blocks, threads=threads) as bid:
            tid = T.get_thread_binding()
            _w = T.alloc_local([words], "uint32")  # noqa: F841 (keeps ``words`` in the closure)
            T.init_barrier_gpu(bar, num_blocks)
            b = T.alloc_shared([threads], "int32")
            val = T.alloc_local([1], "int32")
            val[0] = 1
            T.atomic_add(A[tid], val[0])
            T.sync_barrier_gpu(bar)
            T.copy(A, b)
            T.copy(b, B[bid, :])

    return main


def test_one_word_barrier_codegen():
    body = kernel_body(lower_source(_upstream_barrier_kernel(1)))
    assert "tilescale::init_barrier_gpu1((&(bar[0])), (uint)64);" in body
    assert "tilescale::sync_barrier_gpu1((&(bar[0])));" in body
    two = kernel_body(lower_source(_upstream_barrier_kernel(2)))
    assert "tilescale::init_barrier_gpu((&(bar[0])), (uint)64);" in two  # two words: the original form
    assert "tilescale::sync_barrier_gpu((&(bar[0])));" in two


def test_one_word_barrier_forms_by_storage():
    @T.prim_func
    def k(W: T.Tensor((4,), "uint32")):
        with T.Kernel(8, threads=32) as _:
            T.init_barrier_gpu(W[3:4], 8)  # the last element: one word
            T.arrive_barrier_gpu(W[3])
            T.wait_barrier_gpu(T.address_of(W[3]))
            T.sync_barrier_gpu(W[0:2])  # two words

    body = kernel_body(lower_source(k))
    assert "tilescale::init_barrier_gpu1((&(W[3])), (uint)8);" in body
    assert "tilescale::arrive_barrier_gpu1((&(W[3])));" in body
    assert "tilescale::wait_barrier_gpu1((&(W[3])));" in body
    assert "tilescale::sync_barrier_gpu((&(W[0])));" in body


@needs_nvcc
def test_one_word_barrier_ptx(tmp_path):
    ptx = nvcc_ptx(lower_source(_upstream_barrier_kernel(1)), tmp_path)
    for instr in ("atom.relaxed.gpu.cas.b32", "atom.acq_rel.gpu.add.u32", "atom.release.gpu.add.u32",
                  "ld.acquire.gpu.b32", "bar.sync", "trap"):
        assert instr in ptx, instr
    assert "globaltimer" not in ptx
    ptx = nvcc_ptx(lower_source(_upstream_barrier_kernel(1)), tmp_path, extra=["-DTILESCALE_WAIT_TIMEOUT_MS=50"])
    assert "%globaltimer" in ptx
