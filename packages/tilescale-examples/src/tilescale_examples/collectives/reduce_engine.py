"""The reduction engine shared by the all-reduce (one-shot, fused two-shot) and the
reduce-scatter: one kernel builder (:mod:`.reduce_kernel`, re-exported here), one host-side plan,
one base class.

Data layout
-----------

Everything is moved in 16-byte *vectors* (``V = 16 // itemsize`` elements: 8 for float16 and
bfloat16, 4 for float32 and int32). A tensor of ``n`` elements is ``nv = ceil(n / V)`` vector
rows; the symmetric staging buffer ``Stage`` holds ``shards x span`` rows (``span`` rows per
shard; one shard for the one-shot, ``world_size`` shards otherwise), zero-padded. Kernels see
2-D ``(rows, V)`` views, so every access is one ``ld``/``st`` of 16 bytes
(``T.copy(..., src_pe=p)`` into registers for peers' rows).

The kernel (one builder, three modes)
-------------------------------------

A grid of ``blocks`` blocks of ``threads`` threads; block ``b`` owns the *rows*
``r = ((t * blocks + b) * U + u) * threads + tx`` (``t < iters``, ``u < U``, ``r < span``) of
every shard, so a warp moves 32 consecutive vectors (512 bytes). Rank ``me``, call ``epoch``:

1. *Stage* (when the input is not already in ``Stage``): block ``b`` copies its rows of every
   shard from the caller's input ``X`` into this rank's ``Stage``.
2. *Ready*: thread ``p < W`` stores ``ready[me, b] = epoch`` on rank ``p``, then waits
   ``ready[p, b] >= epoch`` here with acquire loads (then ``__syncthreads``): block ``b`` of
   every rank has staged its rows. When the kernel staged (step 1), the store is a release
   at system scope after a ``__syncthreads``. No separate fence: the block barrier puts every
   thread's staging stores before the store in causality order, and a release is cumulative
   over them (PTX memory model; the same argument as ``T.put_signal``'s, see
   ``signal.cuh``). When the input was already in ``Stage`` (``stage_in == 0``: written by
   earlier work on the stream), the store is relaxed (system scope) and needs no barrier
   before it: a kernel's writes are performed at system scope when it completes (the host
   may read them after synchronising with the stream), and this kernel starts after that;
   so is every read of ``Stage`` by earlier kernels, which a peer's push must not overtake.
   This is the ordering torch symmetric memory's one-shot all-reduce relies on for its
   relaxed entry barrier, and it saves the release's system-scope fence (about 0.5 us of a
   call on an H200).
3. *Reduce*: for its rows ``r`` of shard ``s`` (``s = 0`` one-shot, ``s = me`` otherwise)
   every thread loads the row from each rank's ``Stage`` (``W`` 16-byte loads per row, all
   issued before the first add) and adds them **in rank order** ``0, 1, ..., W-1`` in the
   accumulation type (float32 for float16/bfloat16), then rounds once.
4. *Store*: ``one_shot`` and ``reduce_scatter`` write the row to the local output;
   ``two_shot`` stores it into row ``r`` of shard ``me`` of every rank's ``Stage`` (the
   all-gather half, in place; one 16-byte ``st.global.v4`` per rank, which tilescale-lang
   makes of every remote 16-byte store), then ``__syncthreads`` and the release store
   ``data[me, b] = epoch`` on every rank, and waits ``data[p, b] >= epoch`` for every ``p``:
   every rank's block ``b`` has stored its rows here.

Determinism: every output element is ``x_0 + x_1 + ... + x_{W-1}`` in that order, in the
accumulation type, rounded once; the two-shot's rank ``s`` computes shard ``s`` and sends the
same bits to everyone. So all ranks get bit-identical results, equal to
:func:`torch_reference`.

Deadlock freedom
----------------

Every block waits only for blocks of the same index on other ranks, and only in steps 2 and
4. The grid has at most ``max_blocks`` blocks (default: the SM count), and a block of at most
1024 threads using at most 128 registers per thread (checked by the CPU tests) always fits on
an SM, so on an otherwise idle GPU all blocks are resident at once. A block reaches its
step-2 signal after a finite amount of its own work, and it signals in step 4 after finishing
all of its step-3 work (no wait inside the loop); so every awaited signal is eventually
written and no cycle of waits can form. Kernels of other streams that do not wait on peers
only delay residency. Do not run two collectives that wait on peers concurrently on
different streams (each could hold SMs the other's blocks need).

Reuse under back-to-back calls
------------------------------

Flags are ``uint64`` words *set* to the call's number ``epoch`` and waited on with ``>=``: no
reset, no wrap. Each flag has a 32-byte sector to itself (:data:`FLAG_STRIDE`
words apart), so the blocks' flag stores and polls do not contend for one sector. Stream
order gives: rank ``p`` starts call ``e + 1`` only after its call ``e`` finished.

* ``one_shot`` / ``reduce_scatter`` have one flag round, so a rank may finish call ``e``
  while a slow peer is still reading its ``Stage``. They **double-buffer** ``Stage``: call
  ``e`` uses buffer ``e % 2``. Rank ``me`` rewrites buffer ``e % 2`` only in call ``e + 2``,
  after its call ``e + 1`` saw ``ready[p, b] >= e + 1`` from every peer, i.e. after every
  peer started call ``e + 1`` and hence finished reading call ``e``.
* ``two_shot`` has a second round that doubles as a completion handshake: rank ``me``'s call
  returns only after ``data[p, b] >= e`` from every peer, and peer ``p``'s block ``b`` signals
  that after reading its rows of ``me``'s ``Stage`` (read before its own stores). So one
  buffer suffices, and peers push into ``me``'s ``Stage`` only after ``ready[me, b] >= e``,
  i.e. after ``me`` staged call ``e`` (everything ``me`` enqueued before, like consumers of
  the previous result, has run).

Call numbers
------------

The call number lives on the device, never in a kernel argument: ``State[b]`` counts block
``b``'s calls. Block ``b`` reads ``epoch = State[b] + 1`` at its start and thread 0 writes
``epoch`` back after the first round's barrier (every thread of the block has read it by
then; the next call starts after this kernel). The staging buffer of a call, ``epoch % 2``,
is chosen in the kernel too (``Stage`` holds both buffers). So a call captured in a CUDA graph
replays as a new call, and eager calls and replays of several graphs mix in any order, as
long as every rank makes the same sequence. The host keeps its own count (``epoch`` of the
collective) only to find the zero-copy input of the next eager call; once an instance has been
captured, a double-buffered one no longer offers it (``input`` raises).
"""

