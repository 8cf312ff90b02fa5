"""The import hook: nothing heavy at interpreter start, the names on tilelang, and a clean opt-out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap



def run_python(code: str, **env) -> str:
    full_env = {k: v for k, v in os.environ.items() if k != "TILESCALE_DISABLE_HOOK"}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_interpreter_start_imports_nothing_heavy():
    out = run_python(
        """
        import sys
        from tilescale_core._bootstrap import TilelangFinder
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tilelang', 'torch', 'cuda', 'tvm', 'tvm_ffi', 'numpy'))
        print(heavy, any(isinstance(f, TilelangFinder) for f in sys.meta_path))
        """
    )
    assert out == "[] True"


def test_names_on_stock_tilelang():
    out = run_python(
        """
        import tilelang, tilescale_core, tvm_ffi
        assert tilelang.get_allocator is tilescale_core.get_allocator
        assert tilelang.tensor is tilescale_core.tensor
        import tilelang.distributed as d
        import tilelang.distributed.shared_memory as sm
        from tilelang.distributed import BaseAllocator, get_allocator, tensor, tensor_from_ptr
        assert BaseAllocator is tilescale_core.BaseAllocator and tensor_from_ptr is tilescale_core.tensor_from_ptr
        assert callable(sm._supports_multicast) and callable(sm._mc_get_aligned_size)
        assert tvm_ffi.get_global_func('tl.shared_memory.vmm_malloc', allow_missing=True) is not None
        import os
        stock = tilelang.__path__[0]
        assert not os.path.exists(os.path.join(stock, 'distributed')), 'a file was written into stock tilelang'
        import torch
        print(torch.cuda.is_initialized())
        """
    )
    assert out.splitlines()[-1] == "False"  # attaching TileScale initialises no CUDA


def test_disabled_hook_leaves_stock_tilelang():
    out = run_python(
        """
        import tilelang
        print(hasattr(tilelang, 'get_allocator'), hasattr(tilelang, 'tensor'))
        try:
            import tilelang.distributed
        except ModuleNotFoundError:
            print('no distributed')
        """,
        TILESCALE_DISABLE_HOOK="1",
    )
    assert out.splitlines() == ["False False", "no distributed"]


def test_doctor_runs_and_exits_zero():
    out = run_python("import runpy, sys; sys.argv=['doctor']; runpy.run_module('tilescale_core.doctor', run_name='__main__')")
    assert "Memory paths" in out and "CUDA IPC" in out and "VMM fabric" in out and "multicast" in out.lower()
    import torch

    if not torch.cuda.is_available():
        assert "no GPU" in out


class _FakeEntryPoint:
    def __init__(self, name, fn):
        self.name, self.value, self._fn = name, f"fake:{name}", fn

    def load(self):
        return self._fn


def test_a_broken_extension_warns_and_the_others_still_apply(monkeypatch):
    import types

    import pytest

    from tilescale_core import _bootstrap

    calls = []

    def broken(module):
        raise RuntimeError("boom")

    eps = [_FakeEntryPoint("a_broken", broken), _FakeEntryPoint("b_good", lambda m: calls.append(m.__name__))]
    monkeypatch.setattr(_bootstrap, "extension_entry_points", lambda: eps)
    module = types.ModuleType("fake_tilelang")
    with pytest.warns(RuntimeWarning, match=r"'a_broken' \(fake:a_broken\) failed and was skipped: RuntimeError: boom"):
        assert _bootstrap.extend(module) == ["b_good"]
    assert calls == ["fake_tilelang"]
    assert _bootstrap.extend(module) == ["b_good"]  # idempotent: nothing runs twice
    assert calls == ["fake_tilelang"]


def test_finder_only_answers_for_top_level_tilelang():
    from tilescale_core._bootstrap import TilelangFinder, _ExtendingLoader

    finder = TilelangFinder()
    assert finder.find_spec("tilelang.language", None) is None
    assert finder.find_spec("numpy", None) is None
    spec = finder.find_spec("tilelang", None)
    assert spec is not None and isinstance(spec.loader, _ExtendingLoader)
