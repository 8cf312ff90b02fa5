"""The collectives the bus-bandwidth benchmarks measure, and the numbers around them: the ops
table (:data:`OPS`: class, torch.distributed baselines, dtypes, bus factor), shard sizes, the
symmetric heap a sweep needs, the check's tolerance, random inputs and the baseline probe.

The benchmark itself: :mod:`~tilescale_examples.benchmarks._collective_cli` (command line,
titles) and :mod:`~tilescale_examples.benchmarks._collective_run` (one rank's sweep).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from tilescale_examples.benchmarks._report import gb_per_s

__all__ = ["Op", "Baseline", "OPS", "HEADERS", "SYMM_HEADERS", "bus_bandwidth", "iters_for", "shard_numel",
           "heap_bytes", "tolerance", "outputs_match", "random_input", "pick_baseline", "HEAP_SLACK",
           "GRAPH_GOAL_BYTES", "GRAPH_GOAL"]

HEADERS = ["size", "shard", "blocks", "TileScale GB/s", "baseline GB/s", "ratio",
           "TileScale us", "baseline us", "TileScale graph us", "check"]
#: Relative tolerance of a floating-point reduction, about one ulp of the dtype (bfloat16 has 8
#: significant bits: one ulp is up to 2**-7 relative). The absolute one is ``rtol * n * (n +
#: 1) / 2`` for ``n`` ranks: inputs lie in [-1, 1), and a baseline that rounds each of its
#: partial sums (of at most ``k`` terms) in the dtype errs by up to half an ulp of ``k`` each.
RTOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-5, "float64": 1e-12}
#: Heap bytes per rank beyond what the collectives of a sweep allocate.
HEAP_SLACK = 64 << 20


@dataclass(frozen=True)
class Baseline:
    """A torch.distributed way to compute the collective: ``call(dist, out, x, group, rank,
    world)`` on flat tensors (``x`` the rank's input, ``out`` the rank's output); ``name`` goes
    into the table title."""

    name: str
    call: Callable


@dataclass(frozen=True)
class Op:
    """One collective: its class (``module.cls`` in :mod:`tilescale_examples.collectives`), the
    baselines to try in order (the last one must work on any backend), the dtypes the
    benchmark offers, its input and output in shards (rows of the probe's inputs), its
    bus-bandwidth factor, and whether it sums (tolerance for floats) or moves data (exact)."""

    name: str
    module: str
    cls: str
    baselines: tuple
    dtypes: tuple
    input_rows: Callable[[int], int]
    output_rows: Callable[[int], int]
    bus_factor: Callable[[int], float]
    reduces: bool = False
    grid_per_peer: bool = True  # grid chunks x world (else chunks)
    #: The collective's ``shape`` (per-rank input) for ``shard`` elements per rank and ``world`` ranks.
    shape: Callable[[int, int], tuple] = lambda shard, world: (shard,)

    def collective(self):
        return getattr(importlib.import_module(f"tilescale_examples.collectives.{self.module}"), self.cls)

    def reference(self, inputs, rank: int):
        """The expected output on ``rank`` from every rank's input (the class's
        ``torch_reference``)."""
        return self.collective().torch_reference(inputs, rank)


def _all_gather_into_tensor(dist, out, x, group, rank, world):
    dist.all_gather_into_tensor(out, x, group=group)


def _all_gather_views(dist, out, x, group, rank, world):
    dist.all_gather(list(out.chunk(world)), x, group=group)


def _reduce_scatter_tensor(dist, out, x, group, rank, world):
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)


def _all_reduce_slice(dist, out, x, group, rank, world):
    total = x.clone()  # all_reduce works in place; the input must survive the call
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    out.copy_(total.view(world, -1)[rank])


def _all_reduce(dist, out, x, group, rank, world):
    out.copy_(x)  # all_reduce works in place; the input must survive the call
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)


def _all_to_all_single(dist, out, x, group, rank, world):
    dist.all_to_all_single(out, x, group=group)


def _all_to_all_lists(dist, out, x, group, rank, world):
    dist.all_to_all(list(out.chunk(world)), list(x.chunk(world)), group=group)


def _all_gather_select(dist, out, x, group, rank, world):
    import torch

    gathered = torch.empty((world, x.numel()), dtype=x.dtype, device=x.device)
    dist.all_gather(list(gathered.unbind(0)), x, group=group)
    out.view(world, -1).copy_(gathered.view(world, world, -1)[:, rank])


def _ring(world: int) -> float:
    """nccl-tests' bus factor of all-gather, reduce-scatter and all-to-all: ``(n - 1) / n``."""
    return (world - 1) / world


