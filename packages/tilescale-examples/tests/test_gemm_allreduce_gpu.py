"""GemmAllReduce on 1, 2 and 4 ranks sharing one GPU (``-m gpu``; the CPU tests are in
``test_gemm_allreduce.py``):

* every case (dtype x ``m`` from 1 row to more than a row block, several waves of tiles; ``k``
  unsplit, split in 2 and ``split_k="auto"``, also with more units than blocks; the one-shot
  and the two-shot reduction),
  fresh random inputs, poisoned outputs and staging buffer, two calls each (the op's output,
  then ``out=``): within :func:`~tilescale_examples.decode.gemm_allreduce.compare`'s bound of
  the exact sum, and **bit-identical on every rank** (the ranks' outputs gathered);
* back-to-back calls without host synchronisation (1000 on 1 and 2 ranks), a straggling rank
  (stream stalls and host sleeps), each rank choosing per call between the op's output and its
  own: every result copied out on the stream, checked at the end;
* two instances at once, one with ``k`` split called on a side stream beside an unsplit one on
  the current stream, fresh inputs, poisoned outputs, both checked;
* repeated calls on the same buffers refilled in place (the op's kept and frozen launches),
  a straggler, every result checked;
* CUDA graphs: warm-up, two graphs of one call each replayed alternately with eager calls in
  between, fresh inputs written into the captured ones before each replay (made on the device
  from a per-replay seed, so every rank rebuilds every rank's inputs), poisoned outputs, a
  straggler; every replay's result copied out and checked at the end.

The kernels are compiled once, in parallel, before the ranks start."""

from __future__ import annotations

import time

import torch
from examples_helpers import case_part_checks, parts_gpu_test, poison, replay_with_graphs, side_stream_pairs

from tilescale_examples.decode.gemm_allreduce import compare

BF16, F16 = torch.bfloat16, torch.float16
#: (m, k, n, dtype, split_k[, reduction]) of the checked cases: one row, a few, a full row
#: block, more than one row block (padded), several waves of tiles (and of split units) per
#: block; the two-shot kernel on one row, a few and more than a row block; and two decode
#: shapes of the benchmark (k = n = 8192: the op's defaults at 16 rows, two-shot at 64)
#: (reduction "auto" when left out).
CASES = [(1, 1024, 2048, BF16, 1), (1, 1024, 2048, BF16, "auto"), (7, 512, 1024, F16, 2),
         (64, 2048, 4096, BF16, "auto"), (200, 1024, 2048, BF16, 1), (130, 1024, 2048, BF16, 2),
         (512, 512, 8192, F16, 1), (512, 512, 8192, F16, 2), (1, 1024, 2048, BF16, 1, "two_shot"),
         (7, 512, 1024, F16, 1, "two_shot"), (200, 1024, 2048, BF16, 1, "two_shot"),
         (16, 8192, 8192, BF16, "auto"), (64, 8192, 8192, BF16, 1, "two_shot")]
#: Back-to-back calls per world size and case (4 ranks time-slice one GPU: fewer).
BACK_TO_BACK = {1: 1000, 2: 1000, 4: 200}
B2B_CASES = [(4, 1024, 2048, BF16, "auto"), (130, 256, 4096, BF16, 1), (130, 256, 4096, BF16, 1, "two_shot")]
#: Graph replays (and eager calls between them) per world size and case.
REPLAYS = {1: 300, 2: 300, 4: 60}
GRAPH_CASES = [(2, 512, 1024, BF16, "auto"), (96, 256, 2048, F16, 1), (96, 256, 2048, F16, 1, "two_shot")]
#: The side-stream part: (the instance on a side stream, the one on the current stream).
SIDE_CASES = [((4, 1024, 2048, BF16, 2), (4, 1024, 2048, BF16, 1)),
              ((130, 256, 4096, BF16, 1, "two_shot"), (4, 1024, 2048, BF16, 1))]
VARIANTS = 8
CACHE_NAME = "gemm_allreduce"


def gemm_ar_kernels(worlds=(1, 2, 4)) -> list:
    """Precompile jobs of every kernel the rank bodies build (the default tiles on this GPU)."""
    from tilescale_examples.decode.gemm_allreduce import gemm_allreduce_jobs

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = {BF16: "bfloat16", F16: "float16"}
    sides = [case for pair in SIDE_CASES for case in pair]
    return [job for m, k, n, d, *options in sorted(set(CASES + B2B_CASES + GRAPH_CASES + REPEAT_CASES + sides), key=str)
            for job in gemm_allreduce_jobs([m], k, n, names[d], worlds, sms, **op_options(options))]


def op_options(options) -> dict:
    """A case's fields after the dtype as GemmAllReduce's keywords: ``split_k`` and, when the
    case names one, ``reduction``."""
    return dict(zip(("split_k", "reduction"), options))


