"""NVSHMEM-style device names (``T.get_pe``, ``T.putmem_nbi_block``, ``T.Amo``, ``T.CmpType``
...) over the heap's intrinsics: registration, argument checks, generated CUDA, and upstream
TileScale's NVSHMEM example kernels lowered verbatim for sm_90a (three compiled by the
toolkit)."""

from __future__ import annotations

import types

import pytest
import tilelang.language as T
from lang_helpers import TARGET, kernel_body, lower_source, needs_toolkit, nvcc_ptx
from upstream_nvshmem import COMMIT, PROGRAMS, factories, header

from tilescale_lang import _extension, nvshmem_names, signals
from tilescale_lang.nvshmem_enums import Amo, CmpType, cmp_name, sig_op_name

MEM = [f"{d}mem{n}_{s}" for s in ("block", "warp") for n in ("", "_nbi") for d in ("put", "get")]
SIG = [f"putmem_signal{n}_{s}" for s in ("block", "warp") for n in ("", "_nbi")]


# ------------------------------------------------------------------------------ registration
def test_every_name_is_on_tilelang_language():
    for name, obj in nvshmem_names.EXPORTS.items():
        assert getattr(T, name) is obj, name
    assert set(MEM + SIG) | {"get_pe", "get_pe_num", "Amo", "CmpType"} == set(nvshmem_names.EXPORTS)
    for name in MEM + SIG + ["get_pe", "get_pe_num"]:
        assert getattr(T, name).__doc__, name


def test_existing_names_unchanged():
    assert T.signal_op is signals.signal_op and T.signal_wait_until is signals.signal_wait_until
    assert T.fence is signals.fence and T.quiet is signals.quiet
    assert T.put_block.__module__ == "tilescale_lang.peer_copy"


def test_a_name_stock_already_has_stays_stock():
    fake = types.SimpleNamespace(get_pe="stock's", putmem_nbi_block="stock's too")
    kept = _extension.attach_intrinsics(fake)
    assert sorted(kept) == ["get_pe", "putmem_nbi_block"]
    assert fake.get_pe == "stock's" and fake.putmem_nbi_block == "stock's too"
    assert fake.get_pe_num is nvshmem_names.get_pe_num and fake.put_block is T.put_block


def test_enums_are_nvshmems():
    # nvshmem_constants.h: NVSHMEM_CMP_EQ..GE = 0..5 (GT 2, LE 3, LT 4), SIGNAL_SET 9, SIGNAL_ADD 10
    assert [CmpType.EQ, CmpType.NE, CmpType.GT, CmpType.LE, CmpType.LT, CmpType.GE] == list(range(6))
    assert (Amo.SIGNAL_SET, Amo.SIGNAL_ADD, Amo.AMO_SIGNAL_ADD) == (9, 10, 10)
    assert T.CmpType is CmpType and T.Amo is Amo
    assert [cmp_name(v) for v in range(6)] == ["eq", "ne", "gt", "le", "lt", "ge"]
    assert cmp_name(CmpType.GE) == "ge" and cmp_name("ge") == "ge"
    assert (sig_op_name(9), sig_op_name(Amo.SIGNAL_ADD), sig_op_name("set")) == ("set", "add", "set")


@pytest.mark.parametrize("bad", [6, -1, CmpType.SENTINEL])
def test_cmp_outside_nvshmems_six(bad):
    with pytest.raises(ValueError, match="cmp"):
        cmp_name(bad)


@pytest.mark.parametrize("bad", [Amo.AMO_ADD, 3, 11, 0])
def test_sig_op_outside_signal_ops(bad):
    with pytest.raises(ValueError, match="sig_op"):
        sig_op_name(bad)


# ------------------------------------------------------------------------------ argument checks
def trace(body):
    """Trace a kernel whose body calls ``body(A, B, s, G, F, r)``."""

    @T.prim_func
    def k(A: T.Tensor((256,), "float16"), B: T.Tensor((256,), "float16"), G: T.Tensor((8,), "uint64"),
          F: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=128) as _:
            s = T.alloc_shared((64,), "float16")
            r = T.alloc_local((1,), "int32")
            body(A, B, s, G, F, r)

    return k


