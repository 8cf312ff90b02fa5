"""Tensors: ``tilelang.tensor``, ``tensor_from_ptr`` and the dtype-string table.

``tensor`` is ``torch.empty`` without an allocator and a zero-copy view over the next
region of a :class:`~tilescale_core.allocator.BaseAllocator` with one.
``tensor_from_ptr`` wraps an arbitrary device address (bytes) in a tensor without copying.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Union

import torch

from ._dlpack import byte_view

__all__ = [
    "DTYPES",
    "normalize_device",
    "numel_of",
    "resolve_dtype",
    "tensor",
    "tensor_from_ptr",
    "view_at",
]

#: dtype strings accepted by :func:`tensor_from_ptr` and :func:`tensor` (the list docs/core.md documents).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
    "long": torch.int64,
    "uint8": torch.uint8,
    "byte": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
}

Shape = Union[int, Sequence[int], torch.Size]
DeviceLike = Union[int, str, torch.device, None]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype string from :data:`DTYPES` (or a ``torch.dtype``) to a ``torch.dtype``.

    Raises:
        ValueError: an unknown dtype string, naming the accepted ones.
        TypeError: neither a string nor a ``torch.dtype``.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(
                f"unknown dtype string {dtype!r}; accepted: {', '.join(DTYPES)}"
            ) from None
    raise TypeError(f"dtype must be a string or torch.dtype, got {type(dtype).__name__}")


#: What a shape dimension may be, for the error messages.
_DIM_KINDS = "an int, a numpy integer or a 0-dim integer tensor"


def _as_dim(value: Any) -> int | None:
    """``value`` as a plain int when it is an integer dimension, else None.

    Accepted: anything ``operator.index`` accepts (``int``, numpy integers, 0-dim integer
    numpy arrays), and 0-dim integer torch tensors (on any device: read with ``.item()``).
    Refused: bools (``True``, ``numpy.bool_``, bool tensors), floats (even whole ones),
    tensors and arrays with more than one dimension or element, everything else.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            return None
        return int(value.item())
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy bool scalars and arrays
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _shape_tuple(shape: Shape, name: str = "shape", positive: bool = False) -> tuple[int, ...]:
    """``shape`` (one dimension or a sequence of them) as a tuple of plain ints.

    Each dimension may be an int, a numpy integer or a 0-dim integer tensor (see
    :func:`_as_dim`); it must be >= 0 (>= 1 with ``positive``).

    Raises:
        ValueError: a dimension of another kind or out of range, or ``shape`` is neither a
            dimension nor a sequence of them; the message names ``name``.
    """
    least, sign = (1, "positive") if positive else (0, "non-negative")
    if type(shape) is tuple and all(type(d) is int and d >= least for d in shape):
        return shape  # the common case, checked without a call per dimension
    single = _as_dim(shape)
    if single is not None:
        items: tuple = (shape,)
    elif isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ValueError(f"{name} must be a dimension or a sequence of dimensions ({_DIM_KINDS} each), "
                         f"got {shape!r}")
    else:
        items = tuple(shape)
    dims = []
    for index, value in enumerate(items):
        dim = _as_dim(value)
        if dim is None or dim < least:
            where = "" if single is not None else f" at index {index} of {shape!r}"
            raise ValueError(f"{name} dimensions must be {sign} integers ({_DIM_KINDS}), got {value!r}{where}")
        dims.append(dim)
    return tuple(dims)


def numel_of(shape: Shape) -> int:
    """Number of elements of ``shape`` (an int or a sequence of ints)."""
    n = 1
    for d in _shape_tuple(shape):
        n *= d
    return n


