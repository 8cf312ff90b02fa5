"""tensor / tensor_from_ptr: the dtype table, bad input, and the no-allocator path."""

from __future__ import annotations

import pytest
import torch

from tilescale_core import tensor, tensor_from_ptr
from tilescale_core.tensors import DTYPES, resolve_dtype

SPEC_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int32": torch.int32,
    "int": torch.int32, "int64": torch.int64, "long": torch.int64, "uint8": torch.uint8, "byte": torch.uint8,
    "int8": torch.int8, "bool": torch.bool, "uint32": torch.uint32, "uint64": torch.uint64,
}


def test_dtype_table_is_the_spec_list():
    assert DTYPES == SPEC_DTYPES


@pytest.mark.parametrize("name", ["float8", "complex64", "Float32", "", "int16"])
def test_unknown_dtype_strings(name):
    with pytest.raises(ValueError, match="unknown dtype string"):
        resolve_dtype(name)
    with pytest.raises(ValueError, match="unknown dtype string"):
        tensor((2,), name)
    with pytest.raises(ValueError, match="unknown dtype string"):
        tensor_from_ptr(4096, (2,), name)


def test_dtype_type_error():
    with pytest.raises(TypeError):
        resolve_dtype(3)


def test_take_ownership_not_implemented():
    with pytest.raises(NotImplementedError, match=r"take_ownership=True\) is not implemented"):
        tensor_from_ptr(4096, (4,), "float32", 0, take_ownership=True)


@pytest.mark.parametrize("ptr", [-1, 1.5, None, True])
def test_bad_pointers(ptr):
    with pytest.raises(ValueError, match="ptr_val"):
        tensor_from_ptr(ptr, (4,))


def test_null_pointer():
    with pytest.raises(ValueError, match="null"):
        tensor_from_ptr(0, (4,))


@pytest.mark.parametrize("shape", [(-1,), (2, 1.5), ("a",)])
def test_bad_shapes(shape):
    with pytest.raises(ValueError, match="shape"):
        tensor(shape, "float32")


@pytest.mark.parametrize("dtype", sorted(SPEC_DTYPES))
def test_tensor_without_allocator_is_torch_empty(dtype):
    t = tensor((2, 3), dtype, device="cpu")
    assert t.shape == (2, 3) and t.dtype == SPEC_DTYPES[dtype] and t.device.type == "cpu"
    t2 = tensor(5, SPEC_DTYPES[dtype], device="cpu")
    assert t2.shape == (5,)


def test_return_peers_needs_allocator():
    with pytest.raises(ValueError, match="needs an allocator"):
        tensor((2,), "float32", return_peers=True)


@pytest.mark.parametrize("dtype", sorted(SPEC_DTYPES))
def test_view_at_every_dtype_is_zero_copy(dtype):
    from tilescale_core.tensors import view_at

    backing = torch.zeros(64, dtype=torch.uint8)
    v = view_at(backing.data_ptr(), (2, 2), SPEC_DTYPES[dtype], torch.device("cpu"))
    assert v.shape == (2, 2) and v.dtype == SPEC_DTYPES[dtype] and v.data_ptr() == backing.data_ptr()
    v.view(torch.uint8).fill_(1)
    assert int(backing[: v.numel() * v.element_size()].sum()) == v.numel() * v.element_size()


def test_slice_view_aliases_its_region():
    from tilescale_core.tensors import slice_view

    region = torch.zeros(1024, dtype=torch.uint8)
    v = slice_view(region, 256, (2, 3), torch.float32)
    assert v.shape == (2, 3) and v.dtype == torch.float32
    v.fill_(1.5)
    assert torch.equal(region[256:280].view(torch.float32), torch.full((6,), 1.5))
    assert not region[:256].any() and not region[280:].any()
    assert slice_view(region, 1024, (0,), torch.float16).numel() == 0
    with pytest.raises(ValueError, match="exceed the 1024-byte region"):
        slice_view(region, 1000, (8,), torch.float32)
    with pytest.raises(ValueError, match="exceed"):
        slice_view(region, -4, (1,), torch.float32)


def test_allocator_tensors_share_one_cached_heap_view():
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    a = BaseAllocator(1 << 16, device="cpu", is_distributed=False, backend=HostBackend())
    x = a._allocate_tensor((4,), torch.int32)
    y = a._allocate_tensor((4,), torch.int32)
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() == a.base_ptr
    assert y.data_ptr() - x.data_ptr() == 256  # bump offsets, default alignment
    a.close()
    assert a._heap_bytes == {}