def _mem_cases(name):
    fn = getattr(T, name)
    remote = "dest" if name.startswith("put") else "src"
    shared_remote = ((lambda A, B, s, G, F, r: fn(s, A, 64, 1)) if remote == "dest"
                     else (lambda A, B, s, G, F, r: fn(A, s, 64, 1)))
    return [
        (lambda A, B, s, G, F, r: fn(3, A, 64, 1), TypeError, "dest"),
        (lambda A, B, s, G, F, r: fn(B, "x", 64, 1), TypeError, "src"),
        (lambda A, B, s, G, F, r: fn(B, A, -2, 1), ValueError, "nelems"),
        (lambda A, B, s, G, F, r: fn(B, A, 2.5, 1), TypeError, "nelems"),
        (lambda A, B, s, G, F, r: fn(B, A, 513, 1), ValueError, "nelems"),  # 512 bytes held
        (lambda A, B, s, G, F, r: fn(B, A, 64, -2), ValueError, "pe"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, 1.5), TypeError, "pe"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, F[0]), TypeError, "pe"),
        (shared_remote, ValueError, remote),
    ]


def _signal_cases(name):
    fn = getattr(T, name)
    return [
        (lambda A, B, s, G, F, r: fn(B, A, 64, G[0], 1, Amo.AMO_ADD, 1), ValueError, "sig_op"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, G[0], 1, 3, 1), ValueError, "sig_op"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, G[0], 1, "xor", 1), ValueError, "sig_op"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, F[0], 1, 9, 1), TypeError, "sig_addr"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, G[0], 1.5, 9, 1), TypeError, "signal"),
        (lambda A, B, s, G, F, r: fn(s, A, 64, G[0], 1, 9, 1), ValueError, "dest"),
        (lambda A, B, s, G, F, r: fn(B, A, -1, G[0], 1, 9, 1), ValueError, "nelems"),
        (lambda A, B, s, G, F, r: fn(B, A, 64, G[0], 1, 10, -3), ValueError, "pe"),
    ]