def rank_inputs(p: int, m: int, k: int, n: int, dtype, device, seed: int) -> tuple:
    """Rank ``p``'s ``(a, b)`` of ``seed`` (any rank rebuilds any rank's), scaled so that the
    output is about 1."""
    g = torch.Generator().manual_seed(seed * 7919 + p * 1000003)
    return (torch.randn(m, k, generator=g).to(dtype).to(device),
            (torch.randn(k, n, generator=g) / k**0.5).to(dtype).to(device))


def _poison_op(op) -> None:
    """Poison the op's output and, while the host knows it (not captured), the staging buffer
    of its next call (no peer reads it: every peer has finished the call before the last;
    two-shot: buffer 0 holds the partials and buffer 1 the reduced rows every call, and
    neither is touched by a peer between this rank's calls; split ``k``: the partials, which
    only this rank reads, and the next call's buffer of rounded products)."""
    poison(op.output)
    if op.captured:
        return
    if op.split_k == 1:
        poison(op.stages[(op.epoch + 1) % 2])
    else:  # the partials (this rank's alone) and the next call's rounded products
        poison(op.stages[0])
        poison(op.stage_buffer[(op.split_k + (op.epoch + 1) % 2) * op.mp:][:op.mp])


def same_on_every_rank(out: torch.Tensor, world: int) -> bool:
    """Whether ``out`` has the same bits on every rank (gathered over the WORLD group)."""
    import torch.distributed as dist

    from tilescale_examples.base import collective_device

    bits = out.contiguous().view(torch.uint8).to(collective_device(dist.group.WORLD, out.device))  # gloo: no int16
    every = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(every, bits)
    return all(torch.equal(e, every[0]) for e in every)


def cases(alloc, rank: int, world: int, rng=None) -> tuple:
    """Every case of :data:`CASES`, two calls each; ``(checked calls, failures)``."""
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    dev = torch.device(alloc.device)
    checks, bad = 0, []
    for index, (m, k, n, dtype, *options) in enumerate(CASES):
        op = GemmAllReduce(alloc, m, k, n, dtype, **op_options(options))
        for call in range(2):
            every = [rank_inputs(p, m, k, n, dtype, dev, 2 * index + call) for p in range(world)]
            a, b = (t.clone() for t in every[rank])
            _poison_op(op)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
            got = op(a, b) if call == 0 else op(a, b, out=out)
            torch.cuda.synchronize()
            what = f"rank {rank}/{world} {(m, k, n)} {dtype} split_k {op.split_k} {op.reduction} call {call}"
            bad += compare(got, every, what)
            if not same_on_every_rank(got, world):
                bad.append(f"{what}: the ranks' outputs differ")
            checks += 1
        op.close()
    return checks, bad


def back_to_back(alloc, rank: int, world: int, rng) -> tuple:
    """:data:`BACK_TO_BACK` calls per case without host synchronisation, a straggler, outputs
    the op's or the caller's (each rank picks per call); ``(checked calls, failures)``."""
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    dev = torch.device(alloc.device)
    checks, bad, calls = 0, [], BACK_TO_BACK[world]
    for index, (m, k, n, dtype, *options) in enumerate(B2B_CASES):
        op = GemmAllReduce(alloc, m, k, n, dtype, **op_options(options))
        every = [[rank_inputs(p, m, k, n, dtype, dev, 100 + 10 * index + v) for p in range(world)]
                 for v in range(VARIANTS)]
        slots = torch.full((calls, m, n), float("nan"), dtype=dtype, device=dev)
        for i in range(calls):
            if rng.random() < 0.05:
                torch.cuda._sleep(rng.randrange(1000, 200_000))  # stall this rank's stream
            if rng.random() < 0.01:
                time.sleep(rng.random() * 0.01)  # and its host
            a, b = every[i % VARIANTS][rank]
            _poison_op(op)
            got = op(a, b) if rng.random() < 0.5 else op(a, b, out=torch.empty((m, n), dtype=dtype, device=dev))
            slots[i].copy_(got)
        torch.cuda.synchronize()
        for i in range(calls):
            bad += compare(slots[i], every[i % VARIANTS],
                           f"rank {rank}/{world} back-to-back {(m, k, n)} {op.reduction} call {i}")
        checks += calls
        op.close()
    return checks, bad


def side_stream(alloc, rank: int, world: int, rng=None) -> tuple:
    """Per pair of :data:`SIDE_CASES`: the first instance called on a side stream while the
    second runs on the current stream, fresh inputs, poisoned outputs; ``(checked calls,
    failures)``."""
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    dev = torch.device(alloc.device)

    def build(case):
        m, k, n, dtype, *options = case
        op = GemmAllReduce(alloc, m, k, n, dtype, **op_options(options))
        _poison_op(op)
        return op

    def inputs(op, seed):
        return [rank_inputs(p, op.m, op.k, op.n, op.dtype, dev, seed) for p in range(world)]

    return side_stream_pairs(SIDE_CASES, build, inputs,
                             lambda op, got, every, what: compare(got, every, f"{what} split_k {op.split_k}"), rank,
                             world)


