"""All-reduce (sum) written the way upstream TileScale's users write kernels: remote TMA
stores, a remote atomic counter per source rank, and a one-word GPU barrier.

::

    ar = TmaAllReduce(allocator, (4096, 128), torch.float32)   # collective; float32, up to 8 ranks
    z = ar(x)        # x: this rank's (4096, 128) float32 on the heap's device; z = sum over ranks
    ar.close()

The kernel (one per call, ``blocks`` blocks of 128 threads; rank ``me`` of ``W``):

1. **Push** -- tiles of 64 x 128 of the local input are dealt to the blocks round-robin. A
   block loads its tile with a TMA load, then stores it into slot ``me`` of ``Y`` on every
   rank ``p`` with ``T.tma_copy(tile, Y[me * rows + ...], dst_pe=p)`` (one TMA descriptor per
   peer, built by the generated host code from the heap table). It waits for the stores to
   complete (``cp.async.bulk.wait_group 0``), orders them with the async proxy
   (``fence.proxy.async``), and thread 0 adds 1 to ``count[me]`` on every rank with a release
   ``T.atomic_add(count[me], 1, memory_order="release", dst_pe=p)``.
2. **Wait** -- block 0 waits (acquire) until every ``count[q]`` has reached ``epoch * tiles``:
   every rank's whole input has landed here.
3. **Grid barrier** -- ``T.sync_barrier_gpu(bar)`` on a one-word ``uint32`` barrier
   (``T.Tensor([1], "uint32")``, ``T.init_barrier_gpu(bar, blocks)`` at the start), so every
   block knows the data is complete.
4. **Reduce** -- each block sums its tiles over the ``W`` slots into the output.

Before each call the ranks pass a ``barrier_all_on_stream``: no rank pushes call ``e + 1``'s
tiles into a peer still reducing call ``e``. Counters count up with the call's epoch, so they
are never reset. All blocks must be co-resident (at most one per SM by default).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples.base import (SymmetricCollective, accepts_0_1_init, accepts_0_1_reference, rank_left_out,
                                     warn_old_spelling)

__all__ = ["TmaAllReduce", "build_tma_allreduce_kernel", "torch_reference", "COLS", "TILE_ROWS", "MAX_RANKS",
           "ALGORITHMS"]

COLS = 128  # float32 columns (512 B rows)
TILE_ROWS = 64  # rows per TMA tile (32 KiB)
THREADS = 128
MAX_RANKS = 8  # remote TMA descriptors cover PEs 0..7
#: Values of the ``algorithm`` argument (one kernel: ``"auto"`` is ``"tma"``).
ALGORITHMS = ("auto", "tma")


def build_tma_allreduce_kernel(rows: int, world_size: int, blocks: int):
    """The kernel ``(Inp, Y, Count, Bar, Z, epoch)`` for ``(rows, COLS)`` float32 inputs."""
    import tilelang.language as T

    R, W, G = rows, world_size, blocks
    tiles = R // TILE_ROWS

    @T.prim_func
    def tma_allreduce(Inp: T.Tensor((R, COLS), "float32"), Y: T.Tensor((W * R, COLS), "float32"),
                      Count: T.Tensor((MAX_RANKS,), "int32"), Bar: T.Tensor((1,), "uint32"),
                      Z: T.Tensor((R, COLS), "float32"), epoch: T.int32):
        with T.Kernel(G, threads=THREADS) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            s = T.alloc_shared((TILE_ROWS, COLS), "float32")
            mbar = T.alloc_barrier([1])
            acc = T.alloc_fragment((TILE_ROWS, COLS), "float32")
            T.init_barrier_gpu(Bar, G)
            # 1. push my tiles into slot `me` of every rank's Y, then count them there
            for it in T.serial((tiles - bx + G - 1) // G):
                t = bx + it * G
                T.tma_copy(Inp[t * TILE_ROWS:(t + 1) * TILE_ROWS, :], s, barrier=mbar[0])
                if T.shuffle_elect(THREADS):
                    T.barrier_arrive(mbar[0])
                T.mbarrier_wait_parity(mbar[0], it % 2)
                for p in T.serial(W):
                    T.tma_copy(s, Y[me * R + t * TILE_ROWS:me * R + (t + 1) * TILE_ROWS, :], dst_pe=p)
                T.tma_store_wait(0, False)  # the stores completed (not only read shared memory)
                T.fence_proxy_async()
                T.sync_threads()
                if tx == 0:
                    for p in T.serial(W):
                        T.atomic_add(Count[me], 1, memory_order="release", dst_pe=p)
            # 2. block 0 waits for every rank's tiles; 3. the grid learns it through the barrier
            if bx == 0:
                if tx < W:
                    T.wait_ge(Count[tx], epoch * tiles)
            T.sync_barrier_gpu(Bar)
            # 4. reduce my tiles over the W slots
            for it in T.serial((tiles - bx + G - 1) // G):
                t = bx + it * G
                T.clear(acc)
                for q in T.serial(W):
                    for i, j in T.Parallel(TILE_ROWS, COLS):
                        acc[i, j] += Y[q * R + t * TILE_ROWS + i, j]
                T.copy(acc, Z[t * TILE_ROWS:(t + 1) * TILE_ROWS, :])

    return tma_allreduce


def _reference(inputs: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """The expected output on ``rank`` (the same on every rank): the sum of the ranks'
    inputs, in float64 then cast back."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("torch_reference needs at least one input")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    return torch.stack([x.double() for x in inputs]).sum(0).to(inputs[0].dtype)