def _ring_twice(world: int) -> float:
    """nccl-tests' bus factor of all-reduce: ``2 (n - 1) / n``."""
    return 2 * (world - 1) / world


def _rows(shard: int, world: int) -> tuple:
    """The shape of an input holding one row of ``shard`` elements per rank."""
    return (world, shard)


_COPY_DTYPES = ("float16", "bfloat16", "float32", "uint8")
OPS = {
    "allgather": Op("all-gather", "allgather", "AllGather",
                    (Baseline("all_gather_into_tensor", _all_gather_into_tensor),
                     Baseline("all_gather", _all_gather_views)),
                    _COPY_DTYPES, lambda n: 1, lambda n: n, _ring),
    "reducescatter": Op("reduce-scatter", "reducescatter", "ReduceScatter",
                        (Baseline("reduce_scatter_tensor", _reduce_scatter_tensor),
                         Baseline("all_reduce + slice", _all_reduce_slice)),
                        ("float16", "bfloat16", "float32", "int32"), lambda n: n, lambda n: 1, _ring,
                        reduces=True, grid_per_peer=False, shape=_rows),
    "alltoall": Op("all-to-all", "alltoall", "AllToAll",
                   (Baseline("all_to_all_single", _all_to_all_single),
                    Baseline("all_to_all", _all_to_all_lists),
                    Baseline("all_gather + select", _all_gather_select)),
                   _COPY_DTYPES, lambda n: n, lambda n: n, _ring, shape=_rows),
    "allreduce": Op("all-reduce", "allreduce", "AllReduce",
                    (Baseline("all_reduce", _all_reduce),),
                    ("float16", "bfloat16", "float32", "int32"), lambda n: n, lambda n: n, _ring_twice,
                    reduces=True, grid_per_peer=False, shape=lambda shard, world: (world * shard,)),
}
#: Column headers added for the reductions: TileScale with its input already in the symmetric
#: buffer against torch symmetric memory (whose input is always there), eager; then torch
#: symmetric memory replayed from a CUDA graph against ``TileScale graph us``.
SYMM_HEADERS = ["TS heap us", "symm us", "symm op", "vs symm", "symm graph us", "symm graph op", "graph vs symm"]
#: All-reduce size (bytes) of the graph goal line, and the goal: TileScale's replayed call at
#: most this fraction of torch symmetric memory's replayed one-shot (one rank, one H200).
GRAPH_GOAL_BYTES, GRAPH_GOAL = 4096, 0.8


def _op(op) -> Op:
    return OPS[op] if isinstance(op, str) else op


# ------------------------------------------------------------------------------ numbers
def bus_bandwidth(total_bytes: int, world: int, milliseconds: float, op="allgather") -> float:
    """nccl-tests' bus bandwidth in GB/s: ``factor(n) * total_bytes / t`` (``(n - 1) / n`` for
    the three collectives here; ``total_bytes`` is S, the larger of input and output)."""
    return gb_per_s(_op(op).bus_factor(world) * total_bytes, milliseconds)


