"""GEMM + all-reduce fused: ``out = all_reduce(a @ b)`` (a row-parallel linear layer of tensor
parallelism at decode and small prefill), one kernel per call::

    gar = GemmAllReduce(allocator, m, k, n, torch.bfloat16)   # collective; a: (m, k), b: (k, n)
    out = gar(a, b)                                           # every rank: its a and its b
    out = gar(a, b, out=y)                                    # into a tensor of your own
    gar.close()                                               # before allocator.close()

What a call computes (every rank the same bits; float16 or bfloat16 in and out, float32
accumulation): each rank's GEMM ``c_p = a_p @ b_p`` with float32 accumulation, **rounded to
the dtype** (what a GEMM followed by an all-reduce, as in TensorRT-LLM's and vLLM's GEMM +
custom all-reduce, hands over), then ``out = (c_0 + c_1 + ... + c_{W-1})`` added in rank order
in float32 and rounded once to the dtype (the reduction engine's convention,
:func:`tilescale_examples.collectives.reduce_engine.torch_reference`). Every rank adds the
same staged partials in the same order, so ``out`` is bit-identical on every rank.
:func:`torch_reference` makes exactly these roundings with torch; the one difference from the
kernel is the float32 summation order inside each partial's dot products (``k`` products),
so compare with :func:`compare` (the bound of
:func:`~tilescale_examples.overlap.gemm.error_bound`, the partials counted as rounded).

The kernel (:mod:`tilescale_examples.decode.gemm_ar_kernel`) is a persistent GEMM whose
epilogue stages each finished tile in this rank's symmetric buffer and signals it; the same
block then sums that tile over the ranks while the other tiles' GEMMs still run (the reduction
starts before the GEMM ends). Call numbers live on the device, so back-to-back calls need no
host synchronisation and CUDA-graph replays are new calls.

With ``split_k`` (``"auto"``, the default: :func:`default_split_k`; or an int) the GEMM is
cut along ``k`` as well, so that the few tiles of a decode output keep every SM busy; the
tile's last unit adds the rank's partials in split order before the rank's product is
rounded and takes part in the exchange alone (the same semantics;
:mod:`tilescale_examples.decode.gemm_ar_split`).

One rank (``world_size = 1``) exchanges nothing: the GEMM's tile (with a split, the tile's
sum of partials) is stored straight into ``out``, no flag released, no block waiting
(:mod:`tilescale_examples.decode.gemm_ar_solo`, :mod:`~tilescale_examples.decode.gemm_ar_split`).

The one-shot reduction above has every rank read ``world_size x`` the output: right for
decode's few rows. ``reduction="two_shot"`` (:mod:`tilescale_examples.decode.gemm_ar_two_shot`)
has each rank reduce ``1 / world_size`` of every tile and push it to every rank, for larger
outputs (same bits; ``split_k = 1``); ``"auto"`` picks by :data:`TWO_SHOT_FROM_BYTES`
(:func:`reduction_for`).
"""

# (no `from __future__ import annotations`: the kernel module defines TileLang kernels)

from typing import Optional, Sequence, Union

import torch

from tilescale_examples.base import (ClosedError, SymmetricOp, check_max_blocks, check_target, check_tensor, settle,
                                     size_table_entry)
from tilescale_examples.collectives.reduce_engine import overlaps
from tilescale_examples.collectives.reduce_engine import torch_reference as rank_order_reduce
from tilescale_examples.decode.gemm_ar_kernel import (GEMM_AR_DTYPES, PASS_CONFIGS, REDUCTIONS, build_gemm_ar_kernel,
                                                      check_split_k, flag_words, gemm_ar_jobs, kernel_args,
                                                      padded_rows, reads_table, tile_count)
from tilescale_examples.overlap.gemm import MAX_ELEMENTS, GemmTiles, check_positive, count_outside

__all__ = ["GemmAllReduce", "torch_reference", "partial_magnitudes", "compare", "default_tiles", "default_split_k",
           "resolve_split_k", "reduction_for", "resolve_reduction", "gemm_allreduce_jobs", "BLOCK_N_CHOICES",
           "SPLIT_K_CHOICES", "TWO_SHOT_FROM_BYTES", "REDUCTIONS", "ClosedError"]

