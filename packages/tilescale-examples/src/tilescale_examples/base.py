"""What every symmetric op shares: argument checks, symmetric buffers, the
compile-once/initialise step, one lifetime (``close`` / context manager / :class:`ClosedError`)
and the call contract's machinery (docs/architecture.md, "Call contract").

:class:`SymmetricOp` is the one base of the product classes: the collectives (through
:class:`SymmetricCollective`), the overlapped GEMMs (through
:class:`~tilescale_examples.overlap.gemm.OverlappedGemm`) and the tutorial ``TmaAllReduce``.
Its ``_setup_op`` is the one setup path (allocator, dtype, world size, group, lifetime state)
and :meth:`SymmetricOp.heap_bytes` sizes the heap by a dry run of the constructor on a
:class:`RecordingAllocator`.

An op built on these classes is **collective to construct**: every rank must build the same
ops (same shapes, dtypes and order), because the heap hands out the same offsets on every
rank only when the allocation sequence is the same, and the constructor ends with a barrier
so that no peer signals a flag before its owner has zeroed it.
"""

# (no `from __future__ import annotations`: subclasses define TileLang kernels)

import inspect
import logging
import math
import time
from typing import Optional, Sequence, Tuple, Union

import torch

from tilescale_examples._checks import (DEFAULT_MAX_BLOCKS, DTYPES, TARGET, check_aligned, check_allocator,
                                        check_bool, check_disjoint, check_dtype, check_group, check_max_blocks,
                                        check_positive_int, check_shape, check_target, check_tensor, check_threads,
                                        default_group, plan_chunks, size_table_entry)
from tilescale_examples._group import all_ranks_agree, collective_device, settle
from tilescale_examples._launch import _PINNED, _REBIND, _USERS, Relaunching, launch as lean_launch, table_bound
from tilescale_examples._contract import (OldSpellingWarning, RecordingAllocator, accepts_0_1_init,
                                          accepts_0_1_out, accepts_0_1_reference, dry_run_heap_bytes,
                                          positional_out, rank_left_out, row_shape_0_1, sm_count_of, warn_old_spelling)

__all__ = ["ClosedError", "SymmetricOp", "SymmetricCollective", "RowsPerRank", "KernelOwner", "Closable",
           "RecordingAllocator",
           "OldSpellingWarning", "accepts_0_1_init", "accepts_0_1_out", "accepts_0_1_reference", "rank_left_out", "row_shape_0_1",
           "positional_out", "warn_old_spelling",
           "check_tensor", "check_disjoint", "check_aligned", "check_threads", "plan_chunks", "size_table_entry",
           "check_allocator", "check_shape",
           "check_dtype", "check_group", "check_max_blocks", "check_target", "check_positive_int", "check_bool",
           "compile_once",
           "settle", "all_ranks_agree", "collective_device", "default_group", "TARGET", "DTYPES",
           "DEFAULT_MAX_BLOCKS"]


class ClosedError(RuntimeError):
    """A call of a symmetric op after its ``close()``, or after its allocator was closed."""


#: Compiled kernels of this process shared by instances (:meth:`KernelOwner._compile_kernel`).
_KERNELS: dict = {}
#: Execution backends whose loaded table :func:`tilescale_lang.metadata.bind_from_device` sets.
_DEVICE_BINDABLE = ("tvm_ffi", "nvrtc")


def _compile_flags() -> tuple:
    """TileScale's compile flags (header hash, wait timeout): they change the binary."""
    from tilescale_lang import headers

    return tuple(headers.compile_flags())


#: Logger of the library's progress messages (INFO: each kernel build, with its time); silent
#: unless configured (the benchmarks show it on rank 0, see ``benchmarks._harness``).
log = logging.getLogger("tilescale_examples")


