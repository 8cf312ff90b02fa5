"""Every collective and overlapped GEMM captured in CUDA graphs (``-m gpu``: 1, 2 and 4 ranks
sharing one GPU); the capture-time errors and call-state rules on the CPU are in
``test_graphs_cpu.py``.

On the GPU, per op: warm-up, capture, then replays with fresh random inputs written into the
captured input (made on the device from a per-replay, per-rank seed, so every rank rebuilds
every rank's input and the torch reference), poisoned outputs, every replay checked bit for
bit (the GEMMs: against the float32 reference within the error bound) on every rank, eager
calls interleaved, a second graph of the same instance replayed alternately, and a random
straggler stalling its stream before a replay. Then one graph holding several ops and two
instances of the same op. Results are compared on the device; each replay's verdict is kept
and read once at the end."""

from __future__ import annotations

import random

import torch
from examples_helpers import (close_rank_heap, gpu_rank_test, open_rank_heap, poison, replay_with_graphs,
                              same_on_every_rank)

#: Replays per op by world size: ranks that share one GPU time-slice, so every replay of 4
#: ranks costs several scheduling rounds.
REPLAYS = {1: 1000, 2: 1000, 4: 100}
CACHE_NAME = "graphs"


# ------------------------------------------------------------------------------ GPU cases
class Case:
    """One op under test: ``build(alloc)`` makes it, ``shape`` is one rank's input,
    ``call(op, x)`` runs it (returns the output), ``reference(inputs, rank)`` is the torch
    result on ``rank`` from every rank's input; ``exact``: bit for bit, else the GEMM bound."""

    def __init__(self, name, build, shape, dtype, call, reference, exact=True, extra=None):
        self.name, self.build, self.shape, self.dtype = name, build, shape, dtype
        self.call, self.reference, self.exact, self.extra = call, reference, exact, extra


def _cases(world: int) -> list:
    from tilescale_examples.collectives import allgather, allreduce, alltoall, reducescatter
    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.collectives.allgather import AllGather
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.collectives.alltoall import AllToAll
    from tilescale_examples.overlap.gemm_rs import GemmReduceScatter
    from tilescale_examples.collectives.reducescatter import ReduceScatter

    W = world
    m, k, n = GEMM
    cases = [
        Case("AllReduce one_shot 1000 fp32", lambda a: AllReduce(a, (1000,), torch.float32, algorithm="one_shot"),
             (1000,), torch.float32, lambda op, x: op(x), allreduce.torch_reference),
        Case("AllReduce two_shot 3M bf16", lambda a: AllReduce(a, (3 << 20,), torch.bfloat16, algorithm="two_shot"),
             (3 << 20,), torch.bfloat16, lambda op, x: op(x), allreduce.torch_reference),
        Case("AllReduce auto (lamport) out= 2048 fp16", lambda a: AllReduce(a, (2048,), torch.float16),
             (2048,), torch.float16, None, allreduce.torch_reference),
        Case("AllReduce lamport 3000 bf16", lambda a: AllReduce(a, (3000,), torch.bfloat16, algorithm="lamport"),
             (3000,), torch.bfloat16, lambda op, x: op(x), allreduce.torch_reference),
        Case("AllGather sm 4096 fp16", lambda a: AllGather(a, (4096,), torch.float16),
             (4096,), torch.float16, lambda op, x: op(x), allgather.torch_reference),
        Case("AllGather copy 64K fp16", lambda a: AllGather(a, (1 << 16,), torch.float16, algorithm="copy"),
             (1 << 16,), torch.float16, lambda op, x: op(x), allgather.torch_reference),
        Case("AllToAll 1024 bf16", lambda a: AllToAll(a, (W, 1024), torch.bfloat16),
             (W, 1024), torch.bfloat16, lambda op, x: op(x), alltoall.torch_reference),
        Case("ReduceScatter 4096 fp32", lambda a: ReduceScatter(a, (W, 4096), torch.float32),
             (W, 4096), torch.float32, lambda op, x: op(x), reducescatter.torch_reference),
        Case("ReduceScatter 1001 fp16 (padded rows)", lambda a: ReduceScatter(a, (W, 1001), torch.float16),
             (W, 1001), torch.float16, lambda op, x: op(x), reducescatter.torch_reference),
        Case("GemmReduceScatter", lambda a: GemmReduceScatter(a, m, k, n, torch.bfloat16),
             (W * m, k), torch.bfloat16, lambda op, x: op(x, op._test_b), None, exact=False,
             extra=("rs", k, n)),
        Case("AllGatherGEMM", lambda a: AllGatherGEMM(a, m, k, n, torch.bfloat16),
             (m, k), torch.bfloat16, lambda op, x: op(x, op._test_b), None, exact=False, extra=("ag", k, n)),
    ]
    return cases


