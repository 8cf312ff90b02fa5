"""The multicast driver module is never reached while the multicast probe says no."""

from __future__ import annotations

import pytest

from tilescale_core import _driver_multicast, probes
from tilescale_core.allocator import BaseAllocator
from tilescale_core.probes import Probe
from tilescale_core.testing import HostBackend


@pytest.mark.parametrize("env", ["NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"])
def test_mcast_refused_without_touching_the_driver(clean_env, env):
    name, value = env.split("=")
    clean_env.setenv(name, value)
    clean_env.setenv("TILESCALE_USE_VMM", "1")
    clean_env.setattr(probes, "probe_vmm_fabric", lambda: Probe(True, "faked"))

    def forbidden(*a, **k):
        raise AssertionError("multicast driver reached")

    for fn in _driver_multicast.__all__:
        clean_env.setattr(_driver_multicast, fn, forbidden)
    with pytest.raises(ValueError, match=f"multicast is unavailable: multicast disabled by {name}={value}"):
        BaseAllocator(4096, device="cpu", backend=HostBackend(), mcast_size=4096)
