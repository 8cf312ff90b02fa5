"""The put-based exchange kernel shared by the all-gather and the all-to-all.

Rank ``me`` sends ``S`` elements to every rank ``p`` (``p == me`` included) into row ``me``
of ``p``'s output, chunk by chunk, with ``T.put_block`` and epoch flags:

* all-gather (``row_per_peer=False``): the same input row (``In: (S,)``) goes to every rank;
* all-to-all (``row_per_peer=True``): row ``p`` of the input (``In: (W * S,)``) goes to rank ``p``.

The protocol (ready handshake, ``T.put_signal_block`` of the chunk with its flag, acquire
wait for the peer's chunk) is described in :mod:`tilescale_examples.collectives.allgather`.
With one rank (``world_size = 1``) there is no peer: each block copies its chunk with
``T.put_block`` and records the call, with no handshake and no flag.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)


from typing import Optional

import torch

from tilescale_examples._launch import kept_view
from tilescale_examples._macros import T, macro, variable
from tilescale_examples.base import SymmetricCollective, plan_chunks

__all__ = ["build_put_exchange_kernel", "PutExchange", "claim_slot", "await_chunk", "count_alone"]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one flat view (the exchange kernel's output parameter)."""
    return tensor.view(-1)


@macro
def claim_slot(Flags, READY, C, c, p, me, tx, epoch):
    """The ready handshake of block ``(c, p)``'s call ``epoch``: tell ``p`` that my slot for its
    chunk ``c`` is free (add 1 to ``ready[me, c]`` on ``p``), wait until ``p``'s slot for my chunk
    ``c`` is (``ready[p, c] >= epoch``), block barrier. ``READY``: the index of ``ready[0, 0]``."""
    if tx == 0:
        T.signal_op(Flags[READY + me * C + c], 1, "add", p)  # my slot for p's chunk c is free
        T.wait_ge(Flags[READY + p * C + c], epoch)  # p's slot for my chunk c is free
    T.sync_threads()


@macro
def await_chunk(Flags, State, C, c, p, tx, epoch):
    """The end of block ``(c, p)``'s call ``epoch``: acquire ``p``'s chunk ``c`` (``data[p, c]
    >= epoch``) and record the call in ``State`` (every thread read it before the barriers)."""
    if tx == 0:
        T.wait_ge(Flags[p * C + c], epoch)  # acquire: p's chunk c is here
        State[p * C + c] = epoch


@macro
def count_alone(State, C, c, p, tx, epoch):
    """The end of block ``(c, p)``'s call ``epoch`` with one rank: nothing to acquire (its chunk
    was its own copy); record the call in ``State`` as :func:`await_chunk` does."""
    if tx == 0:
        State[p * C + c] = epoch


def build_put_exchange_kernel(shard_numel: int, dtype: str, world_size: int, chunks: int,
                              chunk: int, threads: int = 512, row_per_peer: bool = False,
                              name: str = "allgather"):
    """The exchange ``T.prim_func``: grid ``chunks x world_size`` blocks of ``threads``.

    Signature: ``(In: (R * shard_numel,), Out: (world_size * shard_numel,), Flags: (2 *
    world_size * chunks,) uint64, State: (world_size * chunks,) int64)`` with ``R =
    world_size`` when ``row_per_peer`` else 1; ``Flags[:world_size*chunks]`` are the data
    flags ``data[src, c]``, the rest the ready flags ``ready[src, c]``; ``State[p * chunks +
    c]`` counts block ``(c, p)``'s calls (the call number lives on the device, so a CUDA graph
    replays correctly). Every flag counts the calls of the one block that adds to it: rank
    ``src``'s block ``(c, me)`` adds 1 per call, and call ``e`` waits for ``>= e``.
    ``name`` names the kernel.
    """
    import tilelang.language as T

    S, W, C, CH = shard_numel, world_size, chunks, chunk
    if (C - 1) * CH >= S or C * CH < S:
        raise ValueError(f"chunks={C} x chunk={CH} does not tile shard_numel={S} (use plan_chunks)")
    READY = W * C
    IN_ROWS, ROW = (W, S) if row_per_peer else (1, 0)  # source row of peer p: p * ROW

    @T.prim_func
    def exchange(In: T.Tensor((IN_ROWS * S,), dtype), Out: T.Tensor((W * S,), dtype),
                 Flags: T.Tensor((2 * W * C,), "uint64"), State: T.Tensor((W * C,), "int64")):
        with T.Kernel(C, W, threads=threads) as (c, p):
            tx = T.get_thread_binding()
            me = T.get_rank()
            # A variable, not the expression c * CH: TileLang 0.1.15's pointer-type pass fails
            # ("Can't fetch the lanes of a scalable vector") on In[c * CH] when CH % 65536 >= 32768.
            start = T.alloc_var("int32")
            start = c * CH
            epoch = T.alloc_var("int64")
            epoch = State[p * C + c] + 1  # this call's number (the add below does not wait for it)
            if W > 1:
                claim_slot(Flags, READY, C, c, p, me, tx, variable(epoch))
                # put chunk c on p, then (release) add 1 to data[me, c] there: data before signal
                T.put_signal_block(T.address_of(In[p * ROW + start]), T.address_of(Out[me * S + start]),
                                   T.min(CH, S - start), Flags[me * C + c], 1, "add", p)
                await_chunk(Flags, State, C, c, p, tx, variable(epoch))
            else:  # one rank: the chunk is a copy of its own; no slot to claim, no flag to wait for
                T.put_block(T.address_of(In[start]), T.address_of(Out[start]), T.min(CH, S - start))
                count_alone(State, C, c, p, tx, variable(epoch))

    return exchange.with_attr("global_symbol", name)


