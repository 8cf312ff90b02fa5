"""AllReduceResidualRMSNorm on 1, 2 and 4 ranks sharing one GPU (``-m gpu``; the CPU tests
are in ``test_decode_norm.py``), against the float32 torch reference
(:func:`~tilescale_examples.decode.reference.compare`: ``residual_out`` bit for bit, ``y`` and
the FP8 scales within float32 rounding):

* every case (dtype x FP8 mode x token counts from 1 to more than the grid; the flag-based
  one-shot and the Lamport exchange), fresh random
  inputs, poisoned outputs, two calls each: the op's outputs, then ``out=`` /
  ``residual_out=residual`` (in place) / ``scales_out=``;
* back-to-back calls without host synchronisation (1000 on 1 and 2 ranks), a straggling rank
  (stream stalls and host sleeps), each rank choosing per call between the op's outputs and
  its own: every result copied out on the stream, checked at the end;
* two instances at once, the Lamport exchange called on a side stream beside the one-shot on
  the current stream, fresh inputs, poisoned outputs, both checked;
* CUDA graphs: warm-up, two graphs of one call each replayed alternately with eager calls in
  between, fresh inputs written into the captured ones before each replay (made on the device
  from a per-replay seed, so every rank rebuilds every rank's inputs), poisoned outputs, a
  straggler; every replay's result copied out and checked at the end.

The kernels are compiled once, in parallel, before the ranks start."""

from __future__ import annotations

import time

import torch
from examples_helpers import case_part_checks, parts_gpu_test, poison, replay_with_graphs, side_stream_pairs

from tilescale_examples.decode.reference import compare

BF16, F16 = torch.bfloat16, torch.float16
EPS = 1e-5
#: (shape, dtype, fp8, algorithm) of the checked cases: one token, a few, more than the grid
#: (200 tokens: blocks own two rows on a 132-SM GPU), every FP8 mode on both dtypes, both
#: exchanges.
CASES = [((1, 4096), BF16, None, "one_shot"), ((7, 1024), F16, None, "one_shot"),
         ((200, 8192), BF16, "per_block", "one_shot"), ((3, 4096), BF16, "per_token", "one_shot"),
         ((16, 2048), F16, "per_block", "one_shot"), ((5, 8192), F16, "per_token", "one_shot"),
         ((200, 4096), BF16, None, "one_shot"), ((1, 4096), BF16, None, "lamport"),
         ((200, 8192), BF16, "per_block", "lamport"), ((5, 8192), F16, "per_token", "lamport")]
#: Back-to-back calls per world size and case (4 ranks time-slice one GPU: fewer).
BACK_TO_BACK = {1: 1000, 2: 1000, 4: 200}
B2B_CASES = [((4, 4096), BF16, None, "one_shot"), ((2, 8192), BF16, "per_block", "one_shot"),
             ((4, 4096), BF16, None, "lamport")]
#: Graph replays (and eager calls between them) per world size and case.
REPLAYS = {1: 300, 2: 300, 4: 60}
GRAPH_CASES = [((4, 4096), BF16, None, "one_shot"), ((3, 2048), F16, "per_block", "one_shot"),
               ((4, 4096), BF16, None, "lamport")]
#: The side-stream part: (the instance on a side stream, the one on the current stream).
SIDE_CASES = [(((4, 4096), BF16, None, "lamport"), ((4, 4096), BF16, None, "one_shot"))]
VARIANTS = 8
CACHE_NAME = "decode_norm"


def norm_kernels(worlds=(1, 2, 4)) -> list:
    """Precompile jobs of every kernel the rank bodies build."""
    from tilescale_examples.decode.norm_kernel import norm_jobs

    sides = [case for pair in SIDE_CASES for case in pair]
    kinds = {(dtype, shape[1], fp8, algorithm)
             for shape, dtype, fp8, algorithm in CASES + B2B_CASES + GRAPH_CASES + sides}
    names = {BF16: "bfloat16", F16: "float16"}
    return [job for d, h, f, a in sorted(kinds, key=str)
            for job in norm_jobs([names[d]], worlds, [h], [f], exchanges=[a])]