CASES = [(name, *case) for name in MEM for case in _mem_cases(name)]
CASES += [(name, *case) for name in SIG for case in _signal_cases(name)]
CASES += [
    ("signal_wait_until", lambda A, B, s, G, F, r: T.signal_wait_until(G[0], 7, 1), ValueError, "cmp"),
    ("signal_wait_until", lambda A, B, s, G, F, r: T.signal_wait_until(G[0], CmpType.SENTINEL, 1), ValueError, "cmp"),
    ("signal_wait_until", lambda A, B, s, G, F, r: T.signal_wait_until(G[0], True, 1), TypeError, "cmp"),
    ("signal_op", lambda A, B, s, G, F, r: T.signal_op(G[0], 1, Amo.AMO_SWAP, 1), ValueError, "sig_op"),
    ("signal_op", lambda A, B, s, G, F, r: T.signal_op(G[0], 1, 8, 1), ValueError, "sig_op"),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rejected_while_tracing(case):
    _, body, exc, word = CASES[case]
    with pytest.raises(exc, match=word):
        trace(body)


# ------------------------------------------------------------------------------ generated CUDA
def body_of(call) -> str:
    return kernel_body(lower_source(trace(call)))


@pytest.mark.parametrize("name, helper", [
    ("putmem_block", "tilescale::put_block<4>((&(A[0])), (&(B[8])), (uint64_t)100, 1);"),
    ("putmem_nbi_block", "tilescale::put_block<4>((&(A[0])), (&(B[8])), (uint64_t)100, 1);"),
    ("getmem_block", "tilescale::get_block<4>((&(A[0])), (&(B[8])), (uint64_t)100, 1);"),
    ("getmem_nbi_block", "tilescale::get_block<4>((&(A[0])), (&(B[8])), (uint64_t)100, 1);"),
    ("putmem_warp", "tilescale::put_warp<4, false>((&(A[0])), (&(B[8])), (uint64_t)100, 1);"),
    ("getmem_nbi_warp", "tilescale::get_warp<4, false>((&(A[0])), (&(B[8])), (uint64_t)100, 1);"),
])
def test_mem_lowers_to_the_peer_copy_in_bytes_between_syncs(name, helper):
    """NVSHMEM's (dest, src, bytes, pe) becomes TileScale's (src, dst, bytes, pe), between
    two block (warp) synchronisations."""
    fn = getattr(T, name)
    body = body_of(lambda A, B, s, G, F, r: fn(T.address_of(B[8]), T.address_of(A[0]), 100, 1))
    assert helper in body
    sync = "__syncthreads();" if name.endswith("block") else "__syncwarp();"
    before, after = body.split(helper)
    assert sync in before and sync in after


def test_mem_run_time_pe_and_size():
    body = body_of(lambda A, B, s, G, F, r: T.putmem_nbi_block(B[r[0]], s, r[0] * 2, T.get_pe() ^ 1))
    assert "tilescale::put_block<4>((&(s[0])), (&(B[r[(int64_t)0]])), ((uint64_t)tilescale::checked_count((r[0] * 2), " in body
    assert "(tilescale::get_rank() ^ 1)" in body


@pytest.mark.parametrize("name, template", [
    ("putmem_signal_block", "4, false, false, true"),
    ("putmem_signal_nbi_block", "4, false, true, true"),
    ("putmem_signal_warp", "4, true, false, true"),
    ("putmem_signal_nbi_warp", "4, true, true, true"),
])
def test_putmem_signal_lowers_to_put_signal(name, template):
    fn = getattr(T, name)
    body = body_of(lambda A, B, s, G, F, r: fn(T.address_of(B[0]), T.address_of(A[0]), 64, T.address_of(G[2]), 5,
                                                T.Amo.SIGNAL_ADD, 1))
    call = f"tilescale::put_signal<{template}>((&(A[0])), (&(B[0])), (uint64_t)64, (&(G[2])), (uint64_t)5, 1);"
    assert call in body
    assert ("__syncthreads();" if "block" in name else "__syncwarp();") in body.split(call)[0]


@pytest.mark.parametrize("sig_op, add", [(9, "false"), (10, "true"), (Amo.SIGNAL_SET, "false"), ("add", "true")])
def test_signal_op_takes_nvshmems_ops(sig_op, add):
    body = body_of(lambda A, B, s, G, F, r: T.signal_op(G[1], 3, sig_op, 1))
    assert f"tilescale::signal_op<{add}>((&(G[1])), (uint64_t)3, 1);" in body


@pytest.mark.parametrize("cmp, relation", [(0, "EQ"), (CmpType.GE, "GE"), (CmpType.GT, "GT"), (3, "LE"), ("lt", "LT"),
                                           (T.CMP_NE, "NE")])
def test_signal_wait_until_takes_cmp_types(cmp, relation):
    body = body_of(lambda A, B, s, G, F, r: T.signal_wait_until(G[1], cmp, 7))
    assert f"tilescale::wait_until<tilescale::Cmp::{relation}, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>" in body


def test_get_pe_is_get_rank():
    body = body_of(lambda A, B, s, G, F, r: T.evaluate(T.call_extern("handle", "keep", T.get_pe(), T.get_pe_num())))
    assert "keep(tilescale::get_rank(), tilescale::get_num_ranks());" in body
    assert str(T.get_pe().dtype) == str(T.get_pe_num().dtype) == "int32"


# ------------------------------------------------------------------------------ upstream kernels
#: (program, factory, upstream-style arguments, expected helpers).  cannon and summa pass a
#: tensor element whose index is a block index times 2**15 elements to a peer intrinsic: with
#: ``T.address_of`` kept as written, stock StorageRewrite rejects them (test_operand_addresses).
UPSTREAM = [
    ("example_allgather", "allgather", (2, 64, 128), ["put_block<4>", "get_rank", "get_num_ranks"]),
    ("example_all_to_all", "all_to_all", (2, 8, 8, 3584, 128), ["put_block<4>", "fence()", "signal_op<false>",
                                                                "Cmp::EQ"]),
    ("example_allgather_gemm", "allgather_gemm", (2, 64, 64, 64, 64, 64, 64), ["put_signal<4, false, true, false>",
                                                                               "Cmp::EQ"]),
    ("example_pre_attn_all2all", "sequence_parallel_all_to_all", (2, 2, 16, 256, 64), ["put_block<4>",
                                                                                        "signal_op<true>"]),
    ("example_pre_attn_all2all_transpose", "sequence_parallel_all_to_all_transpose", (2, 2, 16, 256, 64),
     ["put_block<4>", "signal_op<true>", "Cmp::EQ"]),
    ("example_post_attn_all2all_transpose", "sequence_parallel_reverse_all_to_all_transpose", (2, 2, 16, 256, 64),
     ["put_block<4>", "signal_op<true>", "quiet()"]),
    ("example_simple_shift", "simple_shift", (128, 128, 128, 128), ["put_block<4>"]),
    ("example_overlapping_allgather", "internode_gather", (2, 1, 2, 128), ["put_block<4>"]),
    ("example_overlapping_allgather", "intranode_gather", (2, 2, 2, 128), ["put_block<4>", "get_num_ranks"]),
    ("example_cannon", "cannon", (2, 1024, 1024, 1024, 128, 256, 64), ["put_signal<4, false, true, true>"]),
    ("example_summa", "summa", (2, 1024, 1024, 1024, 128, 256, 64), ["put_signal<4, false, true, true>"]),
]
#: The pass configurations upstream's programs compile with.
PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}


