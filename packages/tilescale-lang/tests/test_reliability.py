"""No silent wrong results (issue 12): checks at lowering, the table guard, the PE debug check.

CPU only: lowering, nvcc PTX compiles and a compiled (never launched) kernel.  The device
side of the guards (the traps) runs in test_gpu.py.
"""

from __future__ import annotations

import pytest
import tilelang
import tilelang.language as T
from lang_helpers import TARGET, FakeAllocator, kernel_body, lower_source, needs_nvcc, nvcc_ptx

from tilescale_lang import headers, metadata, validation
from tilescale_lang._tvm import tirx

# --------------------------------------------------------------------- indices that are calls
# Every intrinsic that takes an element, with indices that are calls, casts and arithmetic on
# T.get_rank() (TileLang's safe-memory pass turned some of them into non-lvalues before).
INDEX_FORMS = {
    "call": lambda F, r: F[T.get_rank()],
    "let": lambda F, r: F[r],
    "address_of_let": lambda F, r: T.address_of(F[r]),
    "arith": lambda F, r: F[(r + 1) % 4],
    "cast": lambda F, r: F[T.cast(T.get_rank(), "int64")],
    "address_of_arith": lambda F, r: T.address_of(F[r * 2 + 1]),
}

VALUE_INTRINSICS = {  # used as expressions (the value is stored into O)
    "ld": lambda x: T.ld(x),
    "ld_peer": lambda x: T.ld(x, src_pe=1),
    "atom_add": lambda x: T.atom_add(x, 1),
    "wait_eq": lambda x: T.wait_eq(x, 1),
    "wait_ge_peer": lambda x: T.wait_ge(x, 1, peer=0),
}
STMT_INTRINSICS = {  # used as statements
    "st": lambda x, A: T.st(x, 5),
    "st_peer": lambda x, A: T.st(x, 5, dst_pe=1),
    "notify": lambda x, A: T.notify(x, 1, signal=2),
    "notify_add": lambda x, A: T.notify(x, 0, signal=1, sig_op="add"),
    "ld_into": lambda x, A: T.ld(x, A[0]),
}


def _value_kernel(intrinsic, form):
    @T.prim_func
    def k(F: T.Tensor((16,), "uint32"), O: T.Tensor((16,), "uint32")):
        with T.Kernel(1, threads=32) as _:
            r = T.get_rank()
            O[0] = intrinsic(form(F, r))

    return k


def _stmt_kernel(intrinsic, form):
    @T.prim_func
    def k(F: T.Tensor((16,), "uint32"), O: T.Tensor((16,), "uint32")):
        with T.Kernel(1, threads=32) as _:
            r = T.get_rank()
            v = T.alloc_local((1,), "uint32")
            intrinsic(form(F, r), v)
            O[1] = v[0]

    return k


@pytest.mark.parametrize("form", sorted(INDEX_FORMS))
@pytest.mark.parametrize("name", sorted(VALUE_INTRINSICS))
def test_value_intrinsics_accept_call_indices(name, form):
    body = kernel_body(lower_source(_value_kernel(VALUE_INTRINSICS[name], INDEX_FORMS[form])))
    assert "if_then_else" not in body and "tilescale::" in body


@pytest.mark.parametrize("form", sorted(INDEX_FORMS))
@pytest.mark.parametrize("name", sorted(STMT_INTRINSICS))
def test_statement_intrinsics_accept_call_indices(name, form):
    body = kernel_body(lower_source(_stmt_kernel(STMT_INTRINSICS[name], INDEX_FORMS[form])))
    assert "tilescale::" in body


@pytest.mark.parametrize("name", ["put_warp", "get_warp", "put_block", "get_block"])
def test_copies_accept_call_offsets(name):
    fn = getattr(T, name)

    @T.prim_func
    def k(A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=128) as _:
            r = T.get_rank()
            fn(T.address_of(A[r * 8]), T.address_of(B[T.get_rank() * 8]), 8, (r + 1) % 2)

    body = kernel_body(lower_source(k))
    assert f"tilescale::{name}<" in body and "tilescale::get_rank()" in body


