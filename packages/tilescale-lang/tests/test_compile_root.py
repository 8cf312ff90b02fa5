"""compile_root / compile_group on tilelang.compile and @tilelang.jit (CPU: real processes
over gloo, real nvcc compiles and failures)."""

from __future__ import annotations

import importlib

import pytest
from lang_helpers import have_nvcc, needs_nvcc

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


#: The 3-rank scenarios: name -> (rank body, its extra arguments, needs nvcc). Each compiles a
#: kernel of its own (its own ``scale`` or flags), so no scenario finds another's kernel in a
#: cache; each has a TileLang cache directory of its own as well.
SCENARIOS = {
    "root compiles": ("_root_compiles", (7,), True),
    "root fails (compile)": ("_root_fails", ("compile",), True),
    "root fails (jit)": ("_root_fails", ("jit",), True),
    "once+group (compile)": ("_once_with_group", ("compile", 9), True),
    "once+group (jit)": ("_once_with_group", ("jit", 11), True),
    "once+group (compile fails)": ("_once_with_group", ("compile fails", 13), True),
    "once+group (jit fails)": ("_once_with_group", ("jit fails", 15), True),
    "fake compiler (world)": ("_once_with_a_fake_compiler", (False,), False),
    "fake compiler (sub-group)": ("_once_with_a_fake_compiler", (True,), False),
    "root first": ("_once_with_a_group_succeeds", (), False),
    "disagree": ("_disagree", (), False),
    "not a member": ("_not_a_member", (), False),
}


def _every_scenario(rank, world, cache_root, names):
    """Rank body: each scenario of ``names`` in order (all ranks run the same sequence, so
    their collectives pair up), with its own cache directory; ``{name: result}``."""
    import os

    import torch.distributed as dist

    results = {}
    for name in names:
        body, args, _ = SCENARIOS[name]
        cache_dir = os.path.join(cache_root, str(list(SCENARIOS).index(name)))
        os.environ["TILELANG_CACHE_DIR"] = cache_dir
        results[name] = globals()[body](rank, world, cache_dir, *args)
        dist.barrier()  # a scenario's last rank is done before the next one starts
    return results


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """The result of every scenario on 3 gloo ranks, from ONE run of spawned ranks (each rank
    imports torch and TileLang once, not once per test): ``{name: [result per rank]}``.
    Scenarios that compile with nvcc are left out without it."""
    from tilescale_core.multiprocess import run_ranks

    names = [n for n, (_, _, nvcc) in SCENARIOS.items() if have_nvcc() or not nvcc]
    out = run_ranks(_every_scenario, 3, args=(str(tmp_path_factory.mktemp("compile-root")), names),
                    backend="gloo", timeout=600)
    return {name: [per_rank[name] for per_rank in out] for name in names}


def _assert_every_rank_raised_the_roots_error(out, root: int, how: str) -> None:
    """Every rank raised the root's nvcc error, ``compile on root rank <root> (<how>) failed``;
    only the root ran nvcc."""
    for rank, o in enumerate(out):
        assert o["error"] is not None, f"rank {rank} did not raise"
        assert f"compile on root rank {root} ({how}) failed" in o["error"]
        assert "no-such-nvcc-flag" in o["error"], o["error"][-2000:]  # the root's nvcc message
        assert o["root"] == root
    assert [o["nvcc"] for o in out] == [int(rank == root) for rank in range(len(out))]  # only the root tried


def _root_compiles(rank, world, cache_dir, scale):
    import tilelang
    import torch.distributed as dist

    calls = _count_nvcc()
    k = tilelang.compile(_kernel(scale), target=TARGET, compile_root=1, compile_group=dist.group.WORLD)
    return {"nvcc": len(calls), "source_ok": "tilescale::get_rank()" in k.get_kernel_source()}


