"""Upstream TileScale compatibility on CPU: the one-word GPU barrier, remote atomics,
remote TMA (generated code, PTX, rejections)."""

from __future__ import annotations

import pytest
import tilelang.language as T
from lang_helpers import kernel_body, lower_source, needs_nvcc, nvcc_ptx


# ------------------------------------------------------------------------------ one-word barrier
def _upstream_barrier_kernel(words: int = 1):
    """Upstream's test_barrier_gpu kernel, as its users write it."""
    from gpu_upstream_kernels import upstream_barrier

    return upstream_barrier(64, 128, words)


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


# ------------------------------------------------------------------------------ remote TMA
def _tma_kernel(const_pe: int | None = None):
    """A TMA load from a peer, a TMA store to a peer and a TMA reduce-add into a peer."""

    @T.prim_func
    def k(A: T.Tensor((256, 256), "float16"), B: T.Tensor((256, 256), "float16"), C: T.Tensor((256, 256), "float32"),
          pe: T.int32):
        with T.Kernel(4, 4, threads=128) as (bx, by):
            s = T.alloc_shared((64, 64), "float16")
            sf = T.alloc_shared((64, 64), "float32")
            bar = T.alloc_barrier([1])
            p = pe if const_pe is None else const_pe
            T.tma_copy(A[bx * 64:(bx + 1) * 64, by * 64:(by + 1) * 64], s, barrier=bar[0], src_pe=p)
            if T.shuffle_elect(128):
                T.barrier_arrive(bar[0])
            T.mbarrier_wait_parity(bar[0], 0)
            T.tma_copy(s, B[bx * 64:(bx + 1) * 64, by * 64:(by + 1) * 64], dst_pe=p)
            T.tma_store_wait(0)
            for i, j in T.Parallel(64, 64):
                sf[i, j] = T.Cast("float32", s[i, j])
            T.fence_proxy_async()
            T.sync_threads()
            T.atomic_add(C[bx * 64:(bx + 1) * 64, by * 64:(by + 1) * 64], sf, use_tma=True, dst_pe=p)
            T.tma_store_wait(0)

    return k


def _lowered(func):
    import tilelang
    from tilelang import tvm

    with tvm.target.Target(TARGET):
        return tilelang.lower(func, target=TARGET)


TARGET = {"kind": "cuda", "arch": "sm_90a"}


def test_remote_tma_dispatches_over_one_descriptor_per_peer():
    art = _lowered(_tma_kernel())
    body = kernel_body(art.kernel_source)
    for k in range(8):
        assert f"tl::tma_load(tilescale_tma_peer{k}_A_desc, bar[0]" in body, k
        assert f"tl::tma_store(tilescale_tma_peer{k}_B_desc" in body, k
        assert f"tilescale_tma_peer{k}_C_desc" in body, k
        assert f"if (p == {k})" in body or k == 7
    assert "tl::tma_load(A_desc, bar[0]" in body  # p == -1 at run time: the local tensor
    assert body.count("tilescale::tma_bad_pe(p);") == 3  # PEs outside 0..7 or the group
    assert "if (p == -1) {" in body and "if (p < 0)" not in body  # -2 is a bad PE, not local
    assert "((0 <= p) && (p < 8)) && (p < tilescale::get_num_ranks())" in body
    host = art.host_mod.script()
    for name in "ABC":
        fill = host.index(f'T.call_packed("tilescale.tma_peer_addresses", {name}, tilescale_tma_peers_{name})')
        bind = host.index(f"tilescale_tma_peer3_{name} = T.reinterpret(\"handle\", tilescale_tma_peers_{name}_buf[3])")
        encode = host.index(f'T.call_packed("__tvm_tensormap_create_tiled", tilescale_tma_peer3_{name}_desc')
        assert fill < bind < encode  # addresses from the heap table, then the descriptor


def test_remote_tma_constant_pe_needs_one_descriptor():
    art = _lowered(_tma_kernel(const_pe=2))
    body = kernel_body(art.kernel_source)
    assert "tl::tma_load(tilescale_tma_peer2_A_desc" in body
    assert "peer1" not in body and "peer3" not in body and "A_desc," not in body.replace("peer2_A_desc", "")
    assert "if (2 < tilescale::get_num_ranks())" in body


@needs_nvcc
def test_remote_tma_ptx_and_debug_trap(tmp_path):
    src = _lowered(_tma_kernel()).kernel_source
    ptx = nvcc_ptx(src, tmp_path)
    assert "cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes" in ptx  # load
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx  # store
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx  # reduce
    traps = ptx.count("trap;")  # the missing-table trap is always there
    debug = nvcc_ptx(src, tmp_path, extra=["-DTILESCALE_DEBUG=1"])
    # a bad PE issues no operation ... or, under TILESCALE_DEBUG, traps with a message
    assert debug.count("trap;") > traps and debug.count("vprintf") > ptx.count("vprintf")
    # issue 39: TILESCALE_CHECK_PE=1 alone compiles the remote TMA PE check in too
    # (docs/reliability.md: "run-time PEs are checked ... with TILESCALE_CHECK_PE=1")
    check_pe = nvcc_ptx(src, tmp_path, extra=["-DTILESCALE_CHECK_PE=1"])
    assert "tma_bad_pe" in check_pe and "tma_bad_pe" not in ptx
    assert check_pe.count("trap;") > traps and check_pe.count("vprintf") > ptx.count("vprintf")


