"""create_host_device_tensor: argument checks and ownership on CPU; on a GPU, both views
share the memory (a kernel sees host writes, the host sees kernel writes) and the memory is
freed only when both tensors are gone."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
import torch

from tilescale_core import host_device
from tilescale_core._dlpack import byte_view


def test_exported_where_upstream_has_it():
    import tilelang.distributed.shared_memory as sm

    assert sm.create_host_device_tensor is host_device.create_host_device_tensor


def test_bad_arguments_fail_before_any_cuda_call(monkeypatch):
    monkeypatch.setattr(host_device, "_PinnedMapped", lambda n: pytest.fail("allocated despite bad arguments"))
    with pytest.raises(ValueError, match="shape"):
        host_device.create_host_device_tensor((2, -1), "float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        host_device.create_host_device_tensor((2,), "float128")
    with pytest.raises(TypeError, match="dtype"):
        host_device.create_host_device_tensor((2,), 4)


@pytest.mark.parametrize("shape", [0, (0,), (4, 0), (2, -1), -3, (torch.tensor(0),), (np.int64(0), 2)])
def test_non_positive_dimensions_are_refused_before_allocating(monkeypatch, shape):
    """Upstream's contract: every dimension positive, checked before anything is allocated
    (and before the CUDA check, so this runs on CPU-only machines too)."""
    monkeypatch.setattr(host_device, "_PinnedMapped", lambda n: pytest.fail("allocated despite a bad shape"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("reached the CUDA check"))
    with pytest.raises(ValueError, match=r"shape dimensions must be positive"):
        host_device.create_host_device_tensor(shape, "float32")


@pytest.mark.parametrize("shape", [(2, 1.5), (True, 2), ("a",), 2.0, None])
def test_non_integer_dimensions_are_refused(monkeypatch, shape):
    monkeypatch.setattr(host_device, "_PinnedMapped", lambda n: pytest.fail("allocated despite a bad shape"))
    with pytest.raises(ValueError, match=r"shape"):
        host_device.create_host_device_tensor(shape, "float32")


def test_integer_like_dimensions_reach_the_allocation(monkeypatch):
    """numpy integers and 0-dim integer tensors are dimensions (upstream converts with int())."""
    sizes = []

    class Fake:
        def __init__(self, nbytes):
            sizes.append(nbytes)
            raise RuntimeError("stop here")

    monkeypatch.setattr(host_device, "_PinnedMapped", Fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match="stop here"):
        host_device.create_host_device_tensor((np.int32(3), torch.tensor(5)), torch.float32)
    assert sizes == [3 * 5 * 4]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        host_device.create_host_device_tensor((4,), torch.float32)


def test_a_view_keeps_its_owner_until_every_view_is_gone():
    """The mechanism that frees the pinned memory: the owner lives as long as any view."""
    freed = []

    class Owner:
        def __del__(self):
            freed.append(1)

    buf = (ctypes.c_uint8 * 64)()
    owner = Owner()
    a = byte_view(ctypes.addressof(buf), 64, torch.device("cpu"), owner).view(torch.float32)
    b = byte_view(ctypes.addressof(buf), 64, torch.device("cpu"), owner)
    del owner
    a[0] = 1.5
    assert b.view(torch.float32)[0].item() == 1.5
    tail = a[8:]  # a view of a view
    del a
    gc.collect()
    assert freed == []
    del b
    gc.collect()
    assert freed == []  # the first tensor's storage lives on through `tail`
    del tail
    gc.collect()
    assert freed == [1]


@pytest.mark.gpu
def test_host_and_device_share_the_memory():
    before = host_device.live_host_device_allocations()
    host, dev = host_device.create_host_device_tensor((1000, 3), torch.float32)
    assert host.device.type == "cpu" and dev.device.type == "cuda" and dev.device.index == torch.cuda.current_device()
    assert host.shape == dev.shape == (1000, 3) and host.dtype == dev.dtype == torch.float32
    assert host_device.live_host_device_allocations() == before + 1
    ref = torch.randn(1000, 3)
    host.copy_(ref)  # host writes ...
    assert torch.equal((dev * 2).cpu(), ref * 2)  # ... a kernel reads them
    dev.mul_(3.0)  # a kernel writes ...
    torch.cuda.synchronize()
    assert torch.equal(host, ref * 3)  # ... the host reads them
    d2 = dev[10:20]
    del dev
    gc.collect()
    assert host_device.live_host_device_allocations() == before + 1
    del host
    gc.collect()
    assert host_device.live_host_device_allocations() == before + 1  # d2 still views it
    d2.zero_()
    torch.cuda.synchronize()
    del d2
    gc.collect()
    assert host_device.live_host_device_allocations() == before
    with pytest.raises(ValueError, match="dimensions must be positive"):
        host_device.create_host_device_tensor(0, "uint64")
    assert host_device.live_host_device_allocations() == before