def normalize_device(device: DeviceLike) -> torch.device:
    """Return a ``torch.device`` with an explicit index for CUDA (``"cuda"`` -> current device)."""
    if device is None or (isinstance(device, str) and device == "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def slice_view(region: torch.Tensor, offset: int, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy tensor of ``shape`` and ``dtype`` at byte ``offset`` of ``region``, a 1-D
    ``torch.uint8`` tensor (for example a whole heap from ``byte_view``). ``offset`` must be a
    multiple of the dtype's size. Much cheaper than :func:`view_at` (no DLPack import)."""
    dims = _shape_tuple(shape)
    nbytes = numel_of(dims) * dtype.itemsize
    if offset < 0 or offset + nbytes > region.numel():
        raise ValueError(f"{nbytes} bytes at offset {offset} exceed the {region.numel()}-byte region")
    return region[offset : offset + nbytes].view(dtype).view(dims)


def view_at(ptr: int, shape: Shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-copy tensor of ``shape`` and ``dtype`` at address ``ptr`` (bytes) on ``device``."""
    dims = _shape_tuple(shape)
    nbytes = numel_of(dims) * torch.empty((), dtype=dtype).element_size()
    return byte_view(ptr, nbytes, device).view(dtype).view(dims)


def tensor_from_ptr(
    ptr_val: int,
    shape: Shape,
    dtype_str: str = "float32",
    device: int = 0,
    take_ownership: bool = False,
) -> torch.Tensor:
    """Create a zero-copy CUDA tensor view of ``shape`` over device address ``ptr_val``.

    Args:
        ptr_val: device address in bytes; the memory must outlive the tensor.
        shape: tensor shape (elements).
        dtype_str: one of :data:`DTYPES` (a ``torch.dtype`` is accepted too).
        device: CUDA ordinal the view is placed on.
        take_ownership: not implemented; ``True`` raises NotImplementedError.
    """
    if take_ownership:
        raise NotImplementedError(
            "tensor_from_ptr(take_ownership=True) is not implemented: the tensor never frees "
            "ptr_val; keep the memory alive and free it yourself"
        )
    dtype = resolve_dtype(dtype_str)
    if isinstance(ptr_val, bool) or not isinstance(ptr_val, int) or ptr_val < 0:
        raise ValueError(f"ptr_val must be a non-negative int address, got {ptr_val!r}")
    if ptr_val == 0 and numel_of(shape) > 0:
        raise ValueError("ptr_val is a null pointer")
    dev = normalize_device(device)
    if dev.type != "cuda":
        raise ValueError(f"tensor_from_ptr creates CUDA tensors; got device {device!r}")
    return view_at(ptr_val, shape, dtype, dev)


def tensor(
    shape: Shape,
    dtype: str | torch.dtype,
    device: DeviceLike = None,
    allocator: Any = None,
    return_peers: bool | None = None,
):
    """Allocate a tensor, from ``allocator``'s symmetric heap when one is given.

    Without an allocator this is ``torch.empty(shape, dtype=dtype, device=device)``.  With
    an initialised :class:`~tilescale_core.allocator.BaseAllocator` it returns a zero-copy
    view over the allocator's next region (256-byte aligned); with ``return_peers=True`` it
    returns a list with one view per rank (index = rank, this rank's entry is the local
    tensor), all on this process's device.  Every rank must make the same calls in the same
    order.

    ``shape`` is one dimension or a sequence of them; a dimension is anything ``int()``
    takes as an exact integer: an ``int``, a numpy integer, or a 0-dim integer tensor (for
    example ``cu_seqlens[-1]``, read on the host).

    Raises:
        ValueError: a dimension that is negative, a bool, a float (even ``2.0``) or not a
            number (the message names ``shape``); unknown dtype string; ``device`` differs
            from the allocator's device; ``return_peers`` without an allocator.
    """
    torch_dtype = resolve_dtype(dtype)
    dims = _shape_tuple(shape)
    if allocator is None:
        if return_peers:
            raise ValueError("return_peers=True needs an allocator (peer views live in its heap)")
        return torch.empty(dims, dtype=torch_dtype, device=device)
    if device is not None:
        wanted = normalize_device(device)
        if wanted != allocator.device:
            raise ValueError(
                f"tensor requested on {wanted} but the allocator's heap is on {allocator.device}"
            )
    return allocator._allocate_tensor(dims, torch_dtype, return_peers=bool(return_peers))
