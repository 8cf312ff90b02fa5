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


# ------------------------------------------------------------------------------ remote atomics
def _atomics_kernel():
    @T.prim_func
    def k(A: T.Tensor((256,), "float32"), H: T.Tensor((256,), "float16"), B: T.Tensor((256,), "bfloat16"),
          I: T.Tensor((8,), "int32"), U: T.Tensor((8,), "uint64"), D: T.Tensor((8,), "float64"),
          O: T.Tensor((8,), "float32"), M: T.Tensor((64, 64), "float32"), pe: T.int32):
        with T.Kernel(1, threads=128) as _:
            tx = T.get_thread_binding()
            f = T.alloc_fragment((64, 64), "float32")
            hl = T.alloc_local((2,), "float16")
            T.copy(M, f)
            hl[0] = H[0]
            hl[1] = H[1]
            T.atomic_add(A[tx], 1.5, dst_pe=pe)
            O[0] = T.atomic_add(A[1], 2.0, memory_order="acq_rel", return_prev=True, dst_pe=pe)
            T.atomic_add(H[tx], 1.0, dst_pe=pe)
            T.atomic_add(B[tx], 1.0, memory_order="release", dst_pe=pe)
            T.atomic_add(I[0], 1, memory_order="acquire", dst_pe=pe)
            T.atomic_add(U[0], 1, dst_pe=pe)
            T.atomic_add(D[0], 0.5, dst_pe=1)
            T.atomic_addx2(H[tx * 2], hl, dst_pe=pe)
            T.atomic_addx2(B[0:2], B[2:4], dst_pe=pe)
            T.atomic_add(M, f, dst_pe=pe)
            T.atomic_add(A[tx], 1.0)  # stock, no peer

    return k


def test_remote_atomics_codegen():
    body = kernel_body(lower_source(_atomics_kernel()))
    A_ = "tilescale::atomic_add_sys<tilescale::Sem::"
    for line in (
        f"{A_}RELAXED, tilescale::AType::F32>((&(A[((int)threadIdx.x)])), 0x1.8p+0f/*1.500000e+00*/, pe);",
        f"O[0] = {A_}ACQ_REL, tilescale::AType::F32>((&(A[1])), 0x1p+1f/*2.000000e+00*/, pe);",
        f"{A_}RELAXED, tilescale::AType::F16>((&(H[((int)threadIdx.x)])), half_t(0x1p+0f/*1.000000e+00*/), pe);",
        f"{A_}RELEASE, tilescale::AType::BF16>((&(B[((int)threadIdx.x)]))",
        f"{A_}ACQUIRE, tilescale::AType::S32>((&(I[0])), 1, pe);",
        f"{A_}RELAXED, tilescale::AType::U64>((&(U[0])), (uint64_t)1, pe);",
        f"{A_}RELAXED, tilescale::AType::F64>((&(D[0])), 0x1p-1/*5.000000e-01*/, 1);",
        "tilescale::atomic_addx2_sys<tilescale::Sem::RELAXED, tilescale::AType::F16X2>((&(H[(((int)threadIdx.x) * 2)])), (&(hl[0])), pe);",
        "tilescale::atomic_addx2_sys<tilescale::Sem::RELAXED, tilescale::AType::BF16X2>((&(B[0])), (&(B[2])), pe);",
        "tilescale::remap_ptr(M, pe)",
        "AtomicAdd((&(A[((int)threadIdx.x)])), 0x1p+0f/*1.000000e+00*/);",
    ):
        assert line in body, line
    assert "AtomicAddx4((&(((float*)" in body  # the tile form: stock vector atomics on the peer view


@needs_nvcc
def test_remote_atomics_ptx(tmp_path):
    ptx = nvcc_ptx(lower_source(_atomics_kernel()), tmp_path)
    for instr in ("atom.relaxed.sys.add.f32", "atom.acq_rel.sys.add.f32", "atom.relaxed.sys.add.noftz.f16",
                  "atom.release.sys.add.noftz.bf16", "atom.acquire.sys.add.u32", "atom.relaxed.sys.add.u64",
                  "atom.relaxed.sys.add.f64", "atom.relaxed.sys.add.noftz.f16x2", "atom.relaxed.sys.add.noftz.bf16x2",
                  "atom.add.v4.f32"):
        assert instr in ptx, instr


def _trace(body):
    @T.prim_func
    def k(A: T.Tensor((256,), "float32"), H: T.Tensor((256,), "float16"), I: T.Tensor((8,), "int8"),
          G: T.Tensor((8,), "int32")):
        with T.Kernel(1, threads=32) as _:
            s = T.alloc_shared((64,), "float32")
            body(A, H, I, G, s)

    return k


ATOMIC_REJECT = [
    (lambda A, H, I, G, s: T.atomic_add(I[0], 1, dst_pe=1), TypeError, "dst of"),
    (lambda A, H, I, G, s: T.atomic_add(s[0], 1.0, dst_pe=1), ValueError, "dst"),
    (lambda A, H, I, G, s: T.atomic_add(A[0], 1.0, memory_order="seq_cst", dst_pe=1), ValueError, "memory_order"),
    (lambda A, H, I, G, s: T.atomic_add(A[0], 1.0, dst_pe=-2), ValueError, "dst_pe"),
    (lambda A, H, I, G, s: T.atomic_add(A[0], 1.0, dst_pe=1.0), TypeError, "dst_pe"),
    (lambda A, H, I, G, s: T.atomic_add(A[0:64], s, return_prev=True, dst_pe=1), ValueError, "return_prev"),
    (lambda A, H, I, G, s: T.atomic_addx2(A[0:2], A[2:4], dst_pe=1), TypeError, "float16 or bfloat16"),
    (lambda A, H, I, G, s: T.atomic_addx2(H[1], H[4:6], dst_pe=1), ValueError, "even element"),
    (lambda A, H, I, G, s: T.atomic_addx2(H[0], A[4:6], dst_pe=1), TypeError, "dtypes differ"),
    (lambda A, H, I, G, s: T.atomic_addx2(H[0], H[4:6], return_prev=True, dst_pe=1), ValueError, "return_prev"),
]


@pytest.mark.parametrize("case", range(len(ATOMIC_REJECT)))
def test_remote_atomics_rejected_while_tracing(case):
    body, exc, word = ATOMIC_REJECT[case]
    with pytest.raises(exc, match=word):
        _trace(body)
