"""Issue 45: ``tilelang.utils.target`` (upstream TileScale's module path of the target helpers)
as aliases of stock TileLang's, added only where stock has no such module (CPU)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def test_the_names_upstream_programs_import():
    """examples/distributed/reduce_scatter.py and upstream's own tests and tools."""
    from tilelang.utils.target import (  # noqa: F401
        check_cuda_availability,
        check_hip_availability,
        determine_target,
        target_is_hopper,
        target_is_volta,
    )


def test_every_alias_is_the_stock_function():
    import tilelang.utils.target as target

    stock_homes = [importlib.import_module(m) for m in
                   ("tilelang.backend.target", "tilelang.cuda.target", "tilelang.rocm.target", "tilelang.metal.target")]
    own = {"target_get_warp_size", "parse_device"}
    for name in target.__all__:
        fn = getattr(target, name)
        if name in own:
            assert all(getattr(home, name, None) is not fn for home in stock_homes)
            continue
        assert any(getattr(home, name, None) is fn for home in stock_homes), name


def test_stock_has_no_such_module_and_ours_comes_after_stocks_directory():
    import tilelang.utils
    import tilelang.utils.target as target

    from tilescale_lang import _extension

    stock_dir = tilelang.utils.__path__[0]
    assert stock_dir == os.path.dirname(tilelang.utils.__file__)
    assert not os.path.exists(os.path.join(stock_dir, "target.py"))  # else stock's would be found first
    assert tilelang.utils.__path__.index(str(_extension.UTILS_FACADE_DIR)) > 0  # after stock's directory
    assert target.__file__.startswith(str(_extension.UTILS_FACADE_DIR))
    _extension.add_utils_facade(tilelang.utils)
    assert tilelang.utils.__path__.count(str(_extension.UTILS_FACADE_DIR)) == 1  # once


def test_hopper_and_warp_size_on_the_cpu():
    from tvm.target import Target

    from tilelang.utils.target import determine_target, target_get_warp_size, target_is_cuda, target_is_hopper

    hopper = determine_target(SM90A, return_object=True)
    assert isinstance(hopper, Target) and target_is_cuda(hopper) and target_is_hopper(hopper)
    assert not target_is_hopper(Target({"kind": "cuda", "arch": "sm_80"}))
    assert target_get_warp_size(hopper) == 32
    assert target_get_warp_size(Target("llvm")) >= 1


def test_parse_device():
    from tilelang.utils.target import parse_device

    assert parse_device(3) == 3
    assert parse_device("cuda:2") == 2 and parse_device(" CUDA:1 ") == 1 and parse_device("5") == 5
    assert parse_device(torch.device("cuda", 4)) == 4 and parse_device(torch.device("cuda")) == 0
    expected_current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert parse_device(None) == parse_device("cuda") == parse_device("gpu") == expected_current
    for bad, match in [(torch.device("cpu"), "Only CUDA devices"), ("cuda:x", "Invalid device specification"),
                       ("tpu", "Invalid device specification"), (1.5, "Invalid device type"),
                       (True, "Invalid device specification")]:
        with pytest.raises(ValueError, match=match):
            parse_device(bad)


def test_importable_in_a_fresh_interpreter():
    """As reduce_scatter.py does it: the module import right after ``import tilelang``."""
    code = textwrap.dedent("""
        import tilelang
        from tilelang.utils.target import target_is_hopper, determine_target
        print(target_is_hopper(determine_target({"kind": "cuda", "arch": "sm_90a"}, return_object=True)))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