class PutExchange(SymmetricCollective):
    """What :class:`~tilescale_examples.collectives.allgather.AllGather` and
    :class:`~tilescale_examples.collectives.alltoall.AllToAll` share: the chunk plan (``_setup``
    takes ``min_chunk_bytes``), the flags and per-block call counters of
    :func:`build_put_exchange_kernel` (``_make_flags``) and the launch with its optional
    ``out``. Subclasses set ``input``, ``output`` and ``kernel``."""

    _BUFFERS = ("input", "output", "flags", "state", "_flat_output")

    def _setup(self, *args, min_chunk_bytes: int, **kwargs) -> None:
        """:meth:`~tilescale_examples.base.SymmetricCollective._setup`, then the plan of the
        exchange: ``chunks`` pieces of ``chunk`` units (:meth:`_chunk_units`) per peer
        (:func:`plan_chunks`, no piece under ``min_chunk_bytes`` before the grid grows)."""
        super()._setup(*args, **kwargs)
        units, unit_bytes = self._chunk_units()
        self.chunks, self.chunk = plan_chunks(units, unit_bytes, self.world_size, self.max_blocks, min_chunk_bytes)

    def _chunk_units(self) -> tuple:
        """``(units, bytes per unit)`` a rank sends each peer, which the chunk plan splits: the
        shard's elements (an exchange that moves rows overrides it)."""
        return self.shard_numel, self.itemsize

    def _make_flags(self) -> None:
        """The kernel's flags, symmetric (``(2 * world_size * chunks,)`` uint64: data then
        ready flags, zeroed), and its per-block call counters (``state``: ``(world_size *
        chunks,)`` int64, zero, on the device). After the output: the heap's order."""
        self.flags = self._tensor((2 * self.world_size * self.chunks,), torch.uint64)
        self.flags.zero_()
        self.state = torch.zeros((self.world_size * self.chunks,), dtype=torch.int64, device=self.device)

    def _launch(self, input: torch.Tensor, keep: bool = False) -> None:
        """One call's data movement on the current stream (the SM kernel; overridden by
        engines that move data otherwise). ``keep``: the call had no ``out``, so a call on a
        tensor laid out as ``input`` may launch the same again (:meth:`_relaunch`), at its
        address or, 16-byte aligned, at another (the full call reads any input in place)."""
        self.bind_table()
        flat = kept_view(self, "_flat_output", self.output, _flat)
        args = (input.view(-1), flat, self.flags, self.state)
        self._launch_kernel(args, changing=(0,))
        self._keep_launch(keep, (input,), args, (0,), views=((0, 0),), movable=True)

    def _call(self, input: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        """A call of the op: the last call's launch again when ``input`` is laid out as its
        input was and no ``out`` is given (:meth:`_relaunch`), else the full call (the open
        and input checks, then :meth:`_exchange`)."""
        if out is None and self._relaunch(input):
            return self.output
        self._check_open()
        self.check_input(input)
        return self._exchange(input, out)

    def _exchange(self, input: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        """Run the exchange kernel on ``input`` (checked by the caller) on the current stream;
        returns ``output``, or ``out`` holding a copy of it (checked here, before the launch)."""
        if out is not None:
            self.check_tensor(out, self.output.shape, "out", "the output shape")
        self._note_capture()
        self.epoch += 1
        self._launch(input, keep=out is None)
        if out is None:
            return self.output
        out.copy_(self.output)
        return out