@needs_nvcc
def test_root_compiles_and_the_others_load(scenarios):
    out = scenarios["root compiles"]
    assert [o["nvcc"] for o in out] == [0, 1, 0], out  # only rank 1 ran nvcc; 0 and 2 hit the cache
    assert all(o["source_ok"] for o in out)


def _root_fails(rank, world, cache_dir, how):
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
def test_a_failure_on_the_root_raises_on_every_rank(how, scenarios):
    """Never a hang, never a bare 'process exited': each rank raises with the root's message."""
    _assert_every_rank_raised_the_roots_error(scenarios[f"root fails ({how})"], 2, "compile_root=2")


def _disagree(rank, world, cache_dir):
    try:
        compile_from_root(lambda: "k", root=rank)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_the_root_get_an_error(scenarios):
    out = scenarios["disagree"]
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


# ------------------------------------------- issue 45: compile_once + compile_group = the group's root
def _once_with_group(rank, world, cache_dir, how, scale):
    import tilelang
    import torch.distributed as dist

    calls = _count_nvcc()
    group = dist.group.WORLD
    flags = ["--no-such-nvcc-flag"] if how.endswith("fails") else []
    try:
        if how.startswith("jit"):
            @tilelang.jit(target=TARGET, compile_once=True, compile_group=group, compile_flags=flags)
            def build(scale):
                return _kernel(scale)

            k = build(scale)
        else:
            k = tilelang.compile(_kernel(scale), target=TARGET, compile_once=True, compile_group=group,
                                 compile_flags=flags)
    except RuntimeError as exc:
        return {"nvcc": len(calls), "error": str(exc), "type": type(exc).__name__,
                "root": getattr(exc, "root", None)}
    return {"nvcc": len(calls), "error": None, "source_ok": "tilescale::get_rank()" in k.get_kernel_source()}


@needs_nvcc
@pytest.mark.parametrize("how", ["compile", "jit"])
def test_compile_once_with_a_group_compiles_on_its_root_only(how, scenarios):
    """Only group rank 0 runs nvcc; ranks 1 and 2 load its result (from the disk cache)."""
    out = scenarios[f"once+group ({how})"]
    assert [o["error"] for o in out] == [None] * 3, out
    assert [o["nvcc"] for o in out] == [1, 0, 0], out
    assert all(o["source_ok"] for o in out)


@needs_nvcc
@pytest.mark.parametrize("how", ["compile fails", "jit fails"])
def test_compile_once_with_a_group_root_failure_raises_everywhere(how, scenarios):
    out = scenarios[f"once+group ({how})"]
    _assert_every_rank_raised_the_roots_error(out, 0, "compile_once=True with compile_group")
    assert [o["type"] for o in out] == ["CompileRootError"] * 3


def _once_with_a_fake_compiler(rank, world, cache_dir, sub_group):
    """The compiler itself replaced by a function that records its calls; it fails on the
    root.  ``sub_group``: the group is global ranks [1, 2] (its root is global rank 1)."""
    import torch.distributed as dist

    from tilescale_lang import codegen

    calls = []

    def compiler(*args, **kwargs):
        calls.append((args, kwargs))
        raise ValueError(f"syntax error reported by the compiler on global rank {rank}")

    compile_fn = codegen.wrap_compile(compiler)
    group = dist.new_group([1, 2]) if sub_group else dist.group.WORLD  # collective: every rank
    if sub_group and rank == 0:
        return {"calls": 0, "error": None}  # not a member: never compiles
    try:
        compile_fn("prim_func", target="cuda", compile_once=True, compile_group=group)
    except RuntimeError as exc:
        return {"calls": len(calls), "error": str(exc), "is_runtime_error": isinstance(exc, RuntimeError)}
    return {"calls": len(calls), "error": None}