# (no `from __future__ import annotations`: the kernel module defines TileLang kernels)

from typing import Optional, Sequence

import torch

from tilescale_examples.base import SymmetricCollective, settle
from tilescale_examples.collectives.lamport_kernel import (LAMPORT_DTYPES, SENTINEL_BYTE, build_lamport_kernel,
                                                           lamport_rows)
from tilescale_examples.collectives.reduce_kernel import (ACCUMULATE, FLAG_STRIDE, MAX_REGISTERS,
                                                          MAX_UNROLLED_VECTORS, MODES, PASS_CONFIGS, REDUCE_DTYPES,
                                                          VECTOR_BYTES, buffers, build_reduce_kernel, check_unroll,
                                                          default_unroll, max_unroll, rank_order_sum, vector_elems)

__all__ = ["MODES", "buffers", "ACCUMULATE", "REDUCE_DTYPES", "VECTOR_BYTES", "MAX_REGISTERS",
           "FLAG_STRIDE", "MAX_UNROLLED_VECTORS", "build_reduce_kernel", "default_unroll", "max_unroll",
           "check_unroll", "vector_elems", "grid", "plan_grid", "Plan",
           "ReductionCollective", "LAMPORT", "rank_order_sum", "rows_view", "overlaps", "torch_reference",
           "PASS_CONFIGS"]

