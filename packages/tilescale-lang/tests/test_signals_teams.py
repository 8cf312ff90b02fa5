"""Triton-distributed parity on CPU: put-with-signal, nbi puts/gets with quiet/fence,
compare-and-swap, signal_op / signal_wait_until, teams and team collectives -- the generated
helper calls, the PTX each promises, and the rejections while tracing."""

from __future__ import annotations

import re

import pytest
import tilelang.language as T
from lang_helpers import kernel_body, lower_source, needs_nvcc, nvcc_ptx

from tilescale_lang import team as TM

S = "tilescale::Scope::"
M = "tilescale::Sem::"


def build(body, sig="uint64"):
    """A kernel with data A/B (float32), signal buffer Sg (``sig``), uint32 flags F, int64 L,
    a team tensor, an output O and a run-time pe; ``body(A, B, Sg, F, L, Team, O, pe, s)``."""

    @T.prim_func
    def k(A: T.Tensor((1024,), "float32"), B: T.Tensor((4096,), "float32"), Sg: T.Tensor((8,), sig),
          F: T.Tensor((8,), "uint32"), L: T.Tensor((8,), "int64"), Team: T.Tensor(TM.TEAM_SHAPE, "int32"),
          O: T.Tensor((8,), "int64"), pe: T.int32):
        with T.Kernel(1, threads=128) as _:
            s = T.alloc_shared((64,), "float32")
            _g = T.alloc_local((1,), sig)  # noqa: F841 (keeps ``sig`` in the closure for the annotations)
            body(A, B, Sg, F, L, Team, O, pe, s)

    return k


def body_of(body, **kw) -> str:
    return kernel_body(lower_source(build(body, **kw)))


# ------------------------------------------------------------------------------ codegen
CODEGEN = [
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_block(A, B, 1024, Sg[1], 7, dst_pe=pe),
     "tilescale::put_signal<4, false, false, false>((&(A[0])), (&(B[0])), (uint64_t)4096, (&(Sg[1])), (uint64_t)7, pe);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_warp(A[32:64], B[64], 32, Sg[2], 1, "add", 1),
     "tilescale::put_signal<4, true, false, true>((&(A[32])), (&(B[64])), (uint64_t)128, (&(Sg[2])), (uint64_t)1, 1);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_nbi_block(A, B, pe, F[0], pe, sig_op=T.SIGNAL_ADD),
     "tilescale::put_signal<4, false, true, true>((&(A[0])), (&(B[0])), "
     "(((uint64_t)tilescale::checked_count(pe, \"put_signal_nbi_block size\")) * (uint64_t)4), (&(F[0])), ((uint)pe), -1);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_nbi_warp(A, B, 8, Sg[0], 2, T.SIGNAL_SET, dst_pe=-1),
     "tilescale::put_signal<4, true, true, false>((&(A[0])), (&(B[0])), (uint64_t)32, (&(Sg[0])), (uint64_t)2, -1);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_nbi_block(A, B, 16, pe),
     "tilescale::put_block<4>((&(A[0])), (&(B[0])), (uint64_t)64, pe);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.get_nbi_warp(A, B, 16, 2),
     "tilescale::get_warp<4, false>((&(A[0])), (&(B[0])), (uint64_t)64, 2);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.quiet(), "tilescale::quiet();"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.fence(), "tilescale::fence();"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_op(Sg[3], 9, "set", pe),
     "tilescale::signal_op<false>((&(Sg[3])), (uint64_t)9, pe);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_op(F[3], 1, sig_op="add"),
     "tilescale::signal_op<true>((&(F[3])), (uint)1, -1);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.evaluate(T.signal_wait_until(Sg[1], T.CMP_GE, 5)),
     f"tilescale::wait_until<tilescale::Cmp::GE, {S}SYS, {M}ACQUIRE>((&(Sg[1])), (uint64_t)5);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.evaluate(T.signal_wait_until(L[0], "lt", -1)),
     f"tilescale::wait_until<tilescale::Cmp::LT, {S}SYS, {M}ACQUIRE>((&(L[0])), (int64_t)-1);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.evaluate(T.atomic_cas(F[1], 0, 1, scope="sys", sem="acquire", pe=pe)),
     f"tilescale::atomic_cas<{S}SYS, {M}ACQUIRE>((&(F[1])), (uint)0, (uint)1, pe)"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.evaluate(T.atomic_cas(L[2], -1, 3)),
     f"tilescale::atomic_cas<{S}GPU, {M}RELAXED>((&(L[2])), (int64_t)-1, (int64_t)3, -1)"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.evaluate(T.team_translate_pe(Tm, pe + 1)),
     "tilescale::team_translate_pe((&(Team[0])), (pe + 1))"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.team_barrier(Tm), "tilescale::barrier_team((&(Team[0])));"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.broadcast_block(Tm, B, A, 1024, pe),
     "tilescale::broadcast_block((&(Team[0])), (&(B[0])), (&(A[0])), (uint64_t)4096, pe);"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.fcollect_block(Tm, B[0:2048], A, 512),
     "tilescale::fcollect_block((&(Team[0])), (&(B[0])), (&(A[0])), (uint64_t)2048);"),
]