@pytest.mark.parametrize("sub_group", [False, True])
def test_compile_once_with_a_group_never_calls_the_compiler_off_the_root(sub_group, scenarios):
    """CPU, no nvcc: the compiler is called once, on the group's rank 0, and its error (a
    ValueError there) reaches every member as a RuntimeError carrying its message."""
    out = scenarios["fake compiler (sub-group)" if sub_group else "fake compiler (world)"]
    root = 1 if sub_group else 0
    members = [1, 2] if sub_group else [0, 1, 2]
    assert [o["calls"] for o in out] == [int(r == root) for r in range(3)], out
    for r in members:
        assert out[r]["is_runtime_error"], out[r]
        assert "compile on root rank 0 (compile_once=True with compile_group) failed" in out[r]["error"]
        assert f"ValueError: syntax error reported by the compiler on global rank {root}" in out[r]["error"]
    if sub_group:
        assert out[0]["error"] is None


def _once_with_a_group_succeeds(rank, world, cache_dir):
    import time

    import torch.distributed as dist

    from tilescale_lang import codegen

    def compiler(*args, **kwargs):
        start = time.monotonic()
        if rank == 0:
            time.sleep(0.5)  # a slow compile on the root
        return (f"kernel from rank {rank}", start, time.monotonic())

    compile_fn = codegen.wrap_compile(compiler)
    if rank != 0:
        time.sleep(0.1)  # the others arrive while the root is still compiling
    return compile_fn("f", compile_once=True, compile_group=dist.group.WORLD)


def test_compile_once_with_a_group_root_compiles_before_the_others_load(scenarios):
    """The root's compile completes before any other rank asks for the kernel (the others'
    call is then a cache load; here the same fake)."""
    out = scenarios["root first"]
    assert [o[0] for o in out] == ["kernel from rank 0", "kernel from rank 1", "kernel from rank 2"]
    root_done = out[0][2]
    assert all(o[1] >= root_done for o in out[1:]), out  # CLOCK_MONOTONIC is system-wide


def test_compile_once_routes(monkeypatch):
    """coordinate(): compile_once with a group -> compile_from_root(group, root 0); without a
    group -> the lock only; compile_root wins over both."""
    from tilescale_lang import compile_lock, compile_root

    seen = []
    monkeypatch.setattr(compile_root, "compile_from_root",
                        lambda build, group, root, **kw: seen.append(("root", group, root, kw.get("option"))) or "r")
    monkeypatch.setattr(compile_lock, "compile_once", lambda build, group=None, **kw: seen.append(("lock",)) or "l")
    g = object()
    assert coordinate(lambda: "plain") == "plain"
    assert coordinate(lambda: "x", True, g) == "r"
    assert coordinate(lambda: "x", True, None) == "l"
    assert coordinate(lambda: "x", True, g, 2) == "r"
    assert coordinate(lambda: "x", False, g, 1) == "r"
    assert coordinate(lambda: "plain", False, g) == "plain"  # a group alone changes nothing
    assert seen == [("root", g, 0, "compile_once=True with compile_group"), ("lock",),
                    ("root", g, 2, None), ("root", g, 1, None)]


def test_compile_root_error_pickles_with_its_fields():
    import pickle

    err = pickle.loads(pickle.dumps(CompileRootError(0, "nvcc: bad flag", "compile_once=True with compile_group")))
    assert isinstance(err, RuntimeError)
    assert (err.root, err.root_message, err.option) == (0, "nvcc: bad flag", "compile_once=True with compile_group")
    assert str(err) == "compile on root rank 0 (compile_once=True with compile_group) failed:\nnvcc: bad flag"
    assert "compile_root=3" in str(CompileRootError(3, "m"))


def _not_a_member(rank, world, cache_dir):
    import torch.distributed as dist

    group = dist.new_group([0])
    if rank != 0:
        try:
            compile_from_root(lambda: "k", group=group, root=0)
        except ValueError as exc:
            return str(exc)
    return None


def test_a_process_outside_the_group_gets_an_error(scenarios):
    out = scenarios["not a member"]
    assert out[0] is None and all("not a member of compile_group" in o for o in out[1:]), out