def _graph_inputs(m, k, n, dtype, device, world: int, seed: int) -> list:
    """Every rank's ``(a, b)`` of ``seed``, made on the device (no host sync)."""
    out = []
    for p in range(world):
        g = torch.Generator(device=device).manual_seed(seed * 64 + p)
        out.append((torch.randn((m, k), generator=g, device=device).to(dtype),
                    (torch.randn((k, n), generator=g, device=device) / k**0.5).to(dtype)))
    return out


def graphs(alloc, rank: int, world: int, rng) -> tuple:
    """Per case: warm-up, two captured graphs replayed alternately, an eager call every 7th
    call, fresh inputs, poisoned outputs, a straggler; ``(checked calls, failures)``."""
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    dev = torch.device(alloc.device)
    checks, bad = 0, []
    for index, (m, k, n, dtype, *options) in enumerate(GRAPH_CASES):
        op = GemmAllReduce(alloc, m, k, n, dtype, **op_options(options))
        a, b = (t.clone() for t in _graph_inputs(m, k, n, dtype, dev, world, 0)[rank])
        count = REPLAYS[world] + 1
        slots = torch.full((count, m, n), float("nan"), dtype=dtype, device=dev)

        def fill(i):
            for dst, src in zip((a, b), _graph_inputs(m, k, n, dtype, dev, world, 1000 * index + i)[rank]):
                dst.copy_(src)

        replay_with_graphs(lambda: op(a, b), fill, lambda: _poison_op(op), lambda i, got: slots[i].copy_(got), count,
                           rng)
        for i in range(count):
            every = _graph_inputs(m, k, n, dtype, dev, world, 1000 * index + i)
            bad += compare(slots[i], every, f"rank {rank}/{world} graph {(m, k, n)} {op.reduction} call {i}")
        checks += count
        op.close()
    return checks, bad


def repeated(alloc, rank: int, world: int, rng) -> tuple:
    """Per case of :data:`REPEAT_CASES`: :data:`REPEATED` calls on the same ``a`` and ``b``,
    refilled in place with fresh inputs before each call (made on the device), without host
    synchronisation, a straggler: the op's repeated call (its kept launch, then its frozen
    launch); ``(checked calls, failures)``."""
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    dev = torch.device(alloc.device)
    checks, bad, calls = 0, [], REPEATED[world]
    for index, (m, k, n, dtype, *options) in enumerate(REPEAT_CASES):
        op = GemmAllReduce(alloc, m, k, n, dtype, **op_options(options))
        a, b = (t.clone() for t in _graph_inputs(m, k, n, dtype, dev, world, 0)[rank])
        slots = torch.full((calls, m, n), float("nan"), dtype=dtype, device=dev)
        for i in range(calls):
            if rng.random() < 0.05:
                torch.cuda._sleep(rng.randrange(1000, 200_000))  # stall this rank's stream
            for dst, src in zip((a, b), _graph_inputs(m, k, n, dtype, dev, world, 5000 + 1000 * index + i)[rank]):
                dst.copy_(src)
            op.output.fill_(float("nan"))
            slots[i].copy_(op(a, b))
        torch.cuda.synchronize()
        for i in range(calls):
            every = _graph_inputs(m, k, n, dtype, dev, world, 5000 + 1000 * index + i)
            bad += compare(slots[i], every, f"rank {rank}/{world} repeated {(m, k, n)} {op.reduction} call {i}")
        if op._kept_launch is None or not op._kept_launch.frozen:
            bad.append(f"rank {rank}/{world} repeated {(m, k, n)}: the calls did not take the frozen launch")
        checks += calls
        op.close()
    return checks, bad


#: Calls on the same buffers per world size and case of the repeated-call part.
REPEATED = {1: 300, 2: 300, 4: 60}
REPEAT_CASES = [(4, 1024, 2048, BF16, "auto"), (96, 256, 2048, F16, 1, "two_shot")]
#: Checked calls per rank, by world size (the side-stream part: two per pair).
_PART_CHECKS = case_part_checks(CASES, B2B_CASES, BACK_TO_BACK, GRAPH_CASES, REPLAYS)
CHECKS = lambda world: _PART_CHECKS(world) + 2 * len(SIDE_CASES) + REPEATED[world] * len(REPEAT_CASES)  # noqa: E731
#: Worlds 1, 2, 4: the cases, two instances with a side stream, the back-to-back calls, the
#: repeated calls on the same buffers, the graphs; fails on any failure.
test_gemm_allreduce_on_gpu = parts_gpu_test((cases, side_stream, back_to_back, repeated, graphs), CHECKS,
                                            gemm_ar_kernels, CACHE_NAME, "GemmAllReduce", timeout=900)
