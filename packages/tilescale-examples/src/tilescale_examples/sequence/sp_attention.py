"""Sequence-parallel attention by all-gathering K and V: each rank holds its shard of the sequence.

With ``W`` ranks and ``SP`` positions per rank, rank ``r`` holds positions ``[r SP, (r + 1) SP)``
of ``q (B, SP, H, D)``, ``k``, ``v (B, SP, Hkv, D)`` (the ``bshd`` layout) and gets its
queries' attention over the whole sequence::

    attn = SPAllGatherAttention(allocator, batch=B, seq_local=SP, heads=H, kv_heads=Hkv, head_dim=D,
                                dtype=torch.bfloat16, causal=True)
    o, lse = attn(q, k, v)      # o (B, SP, H, D), lse (B, H, SP) float32: this rank's queries
    attn.close()                # before allocator.close()

A call all-gathers ``k`` and ``v`` (two :class:`~tilescale_examples.collectives.allgather.AllGather`
calls: device-side call state, so back-to-back calls need no host synchronisation and a call
can be captured in a CUDA graph), then runs :func:`build_sp_attention_kernel`: the flash
kernel's blocks (:mod:`~tilescale_examples.sequence.flash_attention`'s online softmax and
buffers) reading the gathered ``(W, B, SP, Hkv, D)`` buffers in place, key tile ``t`` from rank
``t // (SP / block_n)``. ``causal`` masks by global position: query ``r SP + i`` sees keys up to
itself, and a block stops after its diagonal's tile (the rank's first position is a run-time
argument: every rank runs the same compiled kernel). ``order="zigzag"`` gives rank ``r`` the
chunks ``r`` and ``2 W - 1 - r`` of ``SP / 2`` positions instead (:func:`positions`), so that
every rank has the same causal work.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from typing import Optional, Sequence, Tuple, Union

import torch

from tilescale_examples.base import check_positive_int
from tilescale_examples.sequence._attention_op import AttentionOp
from tilescale_examples.sequence.flash_attention import (DTYPES, build_attention_kernel, check_head_dim, check_scale,
                                                         check_tiles)
from tilescale_examples.sequence.flash_attention import torch_reference as attention_reference

__all__ = ["SPAllGatherAttention", "build_sp_attention_kernel", "torch_reference", "positions", "ORDERS"]


def build_sp_attention_kernel(world_size: int, batch: int, seq_local: int, heads: int, kv_heads: int, head_dim: int,
                              causal: bool, scale: float, dtype: str = "bfloat16", block_m: int = 128,
                              block_n: int = 128, num_stages: int = 2, threads: int = 256, order: str = "contiguous"):
    """:func:`~tilescale_examples.sequence.flash_attention.build_attention_kernel` over the
    gathered shards: ``sp_attention(Q, K, V, O, LSE, q_start)``, ``Q (B, SP, H, D)``, ``K``, ``V
    (W, B, SP, Hkv, D)``, ``q_start`` the global position of this rank's first query (see
    :func:`positions`)."""
    return build_attention_kernel(world_size, batch, seq_local, seq_local, heads, kv_heads, head_dim, causal, scale,
                                  dtype, block_m, block_n, num_stages, threads, name=f"sp_attention_{order}",
                                  zigzag=order == "zigzag")


#: Values of ``order``: how the sequence is split into the ranks' shards.
ORDERS = ("contiguous", "zigzag")


def positions(rank: int, world_size: int, seq_local: int, order: str = "contiguous") -> torch.Tensor:
    """The global positions of rank ``rank``'s ``seq_local`` rows: ``[r SP, (r + 1) SP)``
    (``"contiguous"``), or chunks ``r`` and ``2 W - 1 - r`` of ``SP / 2`` positions each
    (``"zigzag"``: every rank then has the same causal work)."""
    if order == "contiguous":
        return torch.arange(rank * seq_local, (rank + 1) * seq_local)
    c = seq_local // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)])


def torch_reference(inputs: Sequence[tuple], rank: int, causal: bool = True,
                    order: str = "contiguous") -> Tuple[torch.Tensor, torch.Tensor]:
    """What a call returns on ``rank`` in float32: ``inputs[p] = (q_p, k_p, v_p)``, rank ``p``'s
    shards (rows at :func:`positions`); ``rank``'s queries over the whole sequence (causal by
    global position): global attention, sliced."""
    world, SP = len(inputs), inputs[0][0].shape[1]
    full = []
    for i in range(3):
        x = inputs[0][i]
        t = x.new_empty((x.shape[0], world * SP, *x.shape[2:]))
        for p in range(world):
            t[:, positions(p, world, SP, order)] = inputs[p][i]
        full.append(t)
    o, lse = attention_reference(*full, causal=causal)
    mine = positions(rank, world, SP, order)
    return o[:, mine], lse[:, :, mine]


class SPAllGatherAttention(AttentionOp):
    """Sequence-parallel attention over K/V all-gathered from every rank (see the module
    docstring).

    Args:
        allocator: the distributed allocator (collective: every rank builds the same ops).
        batch, seq_local, heads, kv_heads, head_dim: this rank's ``q (batch, seq_local, heads,
            head_dim)`` and ``k``, ``v (batch, seq_local, kv_heads, head_dim)``; ``heads`` a
            multiple of ``kv_heads``; ``head_dim`` in
            :data:`~tilescale_examples.sequence.flash_attention.HEAD_DIMS`; ``seq_local`` a
            multiple of the tiles (``block_m``, ``block_n``).
        dtype: bfloat16 or float16.
        world_size, group: as every op (keyword-only).
        causal: mask by global position (default True).
        order: ``"contiguous"`` (rank ``r`` holds positions ``[r SP, (r + 1) SP)``) or
            ``"zigzag"`` (chunks ``r`` and ``2 W - 1 - r`` of ``SP / 2``: every rank has the
            same causal work; ``seq_local`` then a multiple of twice the tiles); see
            :func:`positions`.
        scale: of the scores (default ``1 / sqrt(head_dim)``).
        tiles: ``block_m``, ``block_n``, ``num_stages``, ``threads`` (default
            :func:`~tilescale_examples.sequence.flash_attention.default_tiles`).
    """

    _BUFFERS = ("gather_k", "gather_v", "output", "lse")
    Q_SHAPE_NAME, KV_SHAPE_NAME, LSE_SHAPE_NAME = "(B, seq_local, H, D) =", "(B, seq_local, Hkv, D) =", "(B, H, seq_local) ="

    def __init__(self, allocator, batch: int, seq_local: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: Union[torch.dtype, str], *, world_size: Optional[int] = None, group=None, causal: bool = True,
                 order: str = "contiguous", scale: Optional[float] = None, target=None, **tiles):
        self._setup_op(allocator, dtype, world_size, group, tuple(DTYPES))
        self.batch, self.seq_local = check_positive_int("batch", batch), check_positive_int("seq_local", seq_local)
        self.heads, self.kv_heads = check_positive_int("heads", heads), check_positive_int("kv_heads", kv_heads)
        self.head_dim = check_head_dim(check_positive_int("head_dim", head_dim))
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
        self.tiles = check_tiles(tiles, head_dim)
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        unit = 2 if order == "zigzag" else 1  # a zigzag shard is two chunks of whole tiles
        if seq_local % (unit * self.tiles["block_m"]) or seq_local % (unit * self.tiles["block_n"]):
            times = "" if unit == 1 else f"{unit} x "
            raise ValueError(f"seq_local={seq_local} must be a multiple of {times}block_m={self.tiles['block_m']} and "
                             f"{times}block_n={self.tiles['block_n']} (order={order!r})")
        self.order = order
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        self.causal = causal
        self.scale = check_scale(scale, head_dim)
        from tilescale_examples.collectives.allgather import AllGather

        self.q_shape, self.kv_shape = (batch, seq_local, heads, head_dim), (batch, seq_local, kv_heads, head_dim)
        self.gather_k = AllGather(allocator, self.kv_shape, self.dtype, world_size=self.world_size, group=group,
                                  target=target)
        self.gather_v = AllGather(allocator, self.kv_shape, self.dtype, world_size=self.world_size, group=group,
                                  target=target)
        self.output = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
        self.lse = torch.empty((batch, heads, seq_local), dtype=torch.float32, device=self.device)
        args = (self.world_size, batch, seq_local, heads, kv_heads, head_dim, causal, self.scale, DTYPES[self.dtype])
        self.kernel = self._compile_plain(lambda: build_sp_attention_kernel(*args, **self.tiles, order=order), target)
        self._q_start = int(positions(self.rank, self.world_size, seq_local, order)[0])

    @staticmethod
    def torch_reference(inputs, rank: int, causal: bool = True, order: str = "contiguous") -> Tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
        """:func:`torch_reference`."""
        return torch_reference(inputs, rank, causal, order)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                 lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's queries over every rank's keys (collective). Returns ``(out, lse)``,
        default the op's own (overwritten by the next call), complete on the current stream.
        Raises :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        out, lse = self._begin_call(q, k, v, out, lse)
        keys, values = self.gather_k(k), self.gather_v(v)
        self.kernel(q, keys, values, out, lse, self._q_start)
        return out, lse

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch={self.batch}, seq_local={self.seq_local}, heads={self.heads}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, causal={self.causal}, "
                f"world_size={self.world_size}{', closed' if self.closed else ''})")
