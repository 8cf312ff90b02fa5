"""The argument checks and small plans every symmetric op shares (re-exported by
:mod:`tilescale_examples.base`, where the ops import them from).

Every check raises ``TypeError`` / ``ValueError`` naming the argument, before anything is
allocated on the heap or compiled. Positive ints are checked by
:func:`tilescale_core.interface.check_positive_int` (one wording in every wheel).
"""

from __future__ import annotations

from typing import Tuple

import torch
from tilescale_core.interface import check_positive_int

__all__ = ["TARGET", "DEFAULT_MAX_BLOCKS", "DTYPES", "plan_chunks", "size_table_entry", "default_group",
           "check_shape", "check_dtype", "check_threads", "check_tensor", "check_group", "check_max_blocks",
           "check_target", "check_allocator", "check_positive_int", "check_bool", "check_disjoint", "check_aligned"]

#: Default TileLang target (H100/H200).
TARGET = {"kind": "cuda", "arch": "sm_90a"}
#: Grid cap when the device cannot be queried (CPU-only builds).
DEFAULT_MAX_BLOCKS = 128

#: torch dtype -> TileLang dtype name, for the dtypes the examples accept.
DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def plan_chunks(shard_numel: int, itemsize: int, world_size: int,
                max_blocks: int = DEFAULT_MAX_BLOCKS,
                min_chunk_bytes: int = 64 * 1024) -> Tuple[int, int]:
    """Split a shard into ``(chunks, chunk)``: ``chunks`` pieces of ``chunk`` elements.

    ``chunk`` is a multiple of 16 bytes (so chunk starts keep the shard's alignment), each
    piece holds at least ``min_chunk_bytes`` unless the shard is smaller, no piece is empty
    (``(chunks - 1) * chunk < shard_numel <= chunks * chunk``) and ``chunks * world_size <=
    max(max_blocks, world_size)``.
    """
    for name, value in (("shard_numel", shard_numel), ("itemsize", itemsize),
                        ("world_size", world_size), ("max_blocks", max_blocks),
                        ("min_chunk_bytes", min_chunk_bytes)):
        check_positive_int(name, value)
    align = max(1, 16 // itemsize)
    max_chunks = max(1, max_blocks // world_size)
    wanted = -(-shard_numel * itemsize // min_chunk_bytes)
    chunks = min(max(wanted, 1), max_chunks)
    chunk = -(-shard_numel // chunks)
    chunk = -(-chunk // align) * align
    chunks = -(-shard_numel // chunk)
    return chunks, chunk


def size_table_entry(table: dict, world_size: int):
    """The entry of a size table keyed by world size: the largest key not above
    ``world_size`` (the smallest key below all of them). ``world_size`` must be a positive int."""
    check_positive_int("world_size", world_size)
    keys = [k for k in sorted(table) if k <= world_size]
    return table[keys[-1]] if keys else table[min(table)]


def default_group():
    """``torch.distributed``'s world group when it is initialised, else None."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def check_bool(name: str, value) -> bool:
    """``value`` when it is a bool (``True``/``False``, not ``0``/``1``), else ``TypeError``
    naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_shape(shape, name: str = "shape") -> Tuple[int, ...]:
    """``shape`` (an int or a sequence of positive ints) as a tuple; errors name ``name``."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {shape!r}") from None
    if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise ValueError(f"{name} must be non-empty positive ints, got {shape!r}")
    return dims


def check_dtype(dtype, allowed=None) -> torch.dtype:
    """``dtype`` (a torch dtype or its name) if it is in ``allowed`` (default: ``DTYPES``)."""
    allowed = DTYPES if allowed is None else allowed
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        raise TypeError(f"dtype must be one of {sorted(DTYPES[d] for d in allowed)}, got {dtype!r}")
    return dtype


def check_threads(threads) -> None:
    """``ValueError`` unless ``threads`` (threads per block of a kernel) is an int multiple of
    32 in [32, 1024]."""
    if not isinstance(threads, int) or threads < 32 or threads > 1024 or threads % 32:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")


def check_tensor(tensor, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str = "input",
                 shape_name: str = "the shape", owner: str = "collective") -> None:
    """Raise ``TypeError`` / ``ValueError`` naming ``name`` unless ``tensor`` is a contiguous
    tensor of ``shape`` (called ``shape_name`` in the message), ``dtype`` and ``device``;
    ``owner`` names what was built for that dtype."""
    if (type(tensor) is torch.Tensor and tensor.dtype is dtype and tensor.shape == shape and tensor.device == device
            and tensor.is_contiguous()):
        return  # the common call, in one expression (a call's host time is part of its cost)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype}, this {owner} was built for {dtype}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape_name} {tuple(shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the allocator's heap is on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_aligned(tensor: torch.Tensor, name: str, reason: str, alignment: int = 16) -> None:
    """``ValueError`` naming ``name`` unless ``tensor``'s first byte is ``alignment``-byte
    aligned (``reason``: what needs it, e.g. "the GEMM reads it with TMA")."""
    if tensor.data_ptr() % alignment:
        raise ValueError(f"{name} must be {alignment}-byte aligned ({reason}), but its data starts at byte "
                         f"{tensor.data_ptr() % alignment} of a {alignment}-byte line; pass a fresh tensor "
                         "(or .clone() the view)")


def check_disjoint(outputs: dict, inputs: dict, reason: str) -> None:
    """``ValueError`` ``"<output> overlaps <other>: <reason>"`` when a given (not None) tensor
    of ``outputs`` overlaps a tensor of ``inputs`` or another output (``{name: tensor}``)."""
    given = [(name, t) for name, t in outputs.items() if t is not None]
    if not given:  # the common call: the op's own outputs
        return
    from tilescale_examples.collectives.reduce_engine import overlaps

    for i, (name, t) in enumerate(given):
        for other, u in [*inputs.items(), *given[i + 1:]]:
            if overlaps(t, u):
                raise ValueError(f"{name} overlaps {other}: {reason}")


def check_group(group):
    """``group`` if it is None or a ``torch.distributed`` process group; ``TypeError`` naming
    it otherwise (a stray object would only fail at the first barrier, after allocating)."""
    if group is None:
        return group
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be None or a torch.distributed ProcessGroup, got {type(group).__name__}: {group!r}")


def check_max_blocks(max_blocks) -> None:
    """``ValueError`` unless ``max_blocks`` is None (the default grid cap) or a positive int."""
    if max_blocks is not None and (not isinstance(max_blocks, int) or isinstance(max_blocks, bool) or max_blocks < 1):
        raise ValueError(f"max_blocks must be None or a positive int, got {max_blocks!r}")


def check_target(target) -> None:
    """``TypeError`` / ``ValueError`` naming ``target`` unless it is None (:data:`TARGET`), a
    TileLang target string or dict whose kind TVM knows (``"auto"`` too), or a TVM ``Target``
    (a bad one would only fail at the compile, after the heap buffers were allocated)."""
    if target is None:
        return
    from tilelang import tvm

    if isinstance(target, tvm.target.Target):
        return
    if isinstance(target, str):
        kind = target.split()[0] if target.strip() else ""
    elif isinstance(target, dict):
        kind = target.get("kind")
    else:
        raise TypeError(f"target must be None, a target string or dict, or a tvm Target, got {type(target).__name__}: {target!r}")
    if kind != "auto" and kind not in tvm.target.Target.list_kinds():
        raise ValueError(f"target {target!r}: unknown target kind {kind!r}")


def check_allocator(allocator) -> None:
    """``TypeError`` unless ``allocator`` looks like a tilescale-core allocator (``table``,
    ``num_ranks``); ``ClosedError`` (a ``RuntimeError``) if it is closed."""
    if allocator is None or not hasattr(allocator, "table") or not hasattr(allocator, "num_ranks"):
        raise TypeError(f"allocator must be a tilescale-core allocator (with table and num_ranks), got {type(allocator).__name__}")
    if getattr(allocator, "closed", False):
        from tilescale_examples.base import ClosedError

        raise ClosedError("allocator is closed")
