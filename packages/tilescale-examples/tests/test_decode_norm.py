"""AllReduceResidualRMSNorm on the CPU: the torch reference against float64, the FP8
convention, argument errors before any kernel, the host side of a call on a CPU stand-in
allocator (a fake kernel), the heap, the generated CUDA (the reduction engine's protocol,
16-byte accesses, the rank-order sum, one barrier per row) and nvcc's register budget at
sm_90a, and the decode benchmark's command line and tables. The GPU runs are in
``test_decode_norm_gpu.py``."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from examples_helpers import (CpuAllocator, call_rejected, exits_naming, kernel_body, lower_with, needs_nvcc,
                              nvcc_resources, output_without_gpu, rejects_before_allocating)

from tilescale_examples import AllReduceResidualRMSNorm, ClosedError
from tilescale_examples.decode.norm_kernel import (FP8_MAX, MAX_ROW_VECTORS, PASS_CONFIGS, build_norm_kernel,
                                                   load_chunk, row_vectors)
from tilescale_examples.decode.reference import compare, quantize_fp8, torch_reference

BF16, F16 = torch.bfloat16, torch.float16
FP8 = torch.float8_e4m3fn


def inputs_for(world, tokens=3, hidden=256, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, hidden, generator=g).to(dtype), torch.randn(tokens, hidden, generator=g).to(dtype),
             (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)) for _ in range(world)]


# ------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fp8", [None, "per_token", "per_block"])
def test_reference_against_float64(dtype, world, fp8):
    ins = inputs_for(world, dtype=dtype, seed=world)
    eps = 1e-5
    got = torch_reference(ins, world - 1, eps=eps, fp8=fp8)
    h64 = sum(x.double() for x, _, _ in ins) + ins[-1][1].double()
    tiny = torch.finfo(dtype).eps
    assert ((got[-1].double() - h64).abs() <= tiny * h64.abs() + 1e-6).all()  # h: rounded once
    h = got[-1].double()
    y64 = h * ins[-1][2].double() / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    if fp8 is None:
        assert got[0].dtype == dtype and ((got[0].double() - y64).abs() <= tiny * y64.abs() + 1e-6).all()
        return
    q, scales = got[0], got[1]
    assert q.dtype == FP8 and scales.dtype == torch.float32
    group = 256 if fp8 == "per_token" else 128
    assert scales.shape == (3, 256 // group)
    amax = y64.view(3, -1, group).abs().amax(-1)
    assert torch.allclose(scales.double(), amax / FP8_MAX, rtol=1e-5, atol=0)
    deq = (q.double().view(3, -1, group) * scales.double().unsqueeze(-1)).view(3, 256)
    assert ((deq - y64).abs() <= 2.0 ** -4 * y64.abs() + scales.double().max() * 2.0 ** -9).all()  # half an e4m3 ulp


def test_reference_sums_in_rank_order_and_rounds_once():
    ins = [(torch.full((1, 8), v, dtype=F16), torch.zeros(1, 8, dtype=F16), torch.ones(8, dtype=F16))
           for v in (2048.0, 1.0, 1.0)]
    assert torch.equal(torch_reference(ins, 0)[1], torch.full((1, 8), 2050.0, dtype=F16))  # per-add rounding: 2048
    assert torch.equal(AllReduceResidualRMSNorm.torch_reference(ins, 2)[1], torch_reference(ins, 0)[1])
    with pytest.raises(ValueError, match="one \\(x, residual, weight\\) per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        torch_reference(ins, 3)


def test_fp8_convention():
    y = torch.zeros(2, 256)
    y[1, 5], y[1, 200] = -3.0, 0.75
    q, s = quantize_fp8(y, "per_token")
    assert s.shape == (2, 1) and s[0, 0] == 0 and not q[0].float().any()  # an all-zero token: scale 0, q 0
    assert s[1, 0] == 3.0 / FP8_MAX and q[1, 5].float() == -FP8_MAX
    q, s = quantize_fp8(y, "per_block")
    assert s.shape == (2, 2) and torch.equal(s[1], torch.tensor([3.0, 0.75]) / FP8_MAX) and q[1, 200].float() == FP8_MAX
    with pytest.raises(ValueError, match="fp8 must be one of"):
        quantize_fp8(y, "per_tensor")


def test_compare_holds_residual_bits_and_y_to_one_ulp():
    want = torch_reference(inputs_for(2), 0)
    assert compare(want, want) == []
    h = want[1].clone()
    h.view(torch.int16)[0, 0] += 1
    assert "residual_out: 1 elements differ" in compare((want[0], h), want)[0]
    y = want[0].clone()
    y.view(torch.int16)[0, :4] += 1  # one ulp: accepted
    assert compare((y, want[1]), want) == []
    y.view(torch.int16)[0, :4] += 3  # four ulps: rejected (the tolerance, eps * |y|, is one to two ulps)
    y[1, 0] = float("nan")
    assert "y: 5 elements off by more than one ulp" in compare((y, want[1]), want, "x")[0]
    q, s, hh = torch_reference(inputs_for(2), 0, fp8="per_token")
    assert compare((q, s * (1 + 1e-3), hh), (q, s, hh))[0].endswith("scales: 3 off by more than 0.0001 relative")


# ------------------------------------------------------------------------------ host side on the CPU
class FakeKernel:
    """Stands in for the GPU launch: stages ``x`` into the call's buffer (``e % 2``, ``e`` from
    the device counters) and writes the reference of ``world_size`` ranks that all hold this
    rank's ``x``, where the kernel would."""

    def __init__(self, op):
        self.op, self.calls, self.tables = op, [], []

    def initialize(self, allocator, stream=None):
        self.tables.append(int(allocator.table[0]))
        return self

    def __call__(self, *args):
        op = self.op
        self.calls.append(args)
        x, res, w, stage, res_out, y = args[:6]
        state = args[-5]
        epoch = int(state[0]) + 1
        state += 1
        if op.algorithm == "one_shot":
            rows = stage.shape[0] // 2
            stage[(epoch % 2) * rows:][:rows].copy_(x)
        got = op.reference([(x.view(op.shape), res.view(op.shape), w.view(-1))] * op.world_size, op.rank)
        res_out.view(op.shape).copy_(got[-1])
        y.view(op.shape).copy_(got[0])
        if op.fp8 is not None:
            args[6].copy_(got[1].view(-1))


