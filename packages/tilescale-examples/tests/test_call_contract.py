"""The call contract of the product classes (docs/architecture.md, "Call contract"), walked
over every class ``tilescale_examples`` exports (minus ``MoEDispatcher``, whose calls are
``dispatch`` / ``combine``) plus the tutorial ``TmaAllReduce``:

* constructor: ``(allocator, shape, dtype, *, world_size=None, algorithm=..., ...)`` (GEMM
  ops: ``(allocator, m_local, k, n, dtype, *, ...)``); ``dtype`` has no default; ``world_size``
  and everything after it keyword-only; one strategy keyword, ``algorithm``, typed
  ``Literal[...]`` with ``"auto"`` among its values;
* ``__call__(input, *, out=None)`` (GEMM ops ``(a, b, *, out=None)``);
* ``torch_reference(inputs, rank)``, the class's and its module's;
* :class:`~tilescale_examples.ClosedError` from every call after ``close()``;
* ``heap_bytes(...)`` equal to what the constructor allocates (a recording allocator, and
  tilescale-core's real allocator on a host-memory heap);
* the 0.1.0 spellings still work, each with a ``FutureWarning`` naming the new spelling.
"""

from __future__ import annotations

import inspect
import typing

import pytest
import torch
from examples_helpers import CpuAllocator, record_compiles

import tilescale_examples
from tilescale_examples import ClosedError
from tilescale_examples.base import OldSpellingWarning, SymmetricOp
from tilescale_examples.overlap import ag_gemm, gemm_rs
from tilescale_examples.tutorials import tma_allreduce
from tilescale_examples.tutorials.tma_allreduce import TmaAllReduce

PRODUCTS = [getattr(tilescale_examples, name) for name in tilescale_examples.__all__
            if name not in ("MoEDispatcher", "ClosedError")] + [TmaAllReduce]
GEMMS = {tilescale_examples.AllGatherGEMM, tilescale_examples.GemmReduceScatter}
IDS = [cls.__name__ for cls in PRODUCTS]
F16, F32 = torch.float16, torch.float32


def good_args(cls, world: int = 2) -> tuple:
    """Positional arguments (after the allocator) of a small instance on ``world`` ranks."""
    return {
        "AllGather": ((16,), F32), "AllToAll": ((world, 16), F32), "ReduceScatter": ((world, 16), F32),
        "AllReduce": ((16,), F32), "AllGatherGEMM": (128, 64, 256, F16), "GemmReduceScatter": (128, 64, 256, F16),
        "TmaAllReduce": ((64, 128), F32),
    }[cls.__name__]


def call_inputs(obj) -> tuple:
    """Inputs of one call of ``obj`` on the CPU."""
    if type(obj) in GEMMS:
        rows = obj.m_local if isinstance(obj, tilescale_examples.AllGatherGEMM) else obj.world_size * obj.m_local
        return torch.zeros((rows, obj.k), dtype=obj.dtype), torch.zeros((obj.k, obj.n), dtype=obj.dtype)
    return (torch.zeros(obj.shape, dtype=obj.dtype),)


@pytest.fixture
def compiles(monkeypatch):
    return record_compiles(monkeypatch, ag_gemm, gemm_rs, tma_allreduce)


@pytest.fixture
def fused_available(monkeypatch):
    """The GEMMs' fused algorithm as if the (CPU) device had stream memory operations."""
    monkeypatch.setattr("tilescale_examples.overlap.stream_ops.stream_ops_available", lambda device: (True, "stub"))


def test_the_products_are_symmetric_ops():
    assert len(PRODUCTS) == 7 and all(issubclass(cls, SymmetricOp) for cls in PRODUCTS)
    assert issubclass(ClosedError, RuntimeError) and tilescale_examples.ClosedError is ClosedError
    assert issubclass(OldSpellingWarning, FutureWarning)


# ------------------------------------------------------------------------------ signatures
@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_constructor_signature(cls):
    P = inspect.Parameter
    params = list(inspect.signature(cls).parameters.values())
    positional = ["allocator", "m_local", "k", "n", "dtype"] if cls in GEMMS else ["allocator", "shape", "dtype"]
    assert [p.name for p in params if p.kind is P.POSITIONAL_OR_KEYWORD] == positional
    assert [p.name for p in params[:len(positional)]] == positional
    assert all(p.kind is P.KEYWORD_ONLY for p in params[len(positional):])
    assert all(p.default is P.empty for p in params[:len(positional)])  # dtype (and the shape) required
    world, algorithm = params[len(positional)], params[len(positional) + 1]
    assert (world.name, world.default) == ("world_size", None)
    assert algorithm.name == "algorithm" and typing.get_origin(algorithm.annotation) is typing.Literal
    values = typing.get_args(algorithm.annotation)
    assert "auto" in values and set(values) == set(cls.ALGORITHMS) and algorithm.default in values
    names = {p.name for p in params}
    assert {"group", "target"} <= names and not names & {"shard_shape", "engine", "plan", "x"}


