"""tensor / tensor_from_ptr: the dtype table, bad input, and the no-allocator path."""

from __future__ import annotations

import numpy as np
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


# ---------------------------------------------- issue 45: dimensions are whatever int() takes exactly
@pytest.mark.parametrize("shape, expected", [
    ((torch.tensor(3), 4), (3, 4)),  # upstream passes (cu_seqlens_q[-1], heads, dim)
    ((torch.tensor([7, 3])[-1], torch.tensor(2, dtype=torch.int32)), (3, 2)),
    ((np.int64(2), np.uint8(5)), (2, 5)),
    ((np.array(6),), (6,)),  # a 0-dim numpy array
    (np.int32(4), (4,)),  # one dimension, not in a sequence
    (torch.tensor(5), (5,)),
    (torch.tensor([2, 3]), (2, 3)),  # a 1-D integer tensor as the whole shape
    (np.array([2, 3]), (2, 3)),
    (torch.Size([2, 3]), (2, 3)),
    ([0, 2], (0, 2)),
    ((), ()),
])
def test_integer_like_dimensions_are_accepted(shape, expected):
    t = tensor(shape, "float32", device="cpu")
    assert tuple(t.shape) == expected
    from tilescale_core.tensors import _shape_tuple

    dims = _shape_tuple(shape)
    assert dims == expected and all(type(d) is int for d in dims)


@pytest.mark.parametrize("shape, shown", [
    ((2, 1.5), "1.5"),
    ((2, 2.0), "2.0"),  # whole floats too: int() would truncate silently
    ((True, 2), "True"),
    ((np.bool_(True),), "True"),
    ((torch.tensor(True),), "tensor(True)"),
    ((torch.tensor(3.0),), "tensor(3.)"),
    ((torch.tensor([3]),), "tensor([3])"),  # one element, but not 0-dim
    ((np.float32(2),), "2.0"),
    ((np.array([4]),), "array([4])"),
    ((2, -1), "-1"),
    ((torch.tensor(-2),), "tensor(-2)"),
    (-1, "-1"),
    (("a",), "'a'"),
    ((None,), "None"),
])
def test_other_dimensions_are_refused_naming_the_argument(shape, shown):
    with pytest.raises(ValueError, match=r"^shape dimensions must be non-negative integers \(an int, a numpy integer "
                                         r"or a 0-dim integer tensor\), got ") as info:
        tensor(shape, "float32", device="cpu")
    assert shown in str(info.value)


@pytest.mark.parametrize("shape", [2.5, "ab", None, object()])
def test_a_shape_that_is_no_sequence_is_refused(shape):
    with pytest.raises(ValueError, match="shape must be a dimension or a sequence of dimensions"):
        tensor(shape, "float32", device="cpu")


def test_allocator_receives_the_normalised_shape():
    """The heap path gets plain ints (a 0-dim CUDA tensor is read once, on the host)."""
    seen = []

    class FakeAllocator:
        device = torch.device("cpu")

        def _allocate_tensor(self, shape, dtype, return_peers=False):
            seen.append(shape)
            return torch.empty(shape, dtype=dtype)

    t = tensor((torch.tensor(2), np.int16(3)), torch.float16, allocator=FakeAllocator())
    assert seen == [(2, 3)] and all(type(d) is int for d in seen[0])
    assert t.shape == (2, 3)
    with pytest.raises(ValueError, match="shape dimensions"):
        tensor((2, 1.0), torch.float16, allocator=FakeAllocator())
    assert len(seen) == 1  # refused before the allocator was asked


def test_the_plugin_tensor_is_this_function():
    import tilelang

    assert tilelang.tensor is tensor


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
