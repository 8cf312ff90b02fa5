"""Mixture-of-experts token dispatch and combine (expert parallelism) on the symmetric heap.

Every rank holds ``x`` (``(T, hidden)`` tokens, ``T <= max_tokens``), a router's choice
``topk_idx`` (``(T, topk)``: global expert indices, ``-1`` for an unused slot) and
``topk_weights`` (``(T, topk)`` float32). The ``num_experts`` experts are split evenly over
the ``W`` ranks: rank ``d`` owns experts ``[d * EL, (d + 1) * EL)``, ``EL = num_experts /
W``::

    moe = MoEDispatcher(allocator, num_experts=64, hidden=7168, topk=8, max_tokens=4096, dtype=torch.bfloat16)
    recv_x, counts, handle = moe.dispatch(x, topk_idx, topk_weights)   # collective
    y = experts(recv_x, handle.recv_offsets)                           # (capacity, hidden)
    out = moe.combine(y, handle)                                       # (T, hidden)
    moe.close()                                                        # before allocator.close()

``out[t] = sum_k topk_weights[t, k] * y_of(t, k)`` accumulated in float32 in slot order and
rounded once, where ``y_of(t, k)`` is the row ``y`` that the owner of expert ``topk_idx[t,
k]`` computed for token ``t``.

Receive layout (fixed; bit-exact against :func:`torch_dispatch_reference`)
----------------------------------------------------------------------------

``recv_x`` is the symmetric ``(capacity, hidden)`` buffer, ``capacity = W * max_tokens *
topk`` (every token of every rank could choose experts of this rank in every slot). Its first
``recv_offsets[EL]`` rows hold the received tokens:

* grouped by local expert ``0 .. EL-1``: expert ``j``'s rows are ``recv_offsets[j] ..
  recv_offsets[j + 1]``, ``counts[j]`` of them;
* inside an expert, by source rank ``0 .. W-1``;
* inside a source rank, by *entry* ``i = t * topk + k`` (token, then slot), so a token that
  picks the same expert in two slots arrives twice.

Rows past ``recv_offsets[EL]`` are stale. ``counts`` (``(EL,)`` int32) and
``handle.recv_offsets`` (``(EL + 1,)`` int32) are device tensors written by the call (no host
synchronisation: read them on the device, e.g. as a grouped GEMM's offsets, or copy them to
the host yourself). ``handle.origin()`` gives each row's source rank and entry.

How it runs
-----------

One kernel per call on the current stream and no host synchronisation, so the calls can be
captured in a CUDA graph: ``dispatch`` (one block per SM, 1024 threads) exchanges the
per-expert counts with every rank on the device, plans every entry's row and copies each
token row straight into its rows on the owner ranks, in one launch; ``combine`` returns each
received row to its source rank and sums each token's ``topk`` rows with its weights in
float32. Each kernel step by step, the call numbers and counters on the device, and why
nothing deadlocks, also back to back without a host barrier: ``docs/moe.md``.

Requirements: every rank makes the same sequence of ``dispatch``/``combine`` calls (a rank
that skips one leaves its peers waiting; set ``TILESCALE_WAIT_TIMEOUT_MS`` to turn that into
an error instead of a hang); work that reads ``recv_x``, ``counts`` or a combine output must
be ordered before the next call on this rank's stream; do not run the kernels under MPS or
green-context partitions that give them fewer SMs than ``max_blocks``.

Bad input
---------

Shapes, dtypes, devices, contiguity, ``hidden`` and the token count are checked on the host
before anything runs (``TypeError`` / ``ValueError`` naming the argument). Expert indices live
on the device:

* ``validate=True`` (the default) checks them with one small reduction and one host
  synchronisation before anything is sent and raises ``ValueError`` naming ``topk_idx``,
  the first bad ``[t, k]`` and its value. It cannot run under CUDA graph capture (a
  ``RuntimeError`` says so).
* ``validate=False`` is the synchronisation-free, capturable path: the plan treats an
  index outside ``[-1, num_experts)`` like ``-1`` (the slot is not sent and gets weight 0 in
  the combine; the call completes on every rank) and records the count, the first bad flat
  index and its value in ``moe.status``; :meth:`MoEDispatcher.check_index_errors` reads it
  and raises the same ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from tilescale_examples.base import (SymmetricCollective, accepts_0_1_init, check_aligned, check_bool,
                                     check_positive_int, check_tensor, warn_old_spelling)
from tilescale_examples.moe.kernels import (DISPATCH_PHASES, MAX_EXPERTS, PLAN_THREADS, build_combine_kernel,
                                            build_dispatch_kernel)
from tilescale_examples.moe.reference import (COMBINE_ATOL, COMBINE_RTOL, expected_routes, torch_combine_reference,
                                              torch_dispatch_reference)

__all__ = ["MoEDispatcher", "DispatchHandle", "expected_routes", "torch_dispatch_reference",
           "torch_combine_reference", "COMBINE_RTOL", "COMBINE_ATOL", "MAX_TOPK", "MAX_TOKENS", "heap_bytes"]

#: Largest top-k and tokens per rank the dispatcher accepts.
MAX_TOPK = 8
MAX_TOKENS = 4096
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_INDEX_DTYPES = {torch.int64: "int64", torch.int32: "int32"}


# ------------------------------------------------------------------------------ the object
@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What ``combine`` needs from a ``dispatch``, plus views of its results.

    Attributes: ``epoch`` (the dispatch's call number on the host), ``num_tokens`` (rows of
    ``x``), ``counts`` (``(EL,)`` int32, device), ``recv_offsets`` (``(EL + 1,)`` int32,
    device: expert ``j``'s rows are ``recv_offsets[j] .. recv_offsets[j + 1]``), ``dest_rank``
    and ``dest_row`` (``(num_tokens, topk)`` int32, device: where each entry went, ``-1`` if
    skipped). They are overwritten by the next dispatch, which also invalidates the handle.
    """

    dispatcher: "MoEDispatcher"
    epoch: int
    num_tokens: int
    counts: torch.Tensor
    recv_offsets: torch.Tensor
    dest_rank: torch.Tensor
    dest_row: torch.Tensor

    @classmethod
    def _made(cls, dispatcher: "MoEDispatcher", epoch: int, num_tokens: int, views: tuple) -> "DispatchHandle":
        """The handle of a dispatch call, ``views`` its ``(counts, recv_offsets, dest_rank,
        dest_row, ...)``: the fields written into the new instance's ``__dict__`` (the frozen
        dataclass's ``__init__`` sets each through ``object.__setattr__``, about 1 us of host
        time per dispatch); the instance is the same as ``cls(...)``'s."""
        handle = object.__new__(cls)
        fields = handle.__dict__
        fields["dispatcher"], fields["epoch"], fields["num_tokens"] = dispatcher, epoch, num_tokens
        fields["counts"], fields["recv_offsets"], fields["dest_rank"], fields["dest_row"] = views[:4]
        return handle

    def origin(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(src_rank, src_entry)`` of every row of ``recv_x`` (device int32 tensors of
        ``capacity`` rows; meaningful below ``recv_offsets[EL]``): the row is entry
        ``src_entry = t * topk + k`` of rank ``src_rank``. Raises
        :class:`~tilescale_examples.base.ClosedError` once the dispatcher is closed."""
        self.dispatcher._check_open()
        packed = self.dispatcher.recv_src
        per_rank = self.dispatcher.max_tokens * self.dispatcher.topk
        return torch.div(packed, per_rank, rounding_mode="floor"), packed % per_rank


def heap_bytes(num_experts: int, hidden: int, topk: int, max_tokens: int, world_size: int,
               dtype: torch.dtype = torch.bfloat16) -> int:
    """Symmetric-heap bytes per rank of one :class:`MoEDispatcher` (0.1.0's argument order, kept
    for 0.1.x): :meth:`MoEDispatcher.heap_bytes`, a dry run of the constructor, which is exact
    (0.1.0 answered a formula with slack, a little more)."""
    return MoEDispatcher.heap_bytes(num_experts, hidden, topk, max_tokens, dtype, world_size=world_size)


def _heap_bytes_0_1(args: tuple, kwargs: dict, world_size: Optional[int]) -> Tuple[tuple, Optional[int]]:
    """``(args, world_size)`` of :meth:`MoEDispatcher.heap_bytes` in the contract's form for
    0.1.0's ``heap_bytes(num_experts, hidden, topk, max_tokens, world_size, dtype=torch.bfloat16)``
    (with a warning); other calls as they are."""
    if len(args) < 5 or isinstance(args[4], bool) or not isinstance(args[4], int) or world_size is not None:
        return args, world_size
    dtype = args[5] if len(args) > 5 else kwargs.pop("dtype", torch.bfloat16)
    warn_old_spelling("MoEDispatcher.heap_bytes(num_experts, hidden, topk, max_tokens, world_size, dtype)",
                      "MoEDispatcher.heap_bytes(num_experts, hidden, topk, max_tokens, dtype, *, world_size=...)")
    return (*args[:4], dtype, *args[6:]), args[4]


class MoEDispatcher(SymmetricCollective):
    """Expert-parallel token dispatch and weighted combine over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator (``tilelang.get_allocator(...,
            is_distributed=True, ...)``) with at least :meth:`heap_bytes` free; its
            ``num_ranks`` ranks take part, one GPU each or sharing GPUs.
        num_experts: experts in total (at most 256), a multiple of the world size.
        hidden: elements per token row, a multiple of 8 (16-byte rows).
        topk: experts per token (1 .. 8).
        max_tokens: most tokens (rows of ``x``) a rank passes to one ``dispatch`` (1 ..
            4096); sizes the receive buffer: ``world_size * max_tokens * topk`` rows.
        dtype: token dtype, ``torch.bfloat16`` or ``torch.float16`` (required; 0.1.0's default,
            bfloat16, still applies through 0.1.x with an ``OldSpellingWarning``).
        index_dtype: dtype of ``topk_idx``: ``torch.int64`` (default, what ``torch.topk``
            returns) or ``torch.int32``.
        world_size: defaults to ``allocator.num_ranks`` and must equal it.
        group: process group for the constructor's closing barrier; default
            ``torch.distributed``'s world group when initialised.
        threads: threads per block of the combine kernel (multiple of 32, at most 1024;
            default 1024: 64 registers each, twice the warps of 512 for large batches); the
            dispatch kernel runs :data:`~tilescale_examples.moe.kernels.PLAN_THREADS` (1024),
            since each of its warps ranks a batch of 32 entries (and block 0 plans).
        max_blocks: blocks of the dispatch and combine grids (all must be co-resident);
            default the device's SM count.
        validate: default of ``dispatch(..., validate=)`` (see the module docstring).
        target: TileLang target (default ``sm_90a``).

    Attributes: ``recv_x`` (symmetric ``(capacity, hidden)``), ``capacity``,
    ``experts_per_rank``, ``status`` (``(3,)`` int64 on the device: bad indices of the last
    dispatch, first bad flat index or -1, its value), ``dispatch_kernel``, ``combine_kernel``,
    ``epoch`` (dispatches so far), ``combines``.

    Construction is collective (same arguments on every rank, same order among the
    allocator's other symmetric allocations); so is every call: all ranks make the same
    sequence of ``dispatch`` and ``combine`` calls. The call contract of the other product
    classes (docs/architecture.md, "Call contract") holds where it applies: its calls are
    ``dispatch`` and ``combine`` (no ``__call__``, no ``algorithm``), each raising
    :class:`~tilescale_examples.base.ClosedError` after ``close()``, and :meth:`heap_bytes`
    is a dry run of the constructor.
    """

    #: Kept launches (:meth:`_relaunch`): the dispatch's (the default site) and the combine's.
    _RELAUNCH_SITES = ("_kept_launch", "_kept_combine")
    _kept_combine = None
    _BUFFERS = ("recv_x", "recv_src", "comb_buf", "count_matrix", "flags", "counters", "state",
                "packed", "base", "weights", "dest_rank", "dest_row", "recv_counts",
                "recv_offsets", "status", "output")

    @accepts_0_1_init(defaults={"dtype": torch.bfloat16})
    def __init__(self, allocator, num_experts: int, hidden: int, topk: int, max_tokens: int,
                 dtype: Union[torch.dtype, str], *, world_size: Optional[int] = None,
                 index_dtype: torch.dtype = torch.int64, group=None, threads: int = 1024,
                 max_blocks: Optional[int] = None, validate: bool = True, target=None):
        self.num_experts = check_positive_int("num_experts", num_experts, upper=MAX_EXPERTS)
        self.hidden = check_positive_int("hidden", hidden)
        if self.hidden % 8:
            raise ValueError(f"hidden must be a multiple of 8 (16-byte rows), got {hidden}")
        self.topk = check_positive_int("topk", topk, upper=MAX_TOPK)
        self.max_tokens = check_positive_int("max_tokens", max_tokens, upper=MAX_TOKENS)
        if index_dtype not in _INDEX_DTYPES:
            raise TypeError(f"index_dtype must be torch.int64 or torch.int32, got {index_dtype!r}")
        check_bool("validate", validate)
        self._setup(allocator, (self.hidden,), dtype, world_size, group, threads, max_blocks, _DTYPES, target=target)
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, got {self.max_blocks!r}")
        W, E, K, H = self.world_size, self.num_experts, self.topk, self.hidden
        if E % W:
            raise ValueError(f"num_experts={E} must be a multiple of world_size={W} (experts are split evenly)")
        self.index_dtype = index_dtype
        self.validate = validate
        self.experts_per_rank = E // W
        self.capacity = W * self.max_tokens * K
        self.blocks = self.max_blocks
        self.combines = 0
        TK = self.max_tokens * K

        # ---- symmetric buffers (same order on every rank)
        self.recv_x = self._tensor((self.capacity, H))
        self.recv_src = self._tensor((self.capacity,), torch.int32)
        self.comb_buf = self._tensor((TK, H))
        self.count_matrix = self._tensor((2, W, E), torch.int32)
        self.flags = self._tensor((2, W), torch.uint64)
        self.counters = self._tensor((4,), torch.uint32)  # the kernels' Ctr words (docs/moe.md)
        for t in (self.count_matrix, self.flags, self.counters):
            t.zero_()
        # ---- local state
        dev = self.device
        # call numbers (the kernels' State, docs/moe.md), block b's copies: [0, b] dispatch calls; [1, b]
        # combine calls and [2, b] the dispatch call the latest combine followed
        self.state = torch.zeros((3, self.blocks), dtype=torch.int64, device=dev)
        self.packed = torch.zeros((TK,), dtype=torch.int32, device=dev)
        self.base = torch.zeros((self.blocks, E + 3), dtype=torch.int32, device=dev)  # the plan's per-block table
        self.weights = torch.zeros((TK,), dtype=torch.float32, device=dev)
        self.dest_rank = torch.full((TK,), -1, dtype=torch.int32, device=dev)
        self.dest_row = torch.full((TK,), -1, dtype=torch.int32, device=dev)
        self.recv_counts = torch.zeros((E,), dtype=torch.int32, device=dev)
        self.recv_offsets = torch.zeros((E + 1,), dtype=torch.int32, device=dev)
        self.status = torch.zeros((3,), dtype=torch.int64, device=dev)
        self.output = torch.empty((self.max_tokens, H), dtype=self.dtype, device=dev)

        self._views = {}  # token count -> views of the routing buffers and the output (_views_of)

        # ---- two rank-agnostic kernels (one binary for every world size), compiled once per host
        # (traced only when compiled: a dry run, heap_bytes, builds neither)
        name = _DTYPES[self.dtype]
        config = (E, K, H, self.max_tokens, name, self.blocks)
        self.combine_kernel = self._compile(lambda: build_combine_kernel(*config, threads), target)
        self._dispatch_config = (E, K, H, self.max_tokens, name, _INDEX_DTYPES[index_dtype], self.blocks, PLAN_THREADS)
        self._target = target
        self._profiled_kernel = None  # dispatch_profiled's, compiled at its first call
        self._finish_build(lambda: build_dispatch_kernel(*self._dispatch_config), target)
        self.dispatch_kernel = self.kernel

    def _compile(self, build, target):
        """Compile ``build()`` once per host and give it the allocator's table."""
        kernel = self._compile_kernel(build, target)
        self.bind_table(force=True, kernel=kernel)
        return kernel

    @classmethod
    def heap_bytes(cls, *args, world_size: Optional[int] = None, device=None, **kwargs) -> int:
        """Symmetric-heap bytes per rank of ``MoEDispatcher(allocator, *args,
        world_size=world_size, **kwargs)``: ``heap_bytes(num_experts, hidden, topk, max_tokens,
        dtype, *, world_size, device=None, **options)``, a dry run of the constructor
        (:meth:`SymmetricOp.heap_bytes <tilescale_examples.base.SymmetricOp.heap_bytes>`; the
        heap does not depend on ``device``). 0.1.0's ``heap_bytes(num_experts, hidden, topk,
        max_tokens, world_size, dtype=torch.bfloat16)`` works through 0.1.x with an
        ``OldSpellingWarning`` (and the module's :func:`heap_bytes` keeps that order)."""
        args, world_size = _heap_bytes_0_1(args, kwargs, world_size)
        if world_size is None:
            raise TypeError("MoEDispatcher.heap_bytes() needs world_size= (keyword-only)")
        return super().heap_bytes(*args, world_size=world_size, device=device, **kwargs)

    # ------------------------------------------------------------------ checks
    def _check_tokens(self, x, topk_idx, topk_weights) -> int:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected (tokens, hidden={self.hidden})")
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"x has {T} tokens, more than max_tokens={self.max_tokens} this "
                             "MoEDispatcher's receive buffer was sized for")
        check_tensor(x, (T, self.hidden), self.dtype, self.device, "x", "(tokens, hidden) =", "MoEDispatcher")
        check_tensor(topk_idx, (T, self.topk), self.index_dtype, self.device, "topk_idx",
                     "(tokens, topk) =", "MoEDispatcher")
        check_tensor(topk_weights, (T, self.topk), torch.float32, self.device, "topk_weights",
                     "(tokens, topk) =", "MoEDispatcher")
        return T

    def _validate_indices(self, topk_idx: torch.Tensor) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("dispatch(validate=True) synchronises with the host to check topk_idx and "
                               "cannot be captured in a CUDA graph: pass validate=False (bad indices are "
                               "then skipped on the device and reported by check_index_errors())")
        bad = (topk_idx < -1) | (topk_idx >= self.num_experts)
        if bool(bad.any()):
            t, k = (int(v) for v in bad.nonzero()[0])
            raise ValueError(self._index_message(int(bad.sum()), t * self.topk + k, int(topk_idx[t, k]))
                             + "; nothing was sent")

    def _index_message(self, count: int, first: int, value: int) -> str:
        t, k = divmod(first, self.topk)
        return (f"topk_idx[{t}, {k}] = {value} is out of range: expert indices must be in "
                f"[0, {self.num_experts}) or -1 for an unused slot ({count} bad entr"
                f"{'y' if count == 1 else 'ies'})")

    def check_index_errors(self) -> None:
        """Raise ``ValueError`` naming ``topk_idx`` if the last dispatch skipped out-of-range
        expert indices (``validate=False``); synchronises with the device. Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``."""
        self._check_open()
        count, first, value = (int(v) for v in self.status.tolist())
        if count:
            raise ValueError(self._index_message(count, first, value) + "; the dispatch skipped them")

    # ------------------------------------------------------------------ calls
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                 validate: Optional[bool] = None):
        """Send every token to the owners of its ``topk`` experts.

        Args:
            x: ``(T, hidden)`` tokens of this rank, ``T <= max_tokens`` (0 allowed), the
                dispatcher's dtype, contiguous, on the allocator's device.
            topk_idx: ``(T, topk)`` expert indices (``index_dtype``); ``-1`` skips a slot.
            topk_weights: ``(T, topk)`` float32 weights, used by ``combine`` (copied).
            validate: check ``topk_idx`` on the host first (default: the constructor's).

        Returns ``(recv_x, counts, handle)``: the symmetric ``(capacity, hidden)`` receive
        buffer in the documented layout, the ``(EL,)`` int32 device tensor of rows per local
        expert, and the :class:`DispatchHandle` for ``combine``. All are overwritten by the
        next dispatch and complete when the kernels finish on the current stream. A call
        without the host check, on tensors laid out as the last two such calls' (a loop over
        the same buffers), launches the kept launch again (docs/launch.md, "Repeated calls").
        """
        if not (self.validate if validate is None else validate) and self._relaunch(x, topk_idx, topk_weights):
            return self._dispatched(x.shape[0])  # laid out as the last such call's: launched as it was
        return self._dispatch(lambda: (self.dispatch_kernel, ()), x, topk_idx, topk_weights, validate)

    def dispatch_profiled(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                          profiler, *, validate: Optional[bool] = None):
        """:meth:`dispatch` (same arguments, results and collective rules: it counts as a
        dispatch call on every rank) run by the same kernel built with phase timestamps:
        thread 0 of every block records the end of each of
        :data:`~tilescale_examples.moe.kernels.DISPATCH_PHASES` into ``profiler`` (a
        :class:`tilescale_lang.profiler.EventProfiler` with at least ``max_blocks`` rows and a
        capacity of ``len(DISPATCH_PHASES)``; event task and slot ``p`` is phase ``p``,
        nanoseconds of ``%globaltimer``; a later call overwrites them). The profiled kernel is
        compiled at the first call, after every argument has been checked."""
        return self._dispatch(lambda: self._profiled_launch(profiler), x, topk_idx, topk_weights, validate)

    def _profiled_launch(self, profiler) -> tuple:
        """``(kernel, extra arguments)`` of :meth:`dispatch_profiled`: checks ``profiler`` and
        compiles the profiled kernel at the first call."""
        buf = getattr(profiler, "buffer", None)
        want = (self.blocks, 1 + 2 * len(DISPATCH_PHASES))
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint64 or buf.device != self.device:
            raise TypeError("profiler must be an EventProfiler whose buffer is on the dispatcher's device")
        if tuple(buf.shape[1:]) != want[1:] or buf.shape[0] < self.blocks or not buf.is_contiguous():
            raise ValueError(f"profiler must have at least {self.blocks} blocks and capacity "
                             f"{len(DISPATCH_PHASES)} (buffer shape {want}), got {tuple(buf.shape)}")
        if self._profiled_kernel is None:
            self._profiled_kernel = self._compile(lambda: build_dispatch_kernel(*self._dispatch_config, profile=True),
                                                  self._target)
        return self._profiled_kernel, (buf[:self.blocks],)

    def _dispatch(self, launch, x, topk_idx, topk_weights, validate):
        """Check the call's arguments, then run ``launch()``'s ``(kernel, extra arguments)``."""
        self._check_open()
        T = self._check_tokens(x, topk_idx, topk_weights)
        validated = self.validate if validate is None else validate
        if validated:
            self._validate_indices(topk_idx)
        kernel, extra = launch()
        self.epoch += 1
        self.bind_table(kernel=kernel)
        args = (topk_idx, topk_weights, x, self.packed, self.base, self.weights, self.count_matrix, self.flags,
                self.recv_x, self.recv_src, self.dest_rank, self.dest_row, self.recv_counts, self.recv_offsets,
                self.status, self.counters, self.state, *extra)
        changing = (0, 1, 2) + tuple(range(17, 17 + len(extra)))
        self._launch_kernel(args, changing, kernel=kernel)
        # a plain dispatch without the host's check may be launched again (dispatch(): _relaunch)
        self._keep_launch(not validated and not extra, (x, topk_idx, topk_weights), args, changing,
                          views=((0, 1), (1, 2), (2, 0)), kernel=kernel)
        return self._dispatched(T)

    def _dispatched(self, tokens: int):
        """``dispatch()``'s result for the call just launched with ``tokens`` tokens."""
        handle = DispatchHandle._made(self, self.epoch, tokens, self._views_of(tokens))
        return self.recv_x, handle.counts, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return every expert output to its token's rank and sum it with the token's weights.

        Args:
            y: ``(capacity, hidden)`` expert outputs in ``recv_x``'s layout (only the received
                rows are read; ``y`` may be ``recv_x`` itself), the dispatcher's dtype,
                contiguous, 16-byte aligned, on the allocator's device.
            handle: the handle of this dispatcher's latest ``dispatch``.

        Returns ``(T, hidden)`` in the dispatcher's dtype: ``out[t] = sum_k topk_weights[t, k]
        * y_of(t, k)`` in float32, slot order, rounded once (zero rows for tokens without a
        valid expert). The buffer is reused by the next combine.
        """
        self._check_open()
        if not isinstance(handle, DispatchHandle) or handle.dispatcher is not self:
            raise TypeError("handle must be a DispatchHandle returned by this MoEDispatcher's dispatch()")
        if handle.epoch != self.epoch:
            raise RuntimeError(f"handle is from dispatch call {handle.epoch}, but dispatch call {self.epoch} "
                               "has overwritten its routing: combine before the next dispatch")
        out = self._views_of(handle.num_tokens)[4]
        if self._relaunch(y, out, site="_kept_combine"):  # y and the token count as the last such call's
            self.combines += 1
            return out
        check_tensor(y, (self.capacity, self.hidden), self.dtype, self.device, "y",
                     "(capacity, hidden) =", "MoEDispatcher")
        check_aligned(y, "y", "the combine reads 16-byte vectors")
        self.combines += 1
        self.bind_table(kernel=self.combine_kernel)
        args = (y, out, self.comb_buf, self.recv_src, self.recv_offsets, self.dest_rank, self.dest_row, self.weights,
                self.flags, self.counters, self.state)
        self._launch_kernel(args, (0, 1), kernel=self.combine_kernel)
        self._keep_launch(True, (y, out), args, (0, 1), views=((0, 0),), site="_kept_combine",
                          kernel=self.combine_kernel)
        return out

    def _views_of(self, tokens: int) -> tuple:
        """``(counts, recv_offsets, dest_rank, dest_row, output)`` views for ``tokens`` rows,
        built once per token count (each slice costs microseconds of host time per call)."""
        views = self._views.get(tokens)
        if views is None:
            EL, K, T = self.experts_per_rank, self.topk, tokens
            views = self._views[T] = (self.recv_counts[:EL], self.recv_offsets[:EL + 1],
                                      self.dest_rank[:T * K].view(T, K), self.dest_row[:T * K].view(T, K),
                                      self.output[:T])
        return views

    def bus_bytes(self) -> float:
        """Bytes of token rows one full dispatch (or combine) moves per rank:
        ``max_tokens * topk * hidden * itemsize``."""
        return float(self.max_tokens * self.topk * self.hidden * self.itemsize)

    def close(self) -> None:
        """Drop the kernels and the tensors (idempotent); heap bytes return with
        ``allocator.close()``."""
        super().close()
        self.dispatch_kernel = self.combine_kernel = self._profiled_kernel = None
        self._views = {}

    def __repr__(self) -> str:
        return (f"MoEDispatcher(num_experts={self.num_experts}, hidden={self.hidden}, topk={self.topk}, "
                f"max_tokens={self.max_tokens}, dtype={self.dtype}, world_size={self.world_size}, "
                f"capacity={self.capacity}, blocks={self.blocks}, threads={self.threads}, "
                f"epoch={self.epoch}{', closed' if self._closed else ''})")
