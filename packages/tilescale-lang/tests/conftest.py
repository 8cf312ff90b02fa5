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
