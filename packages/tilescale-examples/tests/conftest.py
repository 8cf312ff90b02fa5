"""tilescale-examples tests: helpers live in ``examples_helpers.py``."""

import examples_helpers  # (sets CUDA_HOME before TileLang is imported)
import pytest


def pytest_configure(config):
    # also registered in pyproject.toml; repeated here for runs that collect several packages
    config.addinivalue_line("markers", "chaos: fault-injection GPU tests (killed ranks, stragglers); run by ci/device-check.sh chaos")
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``): an alias of the
    # tilescale plugin's ``tilescale_gpu``.
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")


@pytest.fixture
def compiles(monkeypatch):
    """Compiles recorded instead of run, in every module that compiles
    (:func:`examples_helpers.record_compiles`): the names of the kernels built."""
    from tilescale_examples.moe import dispatcher
    from tilescale_examples.overlap import ag_gemm, gemm_rs
    from tilescale_examples.tutorials import tma_allreduce

    return examples_helpers.record_compiles(monkeypatch, ag_gemm, gemm_rs, dispatcher, tma_allreduce)


@pytest.fixture
def fused_available(monkeypatch):
    """The GEMMs' fused algorithm as if the (CPU) device had stream memory operations."""
    monkeypatch.setattr("tilescale_examples.overlap.stream_ops.stream_ops_available", lambda device: (True, "stub"))