def make(shape=(3, 256), dtype=BF16, num_ranks=2, **kwargs):
    """The op on a stand-in allocator with a fake kernel; the flag-based one-shot exchange
    unless ``algorithm`` says otherwise (``"auto"`` takes Lamport at these sizes)."""
    kwargs.setdefault("algorithm", "one_shot")
    op = AllReduceResidualRMSNorm(CpuAllocator(num_ranks=num_ranks), shape, dtype, threads=64, **kwargs)
    op.kernel = FakeKernel(op)
    return op


def expected(op, x, r, w):
    return op.reference([(x, r, w)] * op.world_size, op.rank)


def test_buffers_arguments_and_call_numbers(compiles):
    op = make(max_blocks=2)
    assert compiles == ["allreduce_residual_rmsnorm"] and (op.blocks, op.iters, op.vec) == (2, 2, 8)
    assert op.allocator.allocations == [((2 * 3 * 32, 8), BF16), ((2 * 2 * 4,), torch.uint64)]
    assert not op.flags.ne(0).any() and not op.state.ne(0).any()
    x, r, w = inputs_for(1)[0]
    y, h = op(x, r, w)
    (args,) = op.kernel.calls
    assert [a.data_ptr() for a in args[:3]] == [x.data_ptr(), r.data_ptr(), w.data_ptr()]
    assert args[3] is op.stage_buffer and args[6] is op.flags and args[7] is op.state  # no call number from the host
    assert args[8:] == (2, 2, 3, 1e-6)
    assert y is op.output and h is op.residual_output and compare((y, h), expected(op, x, r, w)) == []
    assert torch.equal(op.stages[1].view(3, 256), x)  # call 1: buffer 1
    op(x, r, w)
    assert torch.equal(op.stages[0].view(3, 256), x) and op.state.tolist() == [2, 2] and op.epoch == 2
    assert op.kernel.tables == [0]  # bound once


