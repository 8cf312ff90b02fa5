"""The bad-argument tally of the collective constructors (issue 39, docs/reliability.md).

Every argument of every collective constructor (``inspect.signature``) gets bad values (wrong
type, a bool for an int, zero / negative, out of range, an unknown string); each must raise
``TypeError``/``ValueError`` naming the argument before anything is allocated on the heap
(:class:`examples_helpers.CpuAllocator` records allocations) or compiled
(the ``compiles`` fixture).  :func:`test_every_constructor_argument_has_a_case`
fails when an argument has no case, so a new one cannot slip in untested.  Counts for the
docs: :data:`TALLY`.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from examples_helpers import CpuAllocator, build_rejected

from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
from tilescale_examples.collectives.allgather import AllGather
from tilescale_examples.collectives.allreduce import AllReduce
from tilescale_examples.collectives.alltoall import AllToAll
from tilescale_examples.overlap.gemm_rs import GemmReduceScatter
from tilescale_examples.moe.dispatcher import MoEDispatcher
from tilescale_examples.collectives.reducescatter import ReduceScatter
from tilescale_examples.tutorials.tma_allreduce import TmaAllReduce

#: Constructor -> good arguments besides ``allocator`` (a 2-rank CpuAllocator).
GOOD = {
    AllReduce: dict(shape=(16,), dtype=torch.float32),
    ReduceScatter: dict(shape=(2, 16), dtype=torch.float32),
    AllGather: dict(shape=(16,), dtype=torch.float32),
    AllToAll: dict(shape=(2, 16), dtype=torch.float32),
    AllGatherGEMM: dict(m_local=128, k=64, n=256, dtype=torch.float16),
    GemmReduceScatter: dict(m_local=128, k=64, n=256, dtype=torch.float16),
    MoEDispatcher: dict(num_experts=8, hidden=64, topk=2, max_tokens=16, dtype=torch.bfloat16),
    TmaAllReduce: dict(shape=(64, 128), dtype=torch.float32),
}

_SHAPE = [(4, 0), (), -1, 1.5, True, "16", (1 << 31,)]
_COUNT = [0, -1, True, 1.5]
#: Argument name -> bad values (each constructor taking that argument gets them all).
BAD = {
    "allocator": [None, object()],
    "shape": _SHAPE,
    "dtype": ["nonsense", 3, torch.complex64],
    "world_size": [3, 0, -1, True, 1.5],
    "algorithm": ["three_shot", 3, None],
    "group": [object(), 3, "world"],
    "threads": [48, 0, -32, True, 1.5, 1 << 20],
    "max_blocks": [0, -1, True, 1.5],
    "unroll": [0, -1, True, 1.5],
    "min_chunk_bytes": [0, -1, True, 1.5],
    "target": ["bogus", {"kind": "nope"}, 3, object()],
    "m_local": _COUNT, "k": _COUNT, "n": _COUNT,
    "block_m": [0, -1, 3, True], "block_n": [0, -1, 3, True], "block_k": [0, -1, 3, True],
    "num_stages": _COUNT, "max_chunks": [0, True, 1.5], "swizzle": [-1, True, 1.5], "pipeline": ["fast", 3, None],
    "warp_policy": ["diagonal", 2, None], "store": ["fast", 3, "TMA"],
    "num_experts": _COUNT + [7, 257], "hidden": [0, True, 1.5, 60], "topk": _COUNT + [9],
    "max_tokens": [0, True, 1.5, 4097],
    "index_dtype": [torch.float32, torch.int16, "int64"],
    "validate": ["yes", 1],
}
#: (constructor, argument) pairs with no bad value, and why: none (group and target are
#: checked too); keep entries commented if one is ever added.
NO_BAD_VALUE: frozenset = frozenset()

PROBES = [(cls, arg, value) for cls in GOOD for arg in inspect.signature(cls).parameters for value in BAD.get(arg, [])]
ARGUMENTS = {(cls, arg) for cls in GOOD for arg in inspect.signature(cls).parameters}
#: Counts cited by docs/reliability.md.
TALLY = {
    "probes": len(PROBES),
    "constructors": len(GOOD),
    "arguments": len({(cls, arg) for cls, arg, _ in PROBES}),
}


@pytest.mark.parametrize("cls", list(GOOD), ids=[c.__name__ for c in GOOD])
def test_good_arguments_build(cls, compiles):
    alloc = CpuAllocator(num_ranks=2)
    cls(allocator=alloc, **GOOD[cls])
    assert alloc.allocations and compiles  # the probes below differ from this by one argument


@pytest.mark.parametrize("cls,arg,value", PROBES, ids=[f"{c.__name__}.{a}={v!r}" for c, a, v in PROBES])
def test_bad_argument_rejected_before_allocating(cls, arg, value, compiles):
    error = build_rejected(cls, {**GOOD[cls], arg: value}, (TypeError, ValueError), compiles=compiles)
    assert re.search(rf"(?<![A-Za-z0-9_]){arg}(?![A-Za-z0-9_])", str(error)), \
        f"{cls.__name__}({arg}={value!r}): the error does not name {arg!r}: {error}"


def test_every_constructor_argument_has_a_case():
    assert NO_BAD_VALUE <= ARGUMENTS
    probed = {(cls, arg) for cls, arg, _ in PROBES}
    missing = sorted(f"{cls.__name__}.{arg}" for cls, arg in ARGUMENTS - probed - NO_BAD_VALUE)
    assert missing == [], "constructor arguments without a bad-value case"
    assert TALLY["arguments"] == len(ARGUMENTS) - len(NO_BAD_VALUE)


@pytest.mark.parametrize("cls", [AllGatherGEMM, GemmReduceScatter], ids=lambda c: c.__name__)
def test_the_overlapped_gemms_take_every_field_of_a_tuned_tiles(cls, compiles):
    """``**dataclasses.asdict(tiles)`` (docs/autotune.md) passes every GemmTiles field."""
    import dataclasses

    from tilescale_examples.overlap.gemm import GemmTiles

    tiles = GemmTiles(128, 256, 64, 4, 256, 8, "async", "row")
    op = cls(allocator=CpuAllocator(num_ranks=2), **GOOD[cls], **dataclasses.asdict(tiles))
    assert op.tiles == tiles