def test_ld_with_call_index_addresses_the_element(tmp_path):
    """The let-bound index form prints as an ordinary element address and compiles."""
    src = lower_source(_value_kernel(VALUE_INTRINSICS["ld"], INDEX_FORMS["address_of_arith"]))
    assert "(&(F[" in kernel_body(src) and "r * 2" in kernel_body(src).replace("(int64_t)", "").replace("((r)", "(r")
    if needs_nvcc.args[0]:  # skipif condition: nvcc missing
        pytest.skip("nvcc not found")
    ptx = nvcc_ptx(src, tmp_path)
    assert "ld.u32" in ptx or "ld.global.u32" in ptx or "ld.b32" in ptx


# --------------------------------------------------------------------- constant PEs
@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda F, A: T.ld(F[0], A[0], src_pe=5000), "src_pe=5000"),
        (lambda F, A: T.st(F[0], 1, dst_pe=1022), "dst_pe=1022"),
        (lambda F, A: T.wait_eq(F[0], 1, peer=4096), "peer=4096"),
        (lambda F, A: T.notify(F[0], 2**31 - 1), "peer=2147483647"),
        (lambda F, A: T.put_block(F, F, 4, dst_pe=1023), "dst_pe=1023"),
        (lambda F, A: T.get_warp(F, F, 4, src_pe=10**6), "src_pe=1000000"),
        (lambda F, A: T.symm_at(F[0], 5000), "pe=5000"),
    ],
)
def test_constant_pe_beyond_the_table_is_rejected(call, arg):
    with pytest.raises(ValueError, match=rf"{arg.replace('(', '[(]')} is out of range.*at most 1022 ranks"):

        @T.prim_func
        def k(F: T.Tensor((8,), "uint32")):
            with T.Kernel(1, threads=32) as _:
                a = T.alloc_local((1,), "uint32")
                call(F, a)


def test_largest_constant_pe_is_accepted():
    @T.prim_func
    def k(F: T.Tensor((8,), "uint32")):
        with T.Kernel(1, threads=32) as _:
            T.st(F[0], 1, dst_pe=validation.MAX_PE)

    assert f"(uint)1, {validation.MAX_PE});" in kernel_body(lower_source(k))


