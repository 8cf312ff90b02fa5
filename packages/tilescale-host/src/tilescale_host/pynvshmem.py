"""``pynvshmem`` without NVSHMEM: upstream TileScale's host module over TileScale's symmetric heap.

Upstream TileScale's NVSHMEM examples call a small part of its ``pynvshmem`` bindings: they
initialise it (``tilelang.distributed.init_distributed`` calls
``pynvshmem.init_nvshmem_by_uniqueid(group)``), allocate symmetric tensors with
``nvshmem_create_tensor(shape, dtype)`` and synchronise with ``nvshmem_barrier_all()``.
This module gives those functions, with upstream's signatures, over one
:func:`tilescale_core.get_allocator` heap per process:

* **Initialisation** records the process group; the heap is made, collectively, by the first
  call that allocates or synchronises (every rank makes those calls, as NVSHMEM requires),
  and becomes the process's default heap (:func:`tilescale_core.interface.set_default_allocator`):
  a kernel that reads the heap table and was never ``kernel.initialize``\\ d gets it at its
  first launch, as an NVSHMEM kernel sees NVSHMEM's heap.  Its size per rank is
  ``NVSHMEM_SYMMETRIC_SIZE`` (NVSHMEM's variable: bytes, or with a ``K``/``M``/``G``/``T``
  suffix), default 4 GiB.
* **Allocation** is the heap's bump allocation: ``nvshmem_free`` and dropping a tensor give
  nothing back (the memory returns with :func:`nvshmem_finalize` or at exit).
* **One node**: the heap maps every peer's memory into this process, so every rank of the
  group must be on this node; a larger group fails with one line that says so.

The top-level module ``pynvshmem`` (``src/pynvshmem.py`` of tilescale-host) re-exports this
one, unless a real ``pynvshmem`` (upstream's NVSHMEM bindings) is installed: then that one is
imported instead, and this module stays reachable as ``tilescale_host.pynvshmem``.
"""

from __future__ import annotations

import operator
import os
import re
import threading
from enum import IntEnum
from typing import Any

__all__ = [
    "Team", "init_nvshmem_by_uniqueid", "nvshmem_barrier_all", "nvshmem_create_tensor",
    "nvshmem_create_tensor_list_intra_node", "nvshmem_finalize", "nvshmem_free", "nvshmem_malloc",
    "nvshmem_my_pe", "nvshmem_n_pes", "nvshmem_ptr", "nvshmem_team_my_pe", "nvshmem_team_n_pes",
    "nvshmemx_barrier_all_on_stream", "nvshmemx_cumodule_finalize", "nvshmemx_cumodule_init",
    "nvshmemx_get_uniqueid", "nvshmemx_init_attr_with_uniqueid", "write32_on_stream",
]