def _weights(k: int, n: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(7 + rank)
    return (torch.randn((k, n), generator=g, device=device) / k ** 0.5).to(torch.bfloat16)


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` filled with normal values from ``seed`` (on its device, no host sync)."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    if t.dtype.is_floating_point:
        src = torch.randn(t.shape, generator=g, device=t.device)
        t.copy_(src)
    else:
        t.copy_(torch.randint(-1000, 1000, t.shape, generator=g, device=t.device))
    return t


def _seed(case: int, replay: int, rank: int) -> int:
    return (case * 1_000_003 + replay) * 64 + rank + 1


class Checker:
    """Builds every rank's input of a replay on the device and keeps each replay's verdict
    (a device bool per replay) without synchronising."""

    def __init__(self, case: Case, index: int, op, rank: int, world: int, device):
        self.case, self.index, self.op, self.rank, self.world, self.device = case, index, op, rank, world, device
        self.scratch = [torch.empty(case.shape, dtype=case.dtype, device=device) for _ in range(world)]
        self.verdicts = []
        if case.extra is not None:
            kind, k, n = case.extra
            self.b = [_weights(k, n, p, device) for p in range(world)]
            op._test_b = self.b[rank] if kind == "rs" else self.b[0]

    def inputs(self, replay: int) -> list:
        return [_fill(self.scratch[p], _seed(self.index, replay, p)) for p in range(self.world)]

    def reference(self, inputs) -> torch.Tensor:
        case = self.case
        if case.extra is None:
            return case.reference(inputs, self.rank)
        kind, k, n = case.extra
        if kind == "rs":
            from tilescale_examples.overlap.gemm_rs import torch_reference

            return torch_reference(list(zip(inputs, self.b)), self.rank)
        from tilescale_examples.overlap.ag_gemm import torch_reference

        return torch_reference([(a, self.b[0]) for a in inputs], self.rank)  # every rank multiplies by b[0]

    def record(self, out: torch.Tensor, replay: int) -> None:
        """Keep whether ``out`` is right for ``replay`` (device-side)."""
        want = self.reference(self.inputs(replay))
        if self.case.exact:
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
            ok = (out.view(bits) == want.view(bits)).all()
        else:
            from tilescale_examples.overlap.gemm import error_bound
            from tilescale_examples.overlap.gemm_rs import partial_magnitudes

            rounded = None
            if self.case.extra[0] == "rs":  # each partial product is rounded to the dtype once
                rounded = partial_magnitudes(self.scratch, self.b, self.rank)
            err = (out.float() - want.float()).abs()
            ok = (err <= error_bound(want, self.case.dtype, rounded)).all()
        self.verdicts.append(ok)

    def failures(self) -> list:
        flags = torch.stack(self.verdicts).cpu().tolist()
        return [i for i, good in enumerate(flags) if not good]


def _run_case(case: Case, index: int, alloc, rank: int, world: int, rng) -> tuple:
    """Warm-up, capture two graphs of one call each, replay them alternately with eager calls
    and stalls interleaved; returns ``(checked calls, failures)``."""
    dev = torch.device(alloc.device)
    op = case.build(alloc)
    chk = Checker(case, index, op, rank, world, dev)
    x = torch.empty(case.shape, dtype=case.dtype, device=dev)
    out = None
    if case.call is None:  # the out= path: the output is a tensor of the caller's
        out = torch.empty(case.shape, dtype=case.dtype, device=dev)

    def call():
        if case.call is None:
            return op(x, out=out)
        return case.call(op, x)

    def poison_outputs():
        poison(getattr(op, "output"))
        if out is not None:
            poison(out)

    calls = REPLAYS[world] + 1  # the warm-up (eager, checked), then replays and eager calls
    replay_with_graphs(call, lambda i: x.copy_(chk.inputs(i)[rank]), poison_outputs,
                       lambda i, result: chk.record(result, i), calls, rng)
    bad = chk.failures()
    op.close()
    return calls, [f"{case.name}: call {i}" for i in bad]


def _one_graph_several_ops(alloc, rank: int, world: int) -> tuple:
    """Two AllReduce instances of one shape and an AllGather in ONE graph, replayed with
    fresh inputs; returns ``(checked calls, failures)``."""
    from tilescale_examples.collectives import allgather, allreduce
    from tilescale_examples.collectives.allgather import AllGather
    from tilescale_examples.collectives.allreduce import AllReduce

    dev = torch.device(alloc.device)
    ops = [AllReduce(alloc, (4096,), torch.float32), AllReduce(alloc, (4096,), torch.float32),
           AllGather(alloc, (2048,), torch.float16)]
    refs = [allreduce.torch_reference, allreduce.torch_reference, allgather.torch_reference]
    shapes = [((4096,), torch.float32), ((4096,), torch.float32), ((2048,), torch.float16)]
    xs = [torch.empty(s, dtype=d, device=dev) for s, d in shapes]
    scratch = [[torch.empty(s, dtype=d, device=dev) for _ in range(world)] for s, d in shapes]

    def fill(replay):
        every = [[_fill(scratch[j][p], _seed(90 + j, replay, p)) for p in range(world)] for j in range(3)]
        for j in range(3):
            xs[j].copy_(every[j][rank])
        return every

    fill(0)
    for op, x in zip(ops, xs):
        op(x)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [op(x) for op, x in zip(ops, xs)]
    verdicts = []
    for replay in range(1, 1 + REPLAYS[world] // 4):
        every = fill(replay)
        for op in ops:
            poison(op.output)
        graph.replay()
        for j in range(3):
            want = refs[j](every[j], rank)
            bits = torch.int32 if want.element_size() == 4 else torch.int16
            verdicts.append((outs[j].view(bits) == want.view(bits)).all())
    torch.cuda.synchronize()
    flags = torch.stack(verdicts).cpu().tolist()
    graph.reset()
    for op in ops:
        op.close()
    return len(flags), [f"one graph, several ops: check {i}" for i, good in enumerate(flags) if not good]


def graph_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    alloc = open_rank_heap(rank, world, cache_dir, 2**30)
    rng = random.Random(1000 + rank)
    checks, failures, per_case = 0, [], {}
    for index, case in enumerate(_cases(world)):
        calls, bad = _run_case(case, index, alloc, rank, world, rng)
        checks += calls
        failures += bad
        per_case[case.name] = calls
    calls, bad = _one_graph_several_ops(alloc, rank, world)
    checks += calls
    failures += bad
    report = close_rank_heap(alloc, rank, checks)
    report.update(failures=failures[:20], per_case=per_case)
    return report


GEMM = (128, 256, 256)  # m_local, k, n of the GEMM cases


def graph_jobs(worlds=(1, 2, 4), sms: int | None = None) -> list:
    """Precompile jobs of every kernel :func:`graph_rank_body` builds at these world sizes
    (the grid caps are ``sms``, default the visible GPU's SM count, as the collectives'
    defaults)."""
    from tilescale_examples.base import plan_chunks
    from tilescale_examples.overlap.gemm import default_tiles
    from tilescale_examples.overlap.gemm_store import default_store
    from tilescale_examples.testing.precompile import reduction_jobs

    sms = torch.cuda.get_device_properties(0).multi_processor_count if sms is None else sms
    m, k, n = GEMM
    tiles = default_tiles(n)
    gemm = (tiles, default_store(tiles))  # the ops' GEMM: their default tiles and epilogue
    jobs = reduction_jobs(("one_shot",), ("float32",), worlds)
    jobs += reduction_jobs(("lamport",), ("float32", "float16", "bfloat16"), worlds)
    jobs += reduction_jobs(("two_shot",), ("bfloat16",), worlds)
    jobs += reduction_jobs(("reduce_scatter",), ("float32", "float16", "bfloat16"), worlds)
    for w in worlds:
        for numel, dtype, size in ((4096, "float16", 2), (1 << 16, "float16", 2), (2048, "float16", 2),
                                   (m * k, "bfloat16", 2)):
            c, ch = plan_chunks(numel, size, w, sms)
            jobs.append(("tilescale_examples.collectives.allgather:build_allgather_kernel", (numel, dtype, w, c, ch), None))
        c, ch = plan_chunks(1024, 2, w, sms)
        jobs.append(("tilescale_examples.collectives.alltoall:build_alltoall_kernel", (1024, "bfloat16", w, c, ch), None))
        jobs.append(("tilescale_examples.overlap.gemm:build_gemm_kernel", (w * m, n, k, "bfloat16", *gemm), None))
    jobs.append(("tilescale_examples.overlap.gemm:build_gemm_kernel", (m, n, k, "bfloat16", *gemm), None))
    return jobs + decode_jobs(worlds, sms)


def decode_jobs(worlds, sms: int) -> list:
    """Precompile jobs of :func:`decode_ops`' kernels at these world sizes (grid cap ``sms``)."""
    from tilescale_examples.decode.gemm_allreduce import gemm_allreduce_jobs
    from tilescale_examples.decode.norm_kernel import norm_jobs

    m, k, n = DECODE
    return (gemm_allreduce_jobs([m], k, n, "bfloat16", worlds, sms)
            + norm_jobs(["bfloat16"], worlds, [n], [None, "per_token"], exchanges=["one_shot", "lamport"]))


def test_graph_jobs_hold_every_kernel_the_cases_build():
    """The precompile list covers the ops under test (CPU): every kernel a case's op builds
    (a dry run of its constructor, :class:`~tilescale_examples._contract.RecordingAllocator`)
    is one of :func:`graph_jobs`' kernels, so the GPU test's ranks compile nothing (a kernel
    compiled by several time-sliced ranks at once can outlast the test's deadline)."""
    from tilescale_examples._contract import RecordingAllocator
    from tilescale_examples.testing.precompile import build_job

    sms, missing, built = 132, [], 0
    for world in (1, 2, 4):
        jobs = {build_job(builder, args).script() for builder, args, _ in graph_jobs((world,), sms)}
        builders = [(case.name, case.build) for case in _cases(world)] + [("torch.compile block", compile_ops),
                                                                          ("torch.compile decode block", decode_ops)]
        for name, make in builders:
            allocator = RecordingAllocator(world, sm_count=sms)
            make(allocator)
            for build, _, _ in allocator.builds:
                func, built = build(), built + 1
                if func.script() not in jobs:
                    missing.append(f"world {world}, {name}: {func.attrs['global_symbol']}")
    assert built >= 3 * len(_cases(1)), f"the dry runs built {built} kernels"
    assert not missing, f"kernels the cases build that graph_jobs does not compile: {missing}"


@gpu_rank_test(1, 2, 4, timeout=600, rank_timeout=560, cache=CACHE_NAME, jobs=graph_jobs)
def test_every_op_replays_correctly_in_cuda_graphs(world, rank, world_size, kernel_cache):
    """Per op: warm-up, two captured graphs replayed alternately with fresh inputs, eager
    calls between them and a straggling rank, every call checked on every rank; then one
    graph holding several ops."""
    report = graph_rank_body(rank, world_size, kernel_cache)
    same = same_on_every_rank(report["checks"])
    assert report["failures"] == [], f"rank {rank}/{world_size}: {report['failures']}"
    assert same, f"rank {rank}/{world_size}: the ranks checked different numbers of calls"
    if rank == 0:
        print(f"graphs world {world_size}: {report['checks']} checked calls per rank: {report['per_case']}")


# ------------------------------------------------------------------------------ torch.compile
COMPILE_STEPS = 100
#: Width of the MLP block's hidden layer.
COMPILE_HIDDEN = 256


def compile_ops(alloc) -> tuple:
    """The ops of the MLP block of :func:`compile_rank_body` on ``alloc``: ``(AllGatherGEMM,
    GemmReduceScatter, AllReduce)``."""
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.overlap.gemm_rs import GemmReduceScatter

    m, k, hidden = GEMM[0], GEMM[1], COMPILE_HIDDEN
    return (AllGatherGEMM(alloc, m, k, hidden, torch.bfloat16), GemmReduceScatter(alloc, m, hidden, k, torch.bfloat16),
            AllReduce(alloc, (hidden,), torch.float32))


#: ``(m, k, n)`` of the decode block: 8 tokens, a ``(512, 1024)`` row-parallel weight.
DECODE = (8, 512, 1024)


def decode_ops(alloc) -> tuple:
    """The ops of the decode block of :func:`decode_compile_rank_body` on ``alloc``:
    ``(GemmAllReduce, AllReduceResidualRMSNorm, the same norm with per-token FP8)``."""
    from tilescale_examples.decode import AllReduceResidualRMSNorm, GemmAllReduce

    m, k, n = DECODE
    return (GemmAllReduce(alloc, m, k, n, torch.bfloat16), AllReduceResidualRMSNorm(alloc, (m, n), torch.bfloat16),
            AllReduceResidualRMSNorm(alloc, (m, n), torch.bfloat16, fp8="per_token"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its element size (a bit-for-bit comparison)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compiled_mismatches(block, step_inputs, names) -> tuple:
    """``(mismatches, steps)`` of ``block`` (a function of ``step_inputs(step)`` calling
    ``torch.ops.tilescale.*``, returning the tensors ``names`` name) compiled with
    ``fullgraph=True`` (its first 3 steps) and ``mode="reduce-overhead"`` (CUDA graphs: the
    rest of :data:`COMPILE_STEPS`), each step's result against the eager block's on the same
    inputs, bit for bit."""
    import torch._dynamo

    torch._dynamo.reset()
    full = torch.compile(block, fullgraph=True)  # a graph break raises
    fast = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    mismatches = []
    for step in range(COMPILE_STEPS):
        args = step_inputs(step)
        want = [t.clone() for t in block(*args)]
        got = [t.clone() for t in (full if step < 3 else fast)(*args)]
        for name, a, b in zip(names, got, want, strict=True):
            if not torch.equal(_bits(a), _bits(b)):
                mismatches.append(f"step {step} ({'fullgraph' if step < 3 else 'reduce-overhead'}): {name}")
    torch.cuda.synchronize()
    return mismatches, COMPILE_STEPS


def _compile_rank(rank: int, world: int, cache_dir: str, body) -> dict:
    """A rank of a torch.compile test: its heap (512 MiB), ``body(alloc, device)`` (which
    returns :func:`compiled_mismatches`' pair), the report with the first 20 failures."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, f"inductor-{rank}"))
    alloc = open_rank_heap(rank, world, cache_dir, 2**29)
    mismatches, checks = body(alloc, torch.device(alloc.device))
    report = close_rank_heap(alloc, rank, checks)
    report["failures"] = mismatches[:20]
    return report


def compile_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """A tensor-parallel MLP block through the custom ops (AllGatherGEMM, ReLU,
    GemmReduceScatter, and an AllReduce of a bias gradient): ``torch.compile(fullgraph=True)``
    matches eager bit for bit, and ``mode="reduce-overhead"`` (CUDA graphs) matches eager over
    :data:`COMPILE_STEPS` steps of fresh inputs, eager and compiled steps interleaved."""
    from tilescale_examples.torch_ops import handle_of

    def body(alloc, dev):
        m, k, hidden = GEMM[0], GEMM[1], COMPILE_HIDDEN
        h_ag, h_rs, h_ar = (handle_of(op) for op in compile_ops(alloc))
        w1, w2 = _weights(k, hidden, rank, dev), _weights(hidden, k, 100 + rank, dev)

        def block(x, grad):
            h = torch.ops.tilescale.all_gather_matmul(x, w1, h_ag)
            h = torch.relu(h)
            y = torch.ops.tilescale.matmul_reduce_scatter(h, w2, h_rs)
            return y, torch.ops.tilescale.all_reduce(grad, h_ar)

        def step_inputs(step):
            return (_fill(torch.empty((m, k), dtype=torch.bfloat16, device=dev), _seed(70, step, rank)),
                    _fill(torch.empty((hidden,), dtype=torch.float32, device=dev), _seed(71, step, rank)))

        return compiled_mismatches(block, step_inputs, ("mlp", "bias grad"))

    return _compile_rank(rank, world, cache_dir, body)


def decode_compile_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """A decode block through the custom ops: a row-parallel projection with its all-reduce
    (``matmul_all_reduce``), the fused all-reduce + residual + RMSNorm
    (``all_reduce_residual_rms_norm``), then its FP8 form on the ReLU of the result: compiled
    (``fullgraph=True``, then ``mode="reduce-overhead"``) against eager, bit for bit, every
    output (the FP8 rows and scales included), :data:`COMPILE_STEPS` steps of fresh inputs."""
    from tilescale_examples.torch_ops import handle_of

    def body(alloc, dev):
        m, k, n = DECODE
        h_gar, h_norm, h_fp8 = (handle_of(op) for op in decode_ops(alloc))
        w = _weights(k, n, rank, dev)
        weight = (_fill(torch.empty((n,), device=dev), _seed(72, 0, 0)).abs() + 0.5).to(torch.bfloat16)

        def block(x, residual):
            z = torch.ops.tilescale.matmul_all_reduce(x, w, h_gar)
            y, residual = torch.ops.tilescale.all_reduce_residual_rms_norm(z, residual, weight, h_norm)
            q, scales, residual2 = torch.ops.tilescale.all_reduce_residual_rms_norm_fp8(torch.relu(y), residual,
                                                                                         weight, h_fp8)
            return z, y, residual, q, scales, residual2

        def step_inputs(step):
            return tuple(_fill(torch.empty(shape, dtype=torch.bfloat16, device=dev), _seed(73 + i, step, rank))
                         for i, shape in enumerate(((m, k), (m, n))))

        return compiled_mismatches(block, step_inputs, ("matmul_all_reduce", "y", "residual_out", "y_fp8", "scales",
                                                        "residual_out (fp8)"))

    return _compile_rank(rank, world, cache_dir, body)


@gpu_rank_test(1, 2, timeout=600, rank_timeout=560, cache=CACHE_NAME, jobs=graph_jobs)
def test_torch_compile_of_a_tensor_parallel_block(world, rank, world_size, kernel_cache):
    """``torch.compile(fullgraph=True)`` and ``mode="reduce-overhead"`` of a block calling
    ``torch.ops.tilescale.*`` match the eager block bit for bit, step by step."""
    report = compile_rank_body(rank, world_size, kernel_cache)
    assert report["failures"] == [], f"rank {rank}/{world_size}: {report['failures']}"
    assert report["checks"] == COMPILE_STEPS
    if rank == 0:
        print(f"torch.compile world {world_size}: {COMPILE_STEPS} steps match eager on every rank")


@gpu_rank_test(1, 2, timeout=600, rank_timeout=560, cache=CACHE_NAME, jobs=graph_jobs)
def test_torch_compile_of_a_decode_block(world, rank, world_size, kernel_cache):
    """``torch.compile(fullgraph=True)`` and ``mode="reduce-overhead"`` of a decode block
    calling ``matmul_all_reduce`` and both fused-norm operators match the eager block bit for
    bit, step by step."""
    report = decode_compile_rank_body(rank, world_size, kernel_cache)
    assert report["failures"] == [], f"rank {rank}/{world_size}: {report['failures']}"
    assert report["checks"] == COMPILE_STEPS
    if rank == 0:
        print(f"torch.compile decode block world {world_size}: {COMPILE_STEPS} steps match eager on every rank")
