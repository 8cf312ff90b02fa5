"""tilescale-lang tests: GPU tests (``@pytest.mark.gpu``) are skipped, with the reason, without a GPU
(by tilescale-host's ``tilescale`` plugin when it is installed, else by this conftest).
Helpers live in ``lang_helpers.py``."""

import pytest

from lang_helpers import have_gpu


def pytest_collection_modifyitems(config, items):
    if hasattr(config.pluginmanager.get_plugin("tilescale"), "add_gpu_marker_alias"):
        return  # the plugin skips ``gpu`` tests itself (``register_gpu_marker`` made ``gpu`` its alias)
    if have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``).
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")