def test_lamport_buffers_arguments_and_the_algorithm_choice(compiles, monkeypatch):
    from tilescale_examples.decode import allreduce_norm

    op = make(max_blocks=2, algorithm="lamport")
    assert compiles == ["allreduce_residual_rmsnorm_lamport"] and op.algorithm == "lamport"
    # three receive buffers of 2 slots of 3 rows x 32 vectors, all the sentinel; no symmetric flags
    assert op.allocator.allocations == [((3 * 2 * 3 * 32, 8), BF16)]
    assert bool((op.stage_buffer.view(torch.uint8) == 0xFF).all()) and len(op.stages) == 3
    assert op.flags.shape == (1,) and not op.flags.ne(0).any()
    x, r, w = inputs_for(1)[0]
    y, h = op(x, r, w)
    (args,) = op.kernel.calls
    assert args[3] is op.stage_buffer and args[6] is op.flags and args[7] is op.state and args[8:] == (2, 2, 3, 1e-6)
    assert compare((y, h), expected(op, x, r, w)) == []
    assert make(algorithm="auto").algorithm == "lamport"  # auto at 2 ranks: Lamport up to 128 KiB (timed with ranks at once)
    assert allreduce_norm.choose_algorithm(1 << 20, 1) == "lamport"  # one rank: timed, Lamport up to 1 MiB
    assert allreduce_norm.choose_algorithm((1 << 20) + 2, 1) == "one_shot"
    assert [allreduce_norm.choose_algorithm(128 << 10, w) for w in (2, 3, 4)] == ["lamport"] * 3
    assert [allreduce_norm.choose_algorithm((128 << 10) + 2, w) for w in (2, 3, 4, 8)] == ["one_shot"] * 4
    assert [allreduce_norm.choose_algorithm(64 << 10, w) for w in (8, 16)] == ["lamport"] * 2
    monkeypatch.setattr(allreduce_norm, "LAMPORT_MAX_BYTES", {1: 0, 2: 4096})
    assert make(shape=(2, 1024), algorithm="auto").algorithm == "lamport"
    assert make(shape=(3, 1024), algorithm="auto").algorithm == "one_shot"
    assert allreduce_norm.choose_algorithm(4096, 4) == "lamport"
    assert allreduce_norm.choose_algorithm(4097, 2) == "one_shot"


@pytest.mark.parametrize("algorithm,fp8", [("one_shot", None), ("lamport", "per_token")])
def test_a_call_laid_out_as_the_last_relaunches_it_and_anything_else_takes_the_full_call(
        compiles, monkeypatch, algorithm, fp8):
    """x, residual and weight laid out as the last call's (refilled in place, a fresh view
    at the same address, or x and residual at other aligned addresses) and no outputs
    given: the kept launch again (new views of x and residual, the weight's kept view, every
    other argument the same object), the right results; another weight, an output, an
    unaligned tensor or a capture takes the full call with its checks."""
    op = make(algorithm=algorithm, fp8=fp8)
    full = []
    monkeypatch.setattr(op, "_check_args", lambda *a: full.append(1) or AllReduceResidualRMSNorm._check_args(op, *a))
    x, r, w = inputs_for(1)[0]
    first = op(x, r, w)
    assert len(full) == 1 and compare(first, expected(op, x, r, w)) == [] and op._kept_launch is None
    op(x, r, w)  # a second full call on the same x: a loop over one buffer, its launch kept
    assert len(full) == 2 and op._kept_launch is not None
    for i in range(3):
        fresh = inputs_for(1, seed=i + 1)[0]
        for dst, src in zip((x, r, w), fresh):
            dst.copy_(src)
        for t in first:
            t.fill_(float("nan") if t.dtype.is_floating_point else 0)
        got = op(x.view(3, 256) if i else x, r, w)
        assert len(full) == 2 and all(a is b for a, b in zip(got, first)) and compare(got, expected(op, x, r, w)) == []
        args, kept = op.kernel.calls[-1], op.kernel.calls[0]
        assert args[0].data_ptr() == x.data_ptr() and args[1].data_ptr() == r.data_ptr()
        assert all(a is b for a, b in zip(args[2:], kept[2:]))  # the weight's kept view, the op's own buffers
    assert op.epoch == 5
    x2, r2 = x.clone(), r.clone()  # x and residual at other addresses (a decode loop's fresh activations)
    for t in first:
        t.fill_(float("nan") if t.dtype.is_floating_point else 0)
    got = op(x2, r2, w)  # the kept launch, moved to them: what the full call would launch
    assert len(full) == 2 and compare(got, expected(op, x2, r2, w)) == [] and op.epoch == 6
    assert op.kernel.calls[-1][0].data_ptr() == x2.data_ptr() and op.kernel.calls[-1][1].data_ptr() == r2.data_ptr()
    op(x, r, w.clone())  # another weight (its view is kept, not moved): the full call
    assert len(full) == 3
    with pytest.raises(ValueError, match="residual"):
        op(x, r.view(-1)[:256].view(1, 256), w)  # the same address, another shape: the full call's checks
    op(x, r, w), op(x, r, w)  # the weight back: the full call keeps it, then relaunched
    assert len(full) == 5 and op._kept_launch is not None
    op(x, r, w, residual_out=r)  # an output given: the full call, nothing kept
    assert len(full) == 6 and op._kept_launch is None
    xu = torch.empty(3 * 256 + 1, dtype=BF16)[1:].view(3, 256)
    xu.copy_(x)
    op(xu, r, w), op(xu, r, w)  # not 16-byte aligned: staged from a copy, never kept
    assert op._kept_launch is None
    op(x, r, w), op(x, r, w)
    op(x, r, w)
    assert len(full) == 10 and op._kept_launch is not None
    op(xu, r, w)  # not 16-byte aligned: not moved there, the full call (a copy)
    assert len(full) == 11 and op._kept_launch is None
    op(x, r, w), op(x, r, w)
    op._captured = True  # after a capture eager calls rebind: the full call
    op(x, r, w)
    assert len(full) == 14 and op._kept_launch is None


