"""tilescale-core tests: GPU tests (``@pytest.mark.gpu``) are skipped, with the reason, without CUDA
(by tilescale-host's ``tilescale`` plugin when it is installed, else by
``tilescale_core.testing.register_gpu_marker``'s fallback)."""

from __future__ import annotations

import os
import sys

import pytest

# Rank bodies live in core_rank_bodies.py beside this file; spawned ranks import it by name.
sys.path.insert(0, os.path.dirname(__file__))


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


OTHER_USER = "tscore-other"


@pytest.fixture(scope="session")
def other_user():
    """``(uid, gid)`` of a second, unprivileged local user, created for attacks from another
    user id; skipped, with the reason, when the tests do not run as root or cannot create it."""
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user for an other-user attack")
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip("needs useradd to create a second user for an other-user attack")
        proc = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/bin/sh", OTHER_USER],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"useradd {OTHER_USER} failed: {proc.stderr.strip()}")
        entry = pwd.getpwnam(OTHER_USER)
    return entry.pw_uid, entry.pw_gid
