"""tilescale-lang tests: GPU tests (``@pytest.mark.gpu``) are skipped, with the reason, without a GPU
(by tilescale-host's ``tilescale`` plugin when it is installed, else by
``tilescale_core.testing.register_gpu_marker``'s fallback).
Helpers live in ``lang_helpers.py``."""


def pytest_configure(config):
    # GPU tests here say ``gpu`` (nox and ci/ select ``-m gpu`` / ``-m "not gpu"``).
    from tilescale_core.testing import register_gpu_marker

    register_gpu_marker(config, "gpu")
