"""Multimem operations on CPU: generated helper calls (tilelang.lower), the PTX nvcc makes
of them (sm_90a), lowering-time rejections, and the CUDA 13.1 gate of multimem_tma_store.
No multicast object is created anywhere: these are codegen/compile proofs only."""

from __future__ import annotations


import pytest
import tilelang
import tilelang.language as T
from lang_helpers import TOOLKIT, kernel_body, lower_source, needs_nvcc, needs_toolkit, nvcc_ptx

from tilescale_lang.multimem import MultimemReduceOp

OP = "tilescale::MMOp::"
TY = "tilescale::MMType::"


def build(body, dtype="float32", local="fragment"):
    """A kernel with a (64, 64) multicast tensor MC, a global tensor L of ``dtype``, flags
    F (uint32) / G (uint64) / S (int32) / X (float32), and a local buffer ``l``."""

    @T.prim_func
    def k(MC: T.Tensor((64, 64), dtype), L: T.Tensor((64, 64), dtype), F: T.Tensor((8,), "uint32"),
          G: T.Tensor((8,), "uint64"), S: T.Tensor((8,), "int32"), X: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=128) as _:
            if local == "fragment":
                l = T.alloc_fragment((64, 64), dtype)
            elif local == "shared":
                l = T.alloc_shared((64, 64), dtype)
            else:
                l = T.alloc_local((2, 4), dtype)
            body(MC, L, l, F, G, S, X)

    return k


def body_of(body, **kw) -> str:
    return kernel_body(lower_source(build(body, **kw)))


# ------------------------------------------------------------------------------ codegen
ELEMENTWISE = [
    # (dtype, local, body, expected fragment)
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l),
     f"l[i] = tilescale::multimem_ld_reduce<{OP}ADD, {TY}F32>((&(MC[((i * 128) + ((int)threadIdx.x))])));"),
    ("float64", "shared", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l, MultimemReduceOp.ADD),
     f"tilescale::multimem_ld_reduce<{OP}ADD, {TY}F64>"),
    ("uint32", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l, T.MultimemReduceOp.MIN),
     f"tilescale::multimem_ld_reduce<{OP}MIN, {TY}U32>"),
    ("int64", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l, "max"),
     f"tilescale::multimem_ld_reduce<{OP}MAX, {TY}S64>"),
    ("int64", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l),
     f"tilescale::multimem_ld_reduce<{OP}ADD, {TY}U64>"),
    ("float16", "shared", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l),
     f"tilescale::multimem_ld_reduce_x2<{OP}ADD, {TY}F16X2>((&(MC[((i * 256) + (((int)threadIdx.x) * 2))])), (&(l[((i * 256) + (((int)threadIdx.x) * 2))])));"),
    ("bfloat16", "shared", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, L, "min"),
     f"tilescale::multimem_ld_reduce_x2<{OP}MIN, {TY}BF16X2>"),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_st(l, MC),
     "tilescale::multimem_st((&(MC[((i * 128) + ((int)threadIdx.x))])), l[i]);"),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_st(L[0:16, 0:64], MC[16:32, 0:64]),
     "tilescale::multimem_st((&(MC[(((i * 128) + ((int)threadIdx.x)) + 1024)])), L[((i * 128) + ((int)threadIdx.x))]);"),
    ("bfloat16", "shared", lambda MC, L, l, *f: T.multimem_st(l[0:8, 32:64], MC[8:16, 0:32]),
     "tilescale::multimem_st_x2("),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_red(l, MC),
     f"tilescale::multimem_red<{OP}ADD, {TY}F32>((&(MC[((i * 128) + ((int)threadIdx.x))])), l[i]);"),
    ("int32", "fragment", lambda MC, L, l, *f: T.multimem_red(l, MC, "max"),
     f"tilescale::multimem_red<{OP}MAX, {TY}S32>"),
    ("uint64", "fragment", lambda MC, L, l, *f: T.multimem_red(l, MC, MultimemReduceOp.MIN),
     f"tilescale::multimem_red<{OP}MIN, {TY}U64>"),
    ("float16", "shared", lambda MC, L, l, *f: T.multimem_red(l, MC),
     f"tilescale::multimem_red_x2<{OP}ADD, {TY}F16X2>"),
    # per-thread local operand: every thread runs the region serially
    ("float32", "local", lambda MC, L, l, *f: T.multimem_ld_reduce(MC[4:6, 8:12], l),
     f"l[((v * 4) + v_1)] = tilescale::multimem_ld_reduce<{OP}ADD, {TY}F32>((&(MC[(((v * 64) + v_1) + 264)])));"),
]