#: Size table of ``reduction="auto"``, keyed by world size
#: (:func:`~tilescale_examples.base.size_table_entry`): outputs of at least this many bytes take
#: the two-shot kernel. None everywhere (one-shot at every size) until the GemmAllReduce
#: benchmark's ``--reduction one_shot two_shot`` rows across GPUs set them: one GPU's emulated
#: peers read their partials from HBM, not over NVLink, which is where two-shot saves.
TWO_SHOT_FROM_BYTES = {1: None, 2: None, 4: None, 8: None}


def reduction_for(nbytes: int, world_size: int) -> str:
    """The reduction a call of ``nbytes`` output bytes on ``world_size`` ranks takes per
    :data:`TWO_SHOT_FROM_BYTES`: ``"one_shot"`` or ``"two_shot"`` (one rank: ``"one_shot"``,
    there is nothing to reduce)."""
    check_positive("nbytes", nbytes)
    limit = size_table_entry(TWO_SHOT_FROM_BYTES, world_size)
    return "two_shot" if world_size > 1 and limit is not None and nbytes >= limit else "one_shot"


def resolve_reduction(reduction, nbytes: int, world_size: int, split_k="auto") -> str:
    """The kernel ``GemmAllReduce(..., reduction=reduction, split_k=split_k)`` runs:
    ``"auto"`` through :func:`reduction_for` (``"one_shot"`` where ``split_k`` is an int
    above 1: the split asked for wins), else one of :data:`REDUCTIONS` (``ValueError`` naming
    ``reduction``); ``"one_shot"`` on one rank whatever is asked (its kernels exchange
    nothing)."""
    if reduction == "auto":
        split_asked = isinstance(split_k, int) and not isinstance(split_k, bool) and split_k > 1
        return "one_shot" if split_asked else reduction_for(nbytes, world_size)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'auto' or one of {REDUCTIONS}, got {reduction!r}")
    return "one_shot" if world_size == 1 else reduction


#: The ``block_n`` candidates of :func:`default_tiles`, in order of preference.
BLOCK_N_CHOICES = (128, 256, 64)