def compile_once(func, group=None, target=None, pass_configs=None):
    """``func`` compiled once per host (``compile_once=True``: one rank compiles, the others
    hit TileLang's disk cache) for ``target`` (default :data:`TARGET`), with TileLang
    ``pass_configs`` when given. Logs ``building kernel <name> ...`` and the seconds it took
    (lowering and nvcc, or a cache load) on :data:`log` at INFO."""
    import tilelang

    attrs = getattr(func, "attrs", None)
    name = str(attrs["global_symbol"]) if attrs is not None and "global_symbol" in attrs else "kernel"
    extra = {} if pass_configs is None else {"pass_configs": dict(pass_configs)}
    log.info("building kernel %s ...", name)
    start = time.monotonic()
    kernel = tilelang.compile(func, target=target or TARGET, compile_once=True, compile_group=group, **extra)
    log.info("kernel %s ready (%.1f s)", name, time.monotonic() - start)
    return kernel


class Closable:
    """Context-manager lifetime: ``with X(...) as x:`` calls ``x.close()`` on exit.
    Subclasses define ``close()`` (idempotent) and ``closed``."""

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def _check_open(self) -> None:
        """:class:`ClosedError` if this object, or the allocator it was built on, is closed."""
        if self.closed:
            raise ClosedError(f"this {type(self).__name__} is closed")
        if getattr(getattr(self, "allocator", None), "closed", False):
            raise ClosedError(f"the allocator of this {type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def copy_symbol(symbol: str, variant: int) -> str:
    """The global symbol of copy ``variant`` (>= 1) of the kernel ``symbol``: see
    :meth:`KernelOwner._compile_kernel`."""
    return f"{symbol}_copy{variant}"


class KernelOwner:
    """What every object that launches TileScale kernels shares: compiling them (shared
    across instances, or a private copy where a CUDA graph pinned a shared one), binding the
    allocator's heap table before each launch, eagerly and under CUDA graph capture, and
    knowing whether a call has been captured.

    Needs the attributes ``allocator``, ``device``, ``group``, ``kernel`` and ``_captured``
    (False at construction)."""

    def _compile_kernel(self, build, target=None, pass_configs=None, key=None):
        """The compiled kernel of ``build()`` (a ``T.prim_func``) for this instance.

        With a ``key`` (a tuple naming everything the kernel depends on) the kernel is kept
        in a process-wide cache, so instances of any size share it (sizes are run-time
        arguments). A kernel that a CUDA graph captured on one allocator without rebinding
        its table (:meth:`bind_table`) stays that allocator's: an instance on another
        allocator gets its own copy of the kernel (the same code under another symbol, so a
        module and table of its own), compiled once per process. Collective, like the
        constructor: every rank asks for the same kernels."""
        variant = 0
        while True:
            full_key = None if key is None else (key, repr(target), _compile_flags(), variant)
            kernel = _KERNELS.get(full_key) if full_key is not None else None
            if kernel is None:
                func = build()
                if variant:
                    func = func.with_attr("global_symbol", copy_symbol(str(func.attrs["global_symbol"]), variant))
                kernel = compile_once(func, self.group, target, pass_configs)
                if full_key is not None:
                    _KERNELS[full_key] = kernel
            pinned = kernel.__dict__.get(_PINNED)
            if pinned is None or pinned is self.allocator:
                return kernel
            variant += 1

    #: Attribute of a compiled kernel naming the allocator whose table its module holds.
    _TABLE_OWNER = "_tilescale_table_owner"

    def _capturing(self) -> bool:
        """Whether the current stream of this instance's device is capturing a CUDA graph."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _note_capture(self) -> bool:
        """Remember whether a call is being captured now; returns :attr:`captured`."""
        if self._capturing():
            self._captured = True
        return self._captured

    @property
    def captured(self) -> bool:
        """Whether a call of this instance has been captured in a CUDA graph (its call
        numbers then advance on the device only, with every replay)."""
        return self._captured

    def bind_table(self, force: bool = False, kernel=None) -> None:
        """Make ``kernel``'s (default ``self.kernel``) metadata table this instance's
        allocator's, stream-ordered on the current stream, before a launch.

        TileLang hands out one compiled kernel (one module, one table) per kernel source and
        process, so instances on different allocators (or emulated ranks) that share a
        kernel must rebind before they launch. Eagerly the table is copied when another
        allocator's is bound (or ``force``): from the instance's device copy of its table once
        the kernel's module is loaded (a device-to-device copy never waits for the stream),
        from host memory before (``kernel.initialize``). Under CUDA graph capture, a shared kernel gets a
        captured device-to-device copy of this allocator's table, so every replay binds its
        own table, and from then on every eager call rebinds too (replays change the bound
        table behind the host's back); a kernel only this allocator uses needs no copy and
        is pinned to it (:meth:`_compile_kernel` gives later instances on other allocators
        a copy of their own)."""
        kernel = self.kernel if kernel is None else kernel
        state = kernel.__dict__
        if not force and table_bound(self, state) and not self._capturing():
            return  # the common eager call: this allocator's table is bound (it is among the users)
        users = state.setdefault(_USERS, set())
        users.add(id(self.allocator))
        if self._capturing():
            from tilescale_lang.metadata import bind_from_device, loaded

            if not loaded(kernel):
                raise RuntimeError(f"{type(self).__name__}: its kernel has never run, so its module is not loaded; "
                                   "call it once outside the CUDA graph capture first (a warm-up, as torch "
                                   "recommends before capturing), on every rank, then capture")
            self._captured = True
            if len(users) > 1:
                bind_from_device(kernel, self._device_table(), torch.cuda.current_stream(self.device).cuda_stream)
                state[_REBIND] = True
                state[self._TABLE_OWNER] = None
            else:
                state[_PINNED] = self.allocator
            return
        if self.device.type != "cuda":
            kernel.initialize(allocator=self.allocator, stream=None)
        else:
            from tilescale_lang.metadata import bind_from_device, loaded

            table = self._device_table()  # made eagerly: a host-to-device copy cannot be captured
            stream = torch.cuda.current_stream(self.device).cuda_stream
            if getattr(kernel, "execution_backend", None) in _DEVICE_BINDABLE and loaded(kernel):
                # From the device copy: a copy from pageable host memory may wait until the
                # stream reaches it, so a rebind behind a kernel that waits for work the host
                # has yet to enqueue (emulated ranks, a stream hold) would never return.
                bind_from_device(kernel, table, stream)
            else:
                kernel.initialize(allocator=self.allocator, stream=stream)
        state[self._TABLE_OWNER] = self.allocator

    #: Whether this instance launches its kernels through the lean launcher
    #: (:mod:`tilescale_lang.lean`: ``op.lean_launch = True``) instead of TileLang's launcher
    #: (the default: its compiled launcher costs less host time per call than the lean one's
    #: Python, see docs/launch.md). Both give the same results.
    lean_launch = False

    def _launch_kernel(self, args: tuple, changing: Sequence[int], kernel=None) -> None:
        """Launch ``kernel`` (default ``self.kernel``) with ``args`` (every parameter, in
        order) on the current stream, the arguments at the ``changing`` positions packed per
        call (:func:`tilescale_examples._launch.launch`)."""
        kernel = self.kernel if kernel is None else kernel
        if not self.lean_launch or self.device.type != "cuda":
            kernel(*args)
        else:
            lean_launch(self.__dict__.setdefault("_lean_launches", {}), kernel, args, changing)

    def _device_table(self) -> torch.Tensor:
        """This allocator's metadata table as a device tensor (made once, by the first eager
        :meth:`bind_table`): the source of the table copies captured in CUDA graphs."""
        table = getattr(self, "_table_on_device", None)
        if table is None:
            if self._capturing():
                raise RuntimeError(f"{type(self).__name__}: its table was never bound outside a CUDA graph capture; "
                                   "call it once before capturing (a warm-up)")
            from tilescale_core.table import table_from_allocator

            values = [v - (1 << 64) if v >= 1 << 63 else v for v in table_from_allocator(self.allocator)]
            table = torch.tensor(values, dtype=torch.int64).to(self.device)  # the uint64 bits
            self._table_on_device = table
        return table


class SymmetricOp(KernelOwner, Relaunching, Closable):
    """Base of every symmetric op: one setup path (:meth:`_setup_op`), one lifetime
    (``close()``, ``closed``, :class:`ClosedError` from every call after ``close()``), and
    :meth:`heap_bytes` from a dry run of the constructor.

    Attributes set by :meth:`_setup_op`: ``allocator``, ``dtype``, ``itemsize``,
    ``world_size``, ``rank``, ``device``, ``group``, ``epoch`` (calls made so far),
    ``kernel``. Subclasses name the strategies of their ``algorithm`` keyword in
    :attr:`ALGORITHMS` and their droppable buffers in ``_BUFFERS``.
    """

    #: Values of the ``algorithm`` keyword, ``"auto"`` first.
    ALGORITHMS: Tuple[str, ...] = ("auto",)
    #: Algorithms that ``"auto"`` chooses between at construction by probing devices and peers
    #: (not by size): :meth:`heap_bytes` of ``"auto"`` is the largest of theirs.
    _AUTO_PROBES: Tuple[str, ...] = ()
    #: Attributes holding tensors (or ops of a plan), dropped (closed) by ``close()``.
    _BUFFERS: tuple = ()

    def _setup_op(self, allocator, dtype, world_size: Optional[int], group, allowed_dtypes=None) -> None:
        """Check the allocator, dtype, world size and group (``TypeError`` / ``ValueError``
        naming the argument, before anything is allocated) and set the lifetime state. On a
        :class:`RecordingAllocator` the op runs dry: no group, no compile, no device."""
        check_allocator(allocator)
        self.dtype = check_dtype(dtype, allowed_dtypes)
        num_ranks = int(allocator.num_ranks)
        world_size = num_ranks if world_size is None else check_positive_int("world_size", world_size)
        if world_size != num_ranks:
            raise ValueError(f"world_size={world_size} but the allocator spans {num_ranks} rank(s)")
        check_group(group)
        self.world_size = world_size
        self.allocator = allocator
        self.rank = int(allocator.local_rank)
        self.device = torch.device(allocator.device)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self._dry_run = bool(getattr(allocator, "dry_run", False))
        self.group = None if self._dry_run else (default_group() if group is None else group)
        self.epoch = 0
        self.kernel = None
        self._closed = False
        self._captured = False

    def _default_max_blocks(self) -> int:
        """The grid cap when none is given: the device's SM count (a dry run's stand-in)."""
        if self._dry_run:
            return self.allocator.sm_count
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return DEFAULT_MAX_BLOCKS

    def _compile_kernel(self, build, target=None, pass_configs=None, key=None):
        if self._dry_run:  # nothing compiled: the build is recorded (RecordingAllocator.builds)
            return self.allocator.record_build(build, target, pass_configs)
        return super()._compile_kernel(build, target, pass_configs, key)

    def _compile_plain(self, build, target=None, pass_configs=None):
        """``compile_once(build())`` with TileLang ``pass_configs`` (no process-wide sharing:
        for kernels without TileScale intrinsics); in a dry run the build is recorded instead."""
        if self._dry_run:
            return self.allocator.record_build(build, target, pass_configs)
        return compile_once(build(), self.group, target, pass_configs)

    def _check_out(self, out, shape, shape_name: str = "the output shape") -> None:
        """``TypeError`` / ``ValueError`` naming ``out`` unless it is a contiguous tensor of
        ``shape``, this op's dtype and the allocator's device."""
        check_tensor(out, shape, self.dtype, self.device, "out", shape_name, type(self).__name__)

    @staticmethod
    def torch_reference(inputs, rank: int) -> torch.Tensor:
        """What a call returns on ``rank``, computed with torch from every rank's inputs
        (``inputs[p]``: rank ``p``'s call arguments; subclasses)."""
        raise NotImplementedError

    @classmethod
    def heap_bytes(cls, *args, world_size: int, device=None, **kwargs) -> int:
        """Symmetric-heap bytes per rank that ``cls(allocator, *args, world_size=world_size,
        **kwargs)`` allocates (the constructor's arguments without the allocator): a dry run
        of the constructor on a :class:`RecordingAllocator`, each allocation rounded up to the
        heap's 256-byte alignment. ``device``: where the op will live (its SM count is the
        default ``max_blocks``, which sizes the flags); default the current CUDA device."""
        return cls._heap_bytes(args, kwargs, world_size, sm_count_of(device))

    @classmethod
    def _heap_bytes(cls, args: tuple, kwargs: dict, world_size: int, sm_count: int) -> int:
        if cls._AUTO_PROBES:
            default = inspect.signature(cls).parameters["algorithm"].default
            if kwargs.get("algorithm", default) == "auto":
                return max(dry_run_heap_bytes(cls, args, dict(kwargs, algorithm=a), world_size, sm_count)
                           for a in cls._AUTO_PROBES)
        return dry_run_heap_bytes(cls, args, kwargs, world_size, sm_count)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drop the kernel and the buffers, closing the ops of a plan among them
        (idempotent). Heap bytes return with ``allocator.close()``; every call after this
        raises :class:`ClosedError`."""
        self._closed = True
        self.kernel = None
        self._forget_launches()
        self.__dict__.pop("_lean_launches", None)  # their prepared buffers
        for name in self._BUFFERS:
            part = getattr(self, name, None)
            if isinstance(part, Closable):
                part.close()
            if hasattr(self, name):
                setattr(self, name, None)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed


#: ``algorithm`` of :meth:`SymmetricCollective._setup` when the op has no such keyword.
_NO_ALGORITHM = object()


class SymmetricCollective(SymmetricOp):
    """Base of the collectives: a tensor ``shape`` (the per-rank input of a call), buffers
    on the symmetric heap, one rank-agnostic kernel compiled once per host.

    Subclasses call ``_setup(...)`` from their constructor, allocate their symmetric tensors
    (same order on every rank), then call ``_finish(kernel_func, target)``. Attributes set
    here besides :class:`SymmetricOp`'s: ``shape``, ``shard_shape`` and ``shard_numel`` (the
    piece one rank owns: ``shape`` here, a row of it for the ops whose input holds one row
    per rank, :class:`RowsPerRank`), ``threads``, ``max_blocks``.
    """

    #: int32 indexing bound of the kernels (elements).
    MAX_ELEMENTS = 2**31

    def _setup(self, allocator, shape: Union[int, Sequence[int]], dtype, world_size: Optional[int],
               group, threads: int, max_blocks: Optional[int], allowed_dtypes=None,
               shape_name: str = "shape", *, algorithm=_NO_ALGORITHM, target=None) -> None:
        """Check the constructor's common arguments, before anything is allocated: ``target``,
        ``algorithm`` (one of :attr:`ALGORITHMS`; left out by an op without that keyword), then
        :meth:`SymmetricOp._setup_op`'s, ``shape``, ``threads`` and ``max_blocks``. Sets
        ``algorithm``: the one asked for, or for ``"auto"`` the op's one strategy where it has
        one (an op that chooses among several sets it after)."""
        check_target(target)
        if algorithm is not _NO_ALGORITHM:
            if algorithm not in self.ALGORITHMS:
                raise ValueError(f"algorithm must be one of {self.ALGORITHMS}, got {algorithm!r}")
            self.algorithm = self.ALGORITHMS[1] if algorithm == "auto" and len(self.ALGORITHMS) == 2 else algorithm
        self._setup_op(allocator, dtype, world_size, group, allowed_dtypes)
        self.shape = self.shard_shape = check_shape(shape, shape_name)
        check_threads(threads)
        check_max_blocks(max_blocks)
        self.shard_numel = math.prod(self.shape)
        largest = self._largest_numel()
        if largest >= self.MAX_ELEMENTS:
            raise ValueError(f"{shape_name} {self.shape}: a buffer of {largest} elements exceeds the kernel's int32 "
                             "indexing (< 2**31 elements)")
        self.max_blocks = self._default_max_blocks() if max_blocks is None else max_blocks
        self.threads = threads
        self._set_shard()

    def _set_shard(self) -> None:
        """The last step of :meth:`_setup`: ``shard_shape`` and ``shard_numel`` from ``shape``
        (here the shape itself; :class:`RowsPerRank`: one row of it)."""

    def _largest_numel(self) -> int:
        """Elements of the op's largest buffer (default: ``world_size`` pieces of ``shape``)."""
        return self.world_size * math.prod(self.shape)

    def _tensor(self, shape, dtype=None, return_peers: bool = False):
        """A symmetric tensor on the allocator's heap (same offset on every rank); with
        ``return_peers`` the list of every rank's view of it (index = rank)."""
        import tilelang

        return tilelang.tensor(tuple(shape), self.dtype if dtype is None else dtype, allocator=self.allocator,
                               return_peers=return_peers)

    def _finish(self, func, target=None, pass_configs=None) -> None:
        """Compile ``func`` once per host (with TileLang ``pass_configs`` when given),
        initialise it with the allocator's table, then make sure every rank's flags are zero
        (device sync + barrier) before anyone signals."""
        self._finish_build(lambda: func, target, pass_configs)

    def _finish_build(self, build, target=None, pass_configs=None) -> None:
        """:meth:`_finish` of ``build()`` (not traced in a dry run)."""
        self.kernel = self._compile_kernel(build, target, pass_configs)
        self.bind_table(force=True)
        settle(self.device, self.group)

    def check_tensor(self, tensor, shape: Tuple[int, ...], name: str = "input", shape_name: str = "the shape") -> None:
        """:func:`check_tensor` against this collective's dtype and device."""
        check_tensor(tensor, shape, self.dtype, self.device, name, shape_name, type(self).__name__)

    #: How error messages call the expected input shape (``input_shape``).
    INPUT_SHAPE_NAME = "the shape"

    @property
    def input_shape(self) -> Tuple[int, ...]:
        """Shape a call's ``input`` must have: ``shape``."""
        return self.shape

    def check_input(self, input) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``input`` unless it is a contiguous
        tensor of ``input_shape`` and this collective's dtype on the allocator's device."""
        self.check_tensor(input, self.input_shape, "input", self.INPUT_SHAPE_NAME)

    def bus_bytes(self) -> float:
        """Bytes per call for the bus bandwidth as nccl-tests count it for all-gather,
        reduce-scatter and all-to-all: ``(n - 1) / n`` times the larger of the input and
        output sizes (the ``world_size`` pieces)."""
        n = self.world_size
        return (n - 1) / n * self.world_size * self.shard_numel * self.itemsize

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, "
                f"world_size={self.world_size}, chunks={getattr(self, 'chunks', '?')}, "
                f"chunk={getattr(self, 'chunk', '?')}, threads={self.threads}, epoch={self.epoch}"
                f"{', closed' if self._closed else ''})")

    #: Attributes holding tensors, dropped by ``close()``.
    _BUFFERS = ("input", "output", "flags", "stage")


class RowsPerRank:
    """Mixin (the first base) of the collectives whose input holds one row per rank,
    ``shape = (world_size, *row)``: :class:`~tilescale_examples.collectives.alltoall.AllToAll`
    and :class:`~tilescale_examples.collectives.reducescatter.ReduceScatter`. ``_setup``
    checks that shape and sets ``shard_shape`` to the row; their largest buffer is the input
    itself; they have one kernel (``"sm"``). Their 0.1.0 spelling took the row as the shape
    (:func:`row_shape_0_1`)."""

    ALGORITHMS = ("auto", "sm")

    def _set_shard(self) -> None:
        if len(self.shape) < 2 or self.shape[0] != self.world_size:
            raise ValueError(f"shape must be (world_size, *row) = ({self.world_size}, ...) with a non-empty row "
                             f"(one row per rank), got {self.shape}")
        self.shard_shape = self.shape[1:]
        self.shard_numel = math.prod(self.shard_shape)

    def _largest_numel(self) -> int:
        return math.prod(self.shape)  # the whole input, (world_size, *row)