#: NVSHMEM's variable for the symmetric heap's bytes per PE; honoured here.
SIZE_ENV = "NVSHMEM_SYMMETRIC_SIZE"
DEFAULT_HEAP_BYTES = 4 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: What :func:`nvshmemx_get_uniqueid` returns: the heap needs no NVSHMEM id (128 bytes, as NVSHMEM's).
UNIQUE_ID = b"tilescale-heap".ljust(128, b"\0")
_lock = threading.RLock()
_state: dict[str, Any] = {"group": None, "rank": 0, "size": 1, "allocator": None}


class Team(IntEnum):
    """NVSHMEM's predefined teams (upstream's ``pynvshmem.Team``).  On one node ``WORLD``,
    ``SHARED`` and ``NODE`` are the same ranks."""

    INVALID = -1
    WORLD = 0
    SHARED = 1
    NODE = 2
    SAME_MYPE_NODE = 3
    SAME_GPU = 4
    GPU_LEADERS = 5
    TEAMS_MIN = 6


def heap_bytes(env: dict | None = None) -> int:
    """Heap bytes per rank: ``NVSHMEM_SYMMETRIC_SIZE`` (``4294967296``, ``512M``, ``4G`` ...)
    or :data:`DEFAULT_HEAP_BYTES`.

    Raises:
        ValueError: a value that is not a positive size (names the variable).
    """
    value = (os.environ if env is None else env).get(SIZE_ENV, "").strip()
    if not value:
        return DEFAULT_HEAP_BYTES
    match = re.fullmatch(r"(\d+)\s*([KMGT]?)(i?B)?", value, flags=re.IGNORECASE)
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"{SIZE_ENV}={value!r} is not a positive size (bytes, or a number with K, M, G or T)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def init_nvshmem_by_uniqueid(group: Any) -> None:
    """Initialise over ``group`` (a ``torch.distributed`` process group), upstream's
    ``pynvshmem.init_nvshmem_by_uniqueid``.  Cheap: the heap is made by the first allocating
    or synchronising call.  Calling it again with the same group does nothing.

    Raises:
        TypeError: ``group`` is not a process group.
        RuntimeError: initialised before with another group; a group larger than this node.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pynvshmem: torch.distributed is not initialised (call tilelang.distributed.init_distributed first)")
    if group is None or not hasattr(group, "size"):
        raise TypeError(f"group must be a torch.distributed process group, got {type(group).__name__}")
    with _lock:
        if _state["group"] is not None:
            if _state["group"] is not group:
                raise RuntimeError("pynvshmem is already initialised with another process group")
            return
        size = dist.get_world_size(group)
        local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        if local.isdigit() and int(local) < size:
            raise RuntimeError(
                f"pynvshmem (TileScale, no NVSHMEM): the group has {size} ranks but LOCAL_WORLD_SIZE={local}: "
                "the symmetric heap spans one node only; multi-node programs need NVSHMEM")
        _state.update(group=group, rank=dist.get_rank(group), size=size)


def nvshmemx_get_uniqueid() -> bytes:
    """NVSHMEM's unique id, for upstream's bootstrap: a fixed token (the heap joins through
    the ``torch.distributed`` group instead)."""
    return UNIQUE_ID


def nvshmemx_init_attr_with_uniqueid(rank: int, nranks: int, unique_id: bytes) -> None:
    """Upstream's second bootstrap step: initialise over the ``torch.distributed`` world
    group, which must have ``nranks`` ranks with this process as ``rank``.

    Raises:
        ValueError: ``rank`` / ``nranks`` disagree with the world group; ``unique_id`` not bytes.
    """
    import torch.distributed as dist

    if not isinstance(unique_id, (bytes, bytearray)):
        raise ValueError(f"unique_id must be bytes, got {type(unique_id).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pynvshmem: torch.distributed is not initialised (call tilelang.distributed.init_distributed first)")
    if (dist.get_rank(), dist.get_world_size()) != (rank, nranks):
        raise ValueError(f"rank={rank}, nranks={nranks} but this process is rank {dist.get_rank()} "
                         f"of {dist.get_world_size()} in the torch.distributed world group")
    init_nvshmem_by_uniqueid(dist.group.WORLD)


def _group() -> Any:
    if _state["group"] is None:
        raise RuntimeError("pynvshmem is not initialised: call pynvshmem.init_nvshmem_by_uniqueid(group) "
                           "(tilelang.distributed.init_distributed() does)")
    return _state["group"]


def _new_heap(group: Any, rank: int, size: int) -> Any:
    """A heap of :func:`heap_bytes` per rank on the current CUDA device, collective over ``group``."""
    import torch
    from tilescale_core import get_allocator

    return get_allocator(size=heap_bytes(), device=torch.device("cuda", torch.cuda.current_device()),
                         is_distributed=True, local_rank=rank, num_local_ranks=size, group=group)


def heap() -> Any:
    """This process's heap (made, collectively over the group, on the first call), the
    process's default heap from then on."""
    group = _group()
    with _lock:
        if _state["allocator"] is None:
            from tilescale_core.interface import set_default_allocator

            _state["allocator"] = _new_heap(group, _state["rank"], _state["size"])
            set_default_allocator(_state["allocator"])
        return _state["allocator"]


def _synchronize() -> None:
    """Wait for this process's device work, as NVSHMEM's allocation and free do (nothing to
    wait for while CUDA is not initialised)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def nvshmem_my_pe() -> int:
    """This rank in the initialised group (``nvshmem_my_pe``)."""
    _group()
    return _state["rank"]


def nvshmem_n_pes() -> int:
    """The number of ranks in the initialised group (``nvshmem_n_pes``)."""
    _group()
    return _state["size"]


def _team(team: Any) -> Team:
    try:
        member = Team(int(team))
    except (TypeError, ValueError):
        raise ValueError(f"team must be a pynvshmem.Team, got {team!r}") from None
    if member not in (Team.WORLD, Team.SHARED, Team.NODE, Team.SAME_MYPE_NODE):
        raise ValueError(f"team {member.name} is not available on TileScale's heap (WORLD, SHARED, NODE, SAME_MYPE_NODE are)")
    return member


def nvshmem_team_my_pe(team: Any) -> int:
    """This rank's index in ``team``: WORLD, SHARED and NODE are the group (one node);
    SAME_MYPE_NODE holds this rank alone."""
    return 0 if _team(team) is Team.SAME_MYPE_NODE else nvshmem_my_pe()


def nvshmem_team_n_pes(team: Any) -> int:
    """The number of ranks in ``team`` (see :func:`nvshmem_team_my_pe`)."""
    return 1 if _team(team) is Team.SAME_MYPE_NODE else nvshmem_n_pes()


def _shape(shape: Any) -> list[int]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = [shape]
    try:  # operator.index: ints, numpy integers, 0-dim integer tensors; never a float truncated
        dims = [operator.index(d) for d in shape]
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have non-negative dimensions, got {dims}")
    n = 1
    for d in dims:
        n *= d
    if n == 0:
        raise ValueError(f"shape {dims} has no elements; nvshmem_create_tensor needs a nonempty tensor")
    return dims


def nvshmem_create_tensor(shape: Any, dtype: Any):
    """A ``shape`` tensor of ``dtype`` in the symmetric heap, at the same offset on every
    rank (collective: every rank makes the same calls in the same order).  Its contents are
    not initialised, as NVSHMEM's.

    Raises:
        TypeError / ValueError: a bad or empty ``shape``, an unknown ``dtype``.
        tilescale_core.HeapExhaustedError: the heap is full (raise ``NVSHMEM_SYMMETRIC_SIZE``).
    """
    dims = _shape(shape)
    allocator = heap()
    _synchronize()
    return allocator.tensor(dims, dtype)


def nvshmem_create_tensor_list_intra_node(shape: Any, dtype: Any) -> list:
    """:func:`nvshmem_create_tensor`, returned as one view per rank of the node (index =
    rank; this rank's entry is its own tensor, the others map the peers' copies)."""
    dims = _shape(shape)
    allocator = heap()
    _synchronize()
    return allocator.tensor(dims, dtype, return_peers=True)


def nvshmem_malloc(size: int) -> int:
    """``size`` bytes of the heap (collective); returns the local address."""
    from tilescale_core.interface import check_positive_int

    allocator = heap()
    return allocator.base_ptr + allocator.allocate(check_positive_int("size", size))


def nvshmem_free(ptr: int) -> None:
    """Nothing: the heap is a bump allocator (memory returns with :func:`nvshmem_finalize`)."""


def nvshmem_ptr(ptr: int, peer: int) -> int:
    """The address of heap address ``ptr``'s counterpart on rank ``peer`` in this process;
    0 for an address outside the heap (NVSHMEM's NULL)."""
    allocator = heap()
    offset = int(ptr) - allocator.base_ptr
    if not 0 <= offset < allocator.size:
        return 0
    if not 0 <= int(peer) < allocator.num_ranks:
        raise ValueError(f"peer must be a rank in [0, {allocator.num_ranks}), got {peer!r}")
    base = allocator.base_ptr if int(peer) == allocator.local_rank else allocator.peer_base_ptrs[int(peer)]
    return base + offset


def nvshmemx_barrier_all_on_stream(stream: Any = None) -> None:
    """Enqueue a barrier of every rank on ``stream`` (a ``torch.cuda.Stream``, a raw stream
    handle as upstream passes it, or None: the current stream); returns at once
    (:func:`tilescale_host.stream_barrier.barrier_all_on_stream`)."""
    import torch

    from .stream_barrier import barrier_all_on_stream

    if isinstance(stream, int) and not isinstance(stream, bool):
        stream = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream()
    barrier_all_on_stream(stream, group=_group())


def nvshmem_barrier_all() -> None:
    """Host barrier of every rank (NVSHMEM's ``nvshmem_barrier_all`` on the host): this
    rank's device work so far completes, every rank arrives, then it returns -- the peers'
    kernels launched before it have finished and their writes to the heap are visible."""
    import torch

    _group()
    torch.cuda.synchronize()
    nvshmemx_barrier_all_on_stream(torch.cuda.current_stream())
    torch.cuda.current_stream().synchronize()


def nvshmemx_cumodule_init(module: Any) -> None:
    """Nothing: kernels get the heap's table from ``kernel.initialize`` or at their first
    launch (the default heap), not per module."""


def nvshmemx_cumodule_finalize(module: Any) -> None:
    """Nothing (see :func:`nvshmemx_cumodule_init`)."""


def write32_on_stream(tensor: Any, value: int, stream: Any = None) -> None:
    """Enqueue ``tensor[0] = value`` on ``stream`` (upstream's ``write32_on_stream``:
    ``cuStreamWriteValue32``), :func:`tilescale_host.signals.set_signal`."""
    from .signals import set_signal

    set_signal(tensor, value, stream)


def nvshmem_finalize() -> None:
    """Free the heap (collective) and forget the group; a later init starts afresh."""
    from tilescale_core.interface import set_default_allocator

    with _lock:
        allocator = _state["allocator"]
        _state.update(group=None, rank=0, size=1, allocator=None)
    if allocator is not None:
        set_default_allocator(None)
        _synchronize()
        allocator.close()


#: Upstream names this module does not provide, with what to use instead.
NOT_PROVIDED = {
    "nvshmem_putmem": "copy into a peer's view from nvshmem_create_tensor_list_intra_node",
    "nvshmem_getmem": "copy from a peer's view from nvshmem_create_tensor_list_intra_node",
    "nvshmemx_putmem_on_stream": "a copy into a peer view on that stream",
    "nvshmemx_getmem_on_stream": "a copy from a peer view on that stream",
    "nvshmemx_putmem_signal_on_stream": "a peer-view copy, then tilescale_host.signals.set_signal",
    "nvshmemx_mc_ptr": "the allocator's multicast region (get_allocator(mcast_size=...))",
    "write64_on_stream": "a 64-bit signal written by a kernel, or write32_on_stream",
}


def __getattr__(name: str) -> Any:
    if name in ("CmpType", "Amo"):
        import tilelang.language as T

        if not hasattr(T, name):
            raise AttributeError(f"pynvshmem.{name} comes from tilescale-lang (T.{name}), which is not installed")
        return getattr(T, name)
    if name in NOT_PROVIDED or name.startswith("nvshmem_") and name.endswith("_p"):
        instead = NOT_PROVIDED.get(name, "T.st(..., dst_pe=pe) in a kernel")
        raise AttributeError(f"pynvshmem.{name} is not provided by TileScale's pynvshmem (no NVSHMEM); use {instead}")
    raise AttributeError(f"module 'pynvshmem' (TileScale) has no attribute {name!r}")
