"""Low-latency MoE dispatch and combine for decode (DeepEP's low-latency mode): an expert-major
masked receive layout, FP8 dispatch, a send/receive split, CUDA-graph safe.

::

    ll = MoELowLatency(allocator, num_experts=64, hidden=7168, topk=8, max_tokens=128, dtype=torch.bfloat16)
    recv_x, recv_counts, handle = ll.dispatch(x, topk_idx)             # collective
    y = experts(recv_x, recv_counts)                                   # (EL, W * max_tokens, hidden)
    out = ll.combine(y, handle, topk_weights)                          # (T, hidden)

    # overlap: issue the sends, compute, then receive
    recv_x, recv_counts, handle, hook = ll.dispatch(x, topk_idx, return_recv_hook=True)
    ...                                                                # other work on the stream
    hook()                                                             # the receive wait

**Receive layout** (masked; bit-exact against
:func:`~tilescale_examples.moe.ll_reference.ll_dispatch_reference`).

``recv_x`` is ``(EL, W * max_tokens, hidden)`` (``EL = num_experts / W`` local experts): local
expert ``j``'s rows from source rank ``s`` are ``recv_x[j, s * max_tokens:][:recv_counts[j, s]]``,
in that rank's token order (entry ``t * topk + k``); the other rows of a segment are stale.
``recv_counts`` is ``(EL, W)`` int32 on the device; :meth:`LowLatencyHandle.origin` gives each
row's source ``(rank, token, slot)``. With ``fp8=True`` ``recv_x`` is the pair ``(rows, scales)``:
``float8_e4m3fn`` rows and ``(EL, W * max_tokens, hidden / 128)`` float32 scales (``scale = amax /
448`` per 128 channels, DeepSeek-V3), quantised inside the dispatch kernel. The combine takes
``y`` in the dispatch dtype in the same layout and returns ``out[t] = sum_k w[t, k] * y(t, k)``
(float32, slot order, rounded once; zero rows for tokens without a valid expert).

How it runs (each kernel step by step, and why back-to-back calls need no host barrier:
"Low-latency mode" in ``docs/moe.md``): each rank ranks its own entries per expert and owns one
segment of every expert on its owner, so its rows move at once, no entry waiting for another
rank's count; the call's last block signals each (expert, source) segment with ``epoch << 32 |
count`` (a release) and the receiver waits for its ``E`` segment words. Call numbers live on the
device (``state``), so the calls can be captured in a CUDA graph and replayed.

Rules: every rank makes the same sequence of calls; the hook of a dispatch is called before the
next ``dispatch`` or ``combine``; a handle is combined at most once, before the next dispatch;
work that reads ``recv_x`` / ``recv_counts`` is ordered before the next call on this rank's stream.
Bad expert indices: as :class:`~tilescale_examples.moe.dispatcher.MoEDispatcher` (skipped on the
device and reported by :meth:`MoELowLatency.check_index_errors`; ``validate=True`` checks on the
host first, with a synchronisation).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

from tilescale_examples.base import SymmetricCollective, check_aligned, check_bool, check_positive_int, check_tensor
from tilescale_examples.moe.dispatcher import MAX_TOPK, MoEDispatcher
from tilescale_examples.moe.ll_combine import build_ll_combine_kernel
from tilescale_examples.moe.ll_dispatch import (LL_MAX_TOKENS, LL_THREADS, build_ll_dispatch_kernel,
                                                build_ll_recv_kernel, check_ll_sizes)
from tilescale_examples.moe.ll_reference import FP8_BLOCK, FP8_TORCH_DTYPE

__all__ = ["MoELowLatency", "LowLatencyHandle"]

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_INDEX_DTYPES = {torch.int64: "int64", torch.int32: "int32"}


@dataclass(eq=False)
class LowLatencyHandle:
    """What ``combine`` needs from a low-latency ``dispatch``.

    Attributes: ``epoch`` (the dispatch's call number on the host), ``num_tokens``,
    ``recv_counts`` (``(EL, W)`` int32, device), ``dest_rank`` / ``dest_row`` (``(num_tokens,
    topk)`` int32, device: each entry's owner and its flat row ``(j * W + s) * max_tokens + r``
    there, ``-1`` if skipped), ``topk_weights`` (the dispatch's, or None). Overwritten by the
    next dispatch, which also invalidates the handle."""

    moe: "MoELowLatency"
    epoch: int
    num_tokens: int
    recv_counts: torch.Tensor
    dest_rank: torch.Tensor
    dest_row: torch.Tensor
    topk_weights: Optional[torch.Tensor] = None
    received: bool = True
    combined: bool = field(default=False)

    def origin(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src_rank, src_token, src_slot)`` of every row of ``recv_x``: three ``(EL, W *
        max_tokens)`` int64 device tensors, meaningful below each segment's count. Raises
        :class:`~tilescale_examples.base.ClosedError` once the op is closed."""
        moe = self.moe
        moe._check_open()
        EL, W, TMAX = moe.experts_per_rank, moe.world_size, moe.max_tokens
        entry = moe.recv_src.view(EL, W * TMAX).long()
        rank = torch.arange(W, device=entry.device).repeat_interleave(TMAX).expand(EL, W * TMAX)
        return rank, torch.div(entry, moe.topk, rounding_mode="floor"), entry % moe.topk


class MoELowLatency(SymmetricCollective):
    """Expert-parallel low-latency dispatch and combine (the decode path; DeepEP's
    ``low_latency_dispatch`` / ``low_latency_combine``).

    Args:
        allocator: an open tilescale-core allocator with at least :meth:`heap_bytes` free.
        num_experts: experts in total (at most 256), a multiple of the world size.
        hidden: elements per token row, a multiple of 8 (of 128 with ``fp8``).
        topk: experts per token (1 .. 8).
        max_tokens: most tokens a rank passes to one ``dispatch`` (1 .. 1024; the kernels'
            shared memory also bounds ``max_tokens * topk``): each (expert, source) segment
            has ``max_tokens`` rows.
        dtype: token dtype, ``torch.bfloat16`` or ``torch.float16`` (required).
        world_size: defaults to ``allocator.num_ranks`` and must equal it.
        fp8: deliver e4m3 rows with float32 scales per 128 channels (quantised in the kernel).
        index_dtype: dtype of ``topk_idx``: ``torch.int64`` (default) or ``torch.int32``.
        group: process group of the constructor's closing barrier.
        threads: threads per block of the dispatch and combine (default 1024).
        max_blocks: blocks of their grids (all co-resident); default the SM count.
        validate: default of ``dispatch(..., validate=)``: check ``topk_idx`` on the host
            (a synchronisation; default False, the capturable path).
        target: TileLang target (default ``sm_90a``).

    Attributes: ``recv_x`` (``(EL, W * max_tokens, hidden)``), ``recv_scales`` (FP8),
    ``recv_counts`` (``(EL, W)`` int32), ``experts_per_rank``, ``status`` (bad indices of the
    last dispatch, as ``MoEDispatcher.status``), ``state`` (the call numbers), ``epoch``,
    ``combines``. The call contract (docs/architecture.md) holds as for ``MoEDispatcher``.
    """

    _BUFFERS = ("recv_x_buf", "recv_scales_buf", "recv_src", "comb_buf", "signals", "flags", "state", "arrive",
                "recv_counts_buf", "route_rank", "route_row", "status", "output")

    def __init__(self, allocator, num_experts: int, hidden: int, topk: int, max_tokens: int,
                 dtype: Union[torch.dtype, str], *, world_size: Optional[int] = None, fp8: bool = False,
                 index_dtype: torch.dtype = torch.int64, group=None, threads: int = LL_THREADS,
                 max_blocks: Optional[int] = None, validate: bool = False, target=None):
        from tilescale_examples.moe.dispatcher import MAX_EXPERTS

        E = self.num_experts = check_positive_int("num_experts", num_experts, upper=MAX_EXPERTS)
        H = self.hidden = check_positive_int("hidden", hidden)
        K = self.topk = check_positive_int("topk", topk, upper=MAX_TOPK)
        TMAX = self.max_tokens = check_positive_int("max_tokens", max_tokens, upper=LL_MAX_TOKENS)
        for name, flag in (("fp8", fp8), ("validate", validate)):
            check_bool(name, flag)
        if index_dtype not in _INDEX_DTYPES:
            raise TypeError(f"index_dtype must be torch.int64 or torch.int32, got {index_dtype!r}")
        if fp8 and FP8_TORCH_DTYPE is None:
            raise TypeError("fp8=True needs torch.float8_e4m3fn (torch >= 2.1)")
        self._setup(allocator, (H,), dtype, world_size, group, threads, max_blocks, _DTYPES, target=target)
        W = self.world_size
        if E % W:
            raise ValueError(f"num_experts={E} must be a multiple of world_size={W} (experts are split evenly)")
        check_ll_sizes(E, K, H, TMAX, threads, fp8)
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, got {self.max_blocks!r}")
        self.fp8, self.index_dtype, self.validate = fp8, index_dtype, validate
        self.experts_per_rank, self.blocks, self.combines = E // W, self.max_blocks, 0
        ROWS, TK = E * TMAX, TMAX * K
        # ---- symmetric buffers (same order on every rank)
        self.recv_x_buf = self._tensor((ROWS, H), torch.uint8 if fp8 else None)
        self.recv_scales_buf = self._tensor((ROWS, H // FP8_BLOCK), torch.float32) if fp8 else None
        self.recv_src = self._tensor((ROWS,), torch.int32)
        self.comb_buf = self._tensor((TK, H))
        self.signals = self._tensor((E,), torch.uint64)  # per (local expert, source): epoch << 32 | count
        self.flags = self._tensor((3, W), torch.uint64)  # dispatch ready, combine ready, combine rows sent
        for t in (self.signals, self.flags):
            t.zero_()
        # ---- local state: call numbers per block ([0] dispatch, [1] combine, [2] the dispatch the
        # latest combine followed), the grid's arrival counters, the routes
        dev = self.device
        self.state = torch.zeros((3, self.blocks), dtype=torch.int64, device=dev)
        self.arrive = torch.zeros((2,), dtype=torch.uint32, device=dev)
        self.recv_counts_buf = torch.zeros((E,), dtype=torch.int32, device=dev)
        self.route_rank = torch.full((TK,), -1, dtype=torch.int32, device=dev)
        self.route_row = torch.full((TK,), -1, dtype=torch.int32, device=dev)
        self.status = torch.zeros((3,), dtype=torch.int64, device=dev)
        self.output = torch.empty((TMAX, H), dtype=self.dtype, device=dev)
        self._pending = None  # the handle whose receive hook has not run
        self._last = None  # the latest dispatch's handle
        self._config = (E, K, H, TMAX, _DTYPES[self.dtype], _INDEX_DTYPES[index_dtype], self.blocks, threads, fp8)
        self._target, self._hook_kernels = target, None  # (send, recv), compiled at the first hook call
        self.combine_kernel = self._compile(
            lambda: build_ll_combine_kernel(E, K, H, TMAX, _DTYPES[self.dtype], self.blocks, threads), target)
        self._finish_build(lambda: build_ll_dispatch_kernel(*self._config), target)
        self.dispatch_kernel = self.kernel

    _compile = MoEDispatcher._compile
    _validate_indices = MoEDispatcher._validate_indices
    _index_message = MoEDispatcher._index_message
    check_index_errors = MoEDispatcher.check_index_errors

    @property
    def recv_x(self):
        """The receive buffer, ``(EL, W * max_tokens, hidden)`` (``float8_e4m3fn`` with ``fp8``)."""
        if self.recv_x_buf is None:
            return None
        rows = self.recv_x_buf.view(FP8_TORCH_DTYPE) if self.fp8 else self.recv_x_buf
        return rows.view(self.experts_per_rank, -1, self.hidden)

    @property
    def recv_scales(self):
        """FP8: the scales, ``(EL, W * max_tokens, hidden / 128)`` float32; None otherwise."""
        buf = self.recv_scales_buf
        return None if buf is None else buf.view(self.experts_per_rank, -1, buf.shape[1])

    @property
    def recv_counts(self):
        """Rows per (local expert, source rank): ``(EL, W)`` int32 on the device."""
        return None if self.recv_counts_buf is None else self.recv_counts_buf.view(self.experts_per_rank, -1)

    # ------------------------------------------------------------------ calls
    def _check_dispatch(self, x, topk_idx, topk_weights) -> int:
        """Argument checks of :meth:`dispatch` (``TypeError`` / ``ValueError`` naming the
        argument); the token count."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            what = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise (ValueError if isinstance(x, torch.Tensor) else TypeError)(
                f"x must be a (tokens, hidden={self.hidden}) tensor, got {what}")
        tokens = x.shape[0]
        if tokens > self.max_tokens:
            raise ValueError(f"x has {tokens} tokens, more than max_tokens={self.max_tokens}")
        owner, shape = "MoELowLatency", (tokens, self.topk)
        check_tensor(x, (tokens, self.hidden), self.dtype, self.device, "x", "(tokens, hidden) =", owner)
        check_tensor(topk_idx, shape, self.index_dtype, self.device, "topk_idx", "(tokens, topk) =", owner)
        if topk_weights is not None:
            check_tensor(topk_weights, shape, torch.float32, self.device, "topk_weights", "(tokens, topk) =", owner)
        return tokens

    def _no_pending_hook(self, call: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{call}: call the receive hook of the previous dispatch first")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, *,
                 return_recv_hook: bool = False, validate: Optional[bool] = None):
        """Send every token to the owners of its ``topk`` experts (collective).

        Args:
            x: ``(T, hidden)`` tokens, ``T <= max_tokens`` (0 allowed), the op's dtype.
            topk_idx: ``(T, topk)`` expert indices (``index_dtype``); ``-1`` skips a slot.
            topk_weights: optional ``(T, topk)`` float32, kept for ``combine``.
            return_recv_hook: launch only the sends and return a hook that runs the receive
                wait (call it before the next call of this op).
            validate: check ``topk_idx`` on the host first (default: the constructor's).

        Returns ``(recv_x, recv_counts, handle)`` (``recv_x`` is ``(rows, scales)`` with FP8),
        plus ``hook`` with ``return_recv_hook``: ``recv_x`` ``(EL, W * max_tokens, hidden)`` in
        the masked layout, ``recv_counts`` ``(EL, W)`` int32; complete on the current stream
        when the kernel (or the hook) has run.
        """
        self._check_open()
        self._no_pending_hook("dispatch")
        tokens = self._check_dispatch(x, topk_idx, topk_weights)
        check_bool("return_recv_hook", return_recv_hook)
        if self.validate if validate is None else validate:
            self._validate_indices(topk_idx)
        kernel = self._send_kernels()[0] if return_recv_hook else self.dispatch_kernel
        self.epoch += 1
        self.bind_table(kernel=kernel)
        scales = (self.recv_scales_buf,) if self.fp8 else ()
        self._launch_kernel((topk_idx, x, self.recv_x_buf.view(FP8_TORCH_DTYPE) if self.fp8 else self.recv_x_buf,
                             *scales, self.recv_src, self.signals, self.flags, self.route_rank, self.route_row,
                             self.recv_counts_buf, self.status, self.arrive, self.state), changing=(0, 1), kernel=kernel)
        TK = tokens * self.topk
        handle = self._last = LowLatencyHandle(self, self.epoch, tokens, self.recv_counts,
                                               self.route_rank[:TK].view(tokens, self.topk),
                                               self.route_row[:TK].view(tokens, self.topk), topk_weights,
                                               received=not return_recv_hook)
        recv = (self.recv_x, self.recv_scales) if self.fp8 else self.recv_x
        if not return_recv_hook:
            return recv, self.recv_counts, handle
        self._pending = handle
        return recv, self.recv_counts, handle, functools.partial(self._receive, handle)

    def _send_kernels(self) -> tuple:
        """``(send, recv)`` kernels of ``return_recv_hook=True``, compiled at the first use."""
        if self._hook_kernels is None:
            send = self._compile(lambda: build_ll_dispatch_kernel(*self._config, phase="send"), self._target)
            recv = self._compile(lambda: build_ll_recv_kernel(self.num_experts, self.blocks), self._target)
            self._hook_kernels = (send, recv)
        return self._hook_kernels

    def _receive(self, handle: LowLatencyHandle) -> None:
        """The receive hook of ``handle``'s dispatch: waits (on the device, on the current
        stream) for this rank's ``E`` segment words and writes ``recv_counts``."""
        self._check_open()
        if handle is not self._pending:
            raise RuntimeError("this receive hook has already run (or belongs to an older dispatch)")
        recv = self._send_kernels()[1]
        self.bind_table(kernel=recv)
        self._launch_kernel((self.signals, self.recv_counts_buf, self.state), changing=(), kernel=recv)
        self._pending, handle.received = None, True

    def combine(self, y: torch.Tensor, handle: LowLatencyHandle, topk_weights: Optional[torch.Tensor] = None):
        """Return every expert output row to its token's rank and sum with the weights
        (collective).

        Args:
            y: ``(EL, W * max_tokens, hidden)`` expert outputs in ``recv_x``'s layout (only
                rows below the counts are read; ``y`` may be ``recv_x`` without FP8), the op's
                dtype, contiguous, 16-byte aligned.
            handle: the handle of this op's latest dispatch, not combined before.
            topk_weights: ``(T, topk)`` float32 (default: the dispatch's).

        Returns ``(T, hidden)`` in the op's dtype (reused by the next combine): ``out[t] =
        sum_k w[t, k] * y(t, k)`` in float32, slot order, rounded once.
        """
        self._check_open()
        if not isinstance(handle, LowLatencyHandle) or handle.moe is not self:
            raise TypeError("handle must be a LowLatencyHandle returned by this MoELowLatency's dispatch()")
        self._no_pending_hook("combine")
        if handle is not self._last or handle.combined:
            raise RuntimeError(f"handle is from dispatch call {handle.epoch} (latest {self.epoch}) or already "
                               "combined: combine each dispatch once, before the next dispatch")
        weights = handle.topk_weights if topk_weights is None else topk_weights
        if weights is None:
            raise TypeError("combine needs topk_weights (none were given to dispatch)")
        shape = (self.experts_per_rank, self.world_size * self.max_tokens, self.hidden)
        check_tensor(y, shape, self.dtype, self.device, "y", "(EL, W * max_tokens, hidden) =", "MoELowLatency")
        check_tensor(weights, (handle.num_tokens, self.topk), torch.float32, self.device, "topk_weights",
                     "(tokens, topk) =", "MoELowLatency")
        check_aligned(y, "y", "the combine reads 16-byte vectors")
        out = self.output[:handle.num_tokens]
        self.combines += 1
        handle.combined = True
        self.bind_table(kernel=self.combine_kernel)
        self._launch_kernel((y.view(-1, self.hidden), out, weights.view(-1), self.comb_buf, self.recv_src,
                             self.recv_counts_buf, self.route_rank, self.route_row, self.flags, self.arrive, self.state),
                            changing=(0, 1, 2), kernel=self.combine_kernel)
        return out

    def bus_bytes(self) -> float:
        """Token bytes one full dispatch moves per rank: ``max_tokens * topk * hidden *
        itemsize`` (one byte per element and the scales with FP8)."""
        per_row = self.hidden + 4 * (self.hidden // FP8_BLOCK) if self.fp8 else self.hidden * self.itemsize
        return float(self.max_tokens * self.topk * per_row)

    def close(self) -> None:
        """Drop the kernels and the tensors (idempotent); heap bytes return with
        ``allocator.close()``."""
        super().close()
        self.dispatch_kernel = self.combine_kernel = self._hook_kernels = self._pending = self._last = None

    def __repr__(self) -> str:
        return (f"MoELowLatency(num_experts={self.num_experts}, hidden={self.hidden}, topk={self.topk}, "
                f"max_tokens={self.max_tokens}, dtype={self.dtype}, world_size={self.world_size}, fp8={self.fp8}, "
                f"blocks={self.blocks}, epoch={self.epoch}{', closed' if self._closed else ''})")
