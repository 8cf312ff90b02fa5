"""Issue 45: the host-side names upstream TileScale's programs import (CPU).

``tilelang.distributed.utils``, the additions to ``tilelang.distributed`` /
``tilelang.distributed.host``, ``CUDA_CHECK``, ``dtype_map``, ``init_distributed``,
``create_mapped_tensor`` and ``tilelang.testing.requires_distributed``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import tilescale_host
from tilescale_host import compat
from tilescale_host import testing as ts_testing

#: Every ``from tilelang.distributed[.utils] import ...`` line of upstream's
#: examples/distributed/*.py, primitives/*.py, deepseek_deepep/*, the gemm_rs / sp helper files
#: and tilelang/distributed/testing/*.py (upstream commit 4704282).
UPSTREAM_IMPORTS = {
    "tilelang.distributed": ["init_dist", "init_distributed", "dtype_map", "perf_fn"],
    "tilelang.distributed.utils": ["CUDA_CHECK", "has_fullmesh_nvlink", "init_distributed", "init_dist",
                                   "create_mapped_tensor"],
}


@pytest.mark.parametrize("module", sorted(UPSTREAM_IMPORTS))
def test_every_name_upstream_programs_import_is_there(module):
    mod = importlib.import_module(module)
    for name in UPSTREAM_IMPORTS[module]:
        assert hasattr(mod, name), f"{module}.{name}"


def test_utils_names_are_the_product_functions():
    import tilelang.distributed.utils as utils

    from tilescale_host import bench, dist_init, signals, topology, utils as host_utils

    assert utils.init_dist is dist_init.init_dist
    assert utils.perf_fn is bench.perf_fn
    assert utils.has_fullmesh_nvlink is topology.has_fullmesh_nvlink
    assert utils.has_fullmesh_nvlink_pynvml is topology.has_fullmesh_nvlink_pynvml
    assert utils.NvidiaSmiUtil is topology.NvidiaSmiUtil
    assert utils.supports_p2p_native_atomic is topology.supports_p2p_native_atomic
    assert utils.cuda_stream_max_priority is topology.cuda_stream_max_priority
    assert utils.set_signal is signals.set_signal and utils.wait_eq is signals.wait_eq
    assert utils.dist_print is host_utils.dist_print
    for name in compat.__all__:
        assert getattr(utils, name) is getattr(compat, name), name
    for name in utils.__all__:
        assert hasattr(utils, name), name


def test_host_and_package_reexport_the_new_names():
    import tilelang.distributed as td
    from tilelang.distributed import host

    for name in compat.__all__:
        assert getattr(host, name) is getattr(compat, name), name
        assert getattr(td, name) is getattr(compat, name), name
        assert getattr(tilescale_host, name) is getattr(compat, name), name
    from tilelang.distributed.host import CUDA_CHECK

    assert CUDA_CHECK is compat.CUDA_CHECK


def test_dtype_map_is_upstreams():
    assert compat.dtype_map == {
        "bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2, "s8": torch.int8, "s32": torch.int32, "float32": torch.float32,
    }


# ------------------------------------------------------------------------------ CUDA_CHECK
def test_cuda_check_passes_success():
    from cuda.bindings import driver, runtime

    assert compat.CUDA_CHECK(driver.CUresult.CUDA_SUCCESS) is None
    assert compat.CUDA_CHECK(runtime.cudaError_t.cudaSuccess) is None


@pytest.mark.parametrize("status_of", [
    lambda d, r: d.CUresult.CUDA_ERROR_INVALID_VALUE,
    lambda d, r: r.cudaError_t.cudaErrorInvalidValue,
])
def test_cuda_check_raises_a_runtime_error_naming_the_status(status_of):
    import tilescale_core
    from cuda.bindings import driver, runtime

    status = status_of(driver, runtime)
    with pytest.raises(tilescale_core.CudaError) as info:
        compat.CUDA_CHECK(status)
    assert isinstance(info.value, RuntimeError)  # what upstream raises
    assert info.value.name == status.name and info.value.code == int(status) == 1
    assert status.name in str(info.value)


def test_cuda_check_takes_a_whole_result_tuple():
    from cuda.bindings import driver, runtime

    ok = runtime.cudaError_t.cudaSuccess
    assert compat.CUDA_CHECK((ok,)) is None
    assert compat.CUDA_CHECK((ok, 7)) == 7
    assert compat.CUDA_CHECK((driver.CUresult.CUDA_SUCCESS, 1, 2)) == (1, 2)
    with pytest.raises(RuntimeError, match="cudaErrorMemoryAllocation"):
        compat.CUDA_CHECK((runtime.cudaError_t.cudaErrorMemoryAllocation, None))


@pytest.mark.parametrize("bad", [0, 1, None, "CUDA_SUCCESS", ()])
def test_cuda_check_refuses_what_is_not_a_status(bad):
    with pytest.raises(TypeError, match="CUDA_CHECK"):
        compat.CUDA_CHECK(bad)


# ------------------------------------------------------------------------ init_distributed
@pytest.fixture
def fake_init_dist(clean_env, monkeypatch):
    calls = []
    group = object()

    def init_dist(local_rank, num_local_ranks):
        calls.append((local_rank, num_local_ranks))
        return local_rank, num_local_ranks, group

    from tilescale_host import dist_init

    monkeypatch.setattr(dist_init, "init_dist", init_dist)
    # No pynvshmem importable (tilescale-host's own one is tested in test_pynvshmem.py).
    monkeypatch.setitem(sys.modules, "pynvshmem", None)
    return calls, group


def test_init_distributed_reads_torchrun_variables(fake_init_dist, monkeypatch):
    calls, group = fake_init_dist
    for name, value in {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    assert compat.init_distributed() == (4, 2, 2)
    assert compat.init_distributed(return_tp_group=True) == (4, 2, 2, group)
    assert compat.init_distributed(return_lc_group=True) == (4, 2, 2, group, group)
    assert compat.init_distributed(return_tp_group=True, return_lc_group=True) == (4, 2, 2, group, group)
    assert calls == [(2, 4)] * 4  # through init_dist, with its checks


def test_init_distributed_defaults_to_one_rank(fake_init_dist):
    calls, _ = fake_init_dist
    assert compat.init_distributed(init_nvshmem=False) == (1, 0, 0)
    assert calls == [(0, 1)]


def test_init_distributed_uses_pynvshmem_only_when_installed(fake_init_dist, monkeypatch):
    calls, group = fake_init_dist
    compat.init_distributed()  # no pynvshmem: nothing to initialise, no error
    seen = []
    monkeypatch.setitem(sys.modules, "pynvshmem", types.SimpleNamespace(init_nvshmem_by_uniqueid=seen.append))
    compat.init_distributed()
    compat.init_distributed(init_nvshmem=False)
    assert seen == [group]


@pytest.mark.parametrize("env, match", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, "RANK=3 differs from LOCAL_RANK=1: a multi-node launch"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
])
def test_init_distributed_refuses(fake_init_dist, monkeypatch, env, match):
    calls, _ = fake_init_dist
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        compat.init_distributed()
    assert calls == []


def test_init_distributed_goes_through_init_dists_checks(clean_env, monkeypatch):
    """The real init_dist: on a machine without a GPU it refuses before any rendezvous."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        compat.init_distributed()


