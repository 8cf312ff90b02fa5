"""Remote 16-byte vector stores: lowered to one ``st.global.v4.b32`` (tilescale_lang.remote_stores)."""

from __future__ import annotations

import re

import tilelang.language as T
from lang_helpers import kernel_body, lower_source, needs_toolkit, nvcc_ptx

from tilescale_lang import remote_stores


def reduce_and_push(dtype: str = "float16", acc: str = "float32", lanes: int = 8):
    """Every thread sums two rows of ``A`` in ``acc`` into a register fragment (filled piece
    by piece, as a reduction's result is), then stores it to ranks 0 and 1 (remote, 16 bytes),
    to ``B`` locally, and its first half to rank 1 (remote, 8 bytes)."""

    peers = [0, 1]  # unrolled at trace time

    @T.prim_func
    def k(A: T.Tensor((2, 4096, lanes), dtype), B: T.Tensor((4096, lanes), dtype), C: T.Tensor((4096, lanes), dtype)):
        with T.Kernel(8, threads=512) as bx:
            tx = T.get_thread_binding()
            v = T.alloc_local((2, lanes), dtype)
            r = T.alloc_local((lanes,), dtype)
            row = bx * 512 + tx
            T.copy(A[0, row, 0:lanes], v[0, 0:lanes], src_pe=0)
            T.copy(A[1, row, 0:lanes], v[1, 0:lanes], src_pe=1)
            for i in T.vectorized(lanes):
                r[i] = T.Cast(dtype, T.Cast(acc, v[0, i]) + T.Cast(acc, v[1, i]))
            for p in peers:
                T.copy(r[0:lanes], B[row, 0:lanes], dst_pe=p)
            for i in T.vectorized(lanes):
                C[row, i] = r[i]
            T.copy(r[0:lanes // 2], C[row, 0:lanes // 2], dst_pe=1)

    return k


def test_remote_16_byte_stores_become_one_vector_store_each():
    body = kernel_body(lower_source(reduce_and_push()))
    stores = re.findall(r"tilescale::store_vec16\(\(&\(\(\(half_t\*\)(\w+)\)\[", body)
    assert len(stores) == 2, body  # one per peer
    assert "*(uint4*)(res" not in body and "= *(uint4*)(r + 0);" in body  # the local store is stock
    assert re.search(r"\*\(uint2\*\)\(\(\(half_t\*\)\w+\) \+ .*\) = \*\(uint2\*\)\(r \+ 0\);", body)  # 8 bytes: stock
    assert body.count("tilescale::remap_ptr(B,") == 2 and body.count("tilescale::remap_ptr(C, 1)") == 1


def test_float32_fragments_are_lowered_too():
    body = kernel_body(lower_source(reduce_and_push("float32", "float32", 4)))
    assert len(re.findall(r"tilescale::store_vec16\(\(&\(\(\(float\*\)\w+\)\[.*\)\), \*\(float4\*\)\(r \+ 0\)\);", body)) == 2


def test_kernels_without_remote_views_are_returned_unchanged():
    @T.prim_func
    def k(A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=64) as _:
            tx = T.get_thread_binding()
            B[tx] = A[tx] + T.Cast("float32", T.get_rank())

    assert remote_stores.lower_remote_vector_stores(k) is k
    assert "store_vec16" not in lower_source(k)


@needs_toolkit
def test_ptx_has_vector_stores_and_no_split_words(tmp_path):
    """One ``st.global.v4.b32`` per row and peer, and no 4-byte stores (nvcc may split stock
    TileLang's plain 16-byte assignment through a remapped pointer into four ``st.u32``: the
    all-reduce's two-shot kernel did; tilescale-examples' reduction tests check that kernel)."""
    ptx = nvcc_ptx(lower_source(reduce_and_push()), tmp_path)
    assert len(re.findall(r"\bst\.global\.v4\.b32\b", ptx)) == 2
    assert not re.findall(r"\bst(?:\.global)?\.(?:u32|b32|f32)\b", ptx)