def test_outputs_in_place_and_unaligned(compiles):
    op = make()
    x, r, w = inputs_for(1)[0]
    want = expected(op, x, r, w)
    rr, xx = r.clone(), x.clone()
    y, h = op(xx, rr, w, out=xx, residual_out=rr)  # y over x, h over the residual
    assert y is xx and h is rr and compare((y, h), want) == []
    args = op.kernel.calls[-1]
    assert args[4].data_ptr() == rr.data_ptr() and args[5].data_ptr() == xx.data_ptr()
    flat = torch.empty(3 * 256 + 1, dtype=BF16)
    out = flat[1:].view(3, 256)  # 2-byte aligned: the kernel writes op.output, the call copies
    y, h = op(x, r, w, out=out)
    assert y is out and compare((y, h), want) == [] and op.kernel.calls[-1][5].data_ptr() == op.output.data_ptr()
    xu = torch.empty(3 * 256 + 1, dtype=BF16)[1:].view(3, 256)
    xu.copy_(x)
    assert compare(op(xu, r, w), want) == [] and op.kernel.calls[-1][0].data_ptr() % 16 == 0  # staged from a copy


def test_the_weight_view_is_kept_only_while_it_is_the_same_aligned_tensor(compiles):
    """A call passes the weight's rows; the next call with the same weight reuses them (its
    in-place updates show through), another weight (or an unaligned one, staged from a copy
    at every call) is what the kernel gets."""
    op = make()
    x, r, w = inputs_for(1)[0]
    op(x, r, w)
    first = op.kernel.calls[-1][2]
    w.mul_(2)  # in place: the kept view shows it
    assert compare(op(x, r, w), expected(op, x, r, w)) == [] and op.kernel.calls[-1][2] is first
    w2 = w.clone()
    assert compare(op(x, r, w2), expected(op, x, r, w2)) == [] and op.kernel.calls[-1][2].data_ptr() == w2.data_ptr()
    wu = torch.empty(257, dtype=BF16)[1:]
    wu.copy_(w)
    op(x, r, wu)
    staged = op.kernel.calls[-1][2]
    wu.mul_(3)  # a copy is never kept: the next call stages the new values
    assert compare(op(x, r, wu), expected(op, x, r, wu)) == [] and op.kernel.calls[-1][2] is not staged


@pytest.mark.parametrize("fp8", ["per_token", "per_block"])
def test_fp8_outputs(fp8, compiles):
    op = make(fp8=fp8)
    assert compiles == [f"allreduce_residual_rmsnorm_fp8_{fp8}"]
    x, r, w = inputs_for(1)[0]
    q, s, h = op(x, r, w)
    assert q is op.output and q.dtype == FP8 and s is op.scales and s.shape == ((3, 1) if fp8 == "per_token" else (3, 2))
    assert compare((q, s, h), expected(op, x, r, w)) == []
    q2, s2 = torch.empty(3, 256, dtype=FP8), torch.empty(s.shape)
    assert op(x, r, w, out=q2, scales_out=s2)[:2] == (q2, s2) and op.kernel.calls[-1][6].data_ptr() == s2.data_ptr()


X = (3, 256)