def rank_inputs(p: int, shape, dtype, device, seed: int) -> tuple:
    """Rank ``p``'s ``(x, residual, weight)`` of ``seed`` (any rank rebuilds any rank's)."""
    g = torch.Generator().manual_seed(seed * 7919 + p * 1000003)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    residual = torch.randn(shape, generator=g).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[1], generator=g)).to(dtype).to(device)
    return x, residual, weight


def _poison(t) -> None:
    """``poison``, or for an e4m3 tensor its NaN byte."""
    if t.element_size() > 1:
        poison(t)
    else:
        t.view(torch.uint8).fill_(0x7F)


def _poison_op(op) -> None:
    """Poison the op's outputs and, while the host knows it (not captured), the staging buffer
    of its next call (no peer reads it: every peer has finished the call before the last;
    not the Lamport receive buffers, whose sentinels are the protocol's state)."""
    for t in (op.output, op.residual_output, op.scales):
        if t is not None:
            _poison(t)
    if not op.captured and op.algorithm != "lamport":
        poison(op.stages[(op.epoch + 1) % 2])


def _fresh_outputs(op, residual) -> dict:
    """``out``, ``residual_out`` (the residual itself: in place) and ``scales_out`` of a
    call with the caller's outputs, poisoned."""
    out = torch.empty_like(op.output)
    _poison(out)
    scales = None if op.scales is None else torch.full_like(op.scales, float("nan"))
    return dict(out=out, residual_out=residual, **({} if scales is None else {"scales_out": scales}))


def cases(alloc, rank: int, world: int, rng=None) -> tuple:
    """Every case of :data:`CASES`, two calls each; ``(checked calls, failures)``."""
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    dev = torch.device(alloc.device)
    checks, bad = 0, []
    for index, (shape, dtype, fp8, algorithm) in enumerate(CASES):
        op = AllReduceResidualRMSNorm(alloc, shape, dtype, eps=EPS, fp8=fp8, algorithm=algorithm)
        for call in range(2):
            every = [rank_inputs(p, shape, dtype, dev, 2 * index + call) for p in range(world)]
            want = op.reference(every, rank)
            x, residual, weight = (t.clone() for t in every[rank])
            _poison_op(op)
            got = op(x, residual, weight) if call == 0 else op(x, residual, weight, **_fresh_outputs(op, residual))
            if call == 1:
                assert got[-1] is residual
            torch.cuda.synchronize()
            bad += compare(got, want, f"rank {rank}/{world} {shape} {dtype} fp8={fp8} {algorithm} call {call}")
            checks += 1
        op.close()
    return checks, bad


def side_stream(alloc, rank: int, world: int, rng=None) -> tuple:
    """Per pair of :data:`SIDE_CASES`: the first instance called on a side stream while the
    second runs on the current stream, fresh inputs, poisoned outputs; ``(checked calls,
    failures)``."""
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    dev = torch.device(alloc.device)

    def build(case):
        shape, dtype, fp8, algorithm = case
        op = AllReduceResidualRMSNorm(alloc, shape, dtype, eps=EPS, fp8=fp8, algorithm=algorithm)
        _poison_op(op)
        return op

    return side_stream_pairs(
        SIDE_CASES, build, lambda op, seed: [rank_inputs(p, op.shape, op.dtype, dev, seed) for p in range(world)],
        lambda op, got, every, what: compare(got, op.reference(every, rank), f"{what} {op.algorithm}"), rank, world)


class Results:
    """Slots for ``n`` results of an op (its ``y``, scales, ``residual_out``), copied on the
    stream, checked at the end against references made once per input variant."""

    def __init__(self, op, n: int):
        self.slots = [torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
                      for t in (op.output, op.scales, op.residual_output) if t is not None]
        for s in self.slots:
            _poison(s)
        self.variant = [0] * n

    def keep(self, i: int, got, variant: int) -> None:
        for slot, t in zip(self.slots, got):
            slot[i].copy_(t)
        self.variant[i] = variant

    def failures(self, want: dict, what: str) -> list:
        torch.cuda.synchronize()
        bad = []
        for i, v in enumerate(self.variant):
            bad += compare([s[i] for s in self.slots], want[v], f"{what} call {i}")
        return bad


