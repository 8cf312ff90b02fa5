"""All-reduce fused with the residual add, RMSNorm and optional FP8 quantisation: the step
between a row-parallel layer and the next layer's GEMM at decode, in one kernel per call::

    norm = AllReduceResidualRMSNorm(allocator, (tokens, hidden), torch.bfloat16, eps=1e-6)  # collective
    y, residual = norm(x, residual, weight)                 # every rank: x its partial sum
    y, residual = norm(x, residual, weight, residual_out=residual)   # the residual in place
    q = AllReduceResidualRMSNorm(allocator, (tokens, hidden), torch.bfloat16, fp8="per_block")
    y_fp8, scales, residual = q(x, residual, weight)        # y ~= y_fp8.float() * scales (per 128 channels)
    norm.close()                                            # before allocator.close()

What a call computes on every rank (``x``, ``residual``: ``(tokens, hidden)``; ``weight``:
``(hidden,)``; float16 or bfloat16; all float32 arithmetic):

* ``h = ((x_0 + x_1 + ... + x_{W-1}) + residual)``, added in rank order in float32 and rounded
  once to the dtype: ``residual_out``, bit-identical on every rank and equal to
  :func:`torch_reference`'s bit for bit;
* ``y = (h * weight) * rsqrt(mean(h * h) + eps)`` per token row (``h`` as rounded), rounded once
  to the dtype; or, with ``fp8``, quantised to ``torch.float8_e4m3fn`` with float32 scales
  ``scale = amax / 448`` (DeepSeek-V3's convention; ``amax`` the largest ``|y|`` of the token,
  ``fp8="per_token"``, scales ``(tokens, 1)``, or of each 128 channels of it,
  ``fp8="per_block"``, scales ``(tokens, hidden / 128)``), ``y_fp8 = e4m3(y / scale)``
  (0 where ``scale`` is 0); ``y ~= y_fp8 * scale``. ``y`` and the scales are the same on every
  rank and match :func:`torch_reference` up to float32 rounding of the row's sum and
  ``rsqrt`` (one unit in the last place of the output dtype).

The kernel (:mod:`tilescale_examples.decode.norm_kernel`) is the reduction engine's one-shot
(:mod:`tilescale_examples.collectives.reduce_engine`: the double-buffered symmetric staging
buffer, one flag round per block, call numbers on the device, so back-to-back calls need no
host synchronisation and CUDA-graph replays are new calls) with each block owning whole token
rows. The reduction is one-shot only: it reads ``world_size x`` the input per rank, which is
right for decode's few tokens; for large inputs use
:class:`~tilescale_examples.collectives.allreduce.AllReduce` and a separate norm.

``algorithm="lamport"`` exchanges the rows with the Lamport protocol instead (the kernel
module's "Lamport exchange": every rank pushes its rows into its slot of every rank's receive
buffer, the data is its own signal, no flag round): the same results, for the smallest
messages, where the flag round is most of a call. ``"auto"`` (default) picks it up to
:data:`LAMPORT_MAX_BYTES`, else the flag-based one-shot (``"one_shot"``).
"""

# (no `from __future__ import annotations`: the kernel module defines TileLang kernels)

import math
from typing import Literal, Optional, Sequence, Union

import torch

from tilescale_examples._launch import kept_view
from tilescale_examples.base import SymmetricCollective, check_tensor, settle, size_table_entry
from tilescale_examples.collectives.lamport_kernel import LAMPORT_BUFFERS, SENTINEL_BYTE
from tilescale_examples.collectives.reduce_engine import overlaps, rows_view
from tilescale_examples.decode.norm_kernel import (FLAG_STRIDE, FP8_BLOCK, FP8_MODES, FP8_TORCH_DTYPE, NORM_DTYPES,
                                                   PASS_CONFIGS, build_norm_kernel, row_vectors)
from tilescale_examples.decode.reference import compare, quantize_fp8, scales_shape, torch_reference

__all__ = ["AllReduceResidualRMSNorm", "torch_reference", "quantize_fp8", "scales_shape", "compare", "FP8_MODES",
           "ALGORITHMS", "LAMPORT_MAX_BYTES", "choose_algorithm"]

