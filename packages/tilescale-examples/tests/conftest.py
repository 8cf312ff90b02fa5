"""tilescale-examples tests: helpers live in ``examples_helpers.py``."""

import examples_helpers  # noqa: F401  (sets CUDA_HOME before TileLang is imported)


def pytest_configure(config):
    # also registered in pyproject.toml; repeated here for runs that collect several packages
    config.addinivalue_line("markers", "chaos: fault-injection GPU tests (killed ranks, stragglers); run by ci/device-check.sh chaos")
    # This repo's GPU tests say ``gpu``; the tilescale plugin's own marker is ``tilescale_gpu``.
    from tilescale_host.pytest_plugin import add_gpu_marker_alias

    add_gpu_marker_alias(config, "gpu")