@pytest.mark.parametrize("case", range(len(CODEGEN)))
def test_codegen(case):
    body, expected = CODEGEN[case]
    assert expected in body_of(body)


def test_team_queries_are_int32():
    @T.prim_func
    def k(Team: T.Tensor(TM.TEAM_SHAPE, "int32"), O: T.Tensor((8,), "int64")):
        with T.Kernel(1, threads=32) as _:
            O[0] = T.team_rank(Team)
            O[1] = T.team_num_ranks(Team)
            O[2] = T.team_translate_pe(Team, T.team_rank(Team))

    text = kernel_body(lower_source(k))
    assert "O[0] = ((int64_t)tilescale::team_rank((&(Team[0]))));" in text
    assert "O[1] = ((int64_t)tilescale::team_num_ranks((&(Team[0]))));" in text
    assert "tilescale::team_translate_pe((&(Team[0])), tilescale::team_rank((&(Team[0]))))" in text
    assert TM.TEAM_SHAPE == (TM.TEAM_WORDS,)


# ------------------------------------------------------------------------------ PTX
def _order(ptx: str, *patterns) -> list[int]:
    """Position of the first match of each pattern in ``ptx`` (asserting every one is there)."""
    pos = []
    for p in patterns:
        m = re.search(p, ptx)
        assert m, (p, ptx[-3000:])
        pos.append(m.start())
    return pos


@needs_nvcc
@pytest.mark.parametrize("scope, nbi, add, sig", [
    ("block", False, False, "uint64"), ("block", True, True, "uint64"),
    ("warp", False, True, "uint32"), ("warp", True, False, "int32"),
])
def test_put_signal_ptx_orders_data_before_a_release(tmp_path, scope, nbi, add, sig):
    """The copy's stores, then the block/warp barrier, then the release of the signal."""
    fn = getattr(T, f"put_signal{'_nbi' if nbi else ''}_{scope}")
    op = "add" if add else "set"

    @T.prim_func
    def k(A: T.Tensor((1024,), "float32"), B: T.Tensor((1024,), "float32"), Sg: T.Tensor((8,), sig), pe: T.int32):
        with T.Kernel(1, threads=128) as _:
            _g = T.alloc_local((1,), sig)  # noqa: F841 (keeps ``sig`` in the closure)
            fn(A, B, 1024, Sg[1], 3, op, pe)

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    bits = 64 if sig.endswith("64") else 32
    release = rf"red\.release\.sys\.add\.u{bits}" if add else rf"st\.release\.sys\.b{bits}"
    sync = r"bar\.sync" if scope == "block" else r"bar\.warp\.sync"
    store, barrier, signal = _order(ptx, r"st(\.global)?\.v4", sync, release)
    assert store < barrier < signal
    # blocking forms synchronise again after the signal; nbi forms return at once
    assert (re.search(sync, ptx[signal:]) is not None) == (not nbi)
    assert "ld.const.u64" in ptx  # the peer address comes from the metadata table


