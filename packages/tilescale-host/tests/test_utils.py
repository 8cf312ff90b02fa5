"""Helpers adopted from triton_dist.utils: printing, random data, environment, device queries."""

from __future__ import annotations

import random

import pytest
import torch

from tilescale_host import utils
from tilescale_host.utils import dist_print, get_bool_env, get_int_env, has_tma, init_seed, rand_tensor


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False)])
def test_get_bool_env(monkeypatch, value, expected):
    monkeypatch.setenv("TS_FLAG", value)
    assert get_bool_env("TS_FLAG", not expected) is expected


def test_get_bool_env_reads_as_every_tilescale_switch(monkeypatch):
    """Issue 39: boolean variables read one way everywhere (tilescale_core.env.flag); get_bool_env
    had its own list and read a set-but-empty variable as off whatever the default."""
    from tilescale_core.env import FALSE, TRUE, flag

    for value in (*TRUE, *(v.upper() for v in TRUE), *FALSE, "", "  "):
        monkeypatch.setenv("TS_FLAG", value)
        for default in (False, True):
            assert get_bool_env("TS_FLAG", default) is flag("TS_FLAG", default), (value, default)
    monkeypatch.setenv("TS_FLAG", "")
    assert get_bool_env("TS_FLAG", True) is True
    for bad in ("2", "enabled"):
        monkeypatch.setenv("TS_FLAG", bad)
        with pytest.raises(ValueError, match=f"TS_FLAG={bad!r} is not a boolean"):
            get_bool_env("TS_FLAG", False)


def test_env_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("TS_UNSET", raising=False)
    assert get_bool_env("TS_UNSET", True) is True
    assert get_int_env("TS_UNSET", 7) == 7
    monkeypatch.setenv("TS_N", " 42 ")
    assert get_int_env("TS_N", 0) == 42
    monkeypatch.setenv("TS_N", "4x")
    with pytest.raises(ValueError, match="TS_N='4x' is not an integer"):
        get_int_env("TS_N", 0)
    monkeypatch.setenv("TS_FLAG", "perhaps")
    with pytest.raises(ValueError, match="TS_FLAG='perhaps' is not a boolean"):
        get_bool_env("TS_FLAG", False)


def test_dist_print_without_group(capsys, clean_env):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    dist_print("hidden")
    dist_print("shown", allowed_ranks=[1], prefix=True)
    dist_print("all", allowed_ranks="all", sep="-")
    assert capsys.readouterr().out == "[rank:1] shown\nall\n"
    with pytest.raises(ValueError, match="allowed_ranks"):
        dist_print("x", allowed_ranks="some")


@pytest.mark.ranks(2, cpu_only=True, timeout=60)
def test_dist_print_synchronised_over_a_group(rank, world_size):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        dist_print("hello", allowed_ranks="all", prefix=True, need_sync=True)
        dist_print("only zero")
    assert buf.getvalue() == ["[rank:0] hello\nonly zero\n", "[rank:1] hello\n"][rank]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_rand_tensor_floats_in_unit_range(dtype):
    t = rand_tensor((64, 33), dtype, device="cpu")
    assert t.shape == (64, 33) and t.dtype == dtype
    f = t.float()
    assert f.min() >= -1 and f.max() <= 1 and f.std() > 0.3


@pytest.mark.parametrize(("dtype", "low", "high"), [(torch.int8, -128, 127), (torch.int32, -128, 127), (torch.uint8, 0, 255)])
def test_rand_tensor_ints(dtype, low, high):
    t = rand_tensor(4096, dtype, device="cpu")
    assert t.dtype == dtype and t.min() >= low and t.max() <= high and t.unique().numel() > 50


def test_rand_tensor_bool():
    assert rand_tensor([100], torch.bool, device="cpu").dtype == torch.bool


def test_init_seed_is_reproducible():
    init_seed(3)
    a = (random.random(), torch.rand(3))
    init_seed(3)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_device_queries_without_gpu(monkeypatch):
    monkeypatch.setattr(utils._cuda, "device_count", lambda: 0)
    assert has_tma() is False


@pytest.mark.gpu
def test_device_queries_on_gpu():
    assert utils.get_device_max_shared_memory_size(0) >= 48 * 1024
    assert utils.get_max_gpu_clock_rate_in_khz(0) >= utils.get_current_gpu_clock_rate_in_khz(0) > 0
    assert utils.get_numa_node(0) >= -1
    assert has_tma() == (torch.cuda.get_device_capability()[0] >= 9)
