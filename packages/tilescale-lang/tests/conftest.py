"""tilescale-lang tests: GPU tests (``@pytest.mark.gpu``) are skipped, with the reason, without a GPU.
Helpers live in ``lang_helpers.py``."""

import pytest

from lang_helpers import have_gpu


def pytest_collection_modifyitems(config, items):
    if have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # This repo's GPU tests say ``gpu``: an alias of the tilescale plugin's ``tilescale_gpu`` when
    # tilescale-host is installed, else a plain marker (this conftest skips them without a GPU).
    plugin = config.pluginmanager.get_plugin("tilescale")
    if plugin is not None:
        plugin.add_gpu_marker_alias(config, "gpu")
    else:
        config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason when none is visible)")