def upstream_source(program: str, factory: str, args) -> str:
    from tilelang import tvm

    func = factories(program)[factory](*args)
    with tvm.transform.PassContext(config=PASS_CONFIGS):
        return lower_source(func)


def test_data_files_name_upstream_and_commit():
    for name in PROGRAMS:
        lines = header(name)
        assert lines[0] == f"# upstream: tile-ai/tilescale examples/distributed/{name}.py", name
        assert lines[1] == f"# commit: {COMMIT}", name


@pytest.mark.parametrize("program, factory, args, helpers", UPSTREAM)
def test_upstream_kernel_lowers_for_sm90a(program, factory, args, helpers):
    body = kernel_body(upstream_source(program, factory, args))
    for helper in helpers:
        assert f"tilescale::{helper}" in body, helper
    assert "nvshmem" not in body


@needs_toolkit
@pytest.mark.parametrize("program, factory, args, ptx_has", [
    ("example_allgather", "allgather", (2, 64, 128), ["bar.sync"]),
    ("example_allgather_gemm", "allgather_gemm", (2, 64, 64, 64, 64, 64, 64), ["st.release.sys", "ld.acquire.sys"]),
    ("example_post_attn_all2all_transpose", "sequence_parallel_reverse_all_to_all_transpose", (2, 2, 16, 256, 64),
     ["red.release.sys.add.u64", "fence.acq_rel.sys", "fence.sc.sys", "ld.acquire.sys"]),
])
def test_upstream_kernel_compiles(program, factory, args, ptx_has, tmp_path):
    ptx = nvcc_ptx(upstream_source(program, factory, args), tmp_path)
    assert f".target {TARGET['arch']}" in ptx
    for instruction in ptx_has:
        assert instruction in ptx, instruction


# ------------------------------------------------------------------------------ default heap
class _Kernel:
    execution_backend = "tvm_ffi"
    adapter = None


def test_launch_guard_binds_the_default_heap():
    """A kernel that reads the table and was never initialised refuses to launch -- unless the
    process has a default heap (pynvshmem's), which its first launch then binds."""
    import torch
    from lang_helpers import FakeAllocator
    from tilescale_core.interface import default_allocator, set_default_allocator

    from tilescale_lang import metadata

    calls = []
    k = _Kernel()
    k.torch_function = lambda *args: calls.append(args) or "launched"
    metadata.guard_launch(k, ["get_rank"])
    assert default_allocator() is None
    with pytest.raises(metadata.KernelNotInitializedError):
        k.torch_function(1)
    heap = FakeAllocator(torch.tensor([1, 2, 0x7F0000000000, 0x7F1000000000], dtype=torch.uint64), 1, 2)
    previous = set_default_allocator(heap)
    try:
        assert k.torch_function(2) == "launched" and calls == [(2,)]
        assert k._tilescale_state["pending"][0] == [1, 2, 0x7F0000000000, 0x7F1000000000]
        assert k.torch_function(3) == "launched"  # the guard is gone
    finally:
        set_default_allocator(previous)


def test_default_heap_argument_and_closed_heap():
    from tilescale_core.interface import default_allocator, set_default_allocator

    with pytest.raises(TypeError, match="allocator"):
        set_default_allocator(object())
    closed = types.SimpleNamespace(table=None, closed=True)
    previous = set_default_allocator(closed)
    try:
        assert default_allocator() is None
    finally:
        set_default_allocator(previous)