#: :meth:`TmaAllReduce.torch_reference`; ``torch_reference(inputs)`` is the 0.1.0 spelling (it warns).
torch_reference = accepts_0_1_reference("tma_allreduce.torch_reference(inputs)", rank_left_out)(_reference)


def _tma_0_1(owner: str, args: tuple, kwargs: dict) -> tuple:
    """The 0.1.0 spellings of ``TmaAllReduce(allocator, shape=(64, 128), group=None,
    max_blocks=None)``: ``group`` and ``max_blocks`` positional (where ``dtype`` is now), and
    ``shape`` left out."""
    if len(args) > 2 and not isinstance(args[2], (torch.dtype, str)):
        args, extra = args[:2], args[2:]
        if len(extra) > 2:
            raise TypeError(f"{owner}() takes 3 positional arguments after self; pass the others by keyword")
        for name, value in zip(("group", "max_blocks"), extra):
            if name in kwargs:
                raise TypeError(f"{owner}() got multiple values for argument {name!r}")
            warn_old_spelling(f"{owner}(..., {name}) passed positionally", f"{name}=... (keyword-only)")
            kwargs[name] = value
    if len(args) < 2 and "shape" not in kwargs:
        warn_old_spelling(f"{owner}() without shape (0.1.0 default {(TILE_ROWS, COLS)})",
                          f"shape={(TILE_ROWS, COLS)}: shape is required")
        kwargs["shape"] = (TILE_ROWS, COLS)
    return args, kwargs


