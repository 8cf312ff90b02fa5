"""tilescale-examples tests: helpers live in ``examples_helpers.py``."""

import examples_helpers  # noqa: F401  (sets CUDA_HOME before TileLang is imported)


def pytest_configure(config):
    # also registered in pyproject.toml; repeated here for runs that collect several packages
    config.addinivalue_line("markers", "chaos: fault-injection GPU tests (killed ranks, stragglers); run by ci/device-check.sh chaos")
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``): an alias of the
    # tilescale plugin's ``tilescale_gpu``.
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")
