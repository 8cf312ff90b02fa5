"""tilescale_host.cuda is the public face of tilescale_host._cuda (CPU: names and identity)."""

from __future__ import annotations

import tilescale_core
from tilescale_core import driver
from tilescale_host import _cuda, cuda


def test_every_private_name_is_public_and_the_same_object():
    assert cuda.__all__ == _cuda.__all__
    for name in _cuda.__all__:
        assert getattr(cuda, name) is getattr(_cuda, name), name


def test_the_names_the_examples_use():
    """stream_ops reads CAN_USE_64_BIT_STREAM_MEM_OPS and calls driver() / check."""
    assert callable(cuda.device_attribute)
    assert cuda.driver is driver.driver_module and cuda.check is driver.check
    assert cuda.CudaError is tilescale_core.CudaError


def test_documented():
    for name in ("device_attribute", "device_count", "driver", "check"):
        assert f":func:`{name}`" in cuda.__doc__