@needs_nvcc
def test_signal_cas_quiet_fence_ptx(tmp_path):
    @T.prim_func
    def k(Sg: T.Tensor((8,), "uint64"), F: T.Tensor((8,), "uint32"), L: T.Tensor((8,), "int64"),
          O: T.Tensor((8,), "int64"), pe: T.int32):
        with T.Kernel(1, threads=32) as _:
            if T.get_thread_binding() == 0:
                T.signal_op(Sg[0], 1, "set", pe)
                T.signal_op(Sg[1], 2, "add", pe)
                T.signal_op(F[0], 3, "set")
                T.signal_op(F[1], 4, "add")
                O[0] = T.signal_wait_until(Sg[2], "eq", 1)
                O[1] = T.atomic_cas(F[2], 0, 1, scope="sys", sem="acquire", pe=pe)
                O[2] = T.atomic_cas(F[3], 1, 0, scope="gpu", sem="release")
                O[3] = T.atomic_cas(L[0], 0, 5, scope="cta", sem="relaxed")
                O[4] = T.atomic_cas(L[1], 0, 5, scope="sys", sem="acq_rel", pe=pe)
                T.quiet()
                T.fence()

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    for instr in (
        "st.release.sys.b64", "red.release.sys.add.u64", "st.release.sys.b32", "red.release.sys.add.u32",
        "ld.acquire.sys.b64", "atom.acquire.sys.cas.b32", "atom.release.gpu.cas.b32",
        "atom.relaxed.cta.cas.b64", "atom.acq_rel.sys.cas.b64", "fence.sc.sys", "fence.acq_rel.sys",
    ):
        assert instr in ptx, instr


def _team_kernel():
    @T.prim_func
    def k(Team: T.Tensor(TM.TEAM_SHAPE, "int32"), A: T.Tensor((1024,), "float32"), B: T.Tensor((4096,), "float32")):
        with T.Kernel(1, threads=128) as _:
            T.team_barrier(Team)
            T.broadcast_block(Team, B, A, 1024, 0)
            T.fcollect_block(Team, B, A, 256)

    return k


@needs_nvcc
def test_team_operations_ptx(tmp_path):
    ptx = nvcc_ptx(lower_source(_team_kernel()), tmp_path)
    for instr in ("atom.release.sys.add.u32", "ld.acquire.sys.b32", "fence.acq_rel.sys", "bar.sync"):
        assert instr in ptx, instr
    assert "globaltimer" not in ptx
    ptx = nvcc_ptx(lower_source(_team_kernel()), tmp_path, extra=["-DTILESCALE_WAIT_TIMEOUT_MS=50"])
    assert "%globaltimer" in ptx and "trap" in ptx  # the team barrier's polls honour the timeout


# ------------------------------------------------------------------------------ rejections
REJECT = [
    # compare-and-swap: integers of 32/64 bits only, PTX semantics and scopes
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(A[0], 0, 1), TypeError, "32- or 64-bit integer ptr"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(s[0], 0, 1), TypeError, "float32"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(F[0], 0, 1, sem="weak"), ValueError, "sem"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(F[0], 0, 1, sem="volatile"), ValueError, "sem"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(F[0], 0, 1, scope="cluster"), ValueError, "scope"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(F[0], 0, 1.5), TypeError, "value"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(F[0], 0, 1, pe=-3), ValueError, "pe"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.atomic_cas(3, 0, 1), TypeError, "ptr"),
    # signals: set/add only, integer signals in global memory
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_op(Sg[0], 1, "xor"), ValueError, "sig_op"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_op(Sg[0], 1, 1.5), TypeError, "sig_op"),  # 9 / 10: NVSHMEM's set / add
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_block(A, B, 4, Sg[0], 1, "max", pe), ValueError, "sig_op"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_warp(A, B, 4, A[0], 1), TypeError, "sig_addr"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.put_signal_block(A, s, 4, Sg[0], 1, dst_pe=1), ValueError, "dst"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_op(A[0], 1), TypeError, "sig_addr"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_op(Sg[0], 1.5), TypeError, "signal"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_wait_until(Sg[0], "approx", 1), ValueError, "cmp"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.signal_wait_until(Sg[0], "==", 1), ValueError, "cmp"),
    # teams
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.team_rank(F), TypeError, "team"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.team_barrier(O), TypeError, "team"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.team_num_ranks(Tm[TM.TEAM_WORDS - 2]), ValueError, "team"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.team_translate_pe(Tm, 1.5), TypeError, "team_pe"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.broadcast_block(Tm, s, A, 16, 0), ValueError, "dst"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.fcollect_block(Tm, B, L, 16), TypeError, "element sizes"),
    (lambda A, B, Sg, F, L, Tm, O, pe, s: T.fcollect_block(Tm, B, A, -1), ValueError, "n"),
]


@pytest.mark.parametrize("case", range(len(REJECT)))
def test_rejected_while_tracing(case):
    body, exc, word = REJECT[case]
    with pytest.raises(exc, match=word):
        build(body)


