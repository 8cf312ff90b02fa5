"""One CUDA error type across TileScale: tilescale_core.CudaError (CPU; fake driver results)."""

from __future__ import annotations

import pickle
import types

import pytest

import tilescale_core
from tilescale_core import _driver, driver


class _Status(int):
    @property
    def name(self):
        return {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE"}[int(self)]


def test_public_names_are_the_core_layer():
    assert tilescale_core.CudaError is driver.CudaError is _driver.CudaError
    assert issubclass(tilescale_core.CudaUnavailableError, tilescale_core.CudaError)
    assert issubclass(tilescale_core.CudaError, RuntimeError)


def test_public_faces_are_the_private_modules():
    """driver fronts _driver and ipc fronts _ipc: every private export, the same objects, and
    the names other wheels use (init, ensure_context, call, driver_module, malloc, free)."""
    from tilescale_core import _ipc, ipc

    for public, private in ((driver, _driver), (ipc, _ipc)):
        assert public.__all__ == private.__all__
        for name in private.__all__:
            assert getattr(public, name) is getattr(private, name), f"{public.__name__}.{name}"
        assert public.__doc__ and "public" in public.__doc__.splitlines()[0]
    for name in ("init", "ensure_context", "call", "rt_call", "check", "driver_module", "device_attribute"):
        assert name in driver.__all__
    for name in ("malloc", "free", "HANDLE_BYTES"):
        assert name in ipc.__all__


def test_check_unpacks_and_raises_with_attributes():
    assert driver.check((_Status(0),), "cuVoid") is None
    assert driver.check((_Status(0), 7), "cuOne") == 7
    assert driver.check((_Status(0), 1, 2), "cuTwo") == (1, 2)
    with pytest.raises(tilescale_core.CudaError) as info:
        driver.check((_Status(1), None), "cuDeviceGet(3)")
    err = info.value
    assert (err.call, err.code, err.name) == ("cuDeviceGet(3)", 1, "CUDA_ERROR_INVALID_VALUE")
    assert str(err) == "cuDeviceGet(3) failed: CUDA_ERROR_INVALID_VALUE (1)"


def test_errors_pickle_with_their_attributes():
    err = pickle.loads(pickle.dumps(driver.CudaError("cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")))
    assert (err.call, err.code, err.name, str(err)) == (
        "cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY", "cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory")
    gone = pickle.loads(pickle.dumps(driver.CudaUnavailableError("no driver here", "cuInit")))
    assert (gone.call, gone.code, gone.name, str(gone)) == ("cuInit", None, "CUDA_UNAVAILABLE", "no driver here")


def test_missing_cuda_python_is_a_cuda_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"no module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    for loader in (_driver.driver_module, _driver.runtime_module):
        unwrapped = loader.__wrapped__  # past functools.cache
        with pytest.raises(tilescale_core.CudaUnavailableError, match="cuda-python is required"):
            unwrapped()


def test_legacy_cuda_python_layout_is_used(monkeypatch):
    import builtins

    legacy = types.ModuleType("cuda.cuda")
    real_import = builtins.__import__

    def old_layout(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "cuda.bindings":
            raise ImportError("cuda-python < 12.8 has no cuda.bindings")
        if name == "cuda" and fromlist and "cuda" in fromlist:
            return types.SimpleNamespace(cuda=legacy)
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", old_layout)
    assert _driver.driver_module.__wrapped__() is legacy


def test_host_raises_the_core_error(monkeypatch):
    pytest.importorskip("tilescale_host")
    from tilescale_host import _cuda

    assert _cuda.CudaError is tilescale_core.CudaError
    assert _cuda.check is driver.check

    def broken_init(flags):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(_cuda, "driver", lambda: types.SimpleNamespace(cuInit=broken_init))
    with pytest.raises(tilescale_core.CudaError, match="the CUDA driver is not available") as info:
        _cuda._init_driver.__wrapped__()
    assert isinstance(info.value, tilescale_core.CudaUnavailableError) and info.value.call == "cuInit"
