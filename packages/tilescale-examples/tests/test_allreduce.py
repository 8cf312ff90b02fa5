"""AllReduce (one-shot, fused two-shot and Lamport): the size tables, staging and output decisions and
argument checks on the CPU; every size class and dtype on 2 and 4 ranks sharing one GPU,
bit-identical across ranks, and 1000 back-to-back calls with a straggling rank (``-m gpu``;
the kernels are compiled once, in parallel, before the ranks start)."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from examples_helpers import (CpuAllocator, call_rejected, close_rank_heap, open_rank_heap, poison, random_tensor,
                              rejects_before_allocating, needs_nvcc, expect_checks, gpu_rank_test, side_stream_beside)
from examples_cache import CACHE_NAME, reduction_kernels

from tilescale_examples import ClosedError
from tilescale_examples.collectives.allreduce import (ALGORITHMS, LAMPORT_MAX_BYTES, ONE_SHOT_MAX_BYTES, AllReduce,
                                                      choose_algorithm, torch_reference)
from tilescale_examples.collectives.lamport_kernel import LAMPORT_BUFFERS
from tilescale_examples.collectives.reduce_engine import FLAG_STRIDE


# ------------------------------------------------------------------------------ size table
def test_size_table():
    assert choose_algorithm(ONE_SHOT_MAX_BYTES[2], 2) == "one_shot"
    assert choose_algorithm(ONE_SHOT_MAX_BYTES[2] + 1, 2) == "two_shot"
    assert choose_algorithm(ONE_SHOT_MAX_BYTES[4], 4) == "one_shot"
    assert choose_algorithm(ONE_SHOT_MAX_BYTES[4] + 1, 4) == "two_shot"
    assert choose_algorithm(ONE_SHOT_MAX_BYTES[2], 3) == "one_shot"  # between keys: the smaller key
    assert choose_algorithm(ONE_SHOT_MAX_BYTES[8] + 1, 16) == "two_shot"
    assert choose_algorithm(1 << 40, 1) == "one_shot"  # nothing to exchange
    assert choose_algorithm(100, 2, table={2: 50}) == "two_shot"
    assert ONE_SHOT_MAX_BYTES[2] >= ONE_SHOT_MAX_BYTES[4] >= ONE_SHOT_MAX_BYTES[8]
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        choose_algorithm(10, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, "float64"])
def test_size_table_picks_lamport_for_small_float_messages(dtype):
    for world in (1, 2, 4, 8):
        limit = LAMPORT_MAX_BYTES[world]
        assert choose_algorithm(limit, world, dtype=dtype) == "lamport"
        assert choose_algorithm(limit + 1, world, dtype=dtype) == choose_algorithm(limit + 1, world)
    assert choose_algorithm(100, 2, dtype=dtype, lamport_table={2: 50}) == "one_shot"
    assert choose_algorithm(4096, 16, dtype=dtype) == "lamport"  # between keys: the smaller key (8)
    assert LAMPORT_MAX_BYTES[2] <= ONE_SHOT_MAX_BYTES[2] and LAMPORT_MAX_BYTES[8] <= ONE_SHOT_MAX_BYTES[8]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, "int32", None])
def test_size_table_never_picks_lamport_for_integers(dtype):
    assert choose_algorithm(16, 2, dtype=dtype) == "one_shot"


def test_size_table_rejects_a_dtype_the_reductions_do_not_take():
    with pytest.raises(TypeError, match="dtype must be one of"):
        choose_algorithm(16, 2, dtype="uint8")


def test_torch_reference_is_the_rank_order_sum():
    h = [torch.full((4,), 2048.0, dtype=torch.float16), torch.ones(4, dtype=torch.float16),
         torch.ones(4, dtype=torch.float16)]
    assert torch.equal(torch_reference(h, 1), torch.full((4,), 2050.0, dtype=torch.float16))
    assert torch.equal(AllReduce.torch_reference(h, 2), torch_reference(h, 0))  # the same on every rank


# ------------------------------------------------------------------------------ the class on CPU
class FakeKernel:
    """Stands in for the GPU launch: records the arguments and writes a recognisable result
    (2 x the staged input) where the real kernel would."""

    def __init__(self, ar):
        self.ar, self.calls, self.tables = ar, [], []

    def initialize(self, allocator, stream=None):
        self.tables.append(int(allocator.table[0]))
        return self

    def __call__(self, *args):
        self.calls.append(args)
        if self.ar.algorithm == "lamport":  # (X, Buf, Out, State, blocks, iters, span)
            args[3].add_(1)
            args[2].copy_(args[0][: args[2].shape[0]] * 2)
            return
        x, stages, stage_in = args[0], args[1], args[-1]
        state = args[-6]
        epoch = int(state[0]) + 1  # the device's call number: block 0's counter
        state += 1
        stage = stages.split(self.ar.plan.stage_rows)[epoch % len(self.ar.stages)]
        if stage_in:
            stage[: x.shape[0]].copy_(x)
        if self.ar.algorithm == "two_shot":
            stage.mul_(2)
        else:
            args[2].copy_(stage[: args[2].shape[0]] * 2)


def make(shape=(64,), dtype="float16", algorithm="auto", num_ranks=2, tmp_path=None, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=num_ranks)
    ar = AllReduce(alloc, shape, dtype, algorithm=algorithm, threads=128)
    ar.kernel = FakeKernel(ar)
    return alloc, ar


@needs_nvcc
def test_one_shot_buffers_staging_and_double_buffering(tmp_path, monkeypatch):
    alloc, ar = make((64,), algorithm="one_shot", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert ar.algorithm == "one_shot" and len(ar.stages) == 2
    # both staging buffers in one symmetric allocation: the kernel picks call e's (e % 2)
    assert alloc.allocations == [((16, 8), torch.float16)] + [((2 * 2 * ar.plan.blocks * FLAG_STRIDE,), torch.uint64)]
    assert [s.data_ptr() for s in ar.stages] == [ar.stage_buffer.data_ptr(), ar.stage_buffer[8:].data_ptr()]
    assert not ar.flags.ne(0).any() and not ar.stage_buffer.ne(0).any() and not ar.state.ne(0).any()
    x = torch.randn(64).half()
    out = ar(x)
    (args,) = ar.kernel.calls
    assert args[0].data_ptr() == x.data_ptr() and args[-1] == 1  # staged inside the kernel
    assert args[1] is ar.stage_buffer and args[4] is ar.state  # no call number from the host
    assert out is ar.output and torch.equal(out, x * 2) and torch.equal(ar.stages[1].view(-1), x)  # call 1: buffer 1
    assert ar.input.data_ptr() == ar.stages[0].data_ptr()  # the next call's buffer
    nxt = ar.input
    nxt.copy_(x * 3)
    ar(nxt)  # zero-copy: the kernel finds the input staged
    args = ar.kernel.calls[-1]
    assert args[-1] == 0 and args[0].data_ptr() == ar.stages[0].data_ptr() and ar.state.tolist() == [2] * ar.plan.blocks
    assert torch.equal(ar.output, x * 6)
    ar(nxt)  # no longer ar.input (the buffers alternate): staged from it, into buffer 1
    assert ar.kernel.calls[-1][-1] == 1 and torch.equal(ar.stages[1].view(-1), x * 3)
    assert ar.kernel.tables == [0]  # the table is bound once, then only when another allocator used the kernel


@needs_nvcc
def test_instances_on_different_allocators_rebind_the_shared_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    a0, a1 = CpuAllocator(num_ranks=2, rank=0), CpuAllocator(num_ranks=2, rank=1)
    ar0, ar1 = AllReduce(a0, (64,), "float16", threads=128), AllReduce(a1, (64,), "float16", threads=128)
    assert ar0.kernel is ar1.kernel  # one compiled kernel (one module, one table) per process
    fake = FakeKernel(ar0)
    ar0.kernel = ar1.kernel = fake
    x = torch.randn(64).half()
    ar0(x), ar0(x), ar1(x), ar0(x)
    assert fake.tables == [0, 1, 0]


@needs_nvcc
def test_outputs_in_place_and_odd_sizes(tmp_path, monkeypatch):
    alloc, ar = make((3, 7), "float32", algorithm="one_shot", tmp_path=tmp_path,
                     monkeypatch=monkeypatch)  # 21: not whole vectors
    x = torch.randn(3, 7)
    out = torch.full((3, 7), float("nan"))
    assert ar(x, out=out) is out and torch.equal(out, x * 2)
    args = ar.kernel.calls[-1]
    assert args[-1] == 1 and args[0] is ar._padded  # copied into a zero-padded local buffer, staged by the kernel
    assert torch.equal(ar.stages[1].view(-1)[:21], x.view(-1))
    assert not ar.stages[1].view(-1)[21:].ne(0).any()  # padding stays zero
    y = x.clone()
    assert ar(y, out=y) is y and torch.equal(y, x * 2)  # in place
    alloc, ar = make((64,), "float32", algorithm="one_shot", tmp_path=tmp_path, monkeypatch=monkeypatch)
    x = torch.randn(64)
    ar(x, out=x)  # whole vectors: the kernel reads and writes x itself
    args = ar.kernel.calls[-1]
    assert args[0].data_ptr() == args[2].data_ptr() == x.data_ptr()


@needs_nvcc
def test_two_shot_is_in_place_on_one_buffer(tmp_path, monkeypatch):
    alloc, ar = make((1001,), "bfloat16", algorithm="two_shot", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert len(ar.stages) == 1 and ar.plan.span == 63 and ar.stages[0].shape == (126, 8)
    assert ar.input.data_ptr() == ar.output.data_ptr() == ar.stages[0].data_ptr()
    x = torch.randn(1001).bfloat16()
    assert ar(x) is ar.output and torch.equal(ar.output, x * 2)
    out = torch.empty(1001, dtype=torch.bfloat16)
    assert ar(x, out=out) is out and torch.equal(out, x * 2)
    ar.input.copy_(x)
    assert ar(ar.input, out=ar.input).data_ptr() == ar.input.data_ptr()  # heap in place: no copy
    assert torch.equal(ar.output, x * 2) and ar.epoch == 3


@needs_nvcc
def test_lamport_buffers_input_and_launch(tmp_path, monkeypatch):
    """Lamport: 3 x world_size receive buffers in one symmetric allocation, every byte the
    sentinel, no flags; a local zero-copy input; the kernel gets (X, Buf, Out, State, blocks,
    iters, span) and the call number stays on the device."""
    alloc, ar = make((1001,), "bfloat16", tmp_path=tmp_path, monkeypatch=monkeypatch)  # auto: small and float
    assert ar.algorithm == "lamport" and ar.flags is None and ar.plan.span == 126
    assert alloc.allocations == [((LAMPORT_BUFFERS * 2 * 126, 8), torch.bfloat16)]
    assert ar.stage_buffer.view(torch.int16).eq(-1).all()  # the sentinel: all ones
    x = torch.randn(1001).bfloat16()
    out = torch.empty(1001, dtype=torch.bfloat16)
    assert ar(x, out=out) is out and torch.equal(out, x * 2)
    args = ar.kernel.calls[-1]
    assert args[0] is ar._padded and args[1] is ar.stage_buffer and args[3] is ar.state  # 1001: padded copy
    assert args[4:] == (ar.plan.blocks, ar.plan.iters, 126)
    ar.input.copy_(x)
    assert ar(ar.input) is ar.output and torch.equal(ar.output, x * 2)  # zero-copy: the local input buffer
    assert ar.kernel.calls[-1][0].data_ptr() == ar.input.data_ptr()  # one local buffer: the same every call
    assert len(alloc.allocations) == 1  # not on the heap
    with pytest.raises(ValueError, match="out overlaps this AllReduce's symmetric staging buffers"):
        ar(x, out=ar.stage_buffer.view(-1)[:1001])
    assert ar.state.tolist() == [2] * ar.plan.blocks and ar.epoch == 2
    assert AllReduce.heap_bytes((1001,), torch.bfloat16, world_size=2, algorithm="lamport", device="cpu") == \
        -(-LAMPORT_BUFFERS * 2 * 126 * 16 // 256) * 256


@needs_nvcc
@pytest.mark.parametrize("algorithm", ["one_shot", "lamport", "two_shot"])
def test_a_repeated_call_relaunches_the_kept_arguments_and_anything_else_takes_the_full_call(
        algorithm, tmp_path, monkeypatch):
    """The steady state of a serving loop: a call on a tensor exactly like the last call's
    (the same address, shape, strides, dtype: the same buffer refilled, or a fresh view of
    it) and no ``out`` skips the full call and launches the kept arguments again with a new
    view of the input, the device call number advancing; anything else (another address,
    a reshaped or restrided tensor, ``out=``, a padded input, a staging buffer, a capture)
    takes the full call with its checks, and close() still refuses."""
    alloc, ar = make((64,), "float16", algorithm=algorithm, tmp_path=tmp_path, monkeypatch=monkeypatch)
    calls, full = ar.kernel.calls, []
    monkeypatch.setattr(ar, "_check_call", lambda *a: full.append(a[0]) or AllReduce._check_call(ar, *a))
    x = torch.randn(64).half()
    assert ar(x) is ar.output and torch.equal(ar.output, x * 2) and ar._kept_launch is None
    ar(x)  # a second full call on the same address: a loop over one buffer, its launch kept
    assert len(full) == 2 and ar._kept_launch is not None
    for i in range(3):
        x.copy_(torch.randn(64).half())  # new values, same buffer
        ar.output.fill_(float("nan"))
        assert ar(x if i else x.view(64)) is ar.output and torch.equal(ar.output, x * 2)
        assert len(full) == 2 and ar.epoch == i + 3 and calls[-1][0].data_ptr() == x.data_ptr()
        assert all(a is b for a, b in zip(calls[-1][1:], calls[0][1:]))  # the kept arguments
    if algorithm != "lamport":
        assert ar.state.tolist() == [5] * ar.plan.blocks  # the device counted every call
    y = torch.randn(64).half()
    ar(y)  # another address, the same layout (aligned, not the op's buffer): launched again, moved to y
    assert len(full) == 2 and torch.equal(ar.output, y * 2) and calls[-1][0].data_ptr() == y.data_ptr()
    misaligned = torch.randn(65).half()[1:]
    ar(misaligned)  # not 16-byte aligned: the full call (a padded copy)
    assert len(full) == 3 and torch.equal(ar.output, misaligned * 2) and ar._kept_launch is None
    if algorithm != "lamport":
        ar(x), ar(x)  # kept again
        x.copy_(torch.randn(64).half())
        ar.input.copy_(x)
        assert ar(ar.input) is ar.output and torch.equal(ar.output, x * 2)  # inside the op's buffers: the full call
        assert len(full) == 6
    with pytest.raises(ValueError, match="input"):
        ar(y.as_strided_((32,), (2,)))  # the same address, reshaped in place: the full call rejects it
    with pytest.raises(TypeError, match="input has dtype torch.int16"):
        ar(x.view(torch.int16))  # the same address and layout, another dtype
    ar(x), ar(x)
    assert ar._kept_launch is not None
    out = torch.empty(64, dtype=torch.float16)
    assert ar(x, out=out) is out and torch.equal(out, x * 2) and ar._kept_launch is None  # out=: nothing kept
    ar(x), ar(x)
    ar._captured = True  # as after a CUDA graph capture: eager calls rebind, so they take the full call
    count = len(full)
    ar(x)
    assert len(full) == count + 1 and ar._kept_launch is None
    ar._captured = False
    odd = make((61,), "float16", algorithm=algorithm, tmp_path=tmp_path, monkeypatch=monkeypatch)[1]
    z = torch.randn(61).half()
    odd(z), odd(z)
    assert odd._kept_launch is None  # not whole vectors: staged from a padded copy every call
    if algorithm == "one_shot":
        ar(ar.input)  # zero-copy
        staged = ar.stages[0].view(-1)
        ar(staged), ar(staged)  # one of its staging buffers, not this call's: staged by the kernel
        assert ar._kept_launch is None
    ar(x)
    ar.close()
    with pytest.raises(ClosedError, match="AllReduce is closed"):
        ar(x)

@needs_nvcc
@pytest.mark.parametrize("algorithm", ["one_shot", "lamport"])
def test_repeated_calls_launch_a_frozen_launch_from_the_second_on(algorithm, tmp_path, monkeypatch, caplog):
    """The first repeated call launches through the op's launcher and freezes that launch
    (``tilescale_lang.lean.freeze`` with the call's parameters); the later ones launch the
    frozen launch alone (no launcher, no views), counted on the device like any call; a new
    full call forgets it; where none can be made (None, or freezing fails: logged once), the
    repeated calls stay on the launcher."""
    from tilescale_lang import lean

    alloc, ar = make((64,), "float16", algorithm=algorithm, tmp_path=tmp_path, monkeypatch=monkeypatch)
    frozen, made, passed = [], [], []

    class Frozen:  # stands for a FrozenLaunch: the frozen parameters launched on the stand-in kernel
        def __init__(self, kernel, args, moving):
            assert list(moving) == [0]  # the input's view may move
            self.kernel, self.args, self.address = kernel, args, args[0].data_ptr()

        capturing = False  # what the real one learns from the driver in the same C call

        def __call__(self, *addresses):  # as the real one: new addresses are written, none keeps the last
            passed.append(addresses)
            if addresses:
                (self.address,) = addresses
            frozen.append(self.address)  # the input address launched
            if self.capturing:
                return False
            if self.address == self.args[0].data_ptr():  # (the stand-in kernel cannot follow a moved input)
                self.kernel(*self.args)
            return True

    monkeypatch.setattr(lean, "freeze", lambda kernel, args, moving: made.append(args) or Frozen(kernel, args, moving))
    x = torch.randn(64).half()
    ar(x), ar(x)  # two full calls: kept
    assert ar(x) is ar.output and len(made) == 1 and not frozen  # the launcher, then frozen
    assert made[0][0].data_ptr() == x.data_ptr() and all(a is b for a, b in zip(made[0][1:], ar.kernel.calls[0][1:]))
    launched = len(ar.kernel.calls)
    for i in range(3):
        x.copy_(torch.randn(64).half())
        ar.output.fill_(float("nan"))
        assert ar(x) is ar.output and torch.equal(ar.output, x * 2) and ar.epoch == 4 + i
        assert len(frozen) == i + 1 and len(made) == 1 and len(ar.kernel.calls) == launched + i + 1
        assert frozen[-1] == x.data_ptr() and passed[-1] == ()  # at the frozen address: nothing to write
    moved = torch.randn(64).half()
    ar(moved)  # another address of the same layout: the frozen launch, moved there
    assert frozen[-1] == moved.data_ptr() and passed[-1] == (moved.data_ptr(),) and len(made) == 1 and ar.epoch == 7
    ar(moved)  # the moved address is now the frozen one
    assert frozen[-1] == moved.data_ptr() and passed[-1] == () and ar.epoch == 8
    ar(x)  # and back
    assert frozen[-1] == x.data_ptr() and passed[-1] == (x.data_ptr(),) and ar.epoch == 9
    out = torch.empty(64).half()
    assert ar(moved, out=out) is out and ar._kept_launch is None and len(frozen) == 6  # out=: the full call
    ar(x), ar(x), ar(x), ar(x)  # kept, frozen anew (made[1]), then launched at x
    assert len(made) == 2 and frozen[-1] == x.data_ptr() and passed[-1] == () and len(frozen) == 7
    Frozen.capturing = True  # the stream captures a graph: the frozen launch launches nothing, the full call runs
    x.copy_(torch.randn(64).half())
    ar.output.fill_(float("nan"))
    launched = len(ar.kernel.calls)
    assert ar(x) is ar.output and torch.equal(ar.output, x * 2) and len(frozen) == 8
    assert len(ar.kernel.calls) == launched + 1 and ar.epoch == 15  # counted once, by the full call
    Frozen.capturing = False
    y = torch.randn(65).half()[1:]
    ar(y), ar(y)  # not aligned: full calls (a padded copy), nothing kept
    assert ar._kept_launch is None
    alloc, ar = make((64,), "float16", algorithm=algorithm, tmp_path=tmp_path, monkeypatch=monkeypatch)
    y = torch.randn(64).half()
    ar(y), ar(y)  # another instance: full calls, a new kept launch, not frozen yet
    assert ar._kept_launch is not None and ar._kept_launch.frozen is None
    monkeypatch.setattr(lean, "freeze", lambda kernel, args, moving: made.append(args) and None)
    ar(y), ar(y), ar(y)
    assert len(made) == 3 and ar._kept_launch.frozen is False and len(frozen) == 8  # asked once, then the launcher
    assert torch.equal(ar.output, y * 2)

    def fails(kernel, args, moving):
        raise ValueError("no launch metadata")

    monkeypatch.setattr(lean, "freeze", fails)
    alloc, ar = make((64,), "float16", algorithm=algorithm, tmp_path=tmp_path, monkeypatch=monkeypatch)
    z = torch.randn(64).half()
    with caplog.at_level("INFO", logger="tilescale_examples.launch"):
        for _ in range(4):
            ar(z)
    assert torch.equal(ar.output, z * 2) and ar._kept_launch.frozen is False
    assert sum("no frozen launch: no launch metadata" in r.getMessage() for r in caplog.records) <= 1


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_lamport_rejects_integer_dtypes_before_allocating(dtype):
    alloc = CpuAllocator(num_ranks=2)
    with pytest.raises(ValueError, match="algorithm='lamport' needs a float dtype"):
        AllReduce(alloc, (64,), dtype, algorithm="lamport")
    assert alloc.allocations == []


@pytest.mark.parametrize("call,exc,match", [
    (lambda ar: ar(torch.zeros(63).half()), ValueError, r"input has shape \(63,\), expected the shape \(64,\)"),
    (lambda ar: ar(torch.zeros(64)), TypeError, "input has dtype torch.float32, this AllReduce was built for torch.float16"),
    (lambda ar: ar(torch.zeros(2, 64).half()[:, 0]), ValueError, "shape"),
    (lambda ar: ar(torch.zeros(128).half()[::2]), ValueError, "input must be contiguous"),
    (lambda ar: ar([0.0] * 64), TypeError, "input must be a torch.Tensor"),
    (lambda ar: ar(torch.zeros(64).half(), out=torch.zeros(64)), TypeError, "out has dtype torch.float32"),
    (lambda ar: ar(torch.zeros(64).half(), out=torch.zeros(128).half()[::2]), ValueError, "out must be contiguous"),
    (lambda ar: ar(torch.zeros(64).half(), out=ar.input), ValueError, "out overlaps this AllReduce's symmetric staging buffers"),
])
@needs_nvcc
def test_call_rejects_bad_arguments_before_any_launch(call, exc, match, tmp_path, monkeypatch):
    call_rejected(make((64,), algorithm="one_shot", tmp_path=tmp_path, monkeypatch=monkeypatch)[1], call, exc, match)


test_constructor_rejects_before_allocating = rejects_before_allocating(
    AllReduce, dict(shape=(16,), dtype=torch.float32), [
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(shape=(4, 0)), ValueError, "shape must be non-empty positive ints"),
    (dict(dtype="uint8"), TypeError, "dtype must be one of"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
    (dict(algorithm="three_shot"), ValueError, "algorithm must be one of"),
    (dict(shape=(1 << 31,)), ValueError, "int32"),
    (dict(threads=48), ValueError, "threads must be a multiple of 32"),
])


@needs_nvcc
def test_close_and_repr(tmp_path, monkeypatch):
    alloc, ar = make((64,), tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert "AllReduce(shape=(64,), dtype=torch.float16, world_size=2, mode='lamport'" in repr(ar)
    assert ar.bus_bytes() == 2 * 0.5 * 64 * 2
    ar.close()
    assert ar.closed and "closed" in repr(ar)
    with pytest.raises(ClosedError, match="AllReduce is closed"):
        ar(torch.zeros(64).half())


# ------------------------------------------------------------------------------ GPU
#: Size classes (elements): tiny and not whole vectors, 4 KiB (float16), a size the ranks do
#: not divide, 2 Mi + 5 (staged by a copy) and 4 Mi (staged in the kernel, two-shot by the
#: table); each with the size table's choice and every other algorithm of the dtype forced.
SIZES = [(7,), (2048,), (3, 1000), ((1 << 21) + 5,), (1 << 22,)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int32]
#: Ways to call; each instance makes two calls, rotating through all four ways, so every
#: algorithm sees every way across the dtypes of a size.
WAYS = ("plain", "out", "inplace", "heap")
CALLS_PER_INSTANCE = 2
#: Back-to-back calls with a straggling rank (4 KiB float16), by world size and algorithm:
#: the 1000-call run on 2 ranks; shorter on 4 (every call needs all 4 time-sliced contexts).
BACK_TO_BACK = {2: {"one_shot": 1000, "two_shot": 200, "lamport": 1000},
                4: {"one_shot": 100, "two_shot": 50, "lamport": 100}}
VARIANTS = 8  # distinct inputs cycled through by the back-to-back calls


def check(out: torch.Tensor, want: torch.Tensor, rank: int, world: int, what: str) -> None:
    """``out`` equals the rank-order reference ``want`` bit for bit. Every rank compares with
    the same reference bits, so passing on every rank means the ranks' outputs are
    bit-identical."""
    bits = torch.int16 if out.element_size() == 2 else torch.int32
    if not torch.equal(out.view(bits), want.view(bits)):
        bad = (out.view(bits) != want.view(bits)).nonzero()[:5].tolist()
        raise AssertionError(f"rank {rank}/{world} {what}: first mismatches at {bad}")


#: Largest message the size classes force the Lamport kernel on (its buffers hold 3 x
#: world_size copies of the message, and the heap of the test is a bump allocator).
LAMPORT_FORCED_MAX_BYTES = 1 << 20


def algorithms_for(shape, dtype, world: int) -> tuple:
    """``"auto"`` and every other algorithm that takes ``dtype`` (the Lamport kernel up to
    :data:`LAMPORT_FORCED_MAX_BYTES`): every kernel, and the size table's choice."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    chosen = choose_algorithm(nbytes, world, dtype=dtype)
    lamport = dtype.is_floating_point and nbytes <= LAMPORT_FORCED_MAX_BYTES
    return ("auto", *[a for a in ALGORITHMS[1:] if a != chosen and (a != "lamport" or lamport)])


def rank_inputs(rank: int, shape, dtype, device, seed: int, count: int) -> list:
    """``count`` inputs of ``rank`` from ``seed`` (any rank can rebuild any rank's)."""
    return [random_tensor(shape, dtype, torch.Generator().manual_seed(seed * 7919 + rank * 1000003 + v), device)
            for v in range(count)]


def size_classes(alloc, rank: int, world: int) -> int:
    """Every size class x dtype x (auto, every other algorithm), two calls each (rotating
    through plain input, ``out=``, in place and the zero-copy ``ar.input``), poisoned
    outputs and staging buffer, fresh inputs; returns the number of checked calls."""
    dev = torch.device(alloc.device)
    checks = 0
    for case, (shape, dtype) in enumerate((s, d) for s in SIZES for d in DTYPES):
        for j, algorithm in enumerate(algorithms_for(shape, dtype, world)):
            ar = AllReduce(alloc, shape, dtype, algorithm=algorithm)
            seed = 2 * case + j
            inputs = [rank_inputs(p, shape, dtype, dev, seed, CALLS_PER_INSTANCE) for p in range(world)]
            for k in range(CALLS_PER_INSTANCE):
                way = WAYS[(2 * case + 2 * j + k) % len(WAYS)]
                x = inputs[rank][k].clone()
                want = torch_reference([inputs[p][k] for p in range(world)], rank)
                poison(ar.output)
                poison(ar.input) if way != "heap" else ar.input.copy_(x)
                if way == "plain":
                    out = ar(x)
                elif way == "out":
                    out = torch.empty_like(x)
                    poison(out)
                    out = ar(x, out=out)
                elif way == "inplace":
                    out = ar(x, out=x)
                    assert out is x
                else:
                    out = ar(ar.input)
                torch.cuda.synchronize()
                check(out, want, rank, world, f"{shape} {dtype} {ar.algorithm} ({algorithm}) {way}")
                checks += 1
            ar.close()
    return checks


def back_to_back(alloc, rank: int, world: int) -> int:
    """Per algorithm, ``BACK_TO_BACK[world]`` calls without host synchronisation; before each
    call this rank poisons the buffer the call stages into and the output (legal: the
    previous call has returned on this stream), and sometimes stalls its stream or its host,
    so the ranks drift apart. Each rank passes, call by call and independently of the
    others, either its input (the kernel stages it) or a copy in ``ar.input`` (staged
    before the kernel), so the ranks mix the two ready signals of a call. Each result is copied out on the stream and checked at the
    end; returns the number of checked calls."""
    dev = torch.device(alloc.device)
    shape, dtype = (2048,), torch.float16  # 4 KiB
    inputs = [rank_inputs(p, shape, dtype, dev, 99, VARIANTS) for p in range(world)]
    mine = inputs[rank]
    want = [torch_reference([inputs[p][v] for p in range(world)], rank) for v in range(VARIANTS)]
    rng = random.Random(rank)
    checks = 0
    for algorithm, calls in BACK_TO_BACK[world].items():
        ar = AllReduce(alloc, shape, dtype, algorithm=algorithm)
        results = torch.empty((calls, *shape), dtype=dtype, device=dev)
        poison(results)
        for i in range(calls):
            if rng.random() < 0.05:
                torch.cuda._sleep(rng.randrange(1000, 200_000))  # stall this rank's stream
            if rng.random() < 0.01:
                time.sleep(rng.random() * 0.01)  # and its host
            poison(ar.input)
            poison(ar.output)
            if rng.random() < 0.5:  # this rank alone picks the zero-copy path: ranks mix both paths
                ar.input.copy_(mine[i % VARIANTS])
                results[i].copy_(ar(ar.input))
            else:
                results[i].copy_(ar(mine[i % VARIANTS]))
        torch.cuda.synchronize()
        for i in range(calls):
            check(results[i], want[i % VARIANTS], rank, world, f"{algorithm} back-to-back call {i}/{calls}")
        checks += calls
        ar.close()
    return checks


#: Algorithms of the side-stream case (4 KiB float16: each is a one-block kernel, so two run at once).
SIDE_STREAM_ALGORITHMS = ("one_shot", "two_shot", "lamport")


def side_stream_and_two_instances(alloc, rank: int, world: int) -> int:
    """Per algorithm, two instances at once: one called on a side stream, the other on the
    current stream, fresh inputs, poisoned outputs, both checked bit for bit; returns the
    number of checked calls."""
    dev = torch.device(alloc.device)
    shape, dtype = (2048,), torch.float16
    checks = 0
    for j, algorithm in enumerate(SIDE_STREAM_ALGORITHMS):
        a, b = (AllReduce(alloc, shape, dtype, algorithm=algorithm) for _ in range(2))
        inputs = [[rank_inputs(p, shape, dtype, dev, 300 + 2 * j + k, 1)[0] for p in range(world)] for k in range(2)]
        outs = [torch.empty(shape, dtype=dtype, device=dev) for _ in range(2)]
        for out in outs:
            poison(out)
        checks += side_stream_beside(
            lambda: a(inputs[0][rank].clone(), out=outs[0]), lambda: b(inputs[1][rank].clone(), out=outs[1]),
            [lambda k=k: check(outs[k], torch_reference(inputs[k], rank), rank, world,
                               f"{algorithm} {'side stream' if k == 0 else 'second instance'}") for k in range(2)])
        a.close()
        b.close()
    return checks


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """The size classes, two instances at once (one on a side stream), then the back-to-back
    calls with a straggler."""
    alloc = open_rank_heap(rank, world, cache_dir, 2**29)
    checks = size_classes(alloc, rank, world)
    checks += side_stream_and_two_instances(alloc, rank, world)
    checks += back_to_back(alloc, rank, world)
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(2, 4, timeout=240, rank_timeout=200, cache=CACHE_NAME, jobs=reduction_kernels)
def test_allreduce_on_gpu(world, rank, world_size, kernel_cache):
    """Every size class and dtype, every algorithm, bit-exact on every rank; two instances of
    each algorithm at once, one on a side stream; then back-to-back calls with a straggling
    rank (1000 one-shot and 1000 Lamport calls on 2 ranks)."""
    want = sum(len(algorithms_for(s, d, world_size)) for s in SIZES for d in DTYPES) * CALLS_PER_INSTANCE
    want += 2 * len(SIDE_STREAM_ALGORITHMS) + sum(BACK_TO_BACK[world_size].values())
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), want, "allreduce")