@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_call_signature(cls):
    P = inspect.Parameter
    params = list(inspect.signature(cls.__call__).parameters.values())[1:]
    inputs = ["a", "b"] if cls in GEMMS else ["input"]
    assert [(p.name, p.kind) for p in params] == [(n, P.POSITIONAL_OR_KEYWORD) for n in inputs] + [("out", P.KEYWORD_ONLY)]
    assert params[-1].default is None


@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_torch_reference_signature(cls):
    import importlib

    module = importlib.import_module(cls.__module__)
    for ref in (cls.torch_reference, module.torch_reference):
        params = list(inspect.signature(ref).parameters.values())
        assert [(p.name, p.kind, p.default) for p in params] == [
            ("inputs", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
            ("rank", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)]


# ------------------------------------------------------------------------------ behaviour
@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_every_call_after_close_raises_closed_error(cls, compiles):
    obj = cls(CpuAllocator(num_ranks=2), *good_args(cls))
    x = call_inputs(obj)
    obj.close()
    obj.close()  # idempotent
    assert obj.closed and obj.kernel is None
    with pytest.raises(ClosedError, match=f"this {cls.__name__} is closed"):
        obj(*x)
    with pytest.raises(ClosedError):
        obj(*x, out=torch.zeros(1))
    other = cls(CpuAllocator(num_ranks=2), *good_args(cls))
    other.allocator.closed = True
    with pytest.raises(ClosedError, match=f"the allocator of this {cls.__name__} is closed"):
        other(*call_inputs(other))


@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_a_call_takes_out_and_checks_it(cls, compiles):
    obj = cls(CpuAllocator(num_ranks=2), *good_args(cls))
    with pytest.raises(ValueError, match=r"out has shape \(3, 3\)"):
        obj(*call_inputs(obj), out=torch.zeros((3, 3), dtype=obj.dtype))
    with pytest.raises(TypeError, match="out has dtype torch.float64"):
        obj(*call_inputs(obj), out=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        obj(*call_inputs(obj), out=[0.0])
    assert obj.epoch == 0  # refused before anything ran


@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_input_shape_is_shape(cls, compiles):
    if cls in GEMMS:
        pytest.skip("a GEMM's inputs are a and b (m_local, k, n)")
    obj = cls(CpuAllocator(num_ranks=2), *good_args(cls))
    assert obj.input_shape == obj.shape == tuple(good_args(cls)[0])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_heap_bytes_is_what_the_constructor_allocates(cls, world, compiles, fused_available):
    args = good_args(cls, world)
    for algorithm in cls.ALGORITHMS:
        alloc = CpuAllocator(num_ranks=world)
        obj = cls(alloc, *args, algorithm=algorithm)
        want = cls.heap_bytes(*args, world_size=world, algorithm=obj.algorithm, device="cpu")
        assert alloc.heap_bytes == want, (algorithm, alloc.allocations)
        if algorithm == "auto" and not cls._AUTO_PROBES:  # chosen by size: the dry run chooses alike
            assert cls.heap_bytes(*args, world_size=world, device="cpu") == want
    if cls._AUTO_PROBES:  # chosen by probing devices: the larger
        assert cls.heap_bytes(*args, world_size=world, device="cpu") == max(
            cls.heap_bytes(*args, world_size=world, algorithm=a, device="cpu") for a in cls._AUTO_PROBES)


def test_heap_bytes_follows_max_blocks_and_allocates_nothing(compiles):
    """The flags grow with the grid; a dry run allocates no memory and compiles nothing."""
    from tilescale_examples.base import RecordingAllocator

    big = 1 << 22
    small = tilescale_examples.AllReduce.heap_bytes((big,), F16, world_size=2, max_blocks=8)
    large = tilescale_examples.AllReduce.heap_bytes((big,), F16, world_size=2, max_blocks=128)
    assert large > small
    recording = RecordingAllocator(2)
    tilescale_examples.AllGatherGEMM(recording, 128, 64, 256, F16, world_size=2, algorithm="sequential")
    assert recording.records and recording.heap_bytes > 0 and compiles == []


@pytest.mark.parametrize("cls", PRODUCTS, ids=IDS)
def test_heap_bytes_on_the_real_allocator(cls, compiles):
    """On tilescale-core's allocator (a host-memory heap, one rank) the bytes the constructor
    takes, rounded to the heap's alignment, are ``heap_bytes``."""
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    alloc = BaseAllocator(1 << 22, device="cpu", is_distributed=False, backend=HostBackend())
    try:
        obj = cls(alloc, *good_args(cls, 1))
        assert -(-alloc.used // 256) * 256 == cls.heap_bytes(*good_args(cls, 1), world_size=1,
                                                              algorithm=obj.algorithm, device="cpu")
        obj.close()
    finally:
        alloc.close()


# ------------------------------------------------------------------------------ 0.1.0 spellings
def _old(match: str):
    return pytest.warns(OldSpellingWarning, match=match)


def test_old_constructor_spellings_work_and_warn(compiles):
    from tilescale_examples import AllGather, AllGatherGEMM, AllReduce, AllToAll, GemmReduceScatter, ReduceScatter

    alloc = CpuAllocator(num_ranks=2)
    with _old(r"AllGather\(shard_shape=...\) is the 0.1.0 spelling .*use shape="):
        assert AllGather(alloc, shard_shape=(16,), dtype=F32).shape == (16,)
    with _old(r"AllGather\(engine=...\).*use algorithm="):
        assert AllGather(alloc, (16,), F32, engine="copy").algorithm == "copy"
    with _old(r"world_size\) passed positionally .*use world_size=\.\.\. \(keyword-only\)"):
        assert AllReduce(alloc, (16,), F32, 2).world_size == 2
    for cls in (AllToAll, ReduceScatter):
        with _old(rf"{cls.__name__}\(shard_shape=\(16,\)\).*use shape=\(world_size, \*shard_shape\) = \(2, 16\)"):
            assert cls(alloc, shard_shape=16, dtype=F32).shape == (2, 16)
        with _old(rf"{cls.__name__}\(allocator, \(16,\), ...\) with the row shape.*\(2, 16\)"):
            obj = cls(alloc, (16,), F32)
        assert obj.shape == (2, 16) and obj.shard_shape == (16,)
    for cls in (AllGatherGEMM, GemmReduceScatter):
        with _old(rf"{cls.__name__}\(\) without dtype \(0.1.0 default torch.float16\).*dtype=torch.float16"):
            assert cls(alloc, 128, 64, 256).dtype == F16
        with _old(rf"{cls.__name__}\(plan=...\).*use algorithm="):
            obj = cls(alloc, 128, 64, 256, F16, plan="sequential")
        assert obj.algorithm == obj.plan == "sequential" and obj.plan_reason == obj.algorithm_reason
    with _old("TmaAllReduce"):
        tma = TmaAllReduce(alloc)  # 0.1.0: shape (64, 128) and float32 by default
    assert tma.shape == (64, 128) and tma.dtype == F32 and tma.out is tma.output
    with pytest.warns(OldSpellingWarning) as record:
        assert TmaAllReduce(alloc, (64, 128), None, 1).max_blocks == 1  # 0.1.0: group, max_blocks
    said = [str(w.message) for w in record]
    assert [m.split(" is the 0.1.0")[0] for m in said] == [
        "TmaAllReduce(..., group) passed positionally", "TmaAllReduce(..., max_blocks) passed positionally",
        "TmaAllReduce() without dtype (0.1.0 default torch.float32)"]
    with pytest.raises(TypeError, match="got both shard_shape= and shape="):
        AllGather(alloc, shape=(16,), shard_shape=(16,), dtype=F32)
    with pytest.raises(TypeError, match="got both engine= and algorithm="):
        AllGather(alloc, (16,), F32, engine="sm", algorithm="sm")


def test_an_old_spelling_warns_at_the_callers_line(compiles):
    with pytest.warns(OldSpellingWarning) as record:
        tilescale_examples.AllReduce(CpuAllocator(num_ranks=2), (16,), F32, 2)
    assert [w.filename for w in record] == [__file__]


def test_positional_out_works_and_warns(compiles):
    from tilescale_examples.base import accepts_0_1_out

    class Op:
        @accepts_0_1_out(1)
        def __call__(self, input, *, out=None):
            return input, out

    with _old(r"Op\(..., out\) passed positionally .*use out=\.\.\. \(keyword-only\)"):
        assert Op()(1, 2) == (1, 2)
    assert Op()(1, out=3) == (1, 3)
    with pytest.raises(TypeError, match="takes 1 input"):
        Op()(1, 2, out=3)
    ar = tilescale_examples.AllReduce(CpuAllocator(num_ranks=2), (16,), F32)
    ar.close()
    with _old("out"), pytest.raises(ClosedError):
        ar(torch.zeros(16), torch.zeros(16))  # translated, then the call refuses: closed


def test_old_torch_reference_spellings_work_and_warn():
    from tilescale_examples.collectives import allgather, allreduce

    xs = [torch.full((3,), float(r)) for r in range(2)]
    for module in (allgather, allreduce, tma_allreduce):
        with _old(r"torch_reference\(.*\) is the 0.1.0 spelling .*use torch_reference\(inputs, rank\)"):
            old = module.torch_reference(xs)
        assert torch.equal(old, module.torch_reference(xs, 0))
    a = [torch.randn(4, 3) for _ in range(2)]
    b = torch.randn(3, 5)
    with _old(r"ag_gemm.torch_reference\(a_shards, b\)"):
        assert torch.equal(ag_gemm.torch_reference(a, b), ag_gemm.torch_reference([(x, b) for x in a], 0))
    aa, bb = [torch.randn(4, 3) for _ in range(2)], [torch.randn(3, 5) for _ in range(2)]
    with _old(r"gemm_rs.torch_reference\(a_shards, b_shards, rank\)"):
        assert torch.equal(gemm_rs.torch_reference(aa, bb, 1), gemm_rs.torch_reference(list(zip(aa, bb)), 1))