class TmaAllReduce(SymmetricCollective):
    """Sum-all-reduce of a ``(rows, 128)`` float32 tensor over every rank of the allocator.

    Collective to construct and to call (every rank, same order). ``rows`` must be a multiple
    of 64; at most 8 ranks (remote TMA descriptors cover PEs 0..7).

    Args:
        allocator: the distributed allocator (its heap holds the slots and counters).
        shape: ``(rows, 128)``, the input of a call.
        dtype: ``torch.float32`` (the only one).
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"`` or ``"tma"`` (the kernel above; the only one).
        group: process group of the allocator's ranks (default: the world group).
        max_blocks: grid size cap (default: the SM count; all blocks must be co-resident).
        target: TileLang target (default ``sm_90a``).

    Attributes: ``output`` (``shape``, what a call without ``out`` returns; overwritten by
    the next call; ``out`` is its 0.1.0 name), ``algorithm``, ``blocks``, ``epoch``. 0.1.0
    spellings (no ``dtype``, no ``shape``, ``group`` / ``max_blocks`` positional) work with a
    warning.
    """

    INPUT_SHAPE_NAME = "shape"
    ALGORITHMS = ALGORITHMS
    torch_reference = staticmethod(_reference)
    _BUFFERS = ("inp", "slots", "count", "bar", "output")

    @accepts_0_1_init(defaults={"dtype": torch.float32}, translate=_tma_0_1)
    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "tma"] = "auto", group=None,
                 max_blocks: Optional[int] = None, target=None):
        self._setup(allocator, shape, dtype, world_size, group, THREADS, max_blocks,
                    allowed_dtypes={torch.float32: "float32"}, algorithm=algorithm, target=target)
        if len(self.shape) != 2 or self.shape[1] != COLS or self.shape[0] % TILE_ROWS:
            raise ValueError(f"shape must be (rows, {COLS}) with rows a multiple of {TILE_ROWS}, got {self.shape}")
        if self.world_size > MAX_RANKS:
            raise ValueError(f"TmaAllReduce uses remote TMA, whose descriptors cover {MAX_RANKS} ranks; got {self.world_size}")
        rows = self.shape[0]
        self.blocks = max(1, min(self.max_blocks, rows // TILE_ROWS))
        self.inp = self._tensor((rows, COLS))
        self.slots = self._tensor((self.world_size * rows, COLS))
        self.count = self._tensor((MAX_RANKS,), torch.int32)
        self.count.zero_()
        self.bar = torch.zeros(1, dtype=torch.uint32, device=self.device)
        self.output = torch.empty((rows, COLS), dtype=torch.float32, device=self.device)
        self._finish_build(lambda: build_tma_allreduce_kernel(rows, self.world_size, self.blocks), target)

    @property
    def out(self) -> Optional[torch.Tensor]:
        """The 0.1.0 name of :attr:`output`."""
        return self.output

    def __call__(self, input: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Return the sum of every rank's ``input`` (``shape``): ``self.output``
        (overwritten by the next call), or ``out`` (a contiguous tensor of ``shape``) holding
        a copy of it. Raises :class:`~tilescale_examples.base.ClosedError` after ``close()``.

        Raises ``RuntimeError`` under CUDA graph capture: the call synchronises the ranks on
        the host (``barrier_all_on_stream``) and passes its call number from the host, as the
        upstream kernels it shows are written; the library's
        :class:`~tilescale_examples.collectives.allreduce.AllReduce` captures."""
        self._check_open()
        self.check_input(input)
        if out is not None:
            self._check_out(out, self.shape)
        if self._capturing():
            raise RuntimeError("TmaAllReduce cannot be captured in a CUDA graph: each call synchronises the ranks "
                               "on the host and passes its call number from the host; use "
                               "tilescale_examples.collectives.allreduce.AllReduce, which captures")
        from tilelang.distributed import barrier_all_on_stream

        self.epoch += 1
        self.inp.copy_(input)
        barrier_all_on_stream(group=self.group)  # every peer finished reducing the last call
        self.bind_table()
        self.kernel(self.inp, self.slots, self.count, self.bar, self.output, self.epoch)
        if out is None:
            return self.output
        out.copy_(self.output)
        return out

    def bus_bytes(self) -> float:
        """Bytes per call for the bus bandwidth of an all-reduce: ``2 (n - 1) / n * size``
        (nccl-tests)."""
        n = self.world_size
        return 2 * (n - 1) / n * self.shard_numel * self.itemsize

    def close(self) -> None:
        """Drop the buffers (the heap memory is the allocator's until it closes); waits for
        the device first."""
        if not self._closed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        super().close()
