"""``metadata.bind_from_device`` and ``metadata.loaded``: the table copy a CUDA graph can
capture (device to device), checked on the CPU with a recording driver."""

from __future__ import annotations

import pytest
import torch

from tilescale_lang import metadata


class _Kernel:
    execution_backend = "tvm_ffi"
    prim_func = None


class _FakeTable:
    """A stand-in for a CUDA uint64 tensor (the CPU build has no CUDA tensors)."""

    def __init__(self, n=4, device="cuda", itemsize=8, contiguous=True):
        self.n, self.device, self._itemsize, self._contiguous = n, torch.device(device), itemsize, contiguous

    def element_size(self):
        return self._itemsize

    def is_contiguous(self):
        return self._contiguous

    def numel(self):
        return self.n

    def data_ptr(self):
        return 0xABC000


class _Driver:
    def __init__(self, size=8192):
        self.calls, self.size = [], size

    def CUmodule(self, handle):
        return ("module", handle)

    def CUstream(self, handle):
        return ("stream", handle)

    def cuModuleGetGlobal(self, module, symbol):
        self.calls.append(("global", module, symbol))
        return 0, 0x1000 + module[1], self.size

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes, stream))
        return (0,)


@pytest.fixture
def driver(monkeypatch):
    drv = _Driver()
    monkeypatch.setattr(metadata, "_driver", lambda: drv)
    monkeypatch.setattr(metadata, "_check", lambda result, what: result[1:] if len(result) > 2 else None)
    return drv


def test_a_tvm_ffi_kernel_is_loaded_once_its_module_is_recorded():
    k = _Kernel()
    assert not metadata.loaded(k)
    metadata._state(k)["modules"].append(7)
    assert metadata.loaded(k)
    other = _Kernel()
    other.execution_backend = "nvrtc"  # loaded with the compile
    assert metadata.loaded(other)


def test_bind_from_device_copies_into_every_loaded_module(driver):
    k = _Kernel()
    metadata._state(k)["modules"].extend([1, 2])
    metadata.bind_from_device(k, _FakeTable(n=4), stream=5)
    copies = [c for c in driver.calls if c[0] == "copy"]
    assert copies == [("copy", 0x1001, 0xABC000, 32, ("stream", 5)), ("copy", 0x1002, 0xABC000, 32, ("stream", 5))]
    assert [c[2] for c in driver.calls if c[0] == "global"] == [metadata.SYMBOL] * 2


def test_bind_from_device_asks_for_a_warm_up_before_the_module_loads(driver):
    with pytest.raises(RuntimeError, match="not been launched yet.*outside the CUDA graph capture first"):
        metadata.bind_from_device(_Kernel(), _FakeTable(), stream=0)
    assert driver.calls == []


@pytest.mark.parametrize("table,match", [
    (_FakeTable(itemsize=4), "8-byte elements"),
    (_FakeTable(contiguous=False), "contiguous"),
    (_FakeTable(device="cpu"), "CUDA tensor"),
])
def test_bind_from_device_rejects_a_bad_table(table, match, driver):
    k = _Kernel()
    metadata._state(k)["modules"].append(1)
    with pytest.raises(ValueError, match=match):
        metadata.bind_from_device(k, table, stream=0)
    assert driver.calls == []


def test_bind_from_device_rejects_a_table_larger_than_the_symbol(monkeypatch):
    drv = _Driver(size=16)
    monkeypatch.setattr(metadata, "_driver", lambda: drv)
    monkeypatch.setattr(metadata, "_check", lambda result, what: result[1:] if len(result) > 2 else None)
    k = _Kernel()
    metadata._state(k)["modules"].append(1)
    with pytest.raises(ValueError, match="exceeds meta_data"):
        metadata.bind_from_device(k, _FakeTable(n=4), stream=0)
    assert not [c for c in drv.calls if c[0] == "copy"]


def test_bind_from_device_refuses_the_cython_backend():
    k = _Kernel()
    k.execution_backend = "cython"
    with pytest.raises(NotImplementedError, match="tvm_ffi and nvrtc"):
        metadata.bind_from_device(k, _FakeTable(), stream=0)


class _TablelessDriver(_Driver):
    """A driver whose modules have no ``meta_data`` (kernels without TileScale intrinsics)."""

    def cuModuleGetGlobal(self, module, symbol):
        self.calls.append(("global", module, symbol))
        return (metadata.CUDA_ERROR_NOT_FOUND, None, None)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes, stream))
        return (0,)


def _strict_check(result, what):
    """The real check's contract: any status but success raises."""
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed with {result[0]}")
    return result[1:] if len(result) > 2 else None


@pytest.mark.parametrize("bind", ["bind_from_device", "apply_to_module"])
def test_a_module_without_a_table_is_left_alone(bind, monkeypatch):
    """A plain TileLang kernel's module has no meta_data: binding skips it instead of failing
    with CUDA_ERROR_NOT_FOUND, so code may bind every kernel it launches."""
    drv = _TablelessDriver()
    monkeypatch.setattr(metadata, "_driver", lambda: drv)
    monkeypatch.setattr(metadata, "_check", _strict_check)
    if bind == "bind_from_device":
        k = _Kernel()
        metadata._state(k)["modules"].extend([1, 2])
        metadata.bind_from_device(k, _FakeTable(n=4), stream=0)
    else:
        metadata.apply_to_module(3, [0, 1, 0x1000], 0, {})
    assert [c[0] for c in drv.calls] == ["global"] * (2 if bind == "bind_from_device" else 1)


def test_another_symbol_failure_still_raises(monkeypatch):
    class _Broken(_Driver):
        def cuModuleGetGlobal(self, module, symbol):
            return (1, None, None)  # CUDA_ERROR_INVALID_VALUE

    drv = _Broken()
    monkeypatch.setattr(metadata, "_driver", lambda: drv)
    monkeypatch.setattr(metadata, "_check", _strict_check)
    k = _Kernel()
    metadata._state(k)["modules"].append(1)
    with pytest.raises(RuntimeError, match="cuModuleGetGlobal"):
        metadata.bind_from_device(k, _FakeTable(n=4), stream=0)
