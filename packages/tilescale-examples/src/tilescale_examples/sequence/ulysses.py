"""Ulysses all-to-all: between a sequence-sharded and a head-sharded attention layout, in one
kernel that writes each row straight into its place on its owner (no ``.contiguous()`` copies
before or after the exchange, as a torch ``all_to_all_single`` path needs).

With ``W`` ranks, sequence ``S`` and ``H`` heads of ``D`` channels (``SP = S / W``, ``HP = H /
W``), both layouts are ``(batch, seq, heads, D)`` (flash-attention's ``bshd``)::

    seq_to_head:  input (B, SP, H, D): this rank's positions, every head
                  -> output (B, S, HP, D): every position, this rank's heads
    head_to_seq:  input (B, S, HP, D) -> output (B, SP, H, D) (the inverse)

    pre = UlyssesAllToAll(allocator, (B, S // W, H, D), torch.bfloat16)  # shape: the input's
    post = UlyssesAllToAll(allocator, (B, S, H // W, D), torch.bfloat16, direction="head_to_seq")
    q_heads = pre(q)                 # (B, S, HP, D), overwritten by pre's next call
    o = post(attention(q_heads, ...))  # (B, SP, H, D)
    pre.close(); post.close()        # before allocator.close()

Rank ``me`` sends rank ``p`` the rows ``(b, s)`` of heads ``[p HP, (p+1) HP)`` (``seq_to_head``;
``head_to_seq``: of positions ``[p SP, (p+1) SP)``): ``B * SP`` runs of ``HP * D`` contiguous
elements each, on both sides. The kernel's grid is ``chunks x W`` blocks; block ``(c, p)``
moves chunk ``c`` of those rows to rank ``p`` with all its threads at once
(``T.put_rows_block``: the rows of one batch entry are evenly spaced on both sides, and each
thread keeps :data:`UNROLL` words in flight across rows, so short rows cost no extra round
trips), then releases a data flag on ``p`` and acquires ``p``'s flag for the same chunk. The
protocol is the all-gather's (:mod:`tilescale_examples.collectives.allgather`: a ready handshake per
block before its puts, so back-to-back calls need no host synchronisation; per-block call
counters on the device, so CUDA graph replays are correct). The input is read in place (any
contiguous tensor of the input shape on the allocator's device). With one rank the kernel
only moves the rows (no handshake, no flags): the exchange costs what the copy does.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

import math
from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples._macros import variable
from tilescale_examples.base import DTYPES
from tilescale_examples.collectives.put_exchange import PutExchange, await_chunk, claim_slot, count_alone

__all__ = ["UlyssesAllToAll", "build_ulysses_kernel", "torch_reference", "global_sizes", "output_shape",
           "seq_sharded_offset", "head_sharded_offset", "batch_segments", "batch_segment", "DIRECTIONS",
           "MIN_CHUNK_BYTES", "UNROLL"]

#: Values of ``direction``.
DIRECTIONS = ("seq_to_head", "head_to_seq")
#: Smallest piece (bytes) a block is given before the grid grows: a quarter of one round of a
#: 512-thread block's loads (UNROLL words of 16 bytes per thread), so that a 4 MiB exchange
#: with 8 ranks fills every SM instead of half of them.
MIN_CHUNK_BYTES = 16 * 1024
#: Words (16 bytes each when aligned) each thread loads before storing them.
UNROLL = 8


def global_sizes(shape, world_size: int, direction: str):
    """``(batch, seq_len, num_heads, head_dim)`` of all ranks together from one rank's input
    ``shape``; ``ValueError`` naming the dimension that ``world_size`` does not divide."""
    B, s, h, D = shape
    split, name = (h, "shape[2] (the heads)") if direction == "seq_to_head" else (s, "shape[1] (the sequence)")
    if split % world_size:
        raise ValueError(f"{name} = {split} is not a multiple of world_size={world_size} ({direction})")
    return (B, s * world_size, h, D) if direction == "seq_to_head" else (B, s, h * world_size, D)


def output_shape(shape, world_size: int, direction: str) -> tuple:
    """One rank's output shape for input ``shape``: ``(B, S, H/W, D)`` for ``seq_to_head``,
    ``(B, S/W, H, D)`` for ``head_to_seq``."""
    B, S, H, D = global_sizes(shape, world_size, direction)
    W = world_size
    return (B, S, H // W, D) if direction == "seq_to_head" else (B, S // W, H, D)


def seq_sharded_offset(r, q, H: int, HP: int, D: int):
    """Element offset of row ``r`` (``b * SP + s``) of the sequence-sharded ``(B, SP, H, D)``
    layout, at the first of rank ``q``'s heads: ``r * H * D + q * HP * D`` (ints or TIR
    expressions: the kernel's addresses and the tests' emulation are the same arithmetic)."""
    return r * (H * D) + q * (HP * D)


def head_sharded_offset(r, q, S: int, SP: int, HP: int, D: int):
    """Element offset of row ``r`` (``b * SP + s``) of rank ``q``'s positions in the
    head-sharded ``(B, S, HP, D)`` layout: position ``q * SP + s`` of batch ``b``."""
    return (r // SP * S + q * SP + r % SP) * (HP * D)


def batch_segments(batch: int, chunk: int, seq_shard: int) -> int:
    """How many batch entries a run of ``chunk`` consecutive rows can touch (at most ``batch``),
    with ``seq_shard`` rows per batch entry: the kernel's strided copies per block."""
    return min(batch, (chunk + seq_shard - 2) // seq_shard + 1)


def batch_segment(first, end, k, seq_shard: int, maximum=max, minimum=min) -> tuple:
    """Rows ``[lo, hi)`` of the ``k``-th batch entry that the chunk rows ``[first, end)`` touch
    (empty when ``hi <= lo``); within it both layouts space the rows evenly. Ints, or TIR
    expressions with ``maximum=T.max, minimum=T.min`` (the kernel's bounds and the tests'
    emulation are the same arithmetic)."""
    entry = first // seq_shard + k
    return maximum(first, entry * seq_shard), minimum(end, (entry + 1) * seq_shard)


def build_ulysses_kernel(batch: int, seq_len: int, num_heads: int, head_dim: int, world_size: int, dtype: str,
                         direction: str, chunks: int, chunk: int, threads: int = 512):
    """The Ulysses all-to-all ``T.prim_func``: ``(In: (B * SP * H * D,), Out: (B * SP * H *
    D,), Flags: (2 * W * chunks,) uint64 [symmetric], State: (W * chunks,) int64)``, grid
    ``chunks x W`` blocks of ``threads``; ``chunk`` rows of ``HP * D`` elements per block
    (:func:`~tilescale_examples.base.plan_chunks` over the ``B * SP`` rows). ``Flags`` and
    ``State`` as in :func:`~tilescale_examples.collectives.put_exchange.build_put_exchange_kernel`."""
    import tilelang.language as T

    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    B, S, H, D, W, C, CH = batch, seq_len, num_heads, head_dim, world_size, chunks, chunk
    SP, HP = S // W, H // W
    R, ROW, N = B * SP, HP * D, B * S * H * D // W
    if (C - 1) * CH >= R or C * CH < R:
        raise ValueError(f"chunks={C} x chunk={CH} does not tile the {R} rows (use plan_chunks)")
    READY, to_heads = W * C, direction == "seq_to_head"
    SEGMENTS = batch_segments(B, CH, SP)  # one strided copy per batch entry a chunk touches

    def by_seq(r, q):
        return seq_sharded_offset(r, q, H, HP, D)

    def by_heads(r, q):
        return head_sharded_offset(r, q, S, SP, HP, D)

    @T.prim_func
    def ulysses(In: T.Tensor((N,), dtype), Out: T.Tensor((N,), dtype), Flags: T.Tensor((2 * W * C,), "uint64"),
                State: T.Tensor((W * C,), "int64")):
        with T.Kernel(C, W, threads=threads) as (c, p):
            tx = T.get_thread_binding()
            me = T.get_rank()
            epoch = T.alloc_var("int64")
            epoch = State[p * C + c] + 1  # this call's number (the add below does not wait for it)
            if W > 1:
                claim_slot(Flags, READY, C, c, p, me, tx, variable(epoch))
            first = c * CH
            end = T.min(first + CH, R)
            # Variables, not expressions: TileLang 0.1.15's pointer-type pass fails ("Can't fetch the
            # lanes of a scalable vector") on offsets that fold into a product with a constant factor
            # of 32768 or more modulo 65536 (docs/lang.md).
            lo, hi = T.alloc_var("int32"), T.alloc_var("int32")
            for k in T.serial(SEGMENTS):  # the chunk's rows of each batch entry: strided on one side
                lo, hi = batch_segment(first, end, k, SP, T.max, T.min)
                if lo < hi:
                    if to_heads:
                        T.put_rows_block(T.address_of(In[by_seq(lo, p)]), T.address_of(Out[by_heads(lo, me)]), hi - lo,
                                         ROW, H * D, ROW, dst_pe=p, unroll_factor=UNROLL)
                    else:
                        T.put_rows_block(T.address_of(In[by_heads(lo, p)]), T.address_of(Out[by_seq(lo, me)]), hi - lo,
                                         ROW, ROW, H * D, dst_pe=p, unroll_factor=UNROLL)
            if W > 1:
                T.sync_threads()  # every thread's words are stored before the release below
                if tx == 0:
                    T.signal_op(Flags[me * C + c], 1, "add", p)  # release: chunk c of my rows is on p
                await_chunk(Flags, State, C, c, p, tx, variable(epoch))
            else:  # one rank: the rows were its own copy; no handshake, no flag
                count_alone(State, C, c, p, tx, variable(epoch))

    return ulysses.with_attr("global_symbol", f"ulysses_{direction}")


def torch_reference(inputs: Sequence[torch.Tensor], rank: int, direction: str = "seq_to_head") -> torch.Tensor:
    """What a call returns on ``rank``, from every rank's input (``inputs[p]``): ``seq_to_head``
    concatenates heads ``[rank HP, (rank+1) HP)`` of every rank's positions along the
    sequence; ``head_to_seq`` concatenates positions ``[rank SP, (rank+1) SP)`` of every
    rank's heads along the heads."""
    inputs = [x.detach() for x in inputs]
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    W = len(inputs)
    if direction == "seq_to_head":
        HP = inputs[0].shape[2] // W
        return torch.cat([x[:, :, rank * HP:(rank + 1) * HP] for x in inputs], dim=1)
    SP = inputs[0].shape[1] // W
    return torch.cat([x[:, rank * SP:(rank + 1) * SP] for x in inputs], dim=2)


class UlyssesAllToAll(PutExchange):
    """A reusable Ulysses all-to-all over an allocator's ranks (see the module docstring).

    Args:
        allocator: an open tilescale-core allocator; its ``num_ranks`` ranks take part.
        shape: a call's input, ``(batch, positions, heads, head_dim)``: ``(B, S/W, H, D)`` for
            ``seq_to_head`` (``H`` a multiple of ``world_size``), ``(B, S, H/W, D)`` for
            ``head_to_seq`` (``S`` a multiple of ``world_size``).
        dtype: torch dtype (or its name): float16, bfloat16, float32, float64, int8, uint8,
            int16, int32 or int64.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"auto"`` or ``"sm"`` (the put_rows_block kernel; the only one).
        direction: ``"seq_to_head"`` (output ``(B, S, H/W, D)``) or ``"head_to_seq"`` (output
            ``(B, S/W, H, D)``).
        group: process group for the constructor's barrier and the compile's ``compile_group``.
        threads: threads per block (multiple of 32, at most 1024), all moving the chunk's rows.
        max_blocks: grid cap (all blocks must be co-resident); default the device's SM count.
        min_chunk_bytes: smallest piece a block is given before the grid grows.
        target: TileLang target (default ``sm_90a``).

    Attributes: ``shape`` (= ``input_shape``), ``output_shape``, ``output`` (symmetric,
    overwritten by the next call), ``input`` (a symmetric buffer of the input shape, for
    callers that want one), ``direction``, ``batch``, ``seq_len``, ``num_heads``, ``head_dim``
    (of all ranks together), ``flags``, ``state``, ``chunks``, ``chunk`` (rows per block),
    ``kernel``, ``epoch``. Construction and calls are collective (same instances, same call
    sequence on every rank).
    """

    ALGORITHMS = ("auto", "sm")

    torch_reference = staticmethod(torch_reference)

    def __init__(self, allocator, shape: Sequence[int], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "sm"] = "auto",
                 direction: Literal["seq_to_head", "head_to_seq"] = "seq_to_head", group=None, threads: int = 512,
                 max_blocks: Optional[int] = None, min_chunk_bytes: int = MIN_CHUNK_BYTES, target=None):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self.direction = direction
        self._setup(allocator, shape, dtype, world_size, group, threads, max_blocks, algorithm=algorithm,
                    target=target, min_chunk_bytes=min_chunk_bytes)
        self.input = self._tensor(self.shape)
        self.output = self._tensor(self.output_shape)
        self._make_flags()
        sizes = (self.batch, self.seq_len, self.num_heads, self.head_dim)
        self._finish_build(lambda: build_ulysses_kernel(*sizes, self.world_size, DTYPES[self.dtype], direction,
                                                        self.chunks, self.chunk, threads), target)

    def _set_shard(self) -> None:
        """The last step of the collectives' checks: ``shape`` must be 4-d and its split
        dimension a multiple of ``world_size``; the sizes of all ranks together and the output
        shape."""
        if len(self.shape) != 4:
            raise ValueError(f"shape must be (batch, positions, heads, head_dim), got {self.shape}")
        W = self.world_size
        self.batch, self.seq_len, self.num_heads, self.head_dim = global_sizes(self.shape, W, self.direction)
        self.output_shape = output_shape(self.shape, W, self.direction)

    def _chunk_units(self) -> tuple:
        """The chunk plan's units: ``B * S / W`` rows of ``H / W * D`` elements go to each rank."""
        W = self.world_size
        return self.batch * self.seq_len // W, self.num_heads // W * self.head_dim * self.itemsize

    def _largest_numel(self) -> int:
        return math.prod(self.shape)  # input and output hold the same elements

    def __call__(self, input: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Exchange ``input`` (``shape``); returns ``self.output`` (``output_shape``,
        overwritten by the next call), or ``out`` (a contiguous tensor of that shape and dtype)
        holding a copy of it; complete when the kernel finishes on the current stream. Every
        rank must make the same sequence of calls (eagerly or in CUDA graph replays). Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        return self._call(input, out)

    def bus_bytes(self) -> float:
        """Bytes per call as nccl-tests count an all-to-all: ``(n - 1) / n`` of the input."""
        n = self.world_size
        return (n - 1) / n * math.prod(self.shape) * self.itemsize

    def __repr__(self) -> str:
        return (f"UlyssesAllToAll(shape={self.shape}, direction={self.direction!r}, dtype={self.dtype}, "
                f"world_size={self.world_size}, chunks={self.chunks}, chunk={self.chunk}, epoch={self.epoch}"
                f"{', closed' if self._closed else ''})")