def back_to_back(alloc, rank: int, world: int, rng) -> tuple:
    """:data:`BACK_TO_BACK` calls per case without host synchronisation, a straggler, outputs
    the op's or the caller's (each rank picks per call); ``(checked calls, failures)``."""
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    dev = torch.device(alloc.device)
    checks, bad, calls = 0, [], BACK_TO_BACK[world]
    for index, (shape, dtype, fp8, algorithm) in enumerate(B2B_CASES):
        op = AllReduceResidualRMSNorm(alloc, shape, dtype, eps=EPS, fp8=fp8, algorithm=algorithm)
        every = [[rank_inputs(p, shape, dtype, dev, 100 + 10 * index + v) for p in range(world)] for v in range(VARIANTS)]
        want = {v: op.reference(every[v], rank) for v in range(VARIANTS)}
        results = Results(op, calls)
        for i in range(calls):
            if rng.random() < 0.05:
                torch.cuda._sleep(rng.randrange(1000, 200_000))  # stall this rank's stream
            if rng.random() < 0.01:
                time.sleep(rng.random() * 0.01)  # and its host
            v = i % VARIANTS
            x, residual, weight = every[v][rank]
            _poison_op(op)
            if rng.random() < 0.5:
                got = op(x, residual, weight)
            else:
                got = op(x, residual, weight, **_fresh_outputs(op, residual.clone()))
            results.keep(i, got, v)
        bad += results.failures(want, f"rank {rank}/{world} back-to-back {shape} fp8={fp8} {algorithm}")
        checks += calls
        op.close()
    return checks, bad


def _fill(t: torch.Tensor, seed: int, offset: float = 0.0) -> torch.Tensor:
    """``t`` filled with normal values (plus ``offset``) from ``seed``, on its device, no host sync."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=g, device=t.device) * (0.1 if offset else 1.0) + offset)
    return t


def _graph_inputs(shape, dtype, device, world: int, seed: int) -> list:
    return [tuple(_fill(torch.empty(s, dtype=dtype, device=device), seed * 64 + 3 * p + k, off)
                  for k, (s, off) in enumerate(((shape, 0.0), (shape, 0.0), ((shape[1],), 1.0))))
            for p in range(world)]


def graphs(alloc, rank: int, world: int, rng) -> tuple:
    """Per case: warm-up, two captured graphs replayed alternately, an eager call every 7th
    call, fresh inputs, poisoned outputs, a straggler; ``(checked calls, failures)``."""
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    dev = torch.device(alloc.device)
    checks, bad = 0, []
    for index, (shape, dtype, fp8, algorithm) in enumerate(GRAPH_CASES):
        op = AllReduceResidualRMSNorm(alloc, shape, dtype, eps=EPS, fp8=fp8, algorithm=algorithm)
        x, residual, weight = (t.clone() for t in _graph_inputs(shape, dtype, dev, world, 0)[rank])
        n = REPLAYS[world] + 1
        results = Results(op, n)

        def call():
            return op(x, residual, weight)

        def fill(i):
            for dst, src in zip((x, residual, weight), _graph_inputs(shape, dtype, dev, world, 1000 * index + i)[rank]):
                dst.copy_(src)

        replay_with_graphs(call, fill, lambda: _poison_op(op), lambda i, got: results.keep(i, got, i), n, rng)
        want = {i: op.reference(_graph_inputs(shape, dtype, dev, world, 1000 * index + i), rank) for i in range(n)}
        bad += results.failures(want, f"rank {rank}/{world} graph {shape} fp8={fp8} {algorithm}")
        checks += n
        op.close()
    return checks, bad


#: Checked calls per rank, by world size (the side-stream part: two per pair).
_PART_CHECKS = case_part_checks(CASES, B2B_CASES, BACK_TO_BACK, GRAPH_CASES, REPLAYS)
CHECKS = lambda world: _PART_CHECKS(world) + 2 * len(SIDE_CASES)  # noqa: E731
#: Worlds 1, 2, 4: the cases, two instances with a side stream, the back-to-back calls, the
#: graphs; fails on any failure.
test_allreduce_residual_rmsnorm_on_gpu = parts_gpu_test((cases, side_stream, back_to_back, graphs), CHECKS,
                                                        norm_kernels, CACHE_NAME, "AllReduceResidualRMSNorm",
                                                        timeout=600)
