"""All-gather over the symmetric heap, built from ``T.put_block`` and flag signals.

Every rank contributes one *shard* (same shape and dtype on every rank); afterwards every
rank holds ``output[r] == shard of rank r`` for all ranks ``r``::

    ag = AllGather(allocator, shard_shape=(4096,), dtype=torch.float16)   # collective
    out = ag(x)          # x: this rank's shard on the allocator's device; out: (world, 4096)
    ...
    ag.close()           # before allocator.close()

The kernel
----------

One rank-agnostic kernel (the rank comes from ``T.get_rank()``; the binary and TileLang's
disk cache serve every rank) with a grid of ``chunks x num_ranks`` blocks. The shard is cut
into ``chunks`` pieces of ``chunk`` elements (a multiple of 16 bytes, so the peer copy moves
16-byte vectors whenever the slot's offset allows it). Block ``(c, p)`` of rank ``me``:

1. *Ready handshake* (thread 0): ``T.notify(ready[me, c], p, epoch)`` tells rank ``p`` that
   ``me``'s output slot for ``p``'s chunk ``c`` is free (every earlier use of this output on
   ``me``'s stream has finished, since the kernel has started), then
   ``T.wait_ge(ready[p, c], epoch)`` waits for the same word from ``p``.
2. ``T.put_block`` of chunk ``c`` of the local shard into ``output[me*shard + c*chunk]`` on
   rank ``p`` (``dst_pe=p``; ``p == me`` is a local copy through the same path).
3. ``__syncthreads()``, then thread 0 issues ``T.fence_sys()`` and the release store
   ``T.notify(data[me, c], p, epoch)`` (``st.release.sys``). This is NVSHMEM's
   put-with-signal order: the block barrier makes every thread's (weak) stores of the chunk
   visible to thread 0 at CTA scope and the system-scope fence plus the release store make
   them visible on rank ``p`` before the flag is.
4. Thread 0 ``T.wait_ge(data[p, c], epoch)`` (``ld.acquire.sys`` polls): ``p``'s chunk
   ``c`` has landed here. When every block has passed its wait, the whole output is present,
   so the kernel returns only when the all-gather is complete on this rank.

Flags are ``uint64`` words set (not added) to the *epoch*, a per-instance call counter passed
as a kernel argument, and waits use ``>=``: repeated calls need no flag reset and the counter
cannot wrap. The handshake of step 1 makes back-to-back calls safe without any host
barrier: rank ``p`` cannot overwrite ``me``'s output for call ``e + 1`` before ``me`` has
launched call ``e + 1``, i.e. before everything ``me`` enqueued earlier on its stream
(consumers of call ``e``'s output, a poison ``fill_``) has run.

Every block waits for a block of another rank, so all blocks of the grid must be co-resident:
the grid is capped at ``max_blocks`` (default: the number of SMs) blocks of ``threads``
threads (one block per SM always fits). Ranks that share one GPU still progress, because
their contexts time-slice, but that mode measures scheduling, not bandwidth.

Lifetime
--------

The constructor is **collective** over ``group``: every rank must construct the same
all-gathers (same shapes, dtypes and order), because it allocates symmetric tensors (the
heap hands out the same offsets on every rank), compiles with ``compile_once=True``, and ends
with a barrier so that no peer signals a flag before its owner has zeroed it. The heap is a
bump allocator: ``close()`` drops the kernel and the tensors but the heap bytes return only
with ``allocator.close()``. Use an instance only while its allocator is open; the output
tensor returned by a call is overwritten by the next call (copy it if it must survive).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

import math
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["AllGather", "plan_chunks", "build_allgather_kernel", "torch_reference", "TARGET"]

#: Default TileLang target (H100/H200).
TARGET = {"kind": "cuda", "arch": "sm_90a"}
#: Smallest chunk a block is given before the grid grows (bytes).
MIN_CHUNK_BYTES = 64 * 1024
#: Grid cap when the device cannot be queried (CPU-only builds).
DEFAULT_MAX_BLOCKS = 128

_DTYPES = {
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
                min_chunk_bytes: int = MIN_CHUNK_BYTES) -> Tuple[int, int]:
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


def build_allgather_kernel(shard_numel: int, dtype: str, world_size: int, chunks: int,
                           chunk: int, threads: int = 512):
    """The all-gather ``T.prim_func`` (see the module docstring for the algorithm).

    Signature: ``(In: (shard_numel,), Out: (world_size * shard_numel,), Flags: (2 *
    world_size * chunks,) uint64, epoch: int64)``; ``Flags[:world_size*chunks]`` are the data
    flags ``data[src, c]``, the rest the ready flags ``ready[src, c]``.
    """
    import tilelang.language as T

    S, W, C, CH = shard_numel, world_size, chunks, chunk
    if (C - 1) * CH >= S or C * CH < S:
        raise ValueError(f"chunks={C} x chunk={CH} does not tile shard_numel={S} (use plan_chunks)")
    READY = W * C

    @T.prim_func
    def allgather(In: T.Tensor((S,), dtype), Out: T.Tensor((W * S,), dtype),
                  Flags: T.Tensor((2 * W * C,), "uint64"), epoch: T.int64):
        with T.Kernel(C, W, threads=threads) as (c, p):
            tx = T.get_thread_binding()
            me = T.get_rank()
            # A variable, not the expression c * CH: TileLang 0.1.15's pointer-type pass fails
            # ("Can't fetch the lanes of a scalable vector") on In[c * CH] once CH >= 32768.
            start = T.alloc_var("int32")
            start = c * CH
            if tx == 0:
                T.notify(Flags[READY + me * C + c], p, epoch)  # my slot for p's chunk c is free
                T.wait_ge(Flags[READY + p * C + c], epoch)  # p's slot for my chunk c is free
            T.sync_threads()
            T.put_block(T.address_of(In[start]), T.address_of(Out[me * S + start]),
                        T.min(CH, S - start), dst_pe=p)
            T.sync_threads()
            if tx == 0:
                T.fence_sys()
                T.notify(Flags[me * C + c], p, epoch)  # release: chunk c is on p
                T.wait_ge(Flags[p * C + c], epoch)  # acquire: p's chunk c is here

    return allgather


def torch_reference(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The expected output: the shards of ranks ``0 .. n-1`` stacked along a new dim 0."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold one tensor per rank, got none")
    return torch.stack([s.detach() for s in shards], dim=0)


def _default_group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class AllGather:
    """A reusable all-gather of one shard shape and dtype over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``); its ``num_ranks`` ranks take part.
        shard_shape: shape of each rank's shard (an int or a tuple of positive ints).
        dtype: torch dtype (or its name) of the shards: float16, bfloat16, float32,
            float64, int8, uint8, int16, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        group: process group for the closing barrier (and the compile's ``compile_group``); default
            ``torch.distributed``'s world group when it is initialised, else none.
        threads: threads per block (multiple of 32, at most 1024).
        max_blocks: grid cap (all blocks must be co-resident); default the device's SM count.
        min_chunk_bytes: smallest piece a block is given before the grid grows.
        target: TileLang target (default ``sm_90a``).

    Attributes: ``input`` (a symmetric shard buffer, for ``ag(ag.input)``; the kernel reads
    its input in place, so any contiguous tensor of the shard's shape and dtype on the
    allocator's device works as well), ``output`` (symmetric, ``(world_size,
    *shard_shape)``), ``flags`` (``uint64``, data then ready flags), ``chunks``, ``chunk``,
    ``kernel``, ``epoch`` (calls made so far).

    The constructor is collective (see the module docstring); ``__call__`` is too, in the
    sense that every rank must make the same sequence of calls.
    """

    def __init__(self, allocator, shard_shape: Union[int, Sequence[int]],
                 dtype: Union[torch.dtype, str], world_size: Optional[int] = None, *,
                 group=None, threads: int = 512, max_blocks: Optional[int] = None,
                 min_chunk_bytes: int = MIN_CHUNK_BYTES, target=None):
        # ---- arguments, checked before any allocation or compile
        if allocator is None or not hasattr(allocator, "table") or not hasattr(allocator, "num_ranks"):
            raise TypeError(f"allocator must be a tilescale-core allocator (with table and num_ranks), got {type(allocator).__name__}")
        if getattr(allocator, "closed", False):
            raise RuntimeError("allocator is closed")
        self.shard_shape = _shape(shard_shape)
        self.dtype = _dtype(dtype)
        num_ranks = int(allocator.num_ranks)
        if world_size is None:
            world_size = num_ranks
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if world_size != num_ranks:
            raise ValueError(f"world_size={world_size} but the allocator spans {num_ranks} rank(s)")
        if not isinstance(threads, int) or threads < 32 or threads > 1024 or threads % 32:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")
        self.world_size = world_size
        self.shard_numel = math.prod(self.shard_shape)
        if world_size * self.shard_numel >= 2**31:
            raise ValueError(f"output of {world_size} x {self.shard_numel} elements exceeds the kernel's int32 indexing (< 2**31 elements)")
        self.device = torch.device(allocator.device)
        if max_blocks is None:
            max_blocks = DEFAULT_MAX_BLOCKS
            if self.device.type == "cuda":
                max_blocks = torch.cuda.get_device_properties(self.device).multi_processor_count
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.chunks, self.chunk = plan_chunks(self.shard_numel, itemsize, world_size, max_blocks, min_chunk_bytes)
        self.group = _default_group() if group is None else group
        self.allocator = allocator
        self.threads = threads
        self.epoch = 0
        self._closed = False

        # ---- symmetric buffers (same order on every rank)
        import tilelang

        self.input = tilelang.tensor(self.shard_shape, self.dtype, allocator=allocator)
        self.output = tilelang.tensor((world_size, *self.shard_shape), self.dtype, allocator=allocator)
        self.flags = tilelang.tensor((2 * world_size * self.chunks,), torch.uint64, allocator=allocator)
        self.flags.zero_()

        # ---- one rank-agnostic kernel, compiled once per host (the first rank; the rest hit the cache)
        func = build_allgather_kernel(self.shard_numel, _DTYPES[self.dtype], world_size,
                                      self.chunks, self.chunk, threads)
        self.kernel = tilelang.compile(func, target=target or TARGET, compile_once=True,
                                       compile_group=self.group)
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        self.kernel.initialize(allocator=allocator, stream=stream)

        # ---- every rank's flags are zero before any peer can signal them
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ calls
    def check_input(self, input) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``input`` unless it is a contiguous
        tensor of the shard's shape and dtype on the allocator's device."""
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if input.dtype != self.dtype:
            raise TypeError(f"input has dtype {input.dtype}, this AllGather was built for {self.dtype}")
        if tuple(input.shape) != self.shard_shape:
            raise ValueError(f"input has shape {tuple(input.shape)}, expected the shard shape {self.shard_shape}")
        if input.device != self.device:
            raise ValueError(f"input is on {input.device}, the allocator's heap is on {self.device}")
        if not input.is_contiguous():
            raise ValueError("input must be contiguous (call .contiguous() first)")

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        """Gather ``input`` (this rank's shard) from every rank; returns ``self.output``,
        ``(world_size, *shard_shape)``, complete when the kernel finishes on the current
        stream. Every rank must call it the same number of times."""
        if self._closed:
            raise RuntimeError("this AllGather is closed")
        if getattr(self.allocator, "closed", False):
            raise RuntimeError("the allocator of this AllGather is closed")
        self.check_input(input)
        self.epoch += 1
        self.kernel(input.view(-1), self.output.view(-1), self.flags, self.epoch)
        return self.output

    def bus_bytes(self) -> float:
        """Bytes per call for the bus bandwidth: ``(n - 1) / n * output bytes`` (nccl-tests)."""
        n = self.world_size
        return (n - 1) / n * self.output.numel() * self.output.element_size()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drop the kernel and the tensors (idempotent). Heap bytes return with
        ``allocator.close()``; a closed instance refuses calls."""
        self._closed = True
        self.kernel = None
        self.input = self.output = self.flags = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AllGather(shard_shape={self.shard_shape}, dtype={self.dtype}, world_size={self.world_size}, "
                f"chunks={self.chunks}, chunk={self.chunk}, threads={self.threads}, epoch={self.epoch}"
                f"{', closed' if self._closed else ''})")


def _shape(shape) -> Tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shard_shape must be an int or a sequence of ints, got {shape!r}") from None
    if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise ValueError(f"shard_shape must be non-empty positive ints, got {shape!r}")
    return dims


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise TypeError(f"dtype must be one of {sorted(_DTYPES.values())}, got {dtype!r}")
    return dtype
