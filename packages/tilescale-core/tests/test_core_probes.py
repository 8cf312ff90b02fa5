"""Capability probes: False with a reason on this machine, and the decision logic over a fake driver."""

from __future__ import annotations

import types

import pytest
import torch

from tilescale_core import _driver, probes
from tilescale_core.probes import MULTICAST_DISABLE_ENV, Probe

ALL_PROBES = [probes.probe_driver, probes.probe_cuda_ipc, probes.probe_vmm_fd, probes.probe_vmm_fabric, probes.probe_multicast]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
@pytest.mark.parametrize("probe", ALL_PROBES, ids=lambda p: p.__name__)
def test_probes_answer_false_without_gpu(probe, monkeypatch):
    for name in MULTICAST_DISABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    result = probe()
    assert isinstance(result, Probe) and result.ok is False and not result
    assert result.reason  # says why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_ffi_probes_false_without_gpu():
    from tilescale_core import shared_memory as sm

    assert sm._supports_vmm_fabric() is False
    assert sm._supports_multicast() is False


class FakeDriver:
    """Stands in for tilescale_core._driver's query functions."""

    def __init__(self, devices=1, version=12080, attrs=None, peer=True):
        self.devices = devices
        self.version = version
        self.attrs = {
            "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
            "HANDLE_TYPE_FABRIC_SUPPORTED": 1,
            "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": 1,
            "MULTICAST_SUPPORTED": 1,
        }
        self.per_device = attrs or {}
        self.peer = peer
        self.calls = 0
        self.queried = set()

    def install(self, monkeypatch):
        def count(fn):
            def wrapped(*a):
                self.calls += 1
                return fn(*a)

            return wrapped

        monkeypatch.setattr(_driver, "init", count(lambda: None))
        monkeypatch.setattr(_driver, "device_count", count(lambda: self.devices))
        monkeypatch.setattr(_driver, "driver_version", count(lambda: self.version))
        monkeypatch.setattr(_driver, "device_attribute", count(self.attribute))
        monkeypatch.setattr(_driver, "can_access_peer", count(lambda a, b: self.peer))
        return self

    def attribute(self, name, ordinal):
        self.queried.add((name, ordinal))
        return self.per_device.get((name, ordinal), self.attrs[name])


@pytest.fixture
def imex(monkeypatch, tmp_path):
    """Point the IMEX channel glob at a temporary directory; returns a channel creator."""
    monkeypatch.setattr(probes, "IMEX_CHANNEL_GLOB", str(tmp_path / "channel*"))
    for name in MULTICAST_DISABLE_ENV:
        monkeypatch.delenv(name, raising=False)

    def make(mode=0o600):
        path = tmp_path / "channel0"
        path.write_text("")
        path.chmod(mode)
        return path

    return make


def test_fabric_passes_with_everything(monkeypatch, imex):
    imex()
    fake = FakeDriver(devices=4).install(monkeypatch)
    assert probes.probe_vmm_fabric().ok
    # every visible device was inspected
    assert {("HANDLE_TYPE_FABRIC_SUPPORTED", d) for d in range(4)} <= fake.queried


def test_fabric_needs_imex_channel(monkeypatch, imex):
    FakeDriver().install(monkeypatch)
    result = probes.probe_vmm_fabric()
    assert not result and "IMEX" in result.reason


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root can open any file")
def test_fabric_needs_accessible_imex_channel(monkeypatch, imex):
    imex(mode=0o000)
    FakeDriver().install(monkeypatch)
    result = probes.probe_vmm_fabric()
    assert not result and "not readable" in result.reason


def test_fabric_needs_driver_12_4(monkeypatch, imex):
    imex()
    FakeDriver(version=12030).install(monkeypatch)
    result = probes.probe_vmm_fabric()
    assert not result and "12.4" in result.reason


def test_fabric_checks_every_device(monkeypatch, imex):
    imex()
    FakeDriver(devices=3, attrs={("HANDLE_TYPE_FABRIC_SUPPORTED", 2): 0}).install(monkeypatch)
    result = probes.probe_vmm_fabric()
    assert not result and "[2]" in result.reason and "fabric" in result.reason


