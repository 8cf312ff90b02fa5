"""The IMEX channel script tilelang/distributed/scripts/conf_vmm.sh (dry runs: no root)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tilescale_core import probes

SCRIPT = probes.CONF_VMM_SCRIPT


def _run(*args, devices_text="195 nvidia\n234 nvidia-caps-imex-channels\n", tmp_path=None):
    devices = tmp_path / "devices"
    devices.write_text(devices_text)
    env = dict(os.environ, CONF_VMM_PROC_DEVICES=str(devices), CONF_VMM_DEV_DIR=str(tmp_path / "imex"))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=30)


def test_script_is_reachable_as_tilelang_distributed_scripts():
    import tilelang.distributed

    path = os.path.join(os.path.dirname(tilelang.distributed.__file__), "scripts", "conf_vmm.sh")
    assert os.path.samefile(path, SCRIPT)


def test_dry_run_creates_channel_with_driver_major_and_requested_minor(tmp_path):
    res = _run("--dry-run", "3", tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    node = f"{tmp_path}/imex/channel3"
    assert f"mknod {node} c 234 3" in res.stdout
    assert f"chmod u+rw {node}" in res.stdout and f"chown " in res.stdout


def test_default_channel_is_zero(tmp_path):
    res = _run("--dry-run", tmp_path=tmp_path)
    assert res.returncode == 0 and f"{tmp_path}/imex/channel0 c 234 0" in res.stdout


@pytest.mark.parametrize("arg", ["-1", "x", "1.5"])
def test_bad_channel_id_is_rejected(arg, tmp_path):
    res = _run("--dry-run", arg, tmp_path=tmp_path)
    assert res.returncode == 2 and "channel_id must be one non-negative integer" in res.stderr


def test_driver_without_imex_is_reported(tmp_path):
    res = _run("--dry-run", devices_text="195 nvidia\n", tmp_path=tmp_path)
    assert res.returncode == 1 and "has not registered nvidia-caps-imex-channels" in res.stderr


def test_probe_reason_points_at_the_script(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "IMEX_CHANNEL_GLOB", str(tmp_path / "none*"))
    assert SCRIPT in probes._imex_channel().reason