@pytest.mark.parametrize("case", range(len(ELEMENTWISE)))
def test_elementwise_codegen(case):
    dtype, local, body, expected = ELEMENTWISE[case]
    assert expected in body_of(body, dtype=dtype, local=local)


def test_parallel_loop_spreads_region_over_threads():
    body = body_of(lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l))
    # 64*64 elements over 128 threads: 32 per thread, one helper call each
    assert "for (int i = 0; i < 32; ++i)" in body
    assert body.count("multimem_ld_reduce<") == 1


def test_signals_codegen():
    @T.prim_func
    def k(F: T.Tensor((8,), "uint32"), G: T.Tensor((8,), "uint64"), S: T.Tensor((8,), "int32")):
        with T.Kernel(1, threads=128) as _:
            T.multimem_signal(F[1], 7)
            T.multimem_signal(T.address_of(G[2]), 1)
            T.multimem_signal_add(F[3], 1)
            T.multimem_signal_add(S[4], -1)
            T.multimem_signal_add(G[5], 2)

    src = kernel_body(lower_source(k))
    assert "tilescale::multimem_signal((&(F[1])), (uint)7);" in src
    assert "tilescale::multimem_signal((&(G[2])), (uint64_t)1);" in src
    assert f"tilescale::multimem_signal_add<{TY}U32>((&(F[3])), (uint)1);" in src
    assert f"tilescale::multimem_signal_add<{TY}S32>((&(S[4])), -1);" in src
    assert f"tilescale::multimem_signal_add<{TY}U64>((&(G[5])), (uint64_t)2);" in src


def tma_kernel(dtype="float16", reduce_op=None, rows=16):
    @T.prim_func
    def k(MC: T.Tensor((64, 64), dtype)):
        with T.Kernel(1, threads=128) as _:
            s = T.alloc_shared((64, 64), dtype)
            T.fence_proxy_async()
            T.sync_threads()
            T.multimem_tma_store(s[0:rows, :], MC[16:16 + rows, :], reduce_op=reduce_op)
            T.tma_store_arrive()
            T.tma_store_wait(0, False)

    return k


@pytest.mark.parametrize(
    "dtype,reduce_op,tmpl,nbytes",
    [
        ("float16", None, f"{OP}NONE, {TY}B32", 2048),
        ("float16", MultimemReduceOp.NONE, f"{OP}NONE, {TY}B32", 2048),
        ("int8", None, f"{OP}NONE, {TY}B32", 1024),
        ("float32", "add", f"{OP}ADD, {TY}F32", 4096),
        ("float16", MultimemReduceOp.MIN, f"{OP}MIN, {TY}F16X2", 2048),
        ("bfloat16", MultimemReduceOp.MAX, f"{OP}MAX, {TY}BF16X2", 2048),
        ("bfloat16", MultimemReduceOp.ADD, f"{OP}ADD, {TY}BF16X2", 2048),
    ],
)
def test_tma_store_codegen(dtype, reduce_op, tmpl, nbytes):
    body = kernel_body(lower_source(tma_kernel(dtype, reduce_op)))
    assert f"tilescale::multimem_tma_store<{tmpl}>((&(MC[1024])), (&(s[0])), (uint){nbytes});" in body
    assert body.index("tl::fence_proxy_async();") < body.index("multimem_tma_store") < body.index("tl::tma_store_arrive();")