#: The mode of the Lamport one-shot all-reduce (:mod:`.lamport_kernel`): flagless, float dtypes.
LAMPORT = "lamport"
_TORCH_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


# ------------------------------------------------------------------------------ plan
def grid(span: int, threads: int, unroll: int, max_blocks: int) -> tuple:
    """``(blocks, iters)`` for ``span`` rows of ``threads * unroll`` rows per block and
    iteration: at most ``max_blocks`` blocks, no more than the rows need, and enough
    iterations to cover every row."""
    if span < 1 or threads < 1 or unroll < 1 or max_blocks < 1:
        raise ValueError(f"span, threads, unroll and max_blocks must be >= 1, got {span}, {threads}, {unroll}, "
                         f"{max_blocks}")
    per_iter = threads * unroll
    blocks = max(1, min(max_blocks, -(-span // per_iter)))
    return blocks, -(-span // (blocks * per_iter))


class Plan:
    """Grid and buffer plan of one reduction (all sizes in 16-byte vector rows).

    Attributes: ``mode``, ``world_size``, ``vec`` (elements per row), ``span`` (rows per
    shard), ``shards``, ``rows_in`` (rows of real input), ``blocks``, ``iters``,
    ``threads``, ``unroll``; ``stage_rows = shards * span``.
    """

    def __init__(self, mode: str, world_size: int, vec: int, span: int, shards: int, rows_in: int,
                 threads: int, unroll: int, max_blocks: int):
        self.mode, self.world_size, self.vec = mode, world_size, vec
        self.span, self.shards, self.rows_in = span, shards, rows_in
        self.threads, self.unroll = threads, unroll
        self.blocks, self.iters = grid(span, threads, unroll, max_blocks)

    @property
    def stage_rows(self) -> int:
        return self.shards * self.span

    @property
    def flag_words(self) -> int:
        """uint64 words of the flag array: ready and data flags of every rank and block,
        :data:`FLAG_STRIDE` words apart."""
        return 2 * self.world_size * self.blocks * FLAG_STRIDE

    def __repr__(self) -> str:
        return (f"Plan({self.mode}, world_size={self.world_size}, vec={self.vec}, span={self.span}, "
                f"shards={self.shards}, blocks={self.blocks}, iters={self.iters}, "
                f"threads={self.threads}, unroll={self.unroll})")


def plan_grid(mode: str, numel: int, itemsize: int, world_size: int, threads: int = 512,
              unroll: Optional[int] = None, max_blocks: int = 132) -> Plan:
    """The plan for ``numel`` elements of ``itemsize`` bytes.

    ``numel`` is the whole tensor for ``one_shot`` / ``two_shot`` and one output shard (one
    input row) for ``reduce_scatter``. ``one_shot``: one shard of ``ceil(numel / vec)`` rows;
    ``two_shot``: ``world_size`` shards of ``ceil(rows / world_size)`` rows (the last ones
    zero-padded); ``reduce_scatter``: ``world_size`` shards of ``ceil(numel / vec)`` rows (each
    input row padded to whole vectors). The grid is at most ``max_blocks`` blocks and no more
    than there are ``threads * unroll`` rows of a shard.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, value in (("numel", numel), ("world_size", world_size), ("threads", threads),
                        ("max_blocks", max_blocks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    unroll = check_unroll(unroll, world_size)
    vec = vector_elems(itemsize)
    rows = -(-numel // vec)
    if mode == "one_shot":
        return Plan(mode, world_size, vec, rows, 1, rows, threads, unroll, max_blocks)
    if mode == "two_shot":
        return Plan(mode, world_size, vec, -(-rows // world_size), world_size, rows, threads, unroll, max_blocks)
    return Plan(mode, world_size, vec, rows, world_size, world_size * rows, threads, unroll, max_blocks)


def torch_reference(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_p inputs[p]`` added in rank order ``0, 1, ...`` in the accumulation dtype
    (float32 for float16/bfloat16, the dtype itself otherwise), rounded once to the dtype:
    what every rank's reduction kernel computes, bit for bit."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one tensor per rank, got none")
    dtype = inputs[0].dtype
    acc_dtype = _TORCH_ACCUMULATE.get(dtype, dtype)
    total = inputs[0].to(acc_dtype)
    for x in inputs[1:]:
        total = total + x.to(acc_dtype)
    return total.to(dtype)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storage spans of ``a`` and ``b`` intersect (same device)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + _extent(a), b0 + _extent(b)
    return a0 < b1 and b0 < a1


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (any strides >= 0)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def rows_view(t: torch.Tensor, vec: int) -> Optional[torch.Tensor]:
    """``t`` as a ``(numel / vec, vec)`` view when it is contiguous, 16-byte aligned and a
    whole number of vectors; else None."""
    n = t.numel()
    if n % vec or not t.is_contiguous() or t.data_ptr() % VECTOR_BYTES:
        return None
    return t.view(n // vec, vec)


# ------------------------------------------------------------------------------ base class
class ReductionCollective(SymmetricCollective):
    """Base of :class:`~tilescale_examples.collectives.allreduce.AllReduce` and
    :class:`~tilescale_examples.collectives.reducescatter.ReduceScatter`: the plan, the staging buffers,
    the flags, one compiled kernel of :func:`build_reduce_kernel` and its launch.

    Subclasses call ``_setup(...)`` (from :class:`SymmetricCollective`) and then
    ``_build(mode, numel, unroll, target)``.
    """

    _BUFFERS = ("stages", "stage_buffer", "flags", "state", "result", "output", "_inputs", "_padded", "_lamport_input")

    def _build(self, mode: str, numel: int, unroll: Optional[int], target) -> None:
        self.mode = mode
        lamport = mode == LAMPORT
        self.plan = plan_grid("one_shot" if lamport else mode, numel, self.itemsize, self.world_size, self.threads,
                              unroll, self.max_blocks)
        p = self.plan
        name = REDUCE_DTYPES[self.dtype]
        if lamport:
            self._build_lamport_buffers(p)
        else:
            self._build_stages(p, buffers(mode))
        self.state = torch.zeros((p.blocks,), dtype=torch.int64, device=self.device)
        self.result = None if mode == "two_shot" else torch.empty((p.span, p.vec), dtype=self.dtype, device=self.device)
        self._padded = None
        first = self.stage_buffer.data_ptr()
        self._stage_span = (first, first + self.stage_buffer.numel() * self.itemsize)  # bytes [first, last)

        def build():
            if lamport:
                return build_lamport_kernel(name, self.world_size, self.threads, p.unroll)
            return build_reduce_kernel(mode, name, self.world_size, self.threads, p.unroll)

        self.kernel = self._compile_kernel(build, target, PASS_CONFIGS,
                                           key=("reduce", mode, name, self.world_size, self.threads, p.unroll))
        self.bind_table(force=True)
        settle(self.device, self.group)

    def _build_stages(self, p: "Plan", nb: int) -> None:
        """The flag modes' buffers: ``nb`` staging buffers and the flags."""
        # one_shot / reduce_scatter have one flag round: double-buffer (see the module docstring);
        # the kernel picks buffer e % 2 from its own call number, so one allocation holds both
        self.stage_buffer = self._tensor((nb * p.stage_rows, p.vec))
        self.stages = list(self.stage_buffer.split(p.stage_rows))
        self.flags = self._tensor((p.flag_words,), torch.uint64)
        self.stage_buffer.zero_()  # the padding rows are summed as zeros and never written by a call
        self.flags.zero_()
        self._inputs = [self._input_view(stage) for stage in self.stages]

    def _build_lamport_buffers(self, p: "Plan") -> None:
        """The Lamport mode's buffers (:mod:`.lamport_kernel`): the symmetric receive buffers,
        every byte the sentinel, and a local input buffer (the zero-copy ``input``: the kernel
        reads its input from wherever it is, so this one needs no symmetric memory)."""
        if REDUCE_DTYPES[self.dtype] not in LAMPORT_DTYPES:
            raise ValueError(f"algorithm='lamport' needs a float dtype (its sentinel is a NaN), got {self.dtype}")
        self.stage_buffer = self._tensor((lamport_rows(self.world_size, p.span), p.vec))
        self.stage_buffer.view(torch.uint8).fill_(SENTINEL_BYTE)
        self.stages = [self.stage_buffer]
        self.flags = None
        self._lamport_input = torch.zeros((p.span, p.vec), dtype=self.dtype, device=self.device)
        self._inputs = [self._input_view(self._lamport_input)]

    def _input_view(self, stage: torch.Tensor) -> torch.Tensor:
        """``stage`` as the caller's input shape (subclasses)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ buffers
    def _next_input_view(self) -> Optional[torch.Tensor]:
        """The zero-copy input view of the next call, or None where the host cannot know
        which buffer that is (a double-buffered instance that has been captured in a CUDA
        graph: replays advance the call number on the device only)."""
        if len(self._inputs) > 1 and self.captured:
            return None
        return self._inputs[(self.epoch + 1) % len(self._inputs)]

    @property
    def input(self) -> torch.Tensor:
        """The symmetric buffer the next call stages into, viewed as the input shape: fill
        it and pass it to the call to skip staging (the view alternates between two buffers
        for double-buffered modes, so read the attribute before every call). The Lamport
        mode stages nothing (its kernel pushes from wherever the input is): there it is one
        local buffer of the input shape, the same for every call.

        Raises ``RuntimeError`` for a double-buffered mode (``one_shot``,
        ``reduce_scatter``) once the instance has been captured in a CUDA graph: replays
        advance the call number on the device, so the host no longer knows the next buffer
        (pass a tensor of your own; the kernel stages it)."""
        self._check_open()
        view = self._next_input_view()
        if view is None:
            raise RuntimeError(f"{type(self).__name__}({self.mode}).input: this instance has been captured in a CUDA "
                               "graph, so which of its two staging buffers the next call uses is known only on the "
                               "device; pass a tensor of your own (the kernel stages it)")
        return view

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.input_shape}, dtype={self.dtype}, world_size={self.world_size}, "
                f"mode={self.mode!r}, blocks={self.plan.blocks}, epoch={self.epoch}"
                f"{', closed' if self.closed else ''})")

    def _is_view_of(self, t, view: Optional[torch.Tensor]) -> bool:
        return (view is not None and isinstance(t, torch.Tensor) and t.data_ptr() == view.data_ptr() and t.shape == view.shape and t.stride() == view.stride()
                and t.dtype == view.dtype and t.device == view.device)

    def _check_call(self, input, out: Optional[torch.Tensor], out_shape) -> bool:
        """What a call checks before anything runs: :class:`~tilescale_examples.base.ClosedError`
        once closed, ``input`` (unless it is the zero-copy view of this call's buffer, ``self.input``)
        and ``out`` when given (``out_shape``). Returns whether ``input`` is that zero-copy view
        (:meth:`_launch`'s ``zero_copy``)."""
        self._check_open()
        zero_copy = self._is_view_of(input, self._next_input_view())
        if not zero_copy:
            self.check_input(input)
        if out is not None:
            self._check_out(out, out_shape)
        return zero_copy

    def _check_out(self, out: torch.Tensor, shape) -> None:
        self.check_tensor(out, shape, "out", "the output shape")
        if self._is_view_of(out, self.output):
            return
        if any(overlaps(out, s) for s in self.stages):
            raise ValueError(f"out overlaps this {type(self).__name__}'s symmetric staging buffers, which peers "
                             "read and write during calls; pass a tensor of your own (or no out)")

    def _out_rows(self, out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``out`` as the kernel's ``(span, vec)`` output when it is exactly whole aligned
        rows, else None (the kernel then writes ``result`` and the call copies)."""
        rows = None if out is None else rows_view(out, self.plan.vec)
        return rows if rows is not None and rows.shape[0] == self.plan.span else None

    # ------------------------------------------------------------------ launch
    def _rows_or_padded(self, input: torch.Tensor, stage_copy) -> torch.Tensor:
        """``input`` as the kernel's ``(rows, vec)`` input when it is whole aligned vectors
        (and, for the reduce-scatter, whole vectors per output row), else a zero-padded local
        copy made by ``stage_copy(padded, input)``."""
        p = self.plan
        x = rows_view(input, p.vec)
        if x is not None and p.mode == "reduce_scatter" and x.shape[0] != p.stage_rows:
            x = None  # rows of the input are not whole vectors: padded by the copy below
        if x is None:
            if self._padded is None:
                self._padded = torch.zeros((p.stage_rows, p.vec), dtype=self.dtype, device=self.device)
            stage_copy(self._padded, input)
            x = self._padded
        return x

    def _keep_for_repeat(self, keep: bool, input: torch.Tensor, args: tuple, changing) -> None:
        """Keep this call's launch for the next call on a tensor laid out as ``input``
        (:meth:`_relaunch`) when ``keep`` (the call had no ``out`` and did not find its input
        staged) and only the view of the input changes: the kernel reads ``input`` in place
        (``args[0]`` its view, not the padded copy) and ``input`` lies outside this instance's
        staging buffers. A later input of this layout may be elsewhere (16-byte aligned and
        outside the staging buffers, as the full call would read it in place too)."""
        self._keep_launch(keep and args[0] is not self._padded, (input,), args, changing, views=((0, 0),),
                          outside=self._stage_span, movable=True)

    def _kernel_args(self, x: torch.Tensor, out_rows: Optional[torch.Tensor], stage_in: int) -> tuple:
        """The flag kernel's parameters (:func:`build_reduce_kernel`'s signature) for a call
        reading ``x`` (rows to stage when ``stage_in`` is 1, else this call's staging buffer)
        and writing ``out_rows`` (None for ``two_shot``, which has no output parameter)."""
        p = self.plan
        head = (x, self.stage_buffer) if out_rows is None else (x, self.stage_buffer, out_rows)
        return head + (self.flags, self.state, p.blocks, p.iters, p.span, p.rows_in, stage_in)

    def _launch(self, input: torch.Tensor, out_rows: Optional[torch.Tensor], stage_copy,
                zero_copy: bool, keep: bool = False) -> torch.Tensor:
        """Stage ``input`` (in the kernel when it is whole aligned vectors, else copied by
        ``stage_copy(padded, input)`` into a zero-padded local buffer that the kernel stages)
        and run this call's kernel; returns the staging buffer the call uses. ``input`` needs
        no staging when it is the zero-copy view of this call's buffer (``zero_copy``, from
        :meth:`_check_call`). ``keep``: the call had no ``out``, so a later call may repeat it
        (:meth:`_keep_for_repeat`)."""
        p = self.plan
        nb = len(self.stages)
        if self._note_capture() and nb > 1 and any(overlaps(input, s) for s in self.stages):
            raise RuntimeError(f"{type(self).__name__}({self.mode}): input is one of this instance's own staging "
                               "buffers, and the instance has been captured in a CUDA graph, where the buffer of "
                               "each call is chosen on the device; pass a tensor of your own")
        self.epoch += 1
        self.bind_table()
        if self.mode == LAMPORT:
            x = self._lamport_input if zero_copy else self._rows_or_padded(input, stage_copy)
            args, changing = (x, self.stage_buffer, out_rows, self.state, p.blocks, p.iters, p.span), (0, 2)
            self._launch_kernel(args, changing)
            self._keep_for_repeat(keep and not zero_copy, input, args, changing)
            return self.stage_buffer
        stage_in = 1
        if zero_copy:
            x, stage_in = self.stages[self.epoch % nb], 0
        else:
            x = self._rows_or_padded(input, stage_copy)
        args = self._kernel_args(x, out_rows, stage_in)
        changing = (0, len(args) - 1) if out_rows is None else (0, 2, len(args) - 1)  # x, out_rows, stage_in
        self._launch_kernel(args, changing)
        self._keep_for_repeat(keep and not zero_copy, input, args, changing)
        return self.stages[self.epoch % nb]