# --------------------------------------------------------------------- create_mapped_tensor
def test_create_mapped_tensor_is_create_host_device_tensor(monkeypatch):
    from tilescale_core import shared_memory

    monkeypatch.setattr(shared_memory, "create_host_device_tensor", lambda shape, dtype: ("mapped", shape, dtype))
    assert compat.create_mapped_tensor((4, 2), torch.float32) == ("mapped", (4, 2), torch.float32)


def test_create_mapped_tensor_refuses_non_positive_dimensions():
    with pytest.raises(ValueError, match="dimensions must be positive"):
        compat.create_mapped_tensor((4, 0), torch.float32)


# -------------------------------------------------------------------- requires_distributed
def _marks(func):
    return {m.name: m for m in getattr(func, "pytestmark", [])}


def test_requires_distributed_marks_and_runs_by_default(monkeypatch):
    monkeypatch.delenv(ts_testing.DISTRIBUTED_ENV, raising=False)

    @ts_testing.requires_distributed
    def test_x():
        pass

    marks = _marks(test_x)
    assert "distributed" in marks
    assert marks["skipif"].args == (False,)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_requires_distributed_skips_when_switched_off(monkeypatch, value):
    monkeypatch.setenv(ts_testing.DISTRIBUTED_ENV, value)

    @ts_testing.requires_distributed
    def test_x():
        pass

    skip = _marks(test_x)["skipif"]
    assert skip.args == (True,) and skip.kwargs["reason"] == f"TILELANG_USE_DISTRIBUTED={value!r} turns distributed tests off"