@pytest.mark.parametrize("call,exc,match", [
    (lambda op: op(torch.zeros(2, 256, dtype=BF16), torch.zeros(X, dtype=BF16), torch.ones(256, dtype=BF16)),
     ValueError, r"x has shape \(2, 256\), expected the shape \(3, 256\)"),
    (lambda op: op(torch.zeros(X), torch.zeros(X, dtype=BF16), torch.ones(256, dtype=BF16)),
     TypeError, "x has dtype torch.float32, this AllReduceResidualRMSNorm was built for torch.bfloat16"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(256, 3, dtype=BF16).t(), torch.ones(256, dtype=BF16)),
     ValueError, "residual must be contiguous"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(X, dtype=BF16), torch.ones(255, dtype=BF16)),
     ValueError, r"weight has shape \(255,\), expected \(hidden,\) \(256,\)"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(X, dtype=BF16), [1.0] * 256),
     TypeError, "weight must be a torch.Tensor"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(X, dtype=BF16), torch.ones(256, dtype=BF16),
                   out=torch.zeros(X, dtype=F16)), TypeError, "out has dtype torch.float16"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(X, dtype=BF16), torch.ones(256, dtype=BF16),
                   residual_out=torch.zeros(3, 255, dtype=BF16)), ValueError, r"residual_out has shape \(3, 255\)"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(X, dtype=BF16), torch.ones(256, dtype=BF16),
                   scales_out=torch.zeros(3, 1)), TypeError, "scales_out is only for an FP8 output"),
    (lambda op: op(torch.zeros(X, dtype=BF16), torch.zeros(X, dtype=BF16), torch.ones(256, dtype=BF16),
                   out=op.stages[0].view(X)), ValueError, "out overlaps this AllReduceResidualRMSNorm's symmetric"),
])
def test_call_rejects_bad_arguments_before_any_launch(call, exc, match, compiles):
    call_rejected(make(), call, exc, match)


def test_outputs_may_alias_an_input_only_exactly(compiles):
    op = make()
    x, r, w = inputs_for(1)[0]
    big = torch.zeros(4 * 256, dtype=BF16)
    call_rejected(op, lambda o: o(x, r, w, out=big[256:].view(X), residual_out=big[:768].view(X)), ValueError,
                  "out and residual_out overlap")
    call_rejected(op, lambda o: o(big[:768].view(X), r, w, out=big[256:].view(X)), ValueError,
                  "out overlaps x: an output may be x itself")
    ww = torch.zeros(1024, dtype=BF16)
    call_rejected(op, lambda o: o(x, r, ww[:256], residual_out=ww[:768].view(X)), ValueError,
                  "residual_out overlaps weight")


test_constructor_rejects_before_allocating = rejects_before_allocating(
    AllReduceResidualRMSNorm, dict(shape=(4, 1024), dtype=BF16), [
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(shape=(1024,)), ValueError, r"shape must be \(tokens, hidden\)"),
    (dict(shape=(2, 4, 1024)), ValueError, r"shape must be \(tokens, hidden\)"),
    (dict(shape=(4, 0)), ValueError, "shape must be non-empty positive ints"),
    (dict(shape=(4, 1028)), ValueError, r"shape: hidden \(1028\) must be a multiple of 8"),
    (dict(shape=(4, 1032), fp8="per_block"), ValueError, r"must be a multiple of 128 for fp8='per_block'"),
    (dict(shape=(4, 8 * 512 * MAX_ROW_VECTORS + 8)), ValueError, "vectors per thread at 512 threads"),
    (dict(dtype=torch.float32), TypeError, "dtype must be one of"),
    (dict(eps=-1.0), ValueError, "eps must be a finite float >= 0"),
    (dict(eps="1e-6"), TypeError, "eps must be a float"),
    (dict(fp8="per_tensor"), ValueError, "fp8 must be None, 'per_token' or 'per_block'"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
    (dict(threads=48), ValueError, "threads must be a multiple of 32"),
    (dict(threads=32, num_ranks=64), ValueError, r"threads \(32\) must be >= world_size \(64\)"),
    (dict(max_blocks=0), ValueError, "max_blocks must be None or a positive int"),
    (dict(algorithm="two_shot"), ValueError, r"algorithm must be one of \('auto', 'one_shot', 'lamport'\)"),
    (dict(shape=(4, 1024), fp8="per_block"), None, None),
    (dict(shape=(4, 1024), algorithm="lamport", fp8="per_token"), None, None),
])


