"""Headers, include injection, cache-key flags, the extension's attachments, real compiles."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import tilelang
import tilelang.language as T
from lang_helpers import TARGET, TOOLKIT, lower_source, needs_nvcc, needs_toolkit

from tilescale_lang import codegen, headers


def _rank_kernel():
    @T.prim_func
    def rank_kernel(R: T.Tensor((2,), "int32")):
        with T.Kernel(1, threads=32) as _:
            R[0] = T.get_rank()
            R[1] = T.get_num_ranks()

    return rank_kernel


def _stock_kernel():
    @T.prim_func
    def stock_kernel(A: T.Tensor((128,), "float32"), B: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            for i in T.Parallel(128):
                B[i] = A[i] * 2.0

    return stock_kernel


def test_extension_attached():
    assert "lang" in tilelang.__tilescale_extensions__
    for name in (
        "get_rank get_num_ranks put_warp get_warp put_block get_block ld st atom_add fence_cta "
        "fence_gpu fence_sys wait_eq wait_ne wait_ge wait_le wait_gt wait_lt init_barrier_gpu "
        "arrive_barrier_gpu wait_barrier_gpu sync_barrier_gpu barrier_blocks sync_blocks notify"
    ).split():
        fn = getattr(T, name)
        assert fn.__doc__, name
    from tilelang.jit.kernel import JITKernel

    assert callable(JITKernel.initialize)


def _params(f):
    import inspect

    return ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(f).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    )


def test_spec_signatures():
    pe_kw = "unroll_factor=4, enable_aggressive_vectorize=False"
    assert _params(T.put_warp) == f"src, dst, size, dst_pe=-1, {pe_kw}"
    assert _params(T.get_warp) == f"src, dst, size, src_pe=-1, {pe_kw}"
    assert _params(T.put_block) == "src, dst, size, dst_pe=-1"
    assert _params(T.get_block) == "src, dst, size, src_pe=-1"
    assert _params(T.ld) == "src, value=None, scope='gpu', sem='weak', na=False, nc=False, src_pe=-1"
    assert _params(T.st) == "dst, value, scope='gpu', sem='weak', na=False, dst_pe=-1"
    assert _params(T.atom_add) == "target, value, scope='gpu', sem='relaxed'"
    for r in ("eq", "ne", "ge", "le", "gt", "lt"):
        assert _params(getattr(T, f"wait_{r}")) == "value, expected, peer=-1, scope='sys', semantics='acquire'"
    assert _params(T.copy) == "src, dst, src_pe=None, dst_pe=None"
    assert _params(T.tma_copy) == "src, dst, src_pe=None, dst_pe=None"
    assert _params(T.get_rank) == _params(T.get_num_ranks) == ""


def test_include_added_only_for_tilescale_kernels():
    src = lower_source(_rank_kernel())
    assert src.startswith(codegen.INCLUDE_LINE)
    assert "tilescale::get_rank()" in src
    assert codegen.INCLUDE_LINE not in lower_source(_stock_kernel())


def test_postproc_chains_previous_callback(monkeypatch):
    seen = []
    monkeypatch.setitem(codegen._state, "previous", lambda code, target: seen.append(1) or code + "// prev\n")
    out = codegen.postproc("tilescale::get_rank();\n", None)
    assert seen and out.startswith(codegen.INCLUDE_LINE) and out.endswith("// prev\n")


def test_uses_tilescale_detection():
    assert codegen.uses_tilescale(_rank_kernel())
    assert not codegen.uses_tilescale(_stock_kernel())


def test_compile_flags_and_timeout(monkeypatch):
    monkeypatch.delenv(headers.WAIT_TIMEOUT_ENV, raising=False)
    flags = headers.compile_flags()
    assert flags[0] == f"-I{headers.include_dir()}"
    assert flags[1].startswith("-DTILESCALE_ABI=") and len(flags) == 2
    monkeypatch.setenv(headers.WAIT_TIMEOUT_ENV, "250")
    assert headers.compile_flags()[-1] == "-DTILESCALE_WAIT_TIMEOUT_MS=250"
    monkeypatch.setenv(headers.WAIT_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="TILESCALE_WAIT_TIMEOUT_MS"):
        headers.compile_flags()
    monkeypatch.delenv(headers.WAIT_TIMEOUT_ENV)
    assert codegen.merge_flags("-O3")[:1] == ["-O3"]
    assert codegen.merge_flags(["-O3", flags[0]]).count(flags[0]) == 1


def test_abi_hash_changes_with_headers(tmp_path):
    copy = tmp_path / "inc"
    shutil.copytree(headers.INCLUDE_DIR, copy)
    assert headers.abi_hash(copy) == headers.abi_hash()
    target = copy / "tilescale" / "wait.cuh"
    target.write_text(target.read_text(encoding="utf-8") + "\n// changed\n")
    assert headers.abi_hash(copy) != headers.abi_hash()
    (copy / "tilescale" / "extra.cuh").write_text("#pragma once\n")
    assert len(headers.header_files(copy)) == len(headers.header_files()) + 1


@needs_toolkit
@pytest.mark.parametrize("timeout", [0, 100])
def test_every_header_compiles(tmp_path, timeout):
    """Every header together, and each on its own (self-contained), compiles for sm_90a with the
    toolkit (nvcc, or NVRTC + ptxas), under TileLang's options."""
    files = headers.header_files()
    assert {f.name for f in files} >= {"common.cuh", "copy.cuh", "memory.cuh", "wait.cuh", "barrier.cuh", "host.cuh", "tilescale.cuh"}
    kernel = 'extern "C" __global__ void k() {}\n'
    src = "".join(f"#include <tilescale/{f.name}>\n" for f in files) + kernel
    TOOLKIT.compile(src, tmp_path / "all", "cubin", options=[f"-DTILESCALE_WAIT_TIMEOUT_MS={timeout}"])
    for f in files:
        TOOLKIT.compile(f"#include <tilescale/{f.name}>\n" + kernel, tmp_path / f.stem, "ptx")