#: Values of the ``algorithm`` argument.
ALGORITHMS = ("auto", "one_shot", "lamport")
#: Size table of ``algorithm="auto"``: the largest input (bytes of ``x`` per rank) exchanged by
#: the Lamport protocol, by world size (:func:`~tilescale_examples.base.size_table_entry`).
#: One rank: either algorithm runs the one-rank kernel (nothing exchanged; the entry only
#: names the buffers the op allocates). Several ranks (emulated ranks running at
#: once on one H100, ``benchmarks.concurrent --op norm``, bfloat16, hidden 4096, 8 to 128 KiB):
#: Lamport 0.78-0.87 of the one-shot at 2 ranks and 0.86-0.89 at 4 at every size, 0.98-1.00
#: at 8 up to 64 KiB (1.41 at 128 KiB); the entries stop at the largest size where it won.
LAMPORT_MAX_BYTES = {1: 1 << 20, 2: 128 << 10, 4: 128 << 10, 8: 64 << 10}


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """What ``algorithm="auto"`` runs for ``nbytes`` of ``x`` per rank on ``world_size``
    ranks: ``"lamport"`` up to :data:`LAMPORT_MAX_BYTES`, else ``"one_shot"``."""
    return "lamport" if nbytes <= size_table_entry(LAMPORT_MAX_BYTES, world_size) else "one_shot"