def default_tiles(m: int, n: int, max_blocks: int, block_m=None, block_n=None, block_k=None, num_stages=None,
                  threads=None) -> GemmTiles:
    """The tile program for an ``(m, n)`` output on a grid of at most ``max_blocks`` blocks,
    each field the given value or, when None: ``block_m`` 64 (one WGMMA row block) up to
    ``m = 128``, else 128; ``block_n`` the first of :data:`BLOCK_N_CHOICES` (128, 256, 64)
    that divides ``n`` and gives at most ``max_blocks`` tiles (one wave, no block computing
    two tiles), else the dividing one with the fewest tiles; ``block_k`` 64; ``num_stages`` 4;
    ``threads`` (the compute warpgroups) 128 for ``block_m`` 64, else 256.

    Measured at ``k = n = 8192`` on one H100 (world 1; the ``--tiles`` rows of
    ``benchmarks.gemm_allreduce``): wide ``block_n`` tiles in one wave beat more, narrower
    tiles even where they leave SMs idle (``m = 1``: 64x128 tiles, 64 blocks, 57 us against
    76 us for 128 blocks of 64x64; ``m = 256``: 128x128, 79 us against 133 us for 128x64 in two
    waves; ``m = 512``: 128x256, 116 us against 149 us for 128x128)."""
    bm = block_m if block_m is not None else (64 if m <= 128 else 128)
    if block_n is None:
        fits = [c for c in BLOCK_N_CHOICES if n % c == 0] or [64]
        rows = -(-m // bm)
        one_wave = [c for c in fits if rows * (n // c) <= max_blocks]
        block_n = one_wave[0] if one_wave else max(fits)
    return GemmTiles(bm, block_n, 64 if block_k is None else block_k, 4 if num_stages is None else num_stages,
                     threads if threads is not None else (128 if bm == 64 else 256))


#: The ``split_k`` candidates of :func:`default_split_k`, in order of preference.
SPLIT_K_CHOICES = (4, 2)


def default_split_k(m: int, k: int, n: int, world_size: int, tiles: GemmTiles, max_blocks: int) -> int:
    """``split_k="auto"``: the first of :data:`SPLIT_K_CHOICES` (4, 2) whose units (``tiles x
    split_k``) still fit one wave of ``max_blocks`` blocks, that
    :func:`~tilescale_examples.decode.gemm_ar_kernel.check_split_k` accepts and that leaves each
    split at least ``num_stages`` steps of ``block_k`` (a full pipeline); else 1 (no split:
    the tiles alone fill the grid)."""
    count = tile_count(m, n, tiles)
    for split in SPLIT_K_CHOICES:
        if count * split > max_blocks or k // split < tiles.block_k * tiles.num_stages:
            continue
        try:
            return check_split_k(split, k, world_size, tiles)
        except ValueError:
            continue
    return 1


def resolve_split_k(split_k, m: int, k: int, n: int, world_size: int, tiles: GemmTiles, max_blocks: int,
                    reduction: str = "one_shot") -> int:
    """The ``split_k`` that ``GemmAllReduce(..., split_k=split_k)`` runs with for this problem:
    ``"auto"`` through :func:`default_split_k`, an int checked (``ValueError`` naming
    ``split_k``, also when the grid cap ``max_blocks`` is below it); with the (resolved)
    ``reduction`` ``"two_shot"`` always 1 (its kernel keeps every tile's ``k`` whole:
    ``ValueError`` for a larger int)."""
    if reduction == "two_shot":
        if split_k != "auto" and check_split_k(split_k, k, world_size, tiles) != 1:
            raise ValueError(f"split_k={split_k}: reduction='two_shot' keeps every tile's k whole; pass split_k=1 "
                             "or 'auto'")
        return 1
    if split_k == "auto":
        return default_split_k(m, k, n, world_size, tiles, max_blocks)
    split_k = check_split_k(split_k, k, world_size, tiles)
    if split_k > max_blocks:
        raise ValueError(f"split_k={split_k} exceeds max_blocks={max_blocks} (the units of a tile run at once)")
    return split_k


def gemm_allreduce_jobs(ms: Sequence[int], k: int, n: int, dtype: str, world_sizes: Sequence[int],
                       max_blocks: int, split_k="auto", reduction="auto", **tiles) -> list:
    """:func:`~tilescale_examples.testing.precompile.precompile` jobs of the kernels
    ``GemmAllReduce(allocator, m, k, n, dtype, max_blocks=max_blocks, split_k=split_k,
    reduction=reduction, **tiles)`` builds for every ``m`` in ``ms`` and world size; ``dtype``
    a name (``"bfloat16"``); ``max_blocks`` the grid cap (the op's default: the device's SM
    count); ``tiles`` the op's tile keywords (``block_m`` ... ``threads``; none: the default
    tiles)."""
    itemsize = getattr(torch, dtype).itemsize
    jobs = []
    for m in ms:
        t = default_tiles(m, n, max_blocks, **tiles)
        for w in world_sizes:
            r = resolve_reduction(reduction, m * n * itemsize, w, split_k)
            jobs += gemm_ar_jobs([(m, k, n)], [dtype], [w], t, resolve_split_k(split_k, m, k, n, w, t, max_blocks, r),
                                 r)
    return jobs


def _check_inputs(inputs, rank: int) -> list:
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one (a, b) pair per rank, got none")
    if not isinstance(rank, int) or not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank!r}")
    return inputs


def torch_reference(inputs: Sequence[tuple], rank: int) -> torch.Tensor:
    """What a call returns on ``rank`` (every rank the same), from every rank's call arguments
    ``inputs[p] = (a_p, b_p)`` (``(m, k)`` and ``(k, n)``, float16 or bfloat16): each
    ``a_p @ b_p`` in float32 rounded to the dtype, then added in rank order in float32 and
    rounded once; an ``(m, n)`` tensor of the dtype (see the module docstring)."""
    inputs = _check_inputs(inputs, rank)
    dtype = inputs[0][0].dtype
    return rank_order_reduce([(a.float() @ b.float()).to(dtype) for a, b in inputs])


def partial_magnitudes(inputs: Sequence[tuple]) -> torch.Tensor:
    """``sum_p |a_p @ b_p|`` in float32: the ``rounded`` term of
    :func:`~tilescale_examples.overlap.gemm.error_bound` (each partial is rounded to the dtype
    once), ``(m, n)``."""
    return sum((a.float() @ b.float()).abs() for a, b in _check_inputs(inputs, 0))


def compare(out: torch.Tensor, inputs: Sequence[tuple], what: str = "") -> list:
    """Failure messages (empty when it matches) of a call's ``out`` against the exact float32
    sum of every rank's ``a_p @ b_p``: every element within
    :func:`~tilescale_examples.overlap.gemm.error_bound` with the partials counted as rounded
    (NaN and inf fail)."""
    inputs = _check_inputs(inputs, 0)
    exact = sum(a.float() @ b.float() for a, b in inputs)
    bad, worst = count_outside(out.to(exact.device), exact, out.dtype, partial_magnitudes(inputs))
    return [f"{what} out: {bad} elements outside the error bound (worst {worst:.3g}x)"] if bad else []


class GemmAllReduce(SymmetricOp):
    """``out = all_reduce(a @ b)`` in one kernel per call, over an allocator's ranks (see the
    module docstring).

    Args:
        allocator: an open tilescale-core allocator; its ``num_ranks`` ranks take part.
        m, k, n: ``a`` is ``(m, k)``, ``b`` ``(k, n)``, the output ``(m, n)`` on every rank;
            ``m`` any positive int (decode: 1-512), ``k`` a multiple of ``block_k``, ``n`` of
            ``block_n``.
        dtype: torch.float16 or torch.bfloat16 (or its name); float32 accumulation.
        world_size: number of ranks; defaults to ``allocator.num_ranks`` and must equal it.
        group: the process group of the constructor's barrier and grid agreement (default:
            the WORLD group).
        block_m, block_n, block_k, num_stages, threads: the GEMM's tiles
            (:class:`~tilescale_examples.overlap.gemm.GemmTiles`); None: :func:`default_tiles`.
        max_blocks: grid cap (default: the SM count; the smallest over the ranks is used, so
            every rank runs the same grid); ``blocks = min(units, max_blocks)`` rounded down
            to a multiple of ``split_k`` (``units = tiles x split_k``).
        split_k: splits of ``k`` per tile (1: none), or ``"auto"`` (the default:
            :func:`default_split_k`, 2 or 4 where the tiles alone leave SMs idle, else 1);
            ``k / split_k`` a multiple of ``block_k``; 1 with the two-shot reduction.
        reduction: ``"one_shot"`` (every rank reads every rank's partial of each tile),
            ``"two_shot"`` (each rank reduces ``1 / world_size`` of each tile and pushes it to
            every rank: ``(W - 1) / W`` of the output read from peers instead of ``W - 1``
            times it, one more flag round per tile) or ``"auto"`` (the default:
            :func:`reduction_for`, :data:`TWO_SHOT_FROM_BYTES`); one rank: its own kernels.
        target: TileLang target (default sm_90a).

    Attributes: ``m``, ``k``, ``n``, ``tiles``, ``split_k``, ``reduction``, ``tile_count``, ``blocks``,
    ``iters`` (units per block, at most), ``output`` (what a call without ``out`` returns; the
    next call overwrites it), ``stages`` (the two halves of the symmetric staging buffer
    ``stage_buffer``: ``(mp, n)`` each of the dtype, the calls' tiles by call parity (two-shot:
    the partials, then the reduced tiles); or ``(split_k * mp, n)`` float32 with ``split_k >
    1``, the partials, then the two calls' rounded products; ``mp`` = ``m`` rounded up to
    ``block_m``), ``flags``, ``state`` (the device's call counts, one per block),
    ``kernel``, ``epoch`` (calls made from the host).

    Memory (symmetric, per rank): ``2 * mp * n`` elements of the dtype (``split_k > 1``:
    ``2 * split_k * mp * n`` float32) and ``world_size * blocks * 4`` uint64 flags
    (``split_k > 1``: ``world_size * 2 * tile_count * 4``, the tiles' flags and counters).
    """

    _BUFFERS = ("stage_buffer", "stages", "flags", "state", "output")
    torch_reference = staticmethod(torch_reference)

    def __init__(self, allocator, m: int, k: int, n: int, dtype: Union[torch.dtype, str], *,
                 world_size: Optional[int] = None, group=None, block_m: Optional[int] = None,
                 block_n: Optional[int] = None, block_k: Optional[int] = None, num_stages: Optional[int] = None,
                 threads: Optional[int] = None, max_blocks: Optional[int] = None, split_k: Union[int, str] = "auto",
                 reduction: str = "auto", target=None):
        check_target(target)
        self._setup_op(allocator, dtype, world_size, group, GEMM_AR_DTYPES)
        for name, value in (("m", m), ("k", k), ("n", n)):
            check_positive(name, value)
        check_max_blocks(max_blocks)
        self.max_blocks = self._agreed_min(self._default_max_blocks() if max_blocks is None else max_blocks)
        self.tiles = default_tiles(m, n, self.max_blocks, block_m, block_n, block_k, num_stages, threads)
        self._check_dims(m, k, n)
        self.m, self.k, self.n = m, k, n
        self.mp = padded_rows(m, self.tiles.block_m)
        self.tile_count = tile_count(m, n, self.tiles)
        self.reduction = resolve_reduction(reduction, m * n * self.dtype.itemsize, self.world_size, split_k)
        self.split_k = resolve_split_k(split_k, m, k, n, self.world_size, self.tiles, self.max_blocks, self.reduction)
        if 2 * self.split_k * self.mp * n >= MAX_ELEMENTS:
            raise ValueError(f"{type(self).__name__}: split_k={self.split_k}: the staging buffers "
                             f"({2 * self.split_k} x {self.mp} x {n}) exceed the kernel's int32 indexing; "
                             "lower split_k")
        units = self.tile_count * self.split_k
        self.blocks = min(units, self.max_blocks // self.split_k * self.split_k)
        self.iters = -(-units // self.blocks)
        self._build(target)

    def _check_dims(self, m: int, k: int, n: int) -> None:
        """``ValueError`` naming the argument for ``k`` / ``n`` not a multiple of their tile,
        buffers beyond int32 indexing, more ranks than threads (one flag per thread), or tiles
        whose pipeline needs more shared memory than a Hopper block has."""
        t, owner = self.tiles, type(self).__name__
        for name, value, tile in (("k", k, "block_k"), ("n", n, "block_n")):
            if value % getattr(t, tile):
                raise ValueError(f"{owner}: {name}={value} is not a multiple of {tile}={getattr(t, tile)} (the GEMM "
                                 f"tile); pass a {tile} that divides it")
        if t.block_n % 8:
            raise ValueError(f"{owner}: block_n={t.block_n} must be a multiple of 8 (16-byte vectors)")
        if max(2 * padded_rows(m, t.block_m) * n, m * k, k * n) >= MAX_ELEMENTS:
            raise ValueError(f"{owner}: m={m}, k={k}, n={n}: a buffer exceeds the kernel's int32 indexing "
                             "(< 2**31 elements)")
        if self.world_size > t.threads:
            raise ValueError(f"{owner}: threads ({t.threads}) must be >= world_size ({self.world_size})")
        from tilescale_lang.autotune.gemm import HOPPER_SMEM_BYTES, gemm_shared_bytes

        smem = gemm_shared_bytes(t.block_m, t.block_n, t.block_k, t.num_stages, self.dtype)
        if smem > HOPPER_SMEM_BYTES:
            raise ValueError(f"{owner}: tiles {t.block_m}x{t.block_n}x{t.block_k} with num_stages={t.num_stages} need "
                             f"{smem} bytes of shared memory per block, more than {HOPPER_SMEM_BYTES}: lower "
                             "num_stages or block_k")

    def _agreed_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks of the group (the grid must be the same on
        every rank); ``value`` itself without a group."""
        if self.group is None:
            return value
        import torch.distributed as dist

        from tilescale_examples.base import collective_device

        t = torch.tensor([value], dtype=torch.int64, device=collective_device(self.group, self.device))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _symmetric(self, shape, dtype) -> torch.Tensor:
        import tilelang

        return tilelang.tensor(tuple(shape), dtype, allocator=self.allocator)

    def _build(self, target) -> None:
        split = self.split_k
        self.stage_buffer = self._symmetric((2 * split * self.mp, self.n), self.dtype if split == 1 else torch.float32)
        self.stages = list(self.stage_buffer.split(split * self.mp))
        self.flags = self._symmetric((flag_words(self.world_size, self.blocks, self.tile_count, split),), torch.uint64)
        self.flags.zero_()
        self.state = torch.zeros((self.blocks,), dtype=torch.int64, device=self.device)
        self.output = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        args = kernel_args(self.m, self.k, self.n, self.world_size, GEMM_AR_DTYPES[self.dtype], self.tiles, split,
                           self.reduction)
        self._has_table = reads_table(self.world_size, split)
        if self._has_table:
            self.kernel = self._compile_kernel(lambda: build_gemm_ar_kernel(*args), target, PASS_CONFIGS,
                                               key=("gemm_allreduce",) + args)
            self.bind_table(force=True)
        else:  # one rank, unsplit: a kernel with no TileScale intrinsic, so no rank table to bind
            self.kernel = self._compile_plain(lambda: build_gemm_ar_kernel(*args), target, PASS_CONFIGS)
        settle(self.device, self.group)

    # ------------------------------------------------------------------ calls
    def check_inputs(self, a, b, out=None) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming ``a``, ``b`` or ``out`` unless ``a`` and
        ``b`` are contiguous ``(m, k)`` / ``(k, n)`` tensors of the dtype on the allocator's
        device and ``out`` (when given) a contiguous ``(m, n)`` one that overlaps neither the
        inputs nor the symmetric buffers."""
        owner = type(self).__name__
        check_tensor(a, (self.m, self.k), self.dtype, self.device, "a", "(m, k) =", owner)
        check_tensor(b, (self.k, self.n), self.dtype, self.device, "b", "(k, n) =", owner)
        if out is None:
            return
        self._check_out(out, (self.m, self.n), "(m, n) =")
        if overlaps(out, self.stage_buffer) or overlaps(out, self.flags):
            raise ValueError(f"out overlaps this {owner}'s symmetric buffers, which peers read during calls; pass a "
                             "tensor of your own")
        for name, t in (("a", a), ("b", b)):
            if overlaps(out, t):
                raise ValueError(f"out overlaps {name}: the kernel reads {name} while it writes out")

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``all_reduce(a @ b)`` on the current stream.

        Args:
            a: this rank's ``(m, k)`` activations, the op's dtype, contiguous, on the
                allocator's device.
            b: this rank's ``(k, n)`` weight rows.
            out: where to write the ``(m, n)`` result (default ``op.output``, which the next
                call overwrites).

        Returns ``out`` or ``op.output``, complete when the kernel finishes on the current
        stream; the same bits on every rank. Every rank makes the same sequence of calls,
        eagerly or in CUDA graph replays (warm up with one eager call before capturing).
        Raises :class:`~tilescale_examples.base.ClosedError` after ``close()``.

        A call without ``out`` on ``a`` and ``b`` laid out as the last such call's (same
        addresses, shapes, strides, dtypes: every check that call made holds; a loop over the
        same buffers, refilled in place) launches that call's launch again (docs/launch.md,
        "Repeated calls"): from the second repeated call on, its frozen launch, whose TMA
        descriptors of ``a`` and ``b`` were encoded once. The kernel keeps its call numbers on
        the device, so a repeated launch is a new call like any other.
        """
        if out is None and self._relaunch(a, b):
            return self.output
        self._check_open()
        self.check_inputs(a, b, out)
        self._note_capture()
        result = self.output if out is None else out
        direct = result.data_ptr() % 16 == 0
        ins = tuple(t if t.data_ptr() % 16 == 0 else t.clone() for t in (a, b))  # TMA needs 16-byte aligned bases
        self.epoch += 1
        if self._has_table:
            self.bind_table()
        args = (*ins, self.stage_buffer, result if direct else self.output, self.flags, self.state, self.blocks,
                self.iters)
        self._launch_kernel(args, (0, 1, 3))
        if not direct:
            result.copy_(self.output)  # not 16-byte aligned: through the op's own output
        # kept when the kernel read a and b themselves (not aligned copies made for this call)
        self._keep_launch(out is None and ins[0] is a and ins[1] is b, (a, b), args, (0, 1, 3),
                          views=((0, 0), (1, 1)), plain=not self._has_table)
        return result

    def flops(self) -> float:
        """Floating-point operations of one call's GEMM on one rank: ``2 * m * n * k``."""
        return 2.0 * self.m * self.n * self.k

    def __repr__(self) -> str:
        t = self.tiles
        return (f"{type(self).__name__}(m={self.m}, k={self.k}, n={self.n}, dtype={self.dtype}, "
                f"world_size={self.world_size}, tiles={t.block_m}x{t.block_n}x{t.block_k}, split_k={self.split_k}, "
                f"reduction={self.reduction!r}, "
                f"blocks={self.blocks}, "
                f"epoch={self.epoch}{', closed' if self.closed else ''})")