def test_reduce_op_enum_exported():
    assert T.MultimemReduceOp is MultimemReduceOp
    assert [m.name for m in MultimemReduceOp] == ["ADD", "MIN", "MAX", "NONE"]


# ------------------------------------------------------------------------------ PTX
@needs_toolkit
def test_ptx_exact_instructions(tmp_path):
    @T.prim_func
    def k(A: T.Tensor((64, 64), "float32"), H: T.Tensor((64, 64), "float16"), B: T.Tensor((64, 64), "bfloat16"),
          U: T.Tensor((64, 64), "uint32"), F: T.Tensor((8,), "uint32"), G: T.Tensor((8,), "uint64"),
          S: T.Tensor((8,), "int32"), D: T.Tensor((64, 64), "int64")):
        with T.Kernel(1, threads=128) as _:
            f = T.alloc_fragment((64, 64), "float32")
            T.multimem_ld_reduce(A, f)
            T.multimem_red(f, A)
            T.multimem_st(f, A)
            h = T.alloc_shared((64, 64), "float16")
            T.multimem_ld_reduce(H, h, "max")
            T.multimem_red(h, H)
            b = T.alloc_shared((64, 64), "bfloat16")
            T.multimem_ld_reduce(B, b, "max")
            T.multimem_red(b, B)
            u = T.alloc_fragment((64, 64), "uint32")
            T.multimem_ld_reduce(U, u, "min")
            T.multimem_red(u, U, "max")
            d = T.alloc_fragment((64, 64), "int64")
            T.multimem_red(d, D)
            T.multimem_signal(F[0], 1)
            T.multimem_signal(G[0], 1)
            T.multimem_signal_add(F[1], 1)
            T.multimem_signal_add(S[1], 1)
            T.multimem_signal_add(G[1], 1)

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    for ins in [
        "multimem.ld_reduce.relaxed.sys.global.add.f32",
        "multimem.red.relaxed.sys.global.add.f32",
        "multimem.st.relaxed.sys.global.b32",
        "multimem.ld_reduce.relaxed.sys.global.max.f16x2",
        "multimem.red.relaxed.sys.global.add.f16x2",
        "multimem.ld_reduce.relaxed.sys.global.max.bf16x2",
        "multimem.red.relaxed.sys.global.add.bf16x2",
        "multimem.ld_reduce.relaxed.sys.global.min.u32",
        "multimem.red.relaxed.sys.global.max.u32",
        "multimem.red.relaxed.sys.global.add.u64",
        "multimem.st.release.sys.global.u32",
        "multimem.st.release.sys.global.u64",
        "multimem.red.release.sys.global.add.u32",
        "multimem.red.release.sys.global.add.s32",
        "multimem.red.release.sys.global.add.u64",
    ]:
        assert ins + " " in ptx, ins


def packed_add_kernel(dtype="float16"):
    @T.prim_func
    def k(H: T.Tensor((64, 64), dtype)):
        with T.Kernel(1, threads=128) as _:
            h = T.alloc_shared((64, 64), dtype)
            T.multimem_ld_reduce(H, h)

    return k


@needs_toolkit
@pytest.mark.parametrize("dtype,ptx", [("float16", "f16x2"), ("bfloat16", "bf16x2")])
def test_ptx_packed_ld_reduce_add(dtype, ptx, tmp_path):
    """From CUDA 12.2 (PTX ISA 8.2): packed ADD reduce-loads accumulate in float32."""
    if TOOLKIT.version < (12, 2):
        pytest.skip(f"{TOOLKIT} is older than 12.2 (test_packed_add_gate covers it)")
    assert f"multimem.ld_reduce.relaxed.sys.global.add.acc::f32.{ptx} " in nvcc_ptx(lower_source(packed_add_kernel(dtype)), tmp_path)


