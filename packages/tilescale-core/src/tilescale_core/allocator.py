"""The symmetric heap: :class:`BaseAllocator` and :func:`get_allocator` (the memory path it
takes: :mod:`~tilescale_core.heap_path`; its allocation log: :mod:`~tilescale_core.allocation_log`).

Every rank owns one base allocation of ``size`` bytes; the ranks exchange handles so that
each process can address every peer's base.  Allocations are bump allocations at the same
offset on every rank, so a peer's copy of a tensor lives at ``peer_base + offset``.  The
CPU ``torch.uint64`` table ``[local_rank, num_ranks, base_0, ..., base_{n-1}]`` is what
kernels receive (``kernel.initialize(allocator=...)``); :mod:`tilescale_core.table` owns its
layout and capacity (``MAX_TABLE_ENTRIES`` here is that module's).

Every rank must allocate the same sizes in the same order.  Each allocator keeps a running
SHA-256 digest of its allocation sequence and compares it across ranks in :meth:`close`,
and on every allocation in check mode (``check_alloc=True`` or ``TILESCALE_CHECK_ALLOC=1``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from . import _driver_multicast, probes
from .allocation_log import AllocationLog, AllocationMismatchError
from .heap_path import PATHS, USE_VMM_ENV, VmmUnavailableError, check_multicast, select_path
from .table import MAX_TABLE_ENTRIES, build_table, check_num_ranks
from ._backends import HeapBackend, make_backend
from ._comm import Comm, SetupError
from ._deadline import call_with_deadline
from ._dlpack import byte_view
from .env import flag
from .tensors import normalize_device, numel_of, resolve_dtype, slice_view, view_at
from .validate import check_positive_int, check_seconds

__all__ = [
    "CHECK_ENV",
    "DEFAULT_ALIGNMENT",
    "DEFAULT_CLOSE_TIMEOUT_S",
    "MAX_TABLE_ENTRIES",
    "PATHS",
    "USE_VMM_ENV",
    "AllocationLog",
    "AllocationMismatchError",
    "BaseAllocator",
    "HeapExhaustedError",
    "SetupError",
    "VmmUnavailableError",
    "check_multicast",
    "get_allocator",
    "select_path",
]

#: Environment switch of the per-allocation cross-rank check (``1`` enables it).
CHECK_ENV = "TILESCALE_CHECK_ALLOC"
#: Default alignment of allocations, bytes.
DEFAULT_ALIGNMENT = 256
#: Seconds each step of :meth:`BaseAllocator.close` may take by default.
DEFAULT_CLOSE_TIMEOUT_S = 60.0


class HeapExhaustedError(MemoryError):
    """An allocation does not fit. Attributes ``requested``, ``used``, ``capacity`` (bytes)."""

    def __init__(self, region: str, requested: int, used: int, capacity: int, alignment: int):
        self.requested = requested
        self.used = used
        self.capacity = capacity
        super().__init__(
            f"symmetric {region} exhausted: requested {requested} bytes (alignment {alignment}) "
            f"with {used} of {capacity} bytes used; create the allocator with a larger size"
        )


@dataclass
class _Region:
    name: str
    base: int
    capacity: int
    used: int = 0


@dataclass
class _Multicast:
    handle: int
    local_ptr: int
    mc_ptr: int
    size: int


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _resolve_group(is_distributed: bool, local_rank: int, num_local_ranks: int, group: Any) -> tuple[int, int, Any]:
    if not is_distributed:
        if (local_rank, num_local_ranks) != (0, 1):
            raise ValueError(
                f"is_distributed=False makes a single-rank heap; got local_rank={local_rank}, "
                f"num_local_ranks={num_local_ranks}"
            )
        return 0, 1, None
    num_local_ranks = check_positive_int("num_local_ranks", num_local_ranks)
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < num_local_ranks:
        raise ValueError(f"local_rank must be an int in [0, {num_local_ranks}), got {local_rank!r}")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if group is None and num_local_ranks == 1:
            return 0, 1, None
        raise ValueError("a distributed allocator needs an initialised torch.distributed process group")
    group = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != num_local_ranks:
        raise ValueError(f"num_local_ranks={num_local_ranks} but the group has {size} ranks")
    if rank != local_rank:
        raise ValueError(f"local_rank={local_rank} but this process is rank {rank} of the group")
    return rank, size, group


def _resolve_device(device: Any, backend: HeapBackend) -> torch.device:
    if backend.device_type == "cpu":
        dev = torch.device(device)
        if dev.type != "cpu":
            raise ValueError(f"this backend holds host memory; device must be 'cpu', got {device!r}")
        return dev
    if not torch.cuda.is_available():
        raise RuntimeError(f"a CUDA heap needs a GPU, and CUDA is unavailable: {probes.probe_driver().reason}")
    dev = normalize_device(device)
    if dev.type != "cuda":
        raise ValueError(f"the symmetric heap lives on a CUDA device; got device={device!r}")
    return dev


class BaseAllocator:
    """A bump allocator over one base allocation per rank, with every peer's base mapped here.

    Construction is collective over ``group``: every rank allocates ``size`` bytes, the
    handles are exchanged, and every peer base is mapped.  When any rank fails during set-up,
    every rank raises :class:`~tilescale_core._comm.SetupError` naming it.  Use
    :func:`get_allocator` (the documented entry point, docs/core.md); the arguments are the same.

    Args:
        size: heap bytes per rank (> 0).
        device: ``"cuda"`` (the current device), ``"cuda:k"``, ``k`` or a ``torch.device``.
        is_distributed: share the heap with the ranks of ``group``.
        local_rank: this process's rank in ``group``.
        num_local_ranks: ``group``'s size.
        group: a ``torch.distributed`` group (default: the world group).  Several ranks may
            share one GPU (use gloo there: NCCL refuses it).
        use_vmm: force VMM (True) or CUDA IPC (False); None chooses (see :func:`select_path`).
        mcast_size: bytes of an additional multicast region (VMM fabric + multicast only).
        check_alloc: compare every allocation across ranks (default: ``TILESCALE_CHECK_ALLOC``,
            read by :func:`tilescale_core.env.flag`: ``1``/``true``/``yes``/``on``; a value that is
            neither an on nor an off spelling is a ``ValueError`` naming it).
        backend: a :class:`~tilescale_core._backends.HeapBackend` replacing the path's own
            (tests use :class:`tilescale_core.testing.HostBackend`).
    """

    def __init__(
        self,
        size: int = 2**30,
        device: Any = "cuda",
        is_distributed: bool = True,
        local_rank: int = 0,
        num_local_ranks: int = 1,
        group: Any = None,
        use_vmm: bool | None = None,
        mcast_size: int | None = None,
        *,
        check_alloc: bool | None = None,
        backend: HeapBackend | None = None,
    ):
        self._closed = True  # until set-up completes
        rank, num_ranks, group = _resolve_group(is_distributed, local_rank, num_local_ranks, group)
        self.local_rank = rank
        self.num_ranks = num_ranks
        self._comm = Comm(group, rank, num_ranks)

        def validate() -> tuple:
            self._validate(size, device, is_distributed, use_vmm, mcast_size, backend)
            self._check = flag(CHECK_ENV, False) if check_alloc is None else bool(check_alloc)
            return (self.size, self.path, self.mcast_size)

        # Checked even for bad input, so that one rank's mistake stops every rank.
        agreed = self._comm.phase("validate arguments", validate, reraise_own=True)
        if len(set(agreed)) > 1:
            listing = "; ".join(f"rank {r}: size={a[0]}, path={a[1]!r}, mcast_size={a[2]}" for r, a in enumerate(agreed))
            raise ValueError(f"the ranks disagree on the heap ({listing}); every rank must pass the same arguments")
        self._log = AllocationLog()
        self._mc: _Multicast | None = None
        self._setup()

    def _validate(self, size, device, is_distributed, use_vmm, mcast_size, backend) -> None:
        """Check the arguments and choose the path and backend; no driver work."""
        size = check_positive_int("size", size)
        check_num_ranks(self.num_ranks)
        self.path = select_path(
            is_distributed=is_distributed,
            use_vmm=use_vmm,
            env_value=os.environ.get(USE_VMM_ENV),
            fabric_probe=probes.probe_vmm_fabric,
            fd_probe=probes.probe_vmm_fd,
        )
        check_multicast(mcast_size, self.path, is_distributed, probes.probe_multicast)
        self._backend = backend if backend is not None else make_backend(self.path)
        self.device = _resolve_device(device, self._backend)
        self.size = size
        self.mcast_size = mcast_size

    # --- set-up and teardown ---------------------------------------------------------

    def _setup(self) -> None:
        comm, backend = self._comm, self._backend
        mine: list[int] = []

        def allocate() -> int:
            mine.append(backend.allocate(self.size, self.device))
            return -1 if self.device.index is None else self.device.index

        with backend.guard(self.device):
            try:
                self.device_ids = comm.phase(f"{self.path}: allocate {self.size} bytes", allocate)
                self.peer_base_ptrs = backend.share(comm, mine[0], self.size, self.device)
            except BaseException:
                if mine:
                    with contextlib.suppress(Exception):
                        backend.free(mine[0])
                raise
            try:
                if self.mcast_size is not None:
                    self._mc = self._setup_multicast()
            except BaseException:
                with contextlib.suppress(Exception):
                    backend.unshare(self.peer_base_ptrs, self.local_rank)
                    backend.free(mine[0])
                raise
        self.base_ptr = mine[0]
        self._heap = _Region("heap", self.base_ptr, self.size)
        # Whole-heap byte views (this rank's now, peers' on first use): a tensor is a slice
        # of one, which costs a few microseconds instead of a DLPack import per tensor.
        self._heap_bytes: dict[int, torch.Tensor] = {}
        self._mc_region = None if self._mc is None else _Region("multicast heap", self._mc.local_ptr, self.mcast_size)
        self.table = build_table(self.local_rank, self.num_ranks, self.peer_base_ptrs)
        self._closed = False

    def _setup_multicast(self) -> _Multicast:
        comm, mc, n = self._comm, _driver_multicast, self.num_ranks
        state: dict[str, int] = {}
        size = 0
        try:
            size = comm.phase("multicast: size", lambda: mc.aligned_size(self.mcast_size, n))[0]

            def create() -> bytes | None:
                if comm.rank != 0:
                    return None
                state["handle"] = mc.create(size, n)
                return mc.export_handle(state["handle"])

            exported = comm.phase("multicast: create", create)[0]

            def attach() -> None:
                if comm.rank != 0:
                    state["handle"] = mc.import_handle(exported)
                mc.add_device(state["handle"], self.device.index)

            comm.phase("multicast: add devices", attach)

            def bind() -> None:
                state["local"] = self._backend.allocate(size, self.device)
                mc.bind_mem(state["handle"], state["local"], size)
                state["bound"] = 1
                state["mc_ptr"] = mc.map(state["handle"], size, [self.device.index])

            comm.phase("multicast: bind and map", bind)
        except BaseException:
            self._teardown_multicast(state, size)
            raise
        return _Multicast(state["handle"], state["local"], state["mc_ptr"], size)

    def _teardown_multicast(self, state: dict[str, int], size: int) -> None:
        mc = _driver_multicast
        steps = [
            ("mc_ptr", lambda: mc.unmap(state["mc_ptr"], size)),
            ("bound", lambda: mc.unbind(state["handle"], self.device.index, size)),
            ("local", lambda: self._backend.free(state["local"])),
            ("handle", lambda: mc.release_handle(state["handle"])),
        ]
        for key, undo in steps:
            if key in state:
                with contextlib.suppress(Exception):
                    undo()

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Collective and idempotent: check the allocation sequences, unmap peers, free the heap.

        Every tensor over the heap becomes invalid.  Call it on every rank before destroying
        the process group.

        Args:
            timeout: seconds each step (device synchronisation, each exchange with the
                peers) may take, > 0 and finite.  Past it the step fails with TimeoutError; the local
                mappings and the heap are released all the same.

        Raises:
            AllocationMismatchError: the ranks' allocation sequences differed (the memory is
                released anyway).
            TimeoutError: the device or a peer did not finish a step in time (a dead or
                stuck rank); this rank's mappings are released before it is raised.
        """
        if self._closed:
            return
        timeout = check_seconds("timeout", timeout)
        self._closed = True
        self._heap_bytes = {}
        comm, backend = self._comm, self._backend
        rank = self.local_rank

        device = self.device

        def step(fn, what):
            def in_thread():
                if device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(device)
                return fn()

            return call_with_deadline(in_thread, timeout, f"allocator.close() on rank {rank}: {what}")

        mismatch = None
        with backend.guard(self.device):
            try:
                step(lambda: backend.synchronize(self.device), "device synchronisation")
                mismatch = step(self._compare_logs, "comparing the allocation sequences")
                step(comm.barrier, "barrier before unmapping")  # nobody uses a peer's memory any more
            except BaseException:
                self._release_local()
                raise
            self._release_local()
            step(comm.barrier, "barrier after unmapping")  # every peer has unmapped this rank's memory
        if mismatch is not None:
            raise mismatch

    def _release_local(self) -> None:
        """Unmap the multicast region and every peer's heap, free this rank's heap; each step
        runs even when an earlier one failed (the first error is raised at the end)."""
        backend, errors = self._backend, []
        if self._mc is not None:
            mc, self._mc = self._mc, None
            state = {"mc_ptr": mc.mc_ptr, "bound": 1, "local": mc.local_ptr, "handle": mc.handle}
            self._teardown_multicast(state, mc.size)
        for undo in (lambda: backend.unshare(self.peer_base_ptrs, self.local_rank), lambda: backend.free(self.base_ptr)):
            try:
                undo()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _compare_logs(self) -> AllocationMismatchError | None:
        summaries = self._comm.all_gather((len(self._log.records), self._log.digest))
        if len(set(summaries)) == 1:
            return None
        logs = self._comm.all_gather(self._log.records)
        index, records = AllocationLog.first_difference(logs)
        return AllocationMismatchError(index, records, "found at close()")

    def __enter__(self) -> BaseAllocator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_closed", True) is False:
            warnings.warn(
                f"{self!r} was garbage-collected without close(); its memory is leaked "
                "(close() is collective and cannot run from a finaliser)",
                ResourceWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.used}/{self.size} bytes used"
        return (
            f"BaseAllocator(path={getattr(self, 'path', '?')!r}, rank={getattr(self, 'local_rank', '?')}"
            f"/{getattr(self, 'num_ranks', '?')}, device={getattr(self, 'device', '?')}, {state})"
        )

    # --- allocation ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (allocations then raise)."""
        return self._closed

    @property
    def used(self) -> int:
        """Bytes of the heap handed out so far (including alignment padding)."""
        return self._heap.used if hasattr(self, "_heap") else 0

    def _bump(self, region: _Region, nbytes: int, alignment: int) -> int:
        if self._closed:
            raise RuntimeError(f"the allocator is closed; cannot allocate {nbytes} bytes")
        nbytes = check_positive_int("nbytes", nbytes)
        alignment = check_positive_int("alignment", alignment)
        if alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        record = (region.name, nbytes, alignment)
        if self._check:
            self._check_record(record)
        offset = _align_up(region.used, alignment)
        if offset + nbytes > region.capacity:
            raise HeapExhaustedError(region.name, nbytes, region.used, region.capacity, alignment)
        self._log.append(record)
        region.used = offset + nbytes
        return offset

    def _check_record(self, record: tuple[str, int, int]) -> None:
        index = len(self._log.records)
        gathered = self._comm.all_gather((index, self._log.digest, record))
        if len(set(gathered)) == 1:
            return
        if len({(i, d) for i, d, _ in gathered}) > 1:  # histories already differ
            logs = self._comm.all_gather(self._log.records + [record])
            index, records = AllocationLog.first_difference(logs)
        else:
            records = {r: rec for r, (_, _, rec) in enumerate(gathered)}
        raise AllocationMismatchError(index, records, f"check mode, {CHECK_ENV}=1")

    def allocate(self, nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
        """Reserve ``nbytes`` bytes aligned to ``alignment``; return the offset from the base.

        The same offset addresses the region on every rank (``peer_base_ptrs[r] + offset``).

        Raises:
            HeapExhaustedError: the region does not fit (message: requested, used, capacity).
            RuntimeError: the allocator is closed.
            AllocationMismatchError: check mode found that ranks disagree.
        """
        return self._bump(self._heap, nbytes, alignment)

    def tensor(self, shape: Any, dtype: str | torch.dtype, return_peers: bool = False):
        """Allocate a ``shape`` tensor of ``dtype`` in the symmetric heap (256-byte aligned).

        Every rank must make the same calls in the same order; the tensor then sits at the
        same offset in every rank's heap.  ``tilelang.tensor(shape, dtype, allocator=a)`` is
        the same call.

        Args:
            shape: an int or a sequence of ints (elements).
            dtype: a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"`` ...).
            return_peers: return one view per rank instead of this rank's tensor.

        Returns:
            this rank's tensor (on :attr:`device`), or with ``return_peers`` a list of
            ``num_ranks`` views of the same tensor, index = rank (the peers' copies mapped
            into this process; this rank's entry is its own tensor).

        Raises:
            ValueError: unknown dtype, negative extents.
            HeapExhaustedError: the heap is full.
            RuntimeError: the allocator is closed.
        """
        return self._allocate_tensor(shape, dtype, return_peers=return_peers)

    def multicast_tensor(self, shape: Any, dtype: str | torch.dtype):
        """Allocate a ``shape`` tensor of ``dtype`` in the multicast region (256-byte aligned).

        Needs an allocator created with ``mcast_size`` (a distributed VMM allocator with
        fabric handles on a machine whose multicast probe passes).

        Returns:
            ``(multicast_view, local_view)``: ``multimem`` instructions (``T.multimem_*``) use
            the multicast view; write this rank's contribution through the local view (this
            rank's physical memory bound to the multicast object).

        Raises:
            RuntimeError: the allocator is closed, or has no multicast region (the message
                says how to get one).
            HeapExhaustedError: the multicast region is full.
        """
        return self._allocate_mcast_tensor(shape, dtype)

    def _allocate_tensor(self, shape: Any, dtype: str | torch.dtype, return_peers: bool = False):
        """Allocate a tensor in the heap; with ``return_peers`` return one view per rank (index = rank)."""
        dtype = resolve_dtype(dtype)
        nbytes = numel_of(shape) * dtype.itemsize
        offset = self.allocate(max(nbytes, 1))
        local = slice_view(self._heap_view(self.local_rank), offset, shape, dtype)
        if not return_peers:
            return local
        return [
            local if r == self.local_rank else slice_view(self._heap_view(r), offset, shape, dtype)
            for r in range(len(self.peer_base_ptrs))
        ]

    def _heap_view(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s whole heap as a 1-D uint8 tensor in this process (cached)."""
        view = self._heap_bytes.get(rank)
        if view is None:
            base = self.base_ptr if rank == self.local_rank else self.peer_base_ptrs[rank]
            view = self._heap_bytes[rank] = byte_view(base, self.size, self.device)
        return view

    def _allocate_mcast_tensor(self, shape: Any, dtype: str | torch.dtype):
        """Allocate in the multicast region; return ``(multicast_view, local_physical_view)``.

        Write this rank's contribution through the local view; ``multimem`` instructions use
        the multicast view.
        """
        if self._mc_region is None or self._mc is None:
            if self._closed:
                raise RuntimeError("the allocator is closed")
            raise RuntimeError(
                f"this allocator has no multicast region (path {self.path!r}): pass mcast_size to "
                f"get_allocator; multicast needs a distributed VMM allocator with fabric handles "
                f"(use_vmm=True or {USE_VMM_ENV}=1) on a machine whose multicast probe passes "
                f"(python -m tilescale_core.doctor)"
            )
        dtype = resolve_dtype(dtype)
        nbytes = numel_of(shape) * dtype.itemsize
        offset = self._bump(self._mc_region, max(nbytes, 1), DEFAULT_ALIGNMENT)
        mc_view = view_at(self._mc.mc_ptr + offset, shape, dtype, self.device)
        local_view = view_at(self._mc.local_ptr + offset, shape, dtype, self.device)
        return mc_view, local_view


def get_allocator(*args: Any, **kwargs: Any) -> BaseAllocator:
    """Create a :class:`BaseAllocator` (collective over ``group``): the documented entry point,
    with the constructor's arguments (one list, shown by ``inspect.signature``) except the
    test-only ``backend``.

    Example::

        allocator = tilelang.get_allocator(size=2**30, local_rank=rank,
                                           num_local_ranks=world_size, group=group)
        views = tilelang.tensor((1024,), "float32", allocator=allocator, return_peers=True)
        views[rank].fill_(rank)  # this rank's tensor; views[r] is rank r's copy
        ...
        allocator.close()
    """
    bound = _GET_ALLOCATOR_SIGNATURE.bind(*args, **kwargs)  # a TypeError names a wrong argument
    return BaseAllocator(*bound.args, **bound.kwargs)


def _public_signature() -> inspect.Signature:
    """:class:`BaseAllocator`'s constructor signature without ``self`` and ``backend``."""
    sig = inspect.signature(BaseAllocator.__init__)
    params = [p for name, p in sig.parameters.items() if name not in ("self", "backend")]
    return sig.replace(parameters=params, return_annotation="BaseAllocator")


_GET_ALLOCATOR_SIGNATURE = get_allocator.__signature__ = _public_signature()
