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


def _restore_ignored_signals() -> None:
    """A suite started in the background by a non-interactive shell (``nox -s tests &``, a CI
    step) inherits SIGINT and SIGQUIT ignored, and so would every launcher the tests start:
    tilescale-run keeps a signal that its parent ignores ignored (as ``nohup`` expects), so
    the signal-forwarding tests would see nothing arrive. Give the forwarded signals their
    default handling in this process, so the launchers it starts inherit that."""
    import signal

    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def pytest_configure(config):
    _restore_ignored_signals()
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``): an alias of the
    # tilescale plugin's ``tilescale_gpu``.
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")
