"""tilescale-examples tests: helpers live in ``examples_helpers.py``."""

import examples_helpers  # (sets CUDA_HOME before TileLang is imported)
import pytest


def pytest_configure(config):
    # also registered in pyproject.toml; repeated here for runs that collect several packages
    config.addinivalue_line("markers", "chaos: fault-injection GPU tests (killed ranks, stragglers); run by ci/device-check.sh chaos")
    config.addinivalue_line("markers", "kernel_cache(name, jobs=None): the TileLang cache the kernel_cache fixture gives "
                                       "a multi-rank GPU test")
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


@pytest.fixture
def kernel_cache(request, tmp_path_factory) -> str:
    """The TileLang cache directory of a multi-rank GPU test (:func:`examples_helpers.gpu_rank_test`),
    from its ``kernel_cache(name, jobs)`` marker: the session cache ``name``, with ``jobs()``
    (precompile jobs) compiled into it first, in parallel, in the pytest process, so that the
    ranks' compiles are cache hits. A plain string: the ranks receive it as an argument."""
    from examples_cache import warm_cache

    marker = request.node.get_closest_marker("kernel_cache")
    if marker is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the kernel_cache fixture needs @pytest.mark.kernel_cache(name)")
    name, jobs = (list(marker.args) + [None])[:2]
    if jobs is None:
        return examples_helpers.session_cache(tmp_path_factory, name)
    return warm_cache(tmp_path_factory, jobs(), name)