def test_close_and_closed_allocator(compiles):
    op = make()
    assert ("AllReduceResidualRMSNorm(shape=(3, 256), dtype=torch.bfloat16, world_size=2, algorithm='one_shot', "
            "eps=1e-06, fp8=None") in repr(op)
    x, r, w = inputs_for(1)[0]
    op.close()
    op.close()
    assert op.closed and op.kernel is None and op.stage_buffer is None and "closed" in repr(op)
    with pytest.raises(ClosedError, match="this AllReduceResidualRMSNorm is closed"):
        op(x, r, w)
    other = make()
    other.allocator.closed = True
    with pytest.raises(ClosedError, match="the allocator of this AllReduceResidualRMSNorm is closed"):
        other(x, r, w)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fp8", [None, "per_token", "per_block"])
def test_heap_bytes_is_what_the_constructor_allocates(world, fp8, compiles):
    from tilescale_examples.base import RecordingAllocator

    for (shape, max_blocks), algorithm in itertools.product((((1, 4096), None), ((256, 8192), 132), ((7, 1024), 4)),
                                                            ("auto", "lamport")):
        alloc = CpuAllocator(num_ranks=world)
        AllReduceResidualRMSNorm(alloc, shape, BF16, fp8=fp8, max_blocks=max_blocks, algorithm=algorithm)
        got = AllReduceResidualRMSNorm.heap_bytes(shape, BF16, world_size=world, fp8=fp8, max_blocks=max_blocks,
                                                  device="cpu", algorithm=algorithm)
        assert got == alloc.heap_bytes
    built = len(compiles)
    AllReduceResidualRMSNorm(RecordingAllocator(2), (4, 1024), BF16)
    assert len(compiles) == built  # a dry run compiles nothing


# ------------------------------------------------------------------------------ codegen
def source(dtype="bfloat16", world=4, hidden=4096, threads=512, fp8=None, exchange="one_shot"):
    return kernel_body(lower_with(build_norm_kernel(dtype, world, hidden, threads, fp8, exchange), PASS_CONFIGS))


NOTIFY = "tilescale::notify<false>("
WAIT = "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>("


def test_protocol_order_and_rows():
    body = source()
    sync = [m.start() for m in re.finditer(r"__syncthreads\(\);", body)]
    weight = body.index("*(uint4*)(w + 0) = *(uint4*)(Wt + ")
    stage = body.index("*(uint4*)(Stage + ")
    ready, wait = body.index(NOTIFY), body.index(WAIT)
    read = body.index("epoch = (State[((int)blockIdx.x)] + (int64_t)1);")
    write = body.index("State[((int)blockIdx.x)] = epoch")
    loads = [m.start() for m in re.finditer(r"tilescale::remap_ptr\(Stage, (\d)\)", body)]
    assert "fence" not in body and body.count(NOTIFY) == 1 and body.count(WAIT) == 1  # one flag round
    # weight first (waits for nothing), stage, barrier, release to peer tx, wait, barrier, count, reads
    assert read < weight < stage < sync[0] < ready < wait < sync[1] < write < loads[0]
    assert "lo = ((((int)(epoch & (int64_t)1)) * tokens) * 512);" in body  # call e's buffer: e % 2, 512 vectors a row
    # the engine's flag layout: ready[me, b] on peer tx, ready[tx, b] here, FLAG_STRIDE (4) words apart
    assert "(&(Flags[(((((int64_t)me) * ((int64_t)blocks)) * (int64_t)4) + (((int64_t)((int)blockIdx.x)) * (int64_t)4))]))" in body
    assert "(&(Flags[(((((int64_t)((int)threadIdx.x)) * ((int64_t)blocks)) * (int64_t)4)" in body
    assert "if (((int)threadIdx.x) < 4)" in body
    # per row: peers 0..3 in order, 16 bytes each; the residual; one barrier (the block's sum)
    assert re.findall(r"remap_ptr\(Stage, (\d)\)", body) == ["0", "1", "2", "3"]
    assert len(re.findall(r"\*\(uint4\*\)\(vals \+ \d+\) = \*\(uint4\*\)\(\(\(bfloat16_t\*\)v", body)) == 4
    assert len(sync) == 3 and "rsqrtf(" in body[sync[2]:] and body.count("__shfl_xor_sync") == 5
    assert "*(uint4*)(ResOut + " in body and "*(uint4*)(Y + " in body