def iters_for(nbytes: int, iters: int) -> int:
    """Fewer timed calls for large sizes (at least 3)."""
    return max(3, min(iters, iters * (64 << 20) // max(nbytes, 1)))


def shard_numel(nbytes: int, world: int, itemsize: int) -> int:
    """Elements per shard for a total size of ``nbytes`` (at least 1)."""
    return max(1, nbytes // world // itemsize)


def heap_bytes(op, sizes, world: int, dtype, max_blocks: int | None = None, *, device=None,
               algorithm: str | None = None) -> int:
    """Symmetric heap per rank for one collective of every size in ``sizes``, built in turn on
    one allocator (the heap is only returned at ``allocator.close()``): the sum over the sizes
    of what the constructor allocates (the class's ``heap_bytes``: a dry run of the
    constructor), plus :data:`HEAP_SLACK`.

    Args:
        dtype: a torch dtype, its name, or an itemsize in bytes (1, 2, 4 or 8: a dtype of that
            size; the heap depends on the size alone).
        max_blocks: the collectives' grid cap (default: ``device``'s SM count, as theirs).
        device: the device the collectives live on (default: the current CUDA device).
        algorithm: the ``algorithm`` they are built with (default: the largest heap over the
            class's ``ALGORITHMS``).
    """
    import torch

    op = _op(op)
    dtype = _dtype(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    cls = op.collective()
    algorithms = [algorithm] if algorithm is not None else list(cls.ALGORITHMS)
    extra = {} if max_blocks is None else {"max_blocks": max_blocks}
    total = HEAP_SLACK
    for nbytes in sizes:
        shape = op.shape(shard_numel(nbytes, world, itemsize), world)
        total += max(cls.heap_bytes(shape, dtype, world_size=world, device=device, algorithm=a, **extra)
                     for a in algorithms)
    return total


def _dtype(dtype):
    """A torch dtype from a dtype, its name or an itemsize."""
    import torch

    if isinstance(dtype, int) and not isinstance(dtype, bool):
        by_size = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}
        if dtype not in by_size:
            raise ValueError(f"itemsize must be one of {sorted(by_size)}, got {dtype}")
        return by_size[dtype]
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def tolerance(op, dtype: str, world: int):
    """``(rtol, atol)`` of the check against the baseline, or None for a bit-exact check."""
    if not _op(op).reduces or dtype not in RTOL:
        return None
    return RTOL[dtype], RTOL[dtype] * world * (world + 1) / 2


def outputs_match(out, ref, tol) -> bool:
    """Whether ``out`` equals ``ref`` (``tol`` None) or is ``allclose`` within ``tol``."""
    import torch

    if tol is None:
        return torch.equal(out, ref)
    return out.shape == ref.shape and torch.allclose(out, ref, rtol=tol[0], atol=tol[1])


def _check_name(tol) -> str:
    return "bit-exact" if tol is None else f"allclose rtol={tol[0]:g} atol={tol[1]:g}"


def random_input(shape, dtype, generator):
    """Floats uniform in [-1, 1) (rounding to the dtype may reach 1); ints in [0, 256) for uint8, [-1000, 1000) otherwise."""
    import torch

    if dtype.is_floating_point:
        return (torch.rand(shape, generator=generator) * 2 - 1).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(lo, hi, tuple(shape), generator=generator).to(dtype)


# ------------------------------------------------------------------------------ baseline
def pick_baseline(op, group, device, dtype, dist=None):
    """``(name, fn)``: the first of ``op.baselines`` that computes the right answer for a small
    input on this group (a backend may lack a collective, or, like older gloo with CUDA
    tensors, refuse it); ``fn(out, x)`` runs it on flat tensors. Every rank probes the same
    candidates in the same order, and a backend refuses on every rank alike."""
    import torch

    if dist is None:
        import torch.distributed as dist
    op = _op(op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = op.input_rows(world)
    inputs = [((torch.arange(rows * 2) + p * rows * 2) % 61).to(dtype).to(device).view(rows, 2)
              for p in range(world)]
    expect = op.reference(inputs, rank).reshape(-1)
    tol = tolerance(op, str(dtype).removeprefix("torch."), world)
    for baseline in op.baselines:
        out = torch.zeros_like(expect)
        try:
            baseline.call(dist, out, inputs[rank].reshape(-1), group, rank, world)
            ok = outputs_match(out, expect, tol)
        except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError):
            ok = False
        if ok:
            return baseline.name, functools.partial(baseline.call, dist, group=group, rank=rank, world=world)
    raise RuntimeError(f"no torch.distributed baseline for {op.name} works on this group")

