"""The call contract of the product classes (docs/architecture.md, "Call contract"), walked
over every class ``tilescale_examples`` exports (``MoEDispatcher``, whose calls are ``dispatch``
/ ``combine``, and ``AllReduceResidualRMSNorm``, whose call takes three inputs and returns a
tuple, ``GemmAllReduce``, a GEMM op with no ``algorithm``, and the sequence-parallel ops
(``SPFlashDecode``, ``SPAllGatherAttention``), whose calls take queries and this rank's K/V
shard, in sections of their own: the
contract where it applies) plus the tutorial
``TmaAllReduce``:

* constructor: ``(allocator, shape, dtype, *, world_size=None, algorithm=..., ...)`` (GEMM
  ops: ``(allocator, m_local, k, n, dtype, *, ...)``); ``dtype`` has no default; ``world_size``
  and everything after it keyword-only; one strategy keyword, ``algorithm``, typed
  ``Literal[...]`` with ``"auto"`` among its values;
* ``__call__(input, *, out=None)`` (GEMM ops ``(a, b, *, out=None)``);
* ``torch_reference(inputs, rank)``, the class's and its module's (plus, with their defaults,
  the constructor options the result depends on: ``UlyssesAllToAll``'s ``direction``);
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
            if name not in ("MoEDispatcher", "AllReduceResidualRMSNorm", "ClosedError", "MoELowLatency",
                            "GemmAllReduce", "SPFlashDecode", "SPAllGatherAttention")] + [TmaAllReduce]
GEMMS = {tilescale_examples.AllGatherGEMM, tilescale_examples.GemmReduceScatter}
IDS = [cls.__name__ for cls in PRODUCTS]
F16, F32 = torch.float16, torch.float32


def good_args(cls, world: int = 2) -> tuple:
    """Positional arguments (after the allocator) of a small instance on ``world`` ranks."""
    return {
        "AllGather": ((16,), F32), "AllToAll": ((world, 16), F32), "ReduceScatter": ((world, 16), F32),
        "AllReduce": ((16,), F32), "AllGatherGEMM": (128, 64, 256, F16), "GemmReduceScatter": (128, 64, 256, F16),
        "TmaAllReduce": ((64, 128), F32), "UlyssesAllToAll": ((2, 8, 2 * world, 16), F32),
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
    assert len(PRODUCTS) == 8 and all(issubclass(cls, SymmetricOp) for cls in PRODUCTS)
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
        assert [(p.name, p.kind, p.default) for p in params[:2]] == [
            ("inputs", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
            ("rank", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)]
        # beyond them only the constructor options the result depends on, with their defaults
        assert all(p.default is not inspect.Parameter.empty and p.name in inspect.signature(cls).parameters
                   for p in params[2:]), params


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
    from tilescale_examples.base import accepts_0_1_out, positional_out

    class Op:
        @accepts_0_1_out(1)
        def __call__(self, input, *out_0_1, out=None):
            if out_0_1:
                out = positional_out(self, 1, out_0_1, out)
            return input, out

    with _old(r"Op\(..., out\) passed positionally .*use out=\.\.\. \(keyword-only\)"):
        assert Op()(1, 2) == (1, 2)
    assert Op()(1, out=3) == (1, 3)
    with pytest.raises(TypeError, match="takes 1 input"):
        Op()(1, 2, out=3)
    with pytest.raises(TypeError, match="takes 1 input"):
        Op()(1, 2, 3)
    assert Op()(input=1) == (1, None)
    # the signature shown is the contract's; the decorator adds no call of its own
    assert str(inspect.signature(Op.__call__)) == "(self, input, *, out=None)"
    assert Op.__call__.__code__.co_name == "__call__" and not hasattr(Op.__call__, "__wrapped__")
    for op in (tilescale_examples.AllReduce, tilescale_examples.AllGather, tilescale_examples.AllToAll,
               tilescale_examples.ReduceScatter, tilescale_examples.AllGatherGEMM, tilescale_examples.GemmReduceScatter):
        assert "out_0_1" not in str(inspect.signature(op.__call__)), op
    with pytest.raises(TypeError, match=r"must take 1 input\(s\), then \*out_0_1"):
        accepts_0_1_out(1)(lambda self, input, *, out=None: None)
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


# ------------------------------------------------------------------------------ MoEDispatcher
#: MoEDispatcher's positional arguments after the allocator: num_experts, hidden, topk, max_tokens, dtype.
MOE_ARGS = (8, 64, 2, 16, F16)


def _moe(alloc=None, world: int = 2):
    return tilescale_examples.MoEDispatcher(alloc or CpuAllocator(num_ranks=world), *MOE_ARGS,
                                           index_dtype=torch.int32)


def _moe_inputs(moe, tokens: int = 3) -> tuple:
    return (torch.zeros((tokens, moe.hidden), dtype=moe.dtype), torch.zeros((tokens, moe.topk), dtype=torch.int32),
            torch.zeros((tokens, moe.topk)))


def test_moe_constructor_follows_the_contract():
    """``(allocator, num_experts, hidden, topk, max_tokens, dtype, *, world_size=None, ...)``:
    the shape arguments and ``dtype`` required, everything after ``dtype`` keyword-only,
    ``world_size`` first; one kernel per call, so no ``algorithm``."""
    P = inspect.Parameter
    cls = tilescale_examples.MoEDispatcher
    params = list(inspect.signature(cls).parameters.values())
    positional = ["allocator", "num_experts", "hidden", "topk", "max_tokens", "dtype"]
    assert issubclass(cls, SymmetricOp)
    assert [p.name for p in params if p.kind is P.POSITIONAL_OR_KEYWORD] == positional
    assert [p.name for p in params[:len(positional)]] == positional
    assert all(p.default is P.empty for p in params[:len(positional)])
    assert all(p.kind is P.KEYWORD_ONLY for p in params[len(positional):])
    assert (params[len(positional)].name, params[len(positional)].default) == ("world_size", None)
    names = {p.name for p in params}
    assert {"group", "target"} <= names and not names & {"algorithm", "engine", "plan", "shape"}


def test_moe_calls_are_dispatch_and_combine():
    P = inspect.Parameter
    cls = tilescale_examples.MoEDispatcher
    assert not any("__call__" in vars(k) for k in cls.__mro__ if k is not object)
    dispatch = list(inspect.signature(cls.dispatch).parameters.values())[1:]
    arg = P.POSITIONAL_OR_KEYWORD
    assert [(p.name, p.kind) for p in dispatch] == [("x", arg), ("topk_idx", arg), ("topk_weights", arg),
                                                  ("validate", P.KEYWORD_ONLY)]
    combine = list(inspect.signature(cls.combine).parameters.values())[1:]
    assert [(p.name, p.kind) for p in combine] == [("y", arg), ("handle", arg)]


def test_moe_every_call_after_close_raises_closed_error(compiles):
    from examples_helpers import LaunchRecorder
    from tilescale_lang.profiler import EventProfiler

    moe = _moe()
    launched = []
    moe.dispatch_kernel = moe.combine_kernel = LaunchRecorder(launched)
    x, idx, w = _moe_inputs(moe)
    handle = moe.dispatch(x, idx, w)[2]
    y = torch.zeros((moe.capacity, moe.hidden), dtype=moe.dtype)
    prof = EventProfiler(blocks=moe.blocks, capacity=7, device="cpu")
    moe.close()
    moe.close()  # idempotent
    assert moe.closed and moe.kernel is None and moe.dispatch_kernel is None and moe.recv_x is None
    calls = {"dispatch": lambda: moe.dispatch(x, idx, w),
             "dispatch_profiled": lambda: moe.dispatch_profiled(x, idx, w, prof),
             "combine": lambda: moe.combine(y, handle), "check_index_errors": moe.check_index_errors,
             "handle.origin": handle.origin}
    for name, call in calls.items():
        with pytest.raises(ClosedError, match="this MoEDispatcher is closed"):
            call()
    assert len(launched) == 1 and moe._profiled_kernel is None  # nothing ran or compiled after close
    other = _moe()
    other.allocator.closed = True
    with pytest.raises(ClosedError, match="the allocator of this MoEDispatcher is closed"):
        other.dispatch(*_moe_inputs(other))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_heap_bytes_is_what_the_constructor_allocates(world, compiles):
    cls = tilescale_examples.MoEDispatcher
    for dtype in (F16, torch.bfloat16):
        alloc = CpuAllocator(num_ranks=world)
        cls(alloc, *MOE_ARGS[:4], dtype, max_blocks=world)
        want = cls.heap_bytes(*MOE_ARGS[:4], dtype, world_size=world, device="cpu")
        assert alloc.heap_bytes == want, alloc.allocations
    # the heap does not depend on the grid: neither max_blocks nor the device's SM count changes it
    assert cls.heap_bytes(*MOE_ARGS, world_size=world, max_blocks=1) == cls.heap_bytes(*MOE_ARGS, world_size=world)


def test_moe_heap_bytes_on_the_real_allocator_and_without_compiling(compiles):
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    from tilescale_examples.base import RecordingAllocator

    alloc = BaseAllocator(1 << 22, device="cpu", is_distributed=False, backend=HostBackend())
    try:
        _moe(alloc).close()
        assert -(-alloc.used // 256) * 256 == tilescale_examples.MoEDispatcher.heap_bytes(*MOE_ARGS, world_size=1)
    finally:
        alloc.close()
    built = len(compiles)
    recording = RecordingAllocator(2)
    _moe(recording)
    assert len(recording.records) == 6 and len(compiles) == built  # a dry run compiles nothing
    with pytest.raises(TypeError, match="world_size"):
        tilescale_examples.MoEDispatcher.heap_bytes(*MOE_ARGS)


def test_moe_old_spellings_work_and_warn(compiles):
    from tilescale_examples.moe import dispatcher

    cls = tilescale_examples.MoEDispatcher
    with _old(r"MoEDispatcher\(\) without dtype \(0.1.0 default torch.bfloat16\).*dtype=torch.bfloat16"):
        assert cls(CpuAllocator(num_ranks=2), *MOE_ARGS[:4]).dtype == torch.bfloat16
    exact = cls.heap_bytes(*MOE_ARGS[:4], torch.bfloat16, world_size=2)
    with _old(r"MoEDispatcher.heap_bytes\(num_experts, hidden, topk, max_tokens, world_size, dtype\) is the 0.1.0 "
              r"spelling .*use MoEDispatcher.heap_bytes\(num_experts, hidden, topk, max_tokens, dtype, \*, world_size"):
        assert cls.heap_bytes(*MOE_ARGS[:4], 2) == exact  # 0.1.0: world_size positional, bfloat16 by default
    with _old("0.1.0 spelling"):
        assert cls.heap_bytes(*MOE_ARGS[:4], 2, F16) == cls.heap_bytes(*MOE_ARGS, world_size=2)
    with _old(r"MoEDispatcher\(\) without dtype"):
        assert cls.heap_bytes(num_experts=8, hidden=64, topk=2, max_tokens=16, world_size=2) == exact
    assert dispatcher.heap_bytes(*MOE_ARGS[:4], 2) == exact  # the module's function keeps 0.1.0's order, silently


# ------------------------------------------------------------------------------ AllReduceResidualRMSNorm
def test_decode_norm_follows_the_contract_where_it_applies(compiles):
    """``(allocator, shape, dtype, *, world_size=None, algorithm="auto", ..., target=None)``
    (``algorithm``: the exchange of its one kernel, a ``Literal`` with ``"auto"``, as the
    collectives'); its call ``(x, residual, weight, *, out=None,
    residual_out=None, scales_out=None)``; ``torch_reference(inputs, rank)``, the class's and
    its module's; :class:`ClosedError` after ``close()``; ``heap_bytes`` what the constructor
    takes on tilescale-core's allocator. (The rest, the argument errors among it, is in
    ``test_decode_norm.py``.)"""
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    from tilescale_examples.decode import allreduce_norm

    P = inspect.Parameter
    cls = tilescale_examples.AllReduceResidualRMSNorm
    params = list(inspect.signature(cls).parameters.values())
    assert issubclass(cls, SymmetricOp) and [p.name for p in params[:3]] == ["allocator", "shape", "dtype"]
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty for p in params[:3])
    assert all(p.kind is P.KEYWORD_ONLY for p in params[3:]) and (params[3].name, params[3].default) == ("world_size", None)
    assert {"group", "target", "eps", "fp8"} <= {p.name for p in params}
    algorithm = params[4]
    assert algorithm.name == "algorithm" and typing.get_origin(algorithm.annotation) is typing.Literal
    assert set(typing.get_args(algorithm.annotation)) == set(cls.ALGORITHMS) and algorithm.default == "auto"
    call = list(inspect.signature(cls.__call__).parameters.values())[1:]
    assert [(p.name, p.kind, p.default) for p in call] == [
        ("x", P.POSITIONAL_OR_KEYWORD, P.empty), ("residual", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("weight", P.POSITIONAL_OR_KEYWORD, P.empty), ("out", P.KEYWORD_ONLY, None),
        ("residual_out", P.KEYWORD_ONLY, None), ("scales_out", P.KEYWORD_ONLY, None)]
    for ref in (cls.torch_reference, allreduce_norm.torch_reference):
        assert [p.name for p in inspect.signature(ref).parameters.values()][:2] == ["inputs", "rank"]
    for algorithm in cls.ALGORITHMS:
        alloc = BaseAllocator(1 << 22, device="cpu", is_distributed=False, backend=HostBackend())
        try:
            op = cls(alloc, (4, 1024), torch.bfloat16, algorithm=algorithm)
            assert -(-alloc.used // 256) * 256 == cls.heap_bytes((4, 1024), torch.bfloat16, world_size=1, device="cpu",
                                                                 algorithm=algorithm)
            x = torch.zeros((4, 1024), dtype=torch.bfloat16)
            op.close()
            with pytest.raises(ClosedError, match="this AllReduceResidualRMSNorm is closed"):
                op(x, x, x[0])
        finally:
            alloc.close()


# ------------------------------------------------------------------------------ MoELowLatency
def test_moe_low_latency_follows_the_contract_where_it_applies(compiles):
    """``MoELowLatency(allocator, num_experts, hidden, topk, max_tokens, dtype, *, world_size=None,
    fp8=False, ...)`` like ``MoEDispatcher`` (no ``algorithm``: one kernel per phase); its calls
    ``dispatch(x, topk_idx, topk_weights=None, *, return_recv_hook=False, validate=None)`` and
    ``combine(y, handle, topk_weights=None)``; :class:`ClosedError` after ``close()``;
    ``heap_bytes`` what the constructor takes on tilescale-core's allocator. (The rest: in
    ``test_moe_low_latency.py``.)"""
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    P = inspect.Parameter
    cls = tilescale_examples.MoELowLatency
    params = list(inspect.signature(cls).parameters.values())
    positional = ["allocator", "num_experts", "hidden", "topk", "max_tokens", "dtype"]
    assert issubclass(cls, SymmetricOp) and [p.name for p in params[:len(positional)]] == positional
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty for p in params[:len(positional)])
    assert all(p.kind is P.KEYWORD_ONLY for p in params[len(positional):])
    assert (params[len(positional)].name, params[len(positional)].default) == ("world_size", None)
    names = {p.name for p in params}
    assert {"group", "target", "fp8"} <= names and not names & {"algorithm", "engine", "plan", "shape"}
    assert not any("__call__" in vars(k) for k in cls.__mro__ if k is not object)
    arg = P.POSITIONAL_OR_KEYWORD
    dispatch = list(inspect.signature(cls.dispatch).parameters.values())[1:]
    assert [(p.name, p.kind) for p in dispatch] == [("x", arg), ("topk_idx", arg), ("topk_weights", arg),
                                                  ("return_recv_hook", P.KEYWORD_ONLY), ("validate", P.KEYWORD_ONLY)]
    combine = list(inspect.signature(cls.combine).parameters.values())[1:]
    assert [(p.name, p.kind) for p in combine] == [("y", arg), ("handle", arg), ("topk_weights", arg)]
    alloc = BaseAllocator(1 << 22, device="cpu", is_distributed=False, backend=HostBackend())
    try:
        ll = cls(alloc, *MOE_ARGS[:4], torch.bfloat16)
        assert -(-alloc.used // 256) * 256 == cls.heap_bytes(*MOE_ARGS[:4], torch.bfloat16, world_size=1)
        x, idx = torch.zeros((3, 64), dtype=torch.bfloat16), torch.zeros((3, 2), dtype=torch.long)
        ll.close()
        ll.close()  # idempotent
        for call in (lambda: ll.dispatch(x, idx), lambda: ll.combine(x, None), ll.check_index_errors):
            with pytest.raises(ClosedError, match="this MoELowLatency is closed"):
                call()
    finally:
        alloc.close()


# ------------------------------------------------------------------------------ GemmAllReduce
def test_gemm_allreduce_follows_the_contract_where_it_applies(compiles):
    """``GemmAllReduce(allocator, m, k, n, dtype, *, world_size=None, group=None, block_m=...,
    ..., max_blocks=None, target=None)``: the GEMM ops' with ``m`` (every rank's rows, not a
    shard) and no ``algorithm`` (one kernel per call); its call ``(a, b, *, out=None)``;
    ``torch_reference(inputs, rank)`` with ``inputs[p] = (a_p, b_p)``, the class's and its
    module's; :class:`ClosedError` after ``close()``; ``heap_bytes`` what the constructor takes
    on tilescale-core's allocator. (The rest, the argument errors among it, is in
    ``test_gemm_allreduce.py``.)"""
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    from tilescale_examples.decode import gemm_allreduce

    P = inspect.Parameter
    cls = tilescale_examples.GemmAllReduce
    params = list(inspect.signature(cls).parameters.values())
    assert issubclass(cls, SymmetricOp) and [p.name for p in params[:5]] == ["allocator", "m", "k", "n", "dtype"]
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty for p in params[:5])
    assert all(p.kind is P.KEYWORD_ONLY for p in params[5:]) and (params[5].name, params[5].default) == ("world_size", None)
    names = {p.name for p in params}
    assert {"group", "target", "block_m", "block_n", "block_k", "threads", "max_blocks"} <= names
    assert not names & {"algorithm", "engine", "plan", "m_local", "shape"}
    call = list(inspect.signature(cls.__call__).parameters.values())[1:]
    assert [(p.name, p.kind, p.default) for p in call] == [
        ("a", P.POSITIONAL_OR_KEYWORD, P.empty), ("b", P.POSITIONAL_OR_KEYWORD, P.empty), ("out", P.KEYWORD_ONLY, None)]
    for ref in (cls.torch_reference, gemm_allreduce.torch_reference):
        assert [p.name for p in inspect.signature(ref).parameters.values()] == ["inputs", "rank"]
    alloc = BaseAllocator(1 << 22, device="cpu", is_distributed=False, backend=HostBackend())
    try:
        op = cls(alloc, 3, 128, 256, torch.bfloat16)
        assert -(-alloc.used // 256) * 256 == cls.heap_bytes(3, 128, 256, torch.bfloat16, world_size=1, device="cpu")
        a, b = torch.zeros((3, 128), dtype=torch.bfloat16), torch.zeros((128, 256), dtype=torch.bfloat16)
        op.close()
        op.close()  # idempotent
        with pytest.raises(ClosedError, match="this GemmAllReduce is closed"):
            op(a, b)
        with pytest.raises(ClosedError):
            op(a, b, out=torch.zeros(1))
    finally:
        alloc.close()


# ------------------------------------------------------------------------------ sequence parallelism
SEQUENCE_OPS = {  # name: (positional names after the allocator, small arguments, call inputs, option names,
    #                        the algorithm keyword's values or None)
    "SPFlashDecode": (["batch", "heads", "kv_heads", "seq_local", "head_dim", "dtype"], (1, 8, 2, 128, 64, torch.bfloat16),
                      ((1, 8, 64), (1, 128, 2, 64), (1, 128, 2, 64)), {"splits", "scale"}, None),
    "SPAllGatherAttention": (["batch", "seq_local", "heads", "kv_heads", "head_dim", "dtype"],
                             (1, 128, 4, 2, 64, torch.bfloat16), ((1, 128, 4, 64), (1, 128, 2, 64), (1, 128, 2, 64)),
                             {"causal", "scale"}, ("auto", "fused", "sequential")),
}


@pytest.mark.parametrize("name", list(SEQUENCE_OPS))
def test_sequence_ops_follow_the_contract_where_it_applies(name, compiles):
    """``Cls(allocator, <sizes>, dtype, *, world_size=None, group=None, ..., target=None)``: no
    ``algorithm`` where there is one plan, else ``algorithm: Literal[...] = "auto"`` keyword-only
    with the class's ``ALGORITHMS``; the call ``(q, k, v, *, <options>=None, out=None, lse=None)``
    (queries and this rank's K/V shard); ``torch_reference(inputs, rank)`` with ``inputs[p] = (q_p, k_p, v_p)``,
    the class's and its module's; :class:`ClosedError` after ``close()``; ``heap_bytes`` what
    the constructor takes on tilescale-core's allocator. (The rest is in their own tests.)"""
    import importlib

    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    positional, args, inputs, options, algorithms = SEQUENCE_OPS[name]
    P = inspect.Parameter
    cls = getattr(tilescale_examples, name)
    params = list(inspect.signature(cls).parameters.values())
    n = len(positional) + 1
    assert issubclass(cls, SymmetricOp) and [p.name for p in params[:n]] == ["allocator"] + positional
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty for p in params[:n])
    assert all(p.kind in (P.KEYWORD_ONLY, P.VAR_KEYWORD) for p in params[n:])
    assert (params[n].name, params[n].default) == ("world_size", None)
    assert {"group", "target"} | options <= {p.name for p in params}
    by_name = {p.name: p for p in params}
    if algorithms is None:
        assert "algorithm" not in by_name
    else:
        algorithm = by_name["algorithm"]
        assert algorithm.kind is P.KEYWORD_ONLY and algorithm.default == "auto"
        assert typing.get_args(algorithm.annotation) == algorithms == cls.ALGORITHMS
    call = list(inspect.signature(cls.__call__).parameters.values())[1:]
    assert [(p.name, p.kind, p.default) for p in call[:3]] == [
        ("q", P.POSITIONAL_OR_KEYWORD, P.empty), ("k", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("v", P.POSITIONAL_OR_KEYWORD, P.empty)]
    assert all(p.kind is P.KEYWORD_ONLY and p.default is None for p in call[3:])  # options, then out and lse
    assert [p.name for p in call[-2:]] == ["out", "lse"]
    for ref in (cls.torch_reference, importlib.import_module(cls.__module__).torch_reference):
        assert [p.name for p in inspect.signature(ref).parameters.values()][:2] == ["inputs", "rank"]
    alloc = BaseAllocator(1 << 22, device="cpu", is_distributed=False, backend=HostBackend())
    try:
        op = cls(alloc, *args)
        assert -(-alloc.used // 256) * 256 == cls.heap_bytes(*args, world_size=1, device="cpu")
        tensors = [torch.zeros(shape, dtype=torch.bfloat16) for shape in inputs]
        op.close()
        op.close()  # idempotent
        with pytest.raises(ClosedError, match=f"this {name} is closed"):
            op(*tensors)
    finally:
        alloc.close()