@pytest.mark.parametrize("version,rejected", [((12, 1), True), ((12, 2), False), ((13, 0), False)])
def test_packed_add_gate(version, rejected):
    """Packed float16/bfloat16 ADD reduce-loads need CUDA 12.2: rejected at compile below it."""
    from tilescale_lang.codegen import tilescale_helpers
    from tilescale_lang.toolkit import Toolkit, ToolkitFeatureError, check_features

    used = tilescale_helpers(packed_add_kernel())
    fake = Toolkit("/opt/cuda", version, None, None)
    if rejected:
        with pytest.raises(ToolkitFeatureError, match=r"ADD of float16/bfloat16 pairs .* needs CUDA Toolkit 12\.2 or newer.*CUDA 12\.1"):
            check_features(used, fake)
    else:
        check_features(used, fake)
    check_features(tilescale_helpers(tma_kernel("float16", "max")) - {h for h in used}, Toolkit("/x", (13, 1), None, None))


@needs_toolkit
def test_ptx_f64_and_64bit_store(tmp_path):
    @T.prim_func
    def k(A: T.Tensor((64, 64), "float64")):
        with T.Kernel(1, threads=128) as _:
            f = T.alloc_fragment((64, 64), "float64")
            T.multimem_ld_reduce(A, f)
            T.multimem_st(f, A)

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    assert "multimem.ld_reduce.relaxed.sys.global.add.f64 " in ptx
    assert "multimem.st.relaxed.sys.global.b64 " in ptx


def _compile_error(src: str, tmp_path, arch="sm_90a") -> str:
    """The toolkit's error message for ``src`` (the test fails if it compiles)."""
    with pytest.raises(RuntimeError) as info:
        TOOLKIT.compile(src, tmp_path / "m", "ptx", arch)
    return str(info.value)


@needs_toolkit
def test_tma_store_header_needs_cuda_13_1(tmp_path):
    """Below 13.1 the header itself refuses the bulk store (the backstop behind the gate)."""
    if TOOLKIT.version >= (13, 1):
        pytest.skip(f"{TOOLKIT}: the gate does not apply")
    assert "multimem_tma_store needs CUDA Toolkit 13.1+" in _compile_error(lower_source(tma_kernel("float16", None)), tmp_path)


@needs_nvcc
def test_tma_store_rejected_at_compile_below_13_1(tmp_path, monkeypatch):
    """tilelang.compile of a kernel using T.multimem_tma_store with a toolkit older than 13.1
    fails before nvcc runs, naming the feature, the version it needs and the toolkit found."""
    if TOOLKIT.version >= (13, 1):
        pytest.skip(f"{TOOLKIT}: the gate does not apply")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    from tilescale_lang.toolkit import ToolkitFeatureError

    with pytest.raises(ToolkitFeatureError) as info:
        tilelang.compile(tma_kernel("float16", None), target={"kind": "cuda", "arch": "sm_90a"})
    msg = str(info.value)
    assert "T.multimem_tma_store" in msg and "multimem bulk store" in msg
    assert "needs CUDA Toolkit 13.1 or newer" in msg
    assert f"CUDA {TOOLKIT.version[0]}.{TOOLKIT.version[1]} ({TOOLKIT.home})" in msg


@pytest.mark.parametrize("version,rejected", [((12, 1), True), ((12, 2), True), ((13, 0), True), ((13, 1), False), ((13, 2), False)])
def test_tma_store_gate_by_toolkit_version(version, rejected):
    from tilescale_lang.codegen import tilescale_helpers
    from tilescale_lang.toolkit import Toolkit, ToolkitFeatureError, check_features

    used = tilescale_helpers(tma_kernel("float16", "add"))
    assert any(h.startswith("tilescale::multimem_tma_store") for h in used)
    fake = Toolkit(f"/opt/cuda-{version[0]}.{version[1]}", version, None, None)
    if rejected:
        with pytest.raises(ToolkitFeatureError, match=rf"needs CUDA Toolkit 13\.1 or newer, .* is CUDA {version[0]}\.{version[1]} \(/opt/cuda-"):
            check_features(used, fake)
    else:
        check_features(used, fake)
    check_features({"tilescale::multimem_st"}, Toolkit("/x", (12, 1), None, None))  # other helpers: no gate


