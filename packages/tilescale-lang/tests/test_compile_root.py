"""compile_root / compile_group on tilelang.compile and @tilelang.jit (CPU: real processes
over gloo, real nvcc compiles and failures)."""

from __future__ import annotations

import importlib

import pytest
from lang_helpers import needs_nvcc

from tilescale_lang import codegen
from tilescale_lang.compile_root import CompileRootError, compile_from_root, coordinate

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _kernel(scale):
    import tilelang.language as T

    @T.prim_func
    def scaled_rank(R: T.Tensor((2,), "int32"), S: T.int32):
        with T.Kernel(1, threads=32) as _:
            R[0] = T.get_rank() * scale + S

    return scaled_rank


def _count_nvcc():
    """Count this process's nvcc runs (TileLang's CUDA compile callback calls this)."""
    import tilelang.contrib.nvcc as nvcc

    calls = []
    original = nvcc.compile_cuda

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    nvcc.compile_cuda = counting
    return calls


def _root_compiles(rank, world, cache_dir, scale):
    import os

    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import tilelang
    import torch.distributed as dist

    calls = _count_nvcc()
    k = tilelang.compile(_kernel(scale), target=TARGET, compile_root=1, compile_group=dist.group.WORLD)
    return {"nvcc": len(calls), "source_ok": "tilescale::get_rank()" in k.get_kernel_source()}


@needs_nvcc
def test_root_compiles_and_the_others_load(tmp_path):
    from tilescale_core.multiprocess import run_ranks

    out = run_ranks(_root_compiles, 3, args=(str(tmp_path), 7), backend="gloo", timeout=300)
    assert [o["nvcc"] for o in out] == [0, 1, 0], out  # only rank 1 ran nvcc; 0 and 2 hit the cache
    assert all(o["source_ok"] for o in out)


def _root_fails(rank, world, cache_dir, how):
    import os

    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import tilelang

    calls = _count_nvcc()
    try:
        if how == "compile":
            tilelang.compile(_kernel(3), target=TARGET, compile_root=2, compile_flags=["--no-such-nvcc-flag"])
        else:
            @tilelang.jit(target=TARGET, compile_once=True, compile_root=2, compile_flags=["--no-such-nvcc-flag"])
            def build(scale):
                return _kernel(scale)

            build(5)
    except CompileRootError as exc:
        return {"error": str(exc), "nvcc": len(calls), "root": exc.root}
    return {"error": None, "nvcc": len(calls)}


@needs_nvcc
@pytest.mark.parametrize("how", ["compile", "jit"])
def test_a_failure_on_the_root_raises_on_every_rank(how, tmp_path):
    """Never a hang, never a bare 'process exited': each rank raises with the root's message."""
    from tilescale_core.multiprocess import run_ranks

    out = run_ranks(_root_fails, 3, args=(str(tmp_path), how), backend="gloo", timeout=300)
    for rank, o in enumerate(out):
        assert o["error"] is not None, f"rank {rank} did not raise"
        assert "compile on root rank 2 (compile_root=2) failed" in o["error"]
        assert "no-such-nvcc-flag" in o["error"], o["error"][-2000:]  # the root's nvcc message
        assert o["root"] == 2
    assert [o["nvcc"] for o in out] == [0, 0, 1]  # only the root tried


def _disagree(rank, world):
    try:
        compile_from_root(lambda: "k", root=rank)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_the_root_get_an_error():
    from tilescale_core.multiprocess import run_ranks

    out = run_ranks(_disagree, 2, backend="gloo", timeout=60)
    assert all(o and "disagree on compile_root" in o for o in out), out


def test_single_process_and_argument_checks(tmp_path):
    assert compile_from_root(lambda: "kernel", root=0, cache_dir=tmp_path) == "kernel"
    with pytest.raises(ValueError, match=r"compile_root must be a group rank in \[0, 1\)"):
        compile_from_root(lambda: "kernel", root=1, cache_dir=tmp_path)
    with pytest.raises(TypeError, match="compile_root"):
        compile_from_root(lambda: "kernel", root="0", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not initialised"):
        compile_from_root(lambda: "kernel", group=object(), root=0, cache_dir=tmp_path)
    assert coordinate(lambda: 3) == 3


def test_jit_accepts_the_options_and_keeps_them_per_function():
    import tilelang

    tl_jit = importlib.import_module("tilelang.jit")
    assert tilelang.jit is tl_jit.jit and getattr(tilelang.jit, "__tilescale_wrapped__", False)

    @tilelang.jit(compile_once=True, compile_group=None, compile_root=0, target=TARGET)
    def f(scale):
        return _kernel(scale)

    @tilelang.jit
    def g(scale):
        return _kernel(scale)

    assert f.__dict__[codegen.JIT_OPTIONS] == (True, None, 0)
    assert codegen.JIT_OPTIONS not in g.__dict__
    assert isinstance(f, tl_jit.JITImpl) and isinstance(g, tl_jit.JITImpl)


def test_jit_compiles_are_coordinated(monkeypatch):
    """Each compile of a decorated function goes through coordinate() with its options."""
    import tilelang

    from tilescale_lang import compile_root

    seen = []
    monkeypatch.setattr(compile_root, "coordinate", lambda build, *opts: seen.append(opts) or "coordinated")

    @tilelang.jit(compile_root=0, target=TARGET)
    def f(scale):
        return _kernel(scale)

    assert f.compile(3) == "coordinated"
    assert seen == [(False, None, 0)]