def _check_eps(eps) -> float:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}: {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    return float(eps)


def _check_fp8(fp8) -> Optional[str]:
    if fp8 is not None and fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be None, 'per_token' or 'per_block', got {fp8!r}")
    if fp8 is not None and FP8_TORCH_DTYPE is None:
        raise ValueError(f"fp8={fp8!r} needs torch.float8_e4m3fn (torch >= 2.1), this torch has none")
    return fp8


class AllReduceResidualRMSNorm(SymmetricCollective):
    """``h = all_reduce(x) + residual``, ``y = rmsnorm(h) * weight`` (optionally FP8) in one
    kernel per call, over an allocator's ranks.

    Args:
        allocator: an open tilescale-core allocator; its ``num_ranks`` ranks take part.
        shape: ``(tokens, hidden)`` of ``x`` and ``residual``; ``hidden`` a multiple of 8
            (whole 16-byte vectors) and, for ``fp8="per_block"``, of 128.
        dtype: torch.float16 or torch.bfloat16 (or its name): ``x``, ``residual``, ``weight``,
            ``residual_out`` and (without ``fp8``) ``y``.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        algorithm: ``"one_shot"`` (staged rows, one flag round), ``"lamport"`` (the Lamport
            exchange, no flag round) or ``"auto"`` (:func:`choose_algorithm`); the same results.
        eps: added to ``mean(h^2)`` under the square root (float, >= 0).
        fp8: None (``y`` in ``dtype``), ``"per_token"`` or ``"per_block"`` (``y`` in
            ``torch.float8_e4m3fn`` with float32 scales, see the module docstring).
        group: the process group of the constructor's barrier (default: the WORLD group).
        threads: threads per block (a multiple of 32 in [32, 1024], >= world_size); a thread
            holds ``ceil(hidden / 8 / threads)`` vectors of a row (at most 8).
        max_blocks: grid cap (default: the SM count); ``blocks = min(tokens, max_blocks)``.
        target: TileLang target (default sm_90a).

    Attributes: ``tokens``, ``hidden``, ``eps``, ``fp8``, ``blocks``, ``iters`` (token rows per
    block), ``algorithm`` (the one running), ``output`` / ``residual_output`` / ``scales``
    (what a call without ``out`` / ``residual_out`` / ``scales_out`` returns; the next call
    overwrites them), ``stages`` (the two symmetric staging buffers, ``(tokens * hidden / 8,
    8)`` each; Lamport: the three receive buffers of ``world_size`` such slots, every element
    the sentinel until a peer's data arrives), ``flags``, ``state`` (the device's call counts,
    one per block), ``kernel``, ``epoch`` (calls made from the host).

    Memory (symmetric, per rank): two staging buffers of ``tokens x hidden`` elements and
    ``world_size * blocks`` uint64 flags (one per 32-byte sector); Lamport: ``3 * world_size``
    buffers of ``tokens x hidden`` elements and no flags.
    """

    ALGORITHMS = ALGORITHMS
    _BUFFERS = ("stage_buffer", "stages", "flags", "state", "output", "residual_output", "scales", "_own_rows",
                "_kept_weight")

    def __init__(self, allocator, shape: Union[int, Sequence[int]], dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, algorithm: Literal["auto", "one_shot", "lamport"] = "auto",
                 eps: float = 1e-6, fp8: Optional[Literal["per_token", "per_block"]] = None, group=None,
                 threads: int = 512, max_blocks: Optional[int] = None, target=None):
        self.eps, self.fp8 = _check_eps(eps), _check_fp8(fp8)
        self._setup(allocator, shape, dtype, world_size, group, threads, max_blocks, NORM_DTYPES,
                    algorithm=algorithm, target=target)
        if self.algorithm == "auto":
            self.algorithm = choose_algorithm(self.shard_numel * self.itemsize, self.world_size)
        self._build(target)

    def _set_shard(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"shape must be (tokens, hidden), got {self.shape}")
        self.tokens, self.hidden = self.shape
        if self.fp8 == "per_block" and self.hidden % FP8_BLOCK:
            raise ValueError(f"shape: hidden ({self.hidden}) must be a multiple of {FP8_BLOCK} for fp8='per_block'")
        if self.threads < self.world_size:
            raise ValueError(f"threads ({self.threads}) must be >= world_size ({self.world_size})")
        self.row_vectors, _ = row_vectors(self.hidden, self.itemsize, self.threads)

    def _largest_numel(self) -> int:  # the staging buffers (Lamport: 3 x world_size of them)
        return (LAMPORT_BUFFERS * self.world_size if self.algorithm == "lamport" else 2) * math.prod(self.shape)

    def _build(self, target) -> None:
        nv, vec = self.row_vectors, self.hidden // self.row_vectors
        self.vec = vec
        self.blocks = min(self.tokens, self.max_blocks)
        self.iters = -(-self.tokens // self.blocks)
        rows = self.tokens * nv
        if self.algorithm == "lamport":  # the receive buffers, every element the sentinel (all ones)
            per_call = self.world_size * rows
            self.stage_buffer = self._tensor((LAMPORT_BUFFERS * per_call, vec))
            self.stage_buffer.view(torch.uint8).fill_(SENTINEL_BYTE)
            self.stages = list(self.stage_buffer.split(per_call))
            self.flags = torch.zeros((1,), dtype=torch.uint64, device=self.device)  # the kernel reads none
        else:
            self.stage_buffer = self._tensor((2 * rows, vec))
            self.stages = list(self.stage_buffer.split(rows))
            self.flags = self._tensor((self.world_size * self.blocks * FLAG_STRIDE,), torch.uint64)
            self.flags.zero_()
        self.state = torch.zeros((self.blocks,), dtype=torch.int64, device=self.device)
        y_dtype = self.dtype if self.fp8 is None else FP8_TORCH_DTYPE
        self.output = torch.empty(self.shape, dtype=y_dtype, device=self.device)
        self.residual_output = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.scales = None if self.fp8 is None else torch.empty(
            scales_shape(self.tokens, self.hidden, self.fp8), dtype=torch.float32, device=self.device)
        # the kernel's views of the op's own outputs (h, y, scales), made once: a view costs host time per call
        self._own_rows = (self.residual_output.view(-1, vec), self.output.view(-1, vec),
                          None if self.scales is None else self.scales.view(-1))
        name = NORM_DTYPES[self.dtype]
        args = (name, self.world_size, self.hidden, self.threads, self.fp8) + (
            (self.algorithm,) if self.algorithm != "one_shot" else ())  # norm_jobs' arguments, exactly
        self.kernel = self._compile_kernel(lambda: build_norm_kernel(*args), target, PASS_CONFIGS,
                                           key=("decode_norm",) + args)
        self.bind_table(force=True)
        settle(self.device, self.group)

    # ------------------------------------------------------------------ reference
    torch_reference = staticmethod(torch_reference)

    def reference(self, inputs: Sequence[tuple], rank: int) -> tuple:
        """:func:`torch_reference` with this op's ``eps`` and ``fp8``."""
        return torch_reference(inputs, rank, eps=self.eps, fp8=self.fp8)

    # ------------------------------------------------------------------ calls
    def _check_args(self, x, residual, weight, out, residual_out, scales_out) -> None:
        """Everything a call checks before anything runs (``TypeError`` / ``ValueError``
        naming the argument)."""
        self._check_open()
        self.check_tensor(x, self.shape, "x", "the shape")
        self.check_tensor(residual, self.shape, "residual", "the shape")
        self.check_tensor(weight, (self.hidden,), "weight", "(hidden,)")
        if out is not None:
            check_tensor(out, self.shape, self.output.dtype, self.device, "out", "the shape", type(self).__name__)
        if residual_out is not None:
            self.check_tensor(residual_out, self.shape, "residual_out", "the shape")
        if scales_out is not None:
            if self.fp8 is None:
                raise TypeError("scales_out is only for an FP8 output (fp8='per_token' or 'per_block')")
            check_tensor(scales_out, self.scales.shape, torch.float32, self.device, "scales_out", "the scales' shape",
                         type(self).__name__)
        self._check_aliasing({"out": out, "residual_out": residual_out, "scales_out": scales_out},
                             {"x": x, "residual": residual, "weight": weight})

    def _check_aliasing(self, outputs: dict, inputs: dict) -> None:
        """Outputs may be exactly ``x`` or ``residual`` (a block reads a row before it writes
        it), else must not overlap the inputs, each other or the symmetric buffers."""
        given = {k: v for k, v in outputs.items() if v is not None}
        for name, t in given.items():
            if overlaps(t, self.stage_buffer) or overlaps(t, self.flags):
                raise ValueError(f"{name} overlaps this {type(self).__name__}'s symmetric buffers, which peers "
                                 "read during calls; pass a tensor of your own")
            for other, u in inputs.items():
                same = other != "weight" and _same_view(t, u)
                if not same and overlaps(t, u):
                    raise ValueError(f"{name} overlaps {other}: an output may be {other} itself (in place) or "
                                     "disjoint from it")
        names = list(given)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if overlaps(given[a], given[b]):
                    raise ValueError(f"{a} and {b} overlap")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                 out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None,
                 scales_out: Optional[torch.Tensor] = None) -> tuple:
        """All-reduce ``x``, add ``residual``, RMS-normalise with ``weight``.

        Args:
            x: this rank's partial sum, ``(tokens, hidden)``, the op's dtype, contiguous, on
                the allocator's device.
            residual: ``(tokens, hidden)``, the op's dtype (this rank's copy).
            weight: ``(hidden,)``, the op's dtype.
            out: where to write ``y`` (``(tokens, hidden)``, the dtype or, with ``fp8``,
                ``torch.float8_e4m3fn``); may be ``x`` or ``residual`` itself. Default
                ``op.output``.
            residual_out: where to write ``h`` (may be ``residual`` for the in-place update,
                or ``x``). Default ``op.residual_output``.
            scales_out: FP8 only: where to write the float32 scales (``(tokens, 1)`` or
                ``(tokens, hidden / 128)``). Default ``op.scales``.

        Returns ``(y, residual_out)``, or with ``fp8`` ``(y_fp8, scales, residual_out)``:
        the given tensors or the op's own (which the next call overwrites), complete when the
        kernel finishes on the current stream. Raises
        :class:`~tilescale_examples.base.ClosedError` after ``close()``.
        """
        own = out is None and residual_out is None and scales_out is None
        if own and self._relaunch(x, residual, weight):  # laid out as the last such call's: launched as it was
            return (self.output, self.residual_output) if self.fp8 is None else (
                self.output, self.scales, self.residual_output)
        self._check_args(x, residual, weight, out, residual_out, scales_out)
        self._note_capture()
        y = self.output if out is None else out
        h = self.residual_output if residual_out is None else residual_out
        s = self.scales if scales_out is None else scales_out
        self.epoch += 1
        self.bind_table()
        vec, (own_h, own_y, own_s) = self.vec, self._own_rows
        ins = (_aligned_rows(x, vec), _aligned_rows(residual, vec), self._weight_rows(weight))
        outs = [own_h if residual_out is None else rows_view(h, vec), own_y if out is None else rows_view(y, vec)]
        tmp = [own_h if outs[0] is None else outs[0], own_y if outs[1] is None else outs[1]]
        scales = [] if s is None else [own_s if scales_out is None else s.view(-1)]
        args = (*ins, self.stage_buffer, *tmp, *scales, self.flags, self.state, self.blocks, self.iters, self.tokens,
                self.eps)
        changing = (0, 1, 2, 4, 5, 6) if scales else (0, 1, 2, 4, 5)
        self._launch_kernel(args, changing)
        # kept when the kernel reads x and residual in place and the weight through its kept view
        # (not copies made for this call): a later call then needs new views of x and residual only,
        # wherever they are (16-byte aligned: this call reads any such x and residual in place)
        keep = (own and ins[0].data_ptr() == x.data_ptr() and ins[1].data_ptr() == residual.data_ptr()
                and ins[2].data_ptr() == weight.data_ptr())
        self._keep_launch(keep, (x, residual, weight), args, changing, views=((0, 0), (1, 1)), movable=True)
        for dst, got, own in ((h, outs[0], self.residual_output), (y, outs[1], self.output)):
            if got is None:
                dst.copy_(own)  # an output that is not whole aligned vectors: through the op's own
        return (y, h) if self.fp8 is None else (y, s, h)

    def _weight_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as the kernel's rows: its view, kept for the next call, which usually
        passes the same weight; or, when it is not whole aligned vectors, an aligned copy made
        at every call (a copy is never kept)."""
        rows = kept_view(self, "_kept_weight", weight, lambda w: rows_view(w, self.vec))
        return _aligned_rows(weight, self.vec) if rows is None else rows

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, world_size={self.world_size}, "
                f"algorithm={self.algorithm!r}, eps={self.eps}, fp8={self.fp8!r}, blocks={self.blocks}, "
                f"epoch={self.epoch}"
                f"{', closed' if self.closed else ''})")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements (pointer, shape, strides, dtype)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _aligned_rows(t: torch.Tensor, vec: int) -> torch.Tensor:
    """``t`` as ``(n / vec, vec)`` rows: a view when it is 16-byte aligned, else an aligned copy."""
    rows = rows_view(t, vec)
    return rows if rows is not None else rows_view(t.clone(), vec)