def test_lamport_exchange_order():
    """Every put of the block (to ranks 0..3, from registers) before the first poll; per row the
    four slots polled in rank order, the sum, the residual out, then the previous call's four
    slots cleared; no flag, fence or remote load; the call count after the last row's barrier."""
    body = source("bfloat16", 4, 4096, 256, None, "lamport")
    puts = [m.start() for m in re.finditer(r"tilescale::lamport_put<2, 0x7fc0ull>\(", body)]
    gets = [m.start() for m in re.finditer(r"tilescale::lamport_get<2>\(", body)]
    clears = [m.start() for m in re.finditer(r"tilescale::lamport_clear\(", body)]
    assert len(puts) == 8 and len(gets) == 8 and len(clears) == 8  # 2 vectors a thread x 4 ranks
    assert re.findall(r"0x7fc0ull>\(\(&\(xin\[0\]\)\), .*?, (\d)\);", body) == ["0", "1", "2", "3"] * 2
    res_out = body.index("*(uint4*)(ResOut + ")
    assert max(puts) < min(gets) and max(gets) < res_out < min(clears)
    assert NOTIFY not in body and WAIT not in body and "remap_ptr" not in body and "fence" not in body
    assert ("lo = ((((int)(((int64_t)3 & ((epoch % (int64_t)3) >> (int64_t)63)) + (epoch % (int64_t)3))) * tokens) "
            "* 2048);") in body
    write = body.index("State[((int)blockIdx.x)] = epoch")
    assert write > max(clears) and body.rindex("__syncthreads();", 0, write) > max(clears)
    assert source("float16", 2, 1024, 128, "per_block", "lamport").count("tilescale::lamport_put<2, 0x7e00ull>(") == 2



@pytest.mark.parametrize("exchange", ["one_shot", "lamport"])
def test_one_rank_reads_x_in_place_with_no_flag_or_wait(exchange):
    """World 1, either exchange: the weight, the call count, then per row x's and the
    residual's vectors read in place, x + residual rounded once into ResOut, the block's sum
    (one barrier), y; nothing staged, no flag, no wait, no Lamport slot, no peer address."""
    body = source("bfloat16", 1, 4096, 512, None, exchange)
    weight = body.index("*(uint4*)(w + 0) = *(uint4*)(Wt + ")
    write = body.index("State[((int)blockIdx.x)] = epoch")
    x = body.index("*(uint4*)(vals + 0) = *(uint4*)(X + ")
    res_out, y = body.index("*(uint4*)(ResOut + "), body.index("*(uint4*)(Y + ")
    assert weight < write < x < res_out < y and body.count("__syncthreads();") == 1
    for absent in ("Stage", "Flags", NOTIFY, WAIT, "lamport_", "remap_ptr", "fence"):
        assert absent not in body, absent
    assert len(re.findall(r"__\d+\.x = \(__\d+\.x\+__\d+\.x\);", body)) == 1  # x + residual: one vector a thread

def test_sum_is_rank_order_then_the_residual():
    body = source("float16", 4, 1024, 128)
    adds = re.findall(r"(__\d+)\.x = \((__\d+)\.x\+(__\d+)\.x\);", body)
    # ((v0 + v1) + v2) + v3, then + residual: each add's left operand is the previous sum
    assert len(adds) >= 4 and all(adds[i + 1][1] == adds[i][0] for i in range(3))
    residual = re.search(r"float4 (__\d+);\n\s+uint2 v__\d+ = \*\(uint2\*\)\(rin \+", body)
    assert residual and adds[3][2] == residual[1]


@pytest.mark.parametrize("fp8", ["per_token", "per_block"])
def test_fp8_codegen(fp8):
    body = source("bfloat16", 2, 8192, 512, fp8)
    assert "__nv_cvt_float2_to_fp8x2(" in body and "__NV_SATFINITE, __NV_E4M3" in body
    assert body.count("*(fp8_e4_8_t*)(Y + ") == 2  # 8 bytes per vector, 2 vectors a thread
    if fp8 == "per_token":
        assert re.search(r"if \(\(\(int\)threadIdx.x\) == 0\) \{\s+Scales\[", body)
        assert body.count("__shfl_xor_sync") == 10 and body.count(", 16, 32)") == 2  # the sum's and the max's
    else:  # a scale per 16 threads (128 channels), max over xor 8, 4, 2, 1 (inside the 16-lane group)
        assert body.count("if ((((int)threadIdx.x) % 16) == 0)") == 2
        assert body.count("__shfl_xor_sync") == 13 and body.count(", 16, 32)") == 1  # 16 crosses groups: the sum only