TMA_REJECT = [
    (lambda A, s, bar: T.tma_copy(A[0:64, 0:64], s, barrier=bar[0], src_pe=8), ValueError, "PEs 0..7"),
    (lambda A, s, bar: T.tma_copy(s, A[0:64, 0:64], dst_pe=9), ValueError, "PEs 0..7"),
    (lambda A, s, bar: T.tma_copy(A[0:64, 0:64], s, barrier=bar[0], src_pe=1, dst_pe=0), ValueError, "both"),
    (lambda A, s, bar: T.tma_copy(s, A[0:64, 0:64], src_pe=1), ValueError, "src"),
    (lambda A, s, bar: T.tma_copy(A[0:64, 0:64], s, barrier=bar[0], dst_pe=1), ValueError, "dst"),
    (lambda A, s, bar: T.tma_copy(A[0:64, 0:64], s, barrier=bar[0], src_pe=-3), ValueError, "src_pe"),
    (lambda A, s, bar: T.atomic_add(A[0:64, 0:64], s, use_tma=True, dst_pe=8), ValueError, "PEs 0..7"),
]


@pytest.mark.parametrize("case", range(len(TMA_REJECT)))
def test_remote_tma_rejected_while_tracing(case):
    body, exc, word = TMA_REJECT[case]
    with pytest.raises(exc, match=word):
        @T.prim_func
        def k(A: T.Tensor((256, 256), "float16")):
            with T.Kernel(1, threads=128) as _:
                s = T.alloc_shared((64, 64), "float16")
                bar = T.alloc_barrier([1])
                body(A, s, bar)


class _Heap:
    def __init__(self, table, size):
        import torch

        self.table = torch.tensor(table, dtype=torch.uint64)
        self.size = size
        self.closed = False


def test_peer_addresses_from_the_registered_heap():
    import ctypes

    from tilescale_lang import remote_tma

    bases = [0x7F0000000000, 0x7F1000000000, 0x7F2000000000]
    heap = _Heap([1, 3, *bases], 1 << 30)
    remote_tma.register_heap(heap, [1, 3, *bases])
    ptr = bases[1] + 0x1234 * 16
    got = remote_tma.peer_addresses(ptr)
    assert got[:3] == [b + 0x1234 * 16 for b in bases] and got[3:] == [ptr] * 5
    slots = (ctypes.c_int64 * 8)()
    remote_tma._fill_addresses(ctypes.c_void_p(ptr), ctypes.c_void_p(ctypes.addressof(slots)))
    assert list(slots) == got
    with pytest.raises(RuntimeError, match="not in a symmetric heap registered by kernel.initialize"):
        remote_tma.peer_addresses(bases[1] + (1 << 30))  # one past the heap
    heap.closed = True
    with pytest.raises(RuntimeError, match="kernel.initialize"):
        remote_tma.peer_addresses(ptr)  # a closed allocator's heap is forgotten


def test_host_binding_runs_through_the_c_host_codegen(tmp_path):
    """The statements the pass adds, compiled by TVM's C host codegen and run on the CPU:
    the peer pointers read back equal the heap-table addresses."""
    import torch
    import tvm
    from tvm import ir, tirx

    from tilescale_core._dlpack import byte_view
    from tilescale_lang import remote_tma
    from tilescale_lang.pipeline_hooks import _peer_bindings

    bases = [0x100000, 0x200000, 0x300000, 0x400000]
    heap = _Heap([2, 4, *bases], 1 << 16)  # the registry keeps a weak reference only
    remote_tma.register_heap(heap, [2, 4, *bases])
    a_handle = tirx.Var("A_handle", "handle")
    a = tirx.decl_buffer((16,), "float32", name="A")
    out_handle = tirx.Var("out_handle", "handle")
    out = tirx.decl_buffer((8,), "int64", name="out")
    peers = [tirx.Var(remote_tma.peer_var_name(k, "A"), ir.PointerType(ir.PrimType("float32"), "global")) for k in range(8)]
    body = tirx.SeqStmt([tirx.BufferStore(out, tirx.reinterpret("int64", v), [k]) for k, v in enumerate(peers)])
    func = tirx.PrimFunc([a_handle, out_handle], body, buffer_map={a_handle: a, out_handle: out})
    func = _peer_bindings(func).with_attr("global_symbol", "bind_peers")
    lib = tvm.compile(tvm.IRModule({"bind_peers": func}), target="c")
    lib.export_library(str(tmp_path / "bind.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "bind.so"))
    ptr = bases[2] + 0x40
    res = torch.zeros(8, dtype=torch.int64)
    fake_a = byte_view(ptr, 64, torch.device("cpu")).view(torch.float32)  # never dereferenced
    lib["bind_peers"](fake_a, res)
    assert res.tolist() == [b + 0x40 for b in bases] + [ptr] * 4