def test_requires_distributed_refuses_an_unreadable_switch(monkeypatch):
    monkeypatch.setenv(ts_testing.DISTRIBUTED_ENV, "maybe")
    with pytest.raises(ValueError, match="TILELANG_USE_DISTRIBUTED='maybe' is not a boolean"):
        ts_testing.requires_distributed(lambda: None)


def test_requires_distributed_skips_without_torch_distributed(monkeypatch):
    import torch.distributed as dist

    monkeypatch.delenv(ts_testing.DISTRIBUTED_ENV, raising=False)
    monkeypatch.setattr(dist, "is_available", lambda: False)
    assert ts_testing.distributed_skip_reason() == "this torch build has no torch.distributed"


def test_tilelang_testing_gets_it_only_when_imported():
    """A fresh interpreter: ``import tilelang`` does not import tilelang.testing (nor pytest);
    importing it brings the name, in ``__all__`` too; stock names are untouched."""
    code = textwrap.dedent("""
        import sys, tilelang
        assert "tilelang.testing" not in sys.modules and "pytest" not in sys.modules
        import tilelang.testing
        from tilelang.testing import requires_distributed, requires_cuda
        import tilescale_host.testing as t
        assert requires_distributed is t.requires_distributed
        assert "requires_distributed" in tilelang.testing.__all__
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_a_stock_requires_distributed_would_win():
    from tilescale_host import _extension

    stock = types.SimpleNamespace(requires_distributed="stock's", __all__=["requires_distributed"])
    _extension.add_testing_names(stock)
    assert stock.requires_distributed == "stock's" and stock.__all__ == ["requires_distributed"]
    bare = types.SimpleNamespace(__all__=["main"])
    _extension.add_testing_names(bare)
    assert bare.requires_distributed is ts_testing.requires_distributed and bare.__all__ == ["main", "requires_distributed"]


_UPSTREAM_STYLE_TEST = '''
import tilelang.testing


@tilelang.testing.requires_distributed
def test_two_ranks():
    assert True
'''


@pytest.mark.parametrize("switch, outcome", [(None, {"passed": 1}), ("0", {"skipped": 1})])
def test_an_upstream_style_test_file_runs(pytester, monkeypatch, switch, outcome):
    """Upstream's primitives/test_*.py pattern: no collection error, no unknown-marker
    warning, runs by default and is skipped with TILELANG_USE_DISTRIBUTED=0."""
    if switch is None:
        monkeypatch.delenv(ts_testing.DISTRIBUTED_ENV, raising=False)
    else:
        monkeypatch.setenv(ts_testing.DISTRIBUTED_ENV, switch)
    pytester.makepyfile(test_upstream_style=_UPSTREAM_STYLE_TEST)
    result = pytester.runpytest_subprocess("-W", "error::pytest.PytestUnknownMarkWarning", "-m", "distributed")
    result.assert_outcomes(**outcome)