@needs_nvcc
def test_real_compile_produces_cubin_with_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tilelang.compile(_rank_kernel(), target=TARGET, execution_backend="tvm_ffi")
    assert kernel.execution_backend == "tvm_ffi"
    assert f"-I{headers.include_dir()}" in kernel.compile_flags
    assert any(f.startswith("-DTILESCALE_ABI=") for f in kernel.compile_flags)
    src = kernel.get_kernel_source()
    assert codegen.INCLUDE_LINE in src
    cuda_mod = kernel.adapter.rt_mod.imports[0]
    assert cuda_mod.kind == "cuda"
    # a stock kernel goes through untouched
    stock = tilelang.compile(_stock_kernel(), target=TARGET, execution_backend="tvm_ffi")
    assert not any("TILESCALE" in f for f in (stock.compile_flags or []))
    # the tracking wrapper is installed until the first launch reports the module: on every
    # kernel, a stock one too (the lean launcher finds a kernel's functions in its module)
    assert kernel.__dict__.get("_tilescale_state", {}).get("capturing")
    assert stock.__dict__.get("_tilescale_state", {}).get("capturing")


@needs_nvcc
def test_timeout_changes_cache_key(tmp_path, monkeypatch):
    """Same function, other timeout: a separate compile (the flag is in the cache key)."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(headers.WAIT_TIMEOUT_ENV, raising=False)
    k0 = tilelang.compile(_rank_kernel(), target=TARGET)
    monkeypatch.setenv(headers.WAIT_TIMEOUT_ENV, "123")
    k1 = tilelang.compile(_rank_kernel(), target=TARGET)
    assert k0 is not k1
    assert "-DTILESCALE_WAIT_TIMEOUT_MS=123" in k1.compile_flags
    assert "-DTILESCALE_WAIT_TIMEOUT_MS=123" not in k0.compile_flags


def test_compile_once_without_group_is_plain_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    calls = []
    wrapped = codegen.wrap_compile(lambda *a, **k: calls.append((a, k)) or "kernel")
    assert wrapped("f", compile_once=True, compile_group=None, target="x") == "kernel"
    assert calls == [(("f",), {"target": "x"})]
    assert wrapped("g") == "kernel"
    assert codegen.wrap_compile(wrapped) is wrapped


@needs_nvcc
def test_gpu_test_kernels_compile(tmp_path, monkeypatch):
    """The GPU suite's kernels lower and compile to cubins here (tvm_ffi), and the PE paths
    they use are in the source."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    import gpu_kernels

    gpu_kernels._cache.clear()
    kernels = [
        gpu_kernels.copy_kernel("float16"),
        gpu_kernels.rank_kernel(),
        gpu_kernels.exchange_kernel(),
        gpu_kernels.barrier_blocks_kernel(),
        gpu_kernels.grid_barrier_kernel(),
        gpu_kernels.rows_copy_kernel("uint8"),
        gpu_kernels.remote_copy_kernel(),
    ]
    for k in kernels:
        assert codegen.INCLUDE_LINE in k.get_kernel_source()
    assert "tilescale::get_warp<2, false>" in kernels[0].get_kernel_source()
    assert "tilescale::get_rows_block<8>" in kernels[-2].get_kernel_source()
    assert kernels[-1].get_kernel_source().count("tilescale::remap_ptr") == 2
    gpu_kernels._cache.clear()



@pytest.mark.parametrize("first", ["tilescale_lang.rank", "tilescale_lang.validation", "tilescale_lang.wait", "tilescale_lang._extension"])
def test_any_module_imported_first_still_extends_tilelang(first):
    """Importing a tilescale_lang module before tilelang (as autodoc does) must not leave the
    extension half-applied: the intrinsics are on T and no RuntimeWarning is raised."""
    import sys

    code = f"import {first}; import tilelang.language as T; assert callable(T.put_warp) and callable(T.wait_eq)"
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