@needs_toolkit
@pytest.mark.parametrize("dtype,reduce_op,ptx", [
    ("float16", None, "multimem.cp.async.bulk.global.shared::cta.bulk_group"),
    ("float32", "add", "multimem.cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"),
    ("bfloat16", "max", "multimem.cp.reduce.async.bulk.global.shared::cta.bulk_group.max.bf16"),
])
def test_tma_store_compiles_with_13_1(dtype, reduce_op, ptx, tmp_path):
    """From CUDA 13.1 the bulk store compiles (and ptxas assembles it) for sm_90a."""
    if TOOLKIT.version < (13, 1):
        pytest.skip(f"{TOOLKIT} is older than 13.1 (the matrix entry cuda='13.1' runs this)")
    src = lower_source(tma_kernel(dtype, reduce_op))
    assert ptx in nvcc_ptx(src, tmp_path)
    out, _, _ = TOOLKIT.compile(src, tmp_path / "cubin", "cubin")
    assert out.read_bytes()[:4] == b"\x7fELF"


@needs_toolkit
def test_multimem_on_pre_sm90_fails_to_compile(tmp_path):
    src = lower_source(build(lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l)))
    assert "tilescale multimem operations need sm_90 or newer" in _compile_error(src, tmp_path, arch="sm_80")