def test_fabric_needs_vmm(monkeypatch, imex):
    imex()
    FakeDriver(attrs={("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0): 0}).install(monkeypatch)
    assert "virtual memory" in probes.probe_vmm_fabric().reason


def test_no_devices(monkeypatch, imex):
    FakeDriver(devices=0).install(monkeypatch)
    result = probes.probe_cuda_ipc()
    assert not result and "no GPU" in result.reason


def test_ipc_needs_peer_access(monkeypatch):
    FakeDriver(devices=2, peer=False).install(monkeypatch)
    result = probes.probe_cuda_ipc()
    assert not result and "0->1" in result.reason
    FakeDriver(devices=2, peer=True).install(monkeypatch)
    assert probes.probe_cuda_ipc().ok


def test_fd_probe(monkeypatch):
    FakeDriver(devices=2).install(monkeypatch)
    assert probes.probe_vmm_fd().ok
    FakeDriver(devices=2, attrs={("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", 1): 0}).install(monkeypatch)
    result = probes.probe_vmm_fd()
    assert not result and "[1]" in result.reason


def test_multicast_env_other_values_do_not_disable(monkeypatch, imex):
    imex()
    FakeDriver(devices=2).install(monkeypatch)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    assert probes.probe_multicast().ok


@pytest.mark.parametrize("name,value", list(MULTICAST_DISABLE_ENV.items()) + [
    ("NCCL_NVLS_ENABLE", "false"), ("NCCL_NVLS_ENABLE", "off"), ("NCCL_NVLS_ENABLE", "NO"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "true"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "yes"),
    ("NVSHMEM_DISABLE_NVLS", "on"), ("NVSHMEM_DISABLE_NVLS", " TRUE "),
])
def test_multicast_env_reads_every_boolean_spelling(monkeypatch, imex, name, value):
    """Every opt-out variable, in its documented spelling (``MULTICAST_DISABLE_ENV``) and the
    other boolean spellings, disables multicast before any driver call."""
    imex()
    fake = FakeDriver().install(monkeypatch)
    monkeypatch.setenv(name, value)
    result = probes.probe_multicast()
    assert not result and f"{name}={value}" in result.reason
    assert fake.calls == 0


@pytest.mark.parametrize("name", list(MULTICAST_DISABLE_ENV))
def test_multicast_env_unreadable_value_disables_conservatively(monkeypatch, imex, name):
    """An opt-out variable owned by NCCL / torch / NVSHMEM with a value TileScale cannot read
    disables multicast (the safe side) instead of raising, and says so."""
    imex()
    fake = FakeDriver().install(monkeypatch)
    monkeypatch.setenv(name, "maybe")
    result = probes.probe_multicast()
    assert not result and f"{name}='maybe'" in result.reason and "not a boolean" in result.reason
    assert fake.calls == 0


@pytest.mark.parametrize("name,value", [("NCCL_NVLS_ENABLE", "true"), ("NCCL_NVLS_ENABLE", "on"),
                                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "false"), ("NVSHMEM_DISABLE_NVLS", "off"),
                                        ("NVSHMEM_DISABLE_NVLS", "")])
def test_multicast_env_enabling_spellings_do_not_disable(monkeypatch, imex, name, value):
    imex()
    FakeDriver(devices=2).install(monkeypatch)
    monkeypatch.setenv(name, value)
    assert probes.probe_multicast().ok


def test_multicast_checks_every_device_and_fabric(monkeypatch, imex):
    imex()
    FakeDriver(devices=2, attrs={("MULTICAST_SUPPORTED", 1): 0}).install(monkeypatch)
    result = probes.probe_multicast()
    assert not result and "[1]" in result.reason
    FakeDriver(devices=2, attrs={("HANDLE_TYPE_FABRIC_SUPPORTED", 0): 0}).install(monkeypatch)
    assert "fabric" in probes.probe_multicast().reason


def test_multicast_probe_never_creates_a_multicast_object(monkeypatch, imex):
    imex()
    FakeDriver(devices=2).install(monkeypatch)
    from tilescale_core import _driver_multicast

    def forbidden(*a, **k):
        raise AssertionError("the probe touched the multicast driver module")

    for name in _driver_multicast.__all__:
        monkeypatch.setattr(_driver_multicast, name, forbidden)
    monkeypatch.setattr(_driver, "call", forbidden)
    assert probes.probe_multicast().ok


def test_probes_never_raise(monkeypatch):
    def boom():
        raise ZeroDivisionError("driver exploded")

    monkeypatch.setattr(_driver, "init", boom)
    result = probes.probe_vmm_fd()
    assert not result and "driver exploded" in result.reason


def test_checked_call_names_the_call_and_result():
    drv = _driver.driver_module()
    fake = types.SimpleNamespace(
        cuMemCreate=lambda *a: (drv.CUresult.CUDA_ERROR_NOT_PERMITTED, None),
        cuDriverGetVersion=lambda: (drv.CUresult.CUDA_SUCCESS, 12080),
        cuThing=lambda: (drv.CUresult.CUDA_SUCCESS, 1, 2),
        cuVoid=lambda: (drv.CUresult.CUDA_SUCCESS,),
        CUresult=drv.CUresult,
        cuGetErrorString=lambda s: (drv.CUresult.CUDA_SUCCESS, b"operation not permitted"),
    )
    orig = _driver.driver_module
    _driver.driver_module = lambda: fake
    try:
        with pytest.raises(_driver.CudaError) as info:
            _driver.call("cuMemCreate", 1, None, 0)
        assert info.value.call == "cuMemCreate" and info.value.code == 800
        assert str(info.value) == "cuMemCreate failed: CUDA_ERROR_NOT_PERMITTED (800): operation not permitted"
        assert _driver.call("cuDriverGetVersion") == 12080
        assert _driver.call("cuThing") == (1, 2)
        assert _driver.call("cuVoid") is None
    finally:
        _driver.driver_module = orig


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver error")
def test_missing_driver_is_a_clear_error():
    with pytest.raises(_driver.CudaUnavailableError, match="cuInit: the CUDA driver library could not be loaded"):
        _driver.device_count()
