"""tilelang.distributed.host: the extension, the facade module and the lazy package API."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest

import tilescale_host
from tilescale_host import _extension


def _load_facade():
    spec = importlib.util.spec_from_file_location("_host_facade", _extension.FACADE_DIR / "distributed" / "host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extension_appends_facade_dir_once():
    fake = types.SimpleNamespace(__path__=["/stock/tilelang"])
    _extension.extend(fake)
    _extension.extend(fake)
    assert fake.__path__ == ["/stock/tilelang", str(_extension.FACADE_DIR)]


def test_facade_exports_match_the_package_api():
    facade = _load_facade()
    public = [n for n in tilescale_host.__all__ if n != "__version__"]
    assert sorted(facade.__all__) == sorted(public)
    for name in facade.__all__:
        assert getattr(facade, name) is getattr(tilescale_host, name), name


def test_package_import_is_light():
    code = "import sys, tilescale_host; assert 'torch' not in sys.modules; tilescale_host.get_int_env"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_spec_spelling_imports():
    """``from tilelang.distributed.host import init_dist`` (needs tilescale-core's whole facade)."""
    pytest.importorskip("tilescale_core.allocator", reason="tilescale-core's allocator is not installed yet")
    from tilelang.distributed import host
    from tilelang.distributed.host import init_dist

    import tilelang.distributed as td

    assert init_dist is tilescale_host.init_dist
    assert set(host.__all__) <= set(td.__all__) and td.wait_eq is tilescale_host.wait_eq


def test_bench_module_path_of_upstream():
    """Upstream scripts import perf_fn / do_bench from tilelang.distributed.bench."""
    import importlib

    import tilescale_host.bench as impl

    mod = importlib.import_module("tilelang.distributed.bench")
    from tilelang.distributed.bench import do_bench, perf_fn

    assert do_bench is impl.do_bench and perf_fn is impl.perf_fn
    assert set(mod.__all__) >= {"do_bench", "perf_fn"}