# --------------------------------------------------------------------- truncation
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda F, G, A, B: T.wait_eq(F[0], 2**40), r"expected=1099511627776 does not fit the uint32"),
        (lambda F, G, A, B: T.wait_ge(F[0], -(2**31) - 1), r"expected=-2147483649 does not fit"),
        (lambda F, G, A, B: T.wait_eq(G[0], 2**64), r"expected=18446744073709551616 does not fit the uint64"),
        (lambda F, G, A, B: T.notify(F[0], 1, signal=2**33), r"signal=8589934592 does not fit the uint32"),
        (lambda F, G, A, B: T.st(F[0], 2**32), r"value=4294967296 does not fit"),
        (lambda F, G, A, B: T.atom_add(F[0], 2**32 + 1), r"value=4294967297 does not fit"),
        (lambda F, G, A, B: T.init_barrier_gpu(F, 2**32), r"expected=4294967296 does not fit"),
        (lambda F, G, A, B: T.put_block(A, B, 65, dst_pe=1), r"size=65 elements exceeds src, which holds 64"),
        (lambda F, G, A, B: T.put_warp(A, B[32:64], 33, dst_pe=1), r"size=33 elements exceeds dst, which holds 32"),
        (lambda F, G, A, B: T.get_block(A[8], B, 57, src_pe=1), r"size=57 elements exceeds src, which holds 56"),
        (lambda F, G, A, B: T.get_warp(T.address_of(A[60]), B, 5), r"size=5 elements exceeds src, which holds 4"),
    ],
)
def test_values_that_would_be_truncated_are_rejected(call, match):
    with pytest.raises(ValueError, match=match):

        @T.prim_func
        def k(F: T.Tensor((8,), "uint32"), G: T.Tensor((8,), "uint64"), A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32")):
            with T.Kernel(1, threads=32) as _:
                call(F, G, A, B)


def test_values_that_fit_are_kept_exactly():
    @T.prim_func
    def k(F: T.Tensor((8,), "uint32"), G: T.Tensor((8,), "int64"), A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=32) as _:
            T.wait_eq(F[0], 2**32 - 1)
            T.wait_eq(F[1], -1)  # two's complement spelling of 0xffffffff
            T.wait_ge(G[0], -(2**63))
            T.notify(F[2], 1, signal=2**31)
            T.put_block(A, B, 64, dst_pe=1)
            T.get_block(A[8], B, 56, src_pe=1)

    body = kernel_body(lower_source(k))
    assert body.count("(uint)4294967295") == 2
    assert "(uint)2147483648" in body and "(uint64_t)256" in body and "(uint64_t)224" in body


# --------------------------------------------------------------------- the run-time PE check
def _peer_kernel():
    """A store to a run-time PE (the PE check's subject; a kernel that reads the table)."""

    @T.prim_func
    def peer_put(F: T.Tensor((8,), "uint32"), pe: T.int32):
        with T.Kernel(1, threads=32) as _:
            T.st(F[0], 1, dst_pe=pe)

    return peer_put


def test_check_pe_flag(monkeypatch):
    monkeypatch.delenv(headers.CHECK_PE_ENV, raising=False)
    monkeypatch.delenv(headers.DEBUG_ENV, raising=False)
    assert "-DTILESCALE_CHECK_PE=1" not in headers.compile_flags()
    monkeypatch.setenv(headers.CHECK_PE_ENV, "1")
    assert "-DTILESCALE_CHECK_PE=1" in headers.compile_flags()
    monkeypatch.setenv(headers.CHECK_PE_ENV, "0")
    assert "-DTILESCALE_CHECK_PE=1" not in headers.compile_flags()
    monkeypatch.setenv(headers.DEBUG_ENV, "1")  # every device debug check, the PE check included
    assert {"-DTILESCALE_CHECK_PE=1", "-DTILESCALE_DEBUG=1"} <= set(headers.compile_flags())
    monkeypatch.delenv(headers.DEBUG_ENV)
    monkeypatch.setenv(headers.CHECK_PE_ENV, "maybe")
    with pytest.raises(ValueError, match="TILESCALE_CHECK_PE='maybe' is not a boolean"):
        headers.compile_flags()


@pytest.mark.parametrize("name", ["TILESCALE_CHECK_PE", "TILESCALE_DEBUG"])
def test_device_check_switches_read_every_boolean_spelling(monkeypatch, name):
    """Issue 39: the on/off switches read 1/true/yes/on and 0/false/no/off (any case), like
    every other TileScale switch (tilescale_core.env.flag); anything else names the variable."""
    monkeypatch.delenv(headers.CHECK_PE_ENV, raising=False)
    monkeypatch.delenv(headers.DEBUG_ENV, raising=False)
    for on in ("1", "true", "Yes", " ON "):
        monkeypatch.setenv(name, on)
        assert "-DTILESCALE_CHECK_PE=1" in headers.compile_flags(), on
    for off in ("0", "false", "No", "off", ""):
        monkeypatch.setenv(name, off)
        assert "-DTILESCALE_CHECK_PE=1" not in headers.compile_flags(), off
    monkeypatch.setenv(name, "2")
    with pytest.raises(ValueError, match=rf"{name}='2' is not a boolean"):
        headers.compile_flags()


@pytest.mark.parametrize("raw", ["18446744073710", str(2**31), "-5", "1_000", "--5", "\u0661", "1e3", "nan"])
def test_wait_timeout_out_of_range_is_rejected(monkeypatch, raw):
    """Issue 39: 18446744073710 ms wrapped to 0.448 ms on the device (and the trap printed a
    negative time); the timeout must fit the device's 32-bit print and 64-bit nanoseconds."""
    monkeypatch.setenv(headers.WAIT_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=r"TILESCALE_WAIT_TIMEOUT_MS must be an integer number of milliseconds in 0..2147483647"):
        headers.compile_flags()


def test_wait_timeout_in_range_is_kept(monkeypatch):
    for raw, flag in (("2147483647", "-DTILESCALE_WAIT_TIMEOUT_MS=2147483647"), (" 250 ", "-DTILESCALE_WAIT_TIMEOUT_MS=250"),
                      ("+7", "-DTILESCALE_WAIT_TIMEOUT_MS=7")):
        monkeypatch.setenv(headers.WAIT_TIMEOUT_ENV, raw)
        assert flag in headers.compile_flags()
    monkeypatch.setenv(headers.WAIT_TIMEOUT_ENV, "0")
    assert not any("WAIT_TIMEOUT" in f for f in headers.compile_flags())


@needs_nvcc
def test_runtime_pe_check_is_compiled_in_only_on_request(tmp_path, monkeypatch):
    src = lower_source(_peer_kernel())
    monkeypatch.delenv(headers.CHECK_PE_ENV, raising=False)
    off = nvcc_ptx(src, tmp_path)
    monkeypatch.setenv(headers.CHECK_PE_ENV, "1")
    on = nvcc_ptx(src, tmp_path)
    assert "out of range" not in _strings(off) and "pe_out_of_range_trap" not in off
    assert "PE %d out of range: rank %d of %d ranks, block (%d,%d,%d) thread (%d,%d,%d)" in _strings(on)
    assert "trap;" in on


def _strings(ptx: str) -> str:
    """The PTX's global byte arrays decoded (printf format strings live there)."""
    import re

    out = []
    for body in re.findall(r"\.global \.align 1 \.b8 [^\[]+\[\d+\] = \{([^}]*)\}", ptx):
        out.append(bytes(int(b) for b in body.split(",") if b.strip()).decode(errors="replace"))
    return "\n".join(out)


# --------------------------------------------------------------------- negative run-time sizes
def _runtime_size_kernel():
    @T.prim_func
    def k(A: T.Tensor((1024,), "float32"), B: T.Tensor((1024,), "float32"), F: T.Tensor((4,), "uint64"),
          n: T.int32, m: T.int64, u: T.uint32, pe: T.int32):
        with T.Kernel(1, threads=128) as _:
            T.put_block(A, B, n - 100, dst_pe=pe)
            T.put_signal_warp(A, B, m, F[0], 1, dst_pe=pe)
            T.get_block(B, A, u, src_pe=pe)
            T.put_block(A, B, 16, dst_pe=pe)

    return k


def test_signed_runtime_sizes_are_wrapped_in_the_checked_count():
    """A signed run-time size goes through tilescale::checked_count (named by intrinsic and
    argument) before it becomes a uint64 byte count; it used to be cast as is, so a negative
    ``n - 100`` became a byte count near 2**64.  Unsigned and constant sizes are not wrapped."""
    body = kernel_body(lower_source(_runtime_size_kernel()))
    assert '(((uint64_t)tilescale::checked_count((n - 100), "put_block size")) * (uint64_t)4)' in body
    assert '(((uint64_t)tilescale::checked_count(m, "put_signal_warp size")) * (uint64_t)4)' in body
    assert "(((uint64_t)u) * (uint64_t)4)" in body and "(uint64_t)64" in body
    assert body.count("tilescale::checked_count(") == 2


def test_team_collective_sizes_are_wrapped_in_the_checked_count():
    @T.prim_func
    def k(Tm: T.Tensor((1024,), "int32"), A: T.Tensor((256,), "float16"), B: T.Tensor((256,), "float16"), n: T.int64):
        with T.Kernel(1, threads=128) as _:
            T.broadcast_block(Tm, A, B, n, 0)

    body = kernel_body(lower_source(k))
    assert '(((uint64_t)tilescale::checked_count(n, "broadcast_block n")) * (uint64_t)2)' in body


def test_size_bytes_wraps_only_signed_sizes_that_may_be_negative():
    n = tirx.Var("n", "int32")
    u = tirx.Var("u", "uint32")
    wrapped = validation.size_bytes(n - 1, 4, "size", "put_warp")
    call = wrapped.a.value  # Cast(uint64, checked_count(...)) * 4
    assert call.args[0].value == "tilescale::checked_count" and call.args[2].value == "put_warp size"
    assert str(call.dtype) == "int32"
    assert "checked_count" not in str(validation.size_bytes(u, 4))
    assert "checked_count" not in str(validation.size_bytes(tirx.Cast("int64", u), 4))  # provably >= 0
    assert int(validation.size_bytes(tirx.IntImm("int32", 3), 4).value) == 12


@needs_nvcc
def test_negative_size_check_is_compiled_in_only_on_request(tmp_path, monkeypatch):
    """nvcc compiles the wrapped sizes with the checks on (the trap and its message are there)
    and off; off, the PTX is the PTX of the unwrapped source (zero cost, no clamp)."""
    import re

    src = lower_source(_runtime_size_kernel())
    unwrapped = re.sub(r'tilescale::checked_count\((.*?), "[a-z_]+ size"\)', r"(\1)", src)
    assert "checked_count" not in unwrapped
    monkeypatch.delenv(headers.CHECK_PE_ENV, raising=False)
    monkeypatch.delenv(headers.DEBUG_ENV, raising=False)
    off = nvcc_ptx(src, tmp_path / "off")
    assert "is negative" not in _strings(off) and "negative_count_trap" not in off and "put_block size" not in _strings(off)
    def same(ptx):  # internal-linkage names carry a hash of the source file; the unused
        # literals of the checked_count calls still take numbers from the string labels
        return re.sub(r"\$str(\$\d+)?", "$str", re.sub(r"_INTERNAL_[0-9a-f]+_", "_INTERNAL_", ptx))

    assert same(off) == same(nvcc_ptx(unwrapped, tmp_path / "unwrapped"))
    for env in (headers.CHECK_PE_ENV, headers.DEBUG_ENV):
        monkeypatch.delenv(headers.CHECK_PE_ENV, raising=False)
        monkeypatch.delenv(headers.DEBUG_ENV, raising=False)
        monkeypatch.setenv(env, "1")
        on = nvcc_ptx(src, tmp_path / env)
        strings = _strings(on)
        assert "%s = %lld is negative: an element count must be >= 0; rank %d block (%d,%d,%d) thread (%d,%d,%d)" in strings
        assert "put_block size" in strings and "put_signal_warp size" in strings
        assert "trap;" in on


# --------------------------------------------------------------------- the missing table
@needs_nvcc
def test_reading_an_empty_table_traps_with_a_message(tmp_path, monkeypatch):
    @T.prim_func
    def k(R: T.Tensor((2,), "int32")):
        with T.Kernel(1, threads=32) as _:
            R[0] = T.get_rank()

    monkeypatch.delenv(headers.CHECK_PE_ENV, raising=False)
    ptx = nvcc_ptx(lower_source(k), tmp_path)
    assert "launched without kernel.initialize(allocator=...)" in _strings(ptx)
    assert "trap;" in ptx


def _local_kernel():
    @T.prim_func
    def local_only(F: T.Tensor((8,), "uint32")):
        with T.Kernel(1, threads=32) as _:
            T.st(F[0], 1, sem="release", scope="gpu")
            T.wait_eq(F[1], 3)
            T.notify(F[2], -1, signal=4)

    return local_only


def test_table_readers_finds_peer_intrinsics_and_rank_queries():
    def readers(body):
        @T.prim_func
        def k(F: T.Tensor((8,), "uint32"), A: T.Tensor((64,), "float32"), pe: T.int32):
            with T.Kernel(1, threads=32) as _:
                body(F, A, pe)

        return metadata.table_readers(k)

    assert readers(lambda F, A, pe: T.st(F[0], 1)) == []
    assert readers(lambda F, A, pe: T.st(F[0], 1, dst_pe=-1)) == []
    assert readers(lambda F, A, pe: T.put_warp(A, A, 4)) == []
    assert readers(lambda F, A, pe: T.atom_add(F[0], 1)) == []
    assert readers(lambda F, A, pe: T.st(F[0], 1, dst_pe=0)) == ["st"]
    assert readers(lambda F, A, pe: T.ld(F[0], src_pe=pe)) == ["ld"]
    assert readers(lambda F, A, pe: T.wait_eq(F[0], 1, peer=pe)) == ["wait_until"]
    assert readers(lambda F, A, pe: T.notify(F[0], pe)) == ["notify"]
    assert readers(lambda F, A, pe: T.put_block(A, A, 4, dst_pe=pe)) == ["put_block"]
    assert readers(lambda F, A, pe: T.barrier_blocks(F)) == ["barrier_blocks"]
    assert readers(lambda F, A, pe: T.evaluate(T.symm_at(F[0], pe))) == ["remap"]
    assert readers(lambda F, A, pe: T.st(F[0], T.get_num_ranks())) == ["get_num_ranks"]


@needs_nvcc
def test_uninitialised_peer_kernel_refuses_to_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(_peer_kernel(), target=TARGET)
    with pytest.raises(metadata.KernelNotInitializedError, match=r"kernel 'peer_put' uses st .*kernel.initialize\(allocator="):
        kernel("not a tensor", 1)  # refused before the arguments are looked at
    kernel.initialize(allocator=FakeAllocator([0, 1, 4096]))
    assert kernel.torch_function.__name__ != "refuse"
    # a second compile of the same function (cache hit) is not guarded again once initialised
    again = tilelang.compile(_peer_kernel(), target=TARGET)
    if again is kernel:
        assert kernel.torch_function.__name__ != "refuse"


@needs_nvcc
def test_the_adapter_path_is_guarded_too(tmp_path, monkeypatch):
    """Stock TileLang's profiler launches through ``kernel.adapter(...)``, not ``kernel(...)``:
    the guard covers it (an upstream program that benchmarks with ``get_profiler().run_once()``
    gets the error, not a device trap), and initialize lifts it on both paths."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    @T.prim_func
    def peer_put_2(F: T.Tensor((16,), "uint32"), pe: T.int32):  # a kernel of its own (TileLang caches in memory)
        with T.Kernel(1, threads=32) as _:
            T.st(F[1], 1, dst_pe=pe)

    kernel = tilelang.compile(peer_put_2, target=TARGET)
    with pytest.raises(metadata.KernelNotInitializedError, match="peer_put_2"):
        kernel.adapter("not a tensor", 1)
    kernel.initialize(allocator=FakeAllocator([0, 1, 4096]))
    assert kernel.adapter.func is kernel.torch_function
    assert kernel.torch_function.__name__ != "refuse"


@needs_nvcc
def test_local_only_kernel_launches_without_initialize(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(_local_kernel(), target=TARGET)
    assert metadata.table_readers(_local_kernel()) == []
    assert kernel.torch_function.__name__ != "refuse"


def test_failed_initialize_keeps_the_guard():
    """initialize() with a bad table raises before lifting the guard."""

    class K:
        execution_backend = "tvm_ffi"

        def torch_function(self, *a):  # pragma: no cover - must never run
            raise AssertionError("launched")

    k = K()
    k.__dict__["torch_function"] = lambda *a: "launched"
    metadata.guard_launch(k, ["get_rank"])
    with pytest.raises(ValueError):
        metadata.initialize(k, allocator=FakeAllocator([5, 1, 0]))
    with pytest.raises(metadata.KernelNotInitializedError, match="get_rank"):
        k.torch_function()


def _header_functions() -> dict:
    """``{name: [body of each overload]}`` of every ``TILESCALE_DEVICE`` function in the CUDA
    headers."""
    import re
    from pathlib import Path

    import tilescale_lang

    functions: dict = {}
    for header in (Path(tilescale_lang.__file__).parent / "include" / "tilescale").glob("*.cuh"):
        text = header.read_text(encoding="utf-8")
        for m in re.finditer(r"TILESCALE_DEVICE\b[^;{(]*?\b(\w+)\s*\(", text):
            start = text.find("{", m.end())
            if start < 0 or ";" in text[m.end():start].split(")")[-1]:
                continue  # a declaration
            depth, i = 0, start
            while True:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
                if depth == 0:
                    break
            functions.setdefault(m.group(1), []).append(text[start:i])
    return functions


def _table_readers_in_headers() -> set:
    """Names of the header functions with an overload that reads the table: it calls
    ``require_table()`` (every read of the table goes through it) or a function whose every
    overload reads it (a call to an overloaded name such as ``st`` counts only when no overload
    of it is local: the scan does not resolve overloads)."""
    import re

    functions = _header_functions()

    def calls(body, names):
        return any(re.search(rf"\b{n}\s*(<[^;()]*>)?\s*\(", body) for n in names)

    always = {"require_table"}
    changed = True
    while changed:
        changed = False
        for name, bodies in functions.items():
            if name not in always and all(calls(b, always) for b in bodies):
                always.add(name)
                changed = True
    return {name for name, bodies in functions.items() if any(calls(b, always) for b in bodies)}


def test_every_emitted_helper_that_reads_the_table_is_guarded():
    """The launch guard (``table_readers``) knows every helper a kernel can call that reads the
    metadata table: each helper the intrinsics emit that reads it (found in the headers) is in
    ``TABLE_HELPERS`` or ``PE_ARGUMENT``; else an uninitialised kernel using it would trap on
    the device instead of raising before the launch."""
    import re
    from pathlib import Path

    from tilescale_lang import validation

    readers = _table_readers_in_headers()
    assert {"get_rank", "remap", "put_signal", "signal_op", "barrier_team", "put_block"} <= readers  # the scan works
    assert not {"fence_sys", "init_barrier_gpu", "wait_barrier_gpu"} & readers
    emitted = set()
    for module in Path(validation.__file__).parent.glob("*.py"):
        emitted |= set(re.findall(r"tilescale::(\w+)", module.read_text(encoding="utf-8")))
    known = validation.TABLE_HELPERS | set(validation.PE_ARGUMENT)
    missing = sorted((emitted & readers) - known)
    assert not missing, f"helpers that read the table but are not in TABLE_HELPERS / PE_ARGUMENT: {missing}"


def test_table_readers_finds_signals_atomics_and_teams():
    def readers(body):
        @T.prim_func
        def k(F: T.Tensor((8,), "uint64"), A: T.Tensor((64,), "float32"), G: T.Tensor((8,), "int32"), pe: T.int32):
            with T.Kernel(1, threads=128) as _:
                body(F, A, G, pe)

        return metadata.table_readers(k)

    assert readers(lambda F, A, G, pe: T.signal_op(F[0], 1, "set", pe)) == ["signal_op"]
    assert readers(lambda F, A, G, pe: T.signal_op(F[0], 1, "set")) == []
    assert readers(lambda F, A, G, pe: T.put_signal_block(A, A, 16, F[1], 1, "add", dst_pe=pe)) == ["put_signal"]
    assert readers(lambda F, A, G, pe: T.evaluate(T.atomic_cas(G[0], 0, 1, pe=pe))) == ["atomic_cas"]
    assert readers(lambda F, A, G, pe: T.evaluate(T.atomic_cas(G[0], 0, 1))) == []