def test_builder_rejects_bad_arguments():
    for kwargs, match in ((dict(dtype="float32"), "dtype must be one of"), (dict(world_size=0), "world_size must be"),
                          (dict(threads=48), "threads must be a multiple of 32"), (dict(fp8="x"), "fp8 must be None"),
                          (dict(hidden=1000, fp8="per_block"), "multiple of 128"), (dict(hidden=1004), "multiple of 8"),
                          (dict(world_size=64, threads=32), "must be >= world_size"),
                          (dict(exchange="nvls"), "exchange must be one of")):
        args = dict(dtype="bfloat16", world_size=2, hidden=1024, threads=512)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            build_norm_kernel(**args)
    assert row_vectors(8192, 2, 512) == (1024, 2) and load_chunk(8, 2) == 2 and load_chunk(16, 4) == 1


@needs_nvcc
@pytest.mark.parametrize("dtype,world,hidden,fp8,exchange", [
    ("bfloat16", 8, 8192, "per_block", "one_shot"), ("float16", 8, 4096, None, "one_shot"),
    ("bfloat16", 2, 8192, "per_token", "one_shot"), ("bfloat16", 1, 4096, None, "one_shot"),
    ("bfloat16", 8, 8192, "per_block", "lamport")])
def test_nvcc_register_budget(dtype, world, hidden, fp8, exchange, tmp_path):
    """sm_90a cubin at 512 threads: at most 128 registers (one block per SM) and no spills."""
    registers, spills = nvcc_resources(lower_with(build_norm_kernel(dtype, world, hidden, 512, fp8, exchange),
                                                  PASS_CONFIGS), tmp_path)
    assert registers <= 128 and spills == 0, (registers, spills)


# ------------------------------------------------------------------------------ the benchmark
SAMPLE = {4096: [[1, 1, 3.1, 6.9, 0.449, "ok"], [1, 16, 3.4, 7.5, 0.453, "ok"], [2, 1, 3.9, 8.8, 0.443, "ok"],
                 [2, 16, 4.4, 9.9, 0.444, "ok"]]}


def test_benchmark_without_gpu_and_bad_arguments(monkeypatch, capsys):
    from tilescale_examples.benchmarks import decode

    assert output_without_gpu(decode.main, [], monkeypatch, capsys) == "decode benchmark: no CUDA GPU visible, nothing to measure\n"
    exits_naming(decode.main, ["--ranks", "0"], "--ranks must be in [1, 64]", capsys)
    exits_naming(decode.main, ["--hidden", "1001"], "--hidden a positive multiple of 8", capsys)
    exits_naming(decode.main, ["--fp8", "per_tensor"], "invalid choice", capsys)
    exits_naming(decode.main, ["--algorithm", "lamport"], "--algorithm lamport runs with --ranks 1 only", capsys)
    exits_naming(decode.main, ["--case-timeout", "-1"], "--case-timeout must be positive", capsys)


def test_benchmark_tables_goals_and_plot(capsys, tmp_path):
    from argparse import Namespace

    from tilescale_examples.benchmarks import _export, _report, decode

    assert decode.goal_lines(SAMPLE) == ["worst fused/unfused at 2+ ranks: 0.444 (goal <= 0.6)",
                                         "slowest fused call at 1-16 tokens: 4.40 us (goal <= 5.0 us)"]
    _report.save_tables(tmp_path, "decode")
    try:
        args = Namespace(fp8="per_token", dtype="bfloat16", iters=50, algorithm="one_shot")
        decode.print_results(SAMPLE, ["x: bad"], args, "H200")
    finally:
        _report.save_tables(None)
    out = capsys.readouterr().out
    assert "+ FP8 per_token, fused (one TileScale kernel) vs unfused" in out and "hidden 4096" in out
    assert "FAILED: x: bad" in out and "1 FAILURE(S)" in out
    record = _export.read_table(tmp_path / "decode.json")
    assert record["headers"] == decode.HEADERS and record["rows"][3][:2] == [2, 16]
    pytest.importorskip("matplotlib")
    from tilescale_examples.benchmarks import _plot

    assert _plot.chart_kind(record) == "lines"
    axes = [ax for ax in _plot.make_figure(record).axes if ax.has_data()]
    assert axes and sum(1 for line in axes[-1].get_lines() if not line.get_label().startswith("_")) == 2  # a ratio per N
