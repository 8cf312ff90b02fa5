"""``tilescale_core.testing.register_gpu_marker``: a GPU test is skipped with its reason when no
GPU is visible, with tilescale-host's pytest plugin and without it (``-p no:tilescale``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SUITE = '''
import pytest

def pytest_configure(config):
    from tilescale_core.testing import register_gpu_marker
    register_gpu_marker(config, "gpu")
'''

TESTS = '''
import pytest

@pytest.mark.gpu
def test_needs_a_gpu():
    raise AssertionError("a GPU test ran without a GPU")

def test_cpu():
    pass
'''


@pytest.mark.parametrize("plugin", ["loaded", "disabled"])
def test_gpu_tests_skip_with_a_reason_without_a_gpu(plugin, tmp_path):
    (tmp_path / "conftest.py").write_text(SUITE)
    (tmp_path / "test_marked.py").write_text(TESTS)
    args = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)]
    if plugin == "disabled":
        args[3:3] = ["-p", "no:tilescale"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 1 skipped" in out, out
    assert "GPU" in out.split("short test summary info")[-1], out


def test_fallback_registers_once(tmp_path):
    """Two conftests registering the same marker (a run collecting several packages) give one
    skipping plugin, not two."""
    from tilescale_core.testing import register_gpu_marker

    class Manager:
        def __init__(self):
            self.plugins = {}

        def get_plugin(self, name):
            return self.plugins.get(name)

        def register(self, plugin, name):
            assert name not in self.plugins
            self.plugins[name] = plugin

    class Config:
        pluginmanager = Manager()
        lines = []

        def addinivalue_line(self, key, line):
            self.lines.append((key, line))

    config = Config()
    register_gpu_marker(config, "gpu")
    register_gpu_marker(config, "gpu")
    assert list(config.pluginmanager.plugins) == ["tilescale-gpu-skip-gpu"]