# ------------------------------------------------------------------------------ rejections
REJECT = [
    # (dtype, local, body, exception, words that must appear)
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l, "min"), ValueError, ["reduce_op=MIN", "float32"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_red(l, MC, MultimemReduceOp.MAX), ValueError, ["reduce_op=MAX", "float32"]),
    ("float64", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l, "max"), ValueError, ["reduce_op=MAX", "float64"]),
    ("float16", "shared", lambda MC, L, l, *f: T.multimem_red(l, MC, "min"), ValueError, ["reduce_op=MIN", "float16"]),
    ("bfloat16", "shared", lambda MC, L, l, *f: T.multimem_red(l, MC, "max"), ValueError, ["reduce_op=MAX", "bfloat16"]),
    ("int8", "shared", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l), ValueError, ["reduce_op=ADD", "int8"]),
    ("int8", "shared", lambda MC, L, l, *f: T.multimem_st(l, MC), ValueError, ["dst dtype int8"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l, MultimemReduceOp.NONE), ValueError, ["reduce_op=NONE"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_red(l, MC, "xor"), ValueError, ["reduce_op"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_red(l, MC, 3), TypeError, ["reduce_op"]),
    # multicast operand must be global
    ("float32", "shared", lambda MC, L, l, *f: T.multimem_ld_reduce(l, MC), ValueError, ["src is the multicast operand", "shared"]),
    ("float32", "shared", lambda MC, L, l, *f: T.multimem_st(MC, l), ValueError, ["dst is the multicast operand"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_red(MC, l), ValueError, ["dst is the multicast operand", "local.fragment"]),
    # shapes
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC[0:32, :], l), ValueError, ["dst region shape"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_st(L[0:8, 0:8], MC[0:8, 0:16]), ValueError, ["src region shape"]),
    ("float32", "fragment", lambda MC, L, l, *f: T.multimem_red(L[0, 0:8], MC[0:8, 0]), ValueError, ["src region shape"]),
    # packed pairs
    ("float16", "shared", lambda MC, L, l, *f: T.multimem_st(l[0:4, 0:3], MC[0:4, 0:3]), ValueError, ["even last extent"]),
    ("float16", "shared", lambda MC, L, l, *f: T.multimem_st(l[0:4, 1:3], MC[0:4, 1:3]), ValueError, ["pair-aligned"]),
    ("float16", "fragment", lambda MC, L, l, *f: T.multimem_ld_reduce(MC, l), ValueError, ["dst", "fragment"]),
    # signals
    ("float32", "fragment", lambda MC, L, l, F, G, S, X: T.multimem_signal(X[0], 1), TypeError, ["addr", "float32"]),
    ("float32", "fragment", lambda MC, L, l, F, G, S, X: T.multimem_signal(S[0], 1), TypeError, ["addr", "int32"]),
    ("float32", "fragment", lambda MC, L, l, F, G, S, X: T.multimem_signal_add(X[0], 1), TypeError, ["addr", "float32"]),
    ("float32", "fragment", lambda MC, L, l, F, G, S, X: T.multimem_signal_add(T.alloc_shared((4,), "uint32")[0], 1), ValueError, ["addr", "global"]),
    ("float32", "fragment", lambda MC, L, l, F, G, S, X: T.multimem_signal(F[0], 1.5), TypeError, ["value"]),
]


@pytest.mark.parametrize("case", range(len(REJECT)))
def test_rejected_at_lowering(case):
    dtype, local, body, exc, words = REJECT[case]
    with pytest.raises(exc) as info:
        build(body, dtype=dtype, local=local)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def _tma(body, dtype="float16"):
    @T.prim_func
    def k(MC: T.Tensor((64, 64), dtype), L: T.Tensor((64, 64), dtype)):
        with T.Kernel(1, threads=128) as _:
            s = T.alloc_shared((64, 64), dtype)
            f = T.alloc_fragment((64, 64), dtype)
            body(MC, L, s, f)

    return k


TMA_REJECT = [
    (lambda MC, L, s, f: T.multimem_tma_store(f, MC), "float16", ["src", "shared memory"]),
    (lambda MC, L, s, f: T.multimem_tma_store(L, MC), "float16", ["src", "shared memory"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s, s), "float16", ["dst is the multicast operand"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s[0:16, :], MC[0:8, :]), "float16", ["dst region shape"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s[0, 0:4], MC[0, 0:4]), "float16", ["multiple of 16 bytes", "8 bytes"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s[0, 0:12], MC[0, 0:12]), "float16", ["multiple of 16 bytes"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s[0, 4:12], MC[0, 0:8]), "float16", ["src", "16-byte aligned"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s[0:2, 0:32], MC[0:2, 0:32]), "float16", ["src", "not physically contiguous"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s, MC, "min"), "float32", ["reduce_op=MIN", "float32"]),
    (lambda MC, L, s, f: T.multimem_tma_store(s, MC, "add"), "int32", ["reduce_op=ADD", "int32"]),
]


@pytest.mark.parametrize("case", range(len(TMA_REJECT)))
def test_tma_store_rejected_at_lowering(case):
    body, dtype, words = TMA_REJECT[case]
    with pytest.raises(ValueError) as info:
        _tma(body, dtype)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("alloc,op,match", [
    (T.alloc_shared, lambda MC, local: T.multimem_tma_store(local, MC), "dst dtype float32 does not match src dtype float16"),
    (T.alloc_fragment, lambda MC, local: T.multimem_ld_reduce(MC, local), "dst dtype float16 does not match src dtype float32"),
], ids=["tma_store", "elementwise"])
def test_dtype_mismatch(alloc, op, match):
    """A float16 local buffer with a float32 multicast tensor, either way round."""
    with pytest.raises(ValueError, match=match):

        @T.prim_func
        def k(MC: T.Tensor((64, 64), "float32")):
            with T.Kernel(1, threads=128) as _:
                local = alloc((64, 64), "float16")
                op(MC, local)
