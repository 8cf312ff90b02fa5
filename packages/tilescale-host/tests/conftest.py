"""Shared fixtures of the tilescale-host tests."""

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def clean_env(monkeypatch):
    """Remove every launcher / TileScale variable from os.environ for the test."""
    for name in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "NNODES", "MASTER_ADDR", "MASTER_PORT",
        "TILESCALE_MASTER_PORT", "TILESCALE_SHARE_GPUS", "NCCL_IB_DISABLE", "NCCL_DEBUG",
        "TILESCALE_VALIDATION_RECORD", "TILESCALE_JOB_ID", "TILESCALE_PARENT_PID",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def pytest_configure(config):
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``): an alias of the
    # tilescale plugin's ``tilescale_gpu``.
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")
