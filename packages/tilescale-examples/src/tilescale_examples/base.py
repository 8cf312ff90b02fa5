"""What the example collectives share: argument checks, symmetric buffers, the
compile-once/initialise step and the lifetime (``close`` / context manager).

A collective built on this class is **collective to construct**: every rank must build the
same collectives (same shapes, dtypes and order), because the heap hands out the same offsets
on every rank only when the allocation sequence is the same, and the constructor ends with a
barrier so that no peer signals a flag before its owner has zeroed it.
"""

# (no `from __future__ import annotations`: subclasses define TileLang kernels)

import math
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["SymmetricCollective", "KernelOwner", "Closable", "check_tensor", "check_threads", "plan_chunks", "size_table_entry",
           "check_allocator",
           "check_group", "check_max_blocks", "check_target", "compile_once", "settle", "all_ranks_agree", "collective_device", "TARGET", "DTYPES"]

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
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
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
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    keys = [k for k in sorted(table) if k <= world_size]
    return table[keys[-1]] if keys else table[min(table)]


def default_group():
    """``torch.distributed``'s world group when it is initialised, else None."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def check_shape(shape, name: str = "shard_shape") -> Tuple[int, ...]:
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
    ``num_ranks``); ``RuntimeError`` if it is closed."""
    if allocator is None or not hasattr(allocator, "table") or not hasattr(allocator, "num_ranks"):
        raise TypeError(f"allocator must be a tilescale-core allocator (with table and num_ranks), got {type(allocator).__name__}")
    if getattr(allocator, "closed", False):
        raise RuntimeError("allocator is closed")


#: Compiled kernels of this process shared by instances (:meth:`SymmetricCollective._compile_kernel`).
_KERNELS: dict = {}
#: Attributes of a compiled kernel: ids of the allocators that bound it, whether every launch
#: must rebind (a graph captured table copies), the allocator a graph captured it for unbound.
_USERS, _REBIND, _PINNED = "_tilescale_table_users", "_tilescale_always_rebind", "_tilescale_pinned_to"


def _compile_flags() -> tuple:
    """TileScale's compile flags (header hash, wait timeout): they change the binary."""
    from tilescale_lang import headers

    return tuple(headers.compile_flags())


def compile_once(func, group=None, target=None, pass_configs=None):
    """``func`` compiled once per host (``compile_once=True``: one rank compiles, the others
    hit TileLang's disk cache) for ``target`` (default :data:`TARGET`), with TileLang
    ``pass_configs`` when given."""
    import tilelang

    extra = {} if pass_configs is None else {"pass_configs": dict(pass_configs)}
    return tilelang.compile(func, target=target or TARGET, compile_once=True, compile_group=group, **extra)


