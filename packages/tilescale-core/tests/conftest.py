"""tilescale-core tests: GPU tests (``@pytest.mark.gpu``) are skipped, with the reason, without CUDA."""

from __future__ import annotations

import os
import sys

import pytest

# Rank bodies live in core_rank_bodies.py beside this file; spawned ranks import it by name.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    from tilescale_core.probes import probe_driver

    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch.cuda.is_available() is False ({probe_driver().reason})")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def clean_env(monkeypatch):
    """Remove the environment variables that steer memory-path selection and checks."""
    for name in ("TILESCALE_USE_VMM", "TILESCALE_CHECK_ALLOC"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def pytest_configure(config):
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``).
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")