# ------------------------------------------------------------------------------ team layout (host)
@pytest.mark.parametrize("ranks, world, layout", [
    ([0, 1, 2, 3], 4, (0, 1, 4)), (range(1, 8, 2), 8, (1, 2, 4)), ([5], 8, (5, 1, 1)), ((2, 4, 6), 7, (2, 2, 3)),
])
def test_team_layout(ranks, world, layout):
    lay = TM.team_layout(ranks, world)
    assert (lay.start, lay.stride, lay.size) == layout
    assert lay.ranks == list(ranks)
    for i, r in enumerate(ranks):
        assert lay.team_rank(r) == i and lay.translate(i) == r
    outsiders = [r for r in range(world) if r not in list(ranks)]
    assert all(lay.team_rank(r) == -1 for r in outsiders)
    assert lay.translate(-1) == lay.translate(lay.size) == -1


@pytest.mark.parametrize("ranks, world, exc, word", [
    ([0, 4], 4, ValueError, "not a subset"),
    ([-1, 0], 4, ValueError, "not a subset"),
    ([], 4, ValueError, "at least one"),
    ([0, 1, 3], 4, ValueError, "evenly strided"),
    ([2, 1], 4, ValueError, "increasing"),
    ([1, 1], 4, ValueError, "repeat"),
    ([0, 1.0], 4, TypeError, "integers"),
    ([0, True], 4, TypeError, "not bools"),  # True was taken as rank 1
    ([False, 1], 4, TypeError, "not bools"),
])
def test_team_layout_rejects(ranks, world, exc, word):
    with pytest.raises(exc, match=word):
        TM.team_layout(ranks, world)


def test_create_team_checks_before_allocating():
    class Alloc:
        num_ranks = 4
        local_rank = 0

    with pytest.raises(ValueError, match="not a subset"):
        TM.create_team([2, 5], Alloc())
    with pytest.raises(TypeError, match="allocator"):
        TM.create_team([0], None)


def test_exported_on_T():
    for name in ("put_signal_block put_signal_warp put_signal_nbi_block put_signal_nbi_warp signal_op "
                 "signal_wait_until quiet fence put_nbi_block put_nbi_warp get_nbi_block get_nbi_warp atomic_cas "
                 "team_rank team_num_ranks team_translate_pe team_barrier broadcast_block fcollect_block").split():
        assert getattr(T, name).__doc__, name
    assert (T.SIGNAL_SET, T.SIGNAL_ADD) == ("set", "add")
    assert (T.CMP_EQ, T.CMP_NE, T.CMP_GT, T.CMP_GE, T.CMP_LT, T.CMP_LE) == ("eq", "ne", "gt", "ge", "lt", "le")


# ------------------------------------------------------------------------------ coherent reads
def _consumer():
    @T.prim_func
    def consumer(D: T.Tensor((1024,), "uint32"), Sg: T.Tensor((4,), "uint64"), O: T.Tensor((1024,), "uint32")):
        with T.Kernel(1, threads=128) as _:
            tx = T.get_thread_binding()
            if tx == 0:
                T.signal_wait_until(Sg[0], "ge", 1)
            T.sync_threads()
            for j in T.serial(8):
                O[j * 128 + tx] = D[j * 128 + tx]

    return consumer


def _stock_reader():
    @T.prim_func
    def reader(D: T.Tensor((1024,), "uint32"), O: T.Tensor((1024,), "uint32")):
        with T.Kernel(1, threads=128) as _:
            tx = T.get_thread_binding()
            for j in T.serial(8):
                O[j * 128 + tx] = D[j * 128 + tx]

    return reader


def test_consumer_parameters_are_not_read_only():
    """A buffer a TileScale kernel only reads may be written by a peer while it runs: it is
    neither ``const`` nor ``__restrict__`` (nvcc would read it through ld.global.nc)."""
    src = lower_source(_consumer())
    sig = src[src.index("consumer_kernel("):src.index(")", src.index("consumer_kernel("))]
    assert "const" not in sig and "__restrict__" not in sig, sig
    stock = lower_source(_stock_reader())
    assert "const uint* __restrict__ D" in stock  # stock kernels are untouched


@needs_nvcc
def test_consumer_reads_are_coherent_ptx(tmp_path):
    ptx = nvcc_ptx(lower_source(_consumer()), tmp_path)
    assert "ld.acquire.sys.b64" in ptx
    assert "ld.global.nc" not in ptx