def settle(device, group=None) -> None:
    """End of a collective constructor: wait for the device (flags zeroed, tables copied),
    then barrier over ``group`` so that no peer signals a flag before its owner zeroed it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def collective_device(group, device) -> torch.device:
    """Where small host-side collectives over ``group`` (flags, timings, agreements) put
    their tensors: ``device`` under NCCL, the CPU otherwise (gloo takes host tensors)."""
    import torch.distributed as dist

    return torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_ranks_agree(ok: bool, group=None, device=None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a MIN all-reduce; ``ok`` itself
    without a group). Collective: every rank of ``group`` must call it."""
    if group is None:
        return bool(ok)
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device(group, device))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class Closable:
    """Context-manager lifetime: ``with X(...) as x:`` calls ``x.close()`` on exit.
    Subclasses define ``close()`` (idempotent) and ``closed``."""

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def _check_open(self) -> None:
        """``RuntimeError`` if this object, or the allocator it was built on, is closed."""
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        if getattr(getattr(self, "allocator", None), "closed", False):
            raise RuntimeError(f"the allocator of this {type(self).__name__} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
                    func = func.with_attr("global_symbol", f"{func.attrs['global_symbol']}_copy{variant}")
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
        allocator's is bound (or ``force``). Under CUDA graph capture, a shared kernel gets a
        captured device-to-device copy of this allocator's table, so every replay binds its
        own table, and from then on every eager call rebinds too (replays change the bound
        table behind the host's back); a kernel only this allocator uses needs no copy and
        is pinned to it (:meth:`_compile_kernel` gives later instances on other allocators
        a copy of their own)."""
        kernel = self.kernel if kernel is None else kernel
        state = kernel.__dict__
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
        if not force and not state.get(_REBIND) and state.get(self._TABLE_OWNER) is self.allocator:
            return
        if self.device.type == "cuda":
            self._device_table()  # made eagerly: a host-to-device copy cannot be captured
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        kernel.initialize(allocator=self.allocator, stream=stream)
        state[self._TABLE_OWNER] = self.allocator

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


class SymmetricCollective(KernelOwner, Closable):
    """Base of the example collectives: validated arguments, buffers on the symmetric heap,
    one rank-agnostic kernel compiled once per host, and an explicit lifetime.

    Subclasses call ``_setup(...)`` from their constructor, allocate their symmetric tensors
    (same order on every rank), then call ``_finish(kernel_func, target)``. Attributes set
    here: ``allocator``, ``shard_shape``, ``shard_numel``, ``dtype``, ``world_size``,
    ``device``, ``group``, ``threads``, ``max_blocks``, ``epoch`` (calls made so far),
    ``kernel``.
    """

    #: int32 indexing bound of the kernels (elements).
    MAX_ELEMENTS = 2**31

    def _setup(self, allocator, shard_shape: Union[int, Sequence[int]], dtype, world_size: Optional[int],
               group, threads: int, max_blocks: Optional[int], allowed_dtypes=None,
               shape_name: str = "shard_shape") -> None:
        check_allocator(allocator)
        self.shard_shape = check_shape(shard_shape, shape_name)
        self.dtype = check_dtype(dtype, allowed_dtypes)
        num_ranks = int(allocator.num_ranks)
        if world_size is None:
            world_size = num_ranks
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if world_size != num_ranks:
            raise ValueError(f"world_size={world_size} but the allocator spans {num_ranks} rank(s)")
        check_threads(threads)
        check_max_blocks(max_blocks)
        check_group(group)
        self.world_size = world_size
        self.shard_numel = math.prod(self.shard_shape)
        if world_size * self.shard_numel >= self.MAX_ELEMENTS:
            raise ValueError(f"{shape_name} {self.shard_shape}: {world_size} x {self.shard_numel} elements exceeds the "
                             "kernel's int32 indexing (< 2**31 elements)")
        self.device = torch.device(allocator.device)
        if max_blocks is None:
            max_blocks = DEFAULT_MAX_BLOCKS
            if self.device.type == "cuda":
                max_blocks = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.max_blocks = max_blocks
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.group = default_group() if group is None else group
        self.allocator = allocator
        self.threads = threads
        self.epoch = 0
        self.kernel = None
        self._closed = False
        self._captured = False

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
        self.kernel = self._compile_kernel(lambda: func, target, pass_configs)
        self.bind_table(force=True)
        settle(self.device, self.group)

    def check_tensor(self, tensor, shape: Tuple[int, ...], name: str = "input", shape_name: str = "the shape") -> None:
        """:func:`check_tensor` against this collective's dtype and device."""
        check_tensor(tensor, shape, self.dtype, self.device, name, shape_name, type(self).__name__)

    #: How error messages call the expected input shape (``input_shape``).
    INPUT_SHAPE_NAME = "(world_size, *shard_shape) ="

    @property
    def input_shape(self) -> Tuple[int, ...]:
        """Shape a call's ``input`` must have (default ``(world_size, *shard_shape)``)."""
        return (self.world_size, *self.shard_shape)

    def check_input(self, input) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``input`` unless it is a contiguous
        tensor of ``input_shape`` and this collective's dtype on the allocator's device."""
        self.check_tensor(input, self.input_shape, "input", self.INPUT_SHAPE_NAME)

    def bus_bytes(self) -> float:
        """Bytes per call for the bus bandwidth as nccl-tests count it for all-gather,
        reduce-scatter and all-to-all: ``(n - 1) / n`` times the larger of the input and
        output sizes (the ``world_size`` rows)."""
        n = self.world_size
        return (n - 1) / n * self.world_size * self.shard_numel * self.itemsize

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shard_shape={self.shard_shape}, dtype={self.dtype}, "
                f"world_size={self.world_size}, chunks={getattr(self, 'chunks', '?')}, "
                f"chunk={getattr(self, 'chunk', '?')}, threads={self.threads}, epoch={self.epoch}"
                f"{', closed' if self._closed else ''})")

    # ------------------------------------------------------------------ lifetime
    #: Attributes holding tensors, dropped by ``close()``.
    _BUFFERS = ("input", "output", "flags", "stage")

    def _drop_buffers(self) -> None:
        for name in self._BUFFERS:
            if hasattr(self, name):
                setattr(self, name, None)

    def close(self) -> None:
        """Drop the kernel and the tensors (idempotent). Heap bytes return with
        ``allocator.close()``; a closed instance refuses calls."""
        self._closed = True
        self.kernel = None
        self._drop_buffers()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed
