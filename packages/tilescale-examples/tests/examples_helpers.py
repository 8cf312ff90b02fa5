"""Shared helpers of the examples' tests: a CPU stand-in allocator, lowering, nvcc/GPU gates.

A module of its own, with a name no other package's tests use, so that one pytest run can
collect every package's tests (``conftest`` is not importable by name across packages)."""

from __future__ import annotations

import os

import pytest

if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    # /usr/local/bin/nvcc may be a shim that misleads TileLang's CUDA_HOME detection
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import tilelang  # noqa: E402,F401  (the import hook attaches tilescale-lang)
import torch  # noqa: E402

from tilescale_examples.base import TARGET  # noqa: E402

from tilescale_lang.toolkit import find_toolkit  # noqa: E402

#: The CUDA toolkit of $CUDA_HOME (nvcc, or NVRTC + ptxas for the CUDA 12.1/12.2 wheels).
TOOLKIT = find_toolkit()
#: Tests that run ``tilelang.compile`` (TileLang calls the toolkit's nvcc).
needs_nvcc = pytest.mark.skipif(TOOLKIT is None or TOOLKIT.nvcc is None,
                                reason=f"needs the nvcc driver (toolkit: {TOOLKIT or 'none; set CUDA_HOME'})")
#: Tests that compile generated CUDA with the toolkit (nvcc, or NVRTC + ptxas).
needs_toolkit = pytest.mark.skipif(TOOLKIT is None, reason="no CUDA toolkit found (set CUDA_HOME)")


def have_gpu() -> bool:
    """Whether torch sees a CUDA GPU."""
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def exits_naming(main, argv, message, capsys, code=2) -> None:
    """A benchmark's ``main(argv)`` exits with status ``code`` (2: argparse's usage error) and
    ``message`` in its standard error."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == code and message in capsys.readouterr().err


def output_without_gpu(main, argv, monkeypatch, capsys) -> str:
    """The standard output of a benchmark's ``main(argv)`` with no CUDA GPU visible (it
    returns 0)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(argv) == 0
    return capsys.readouterr().out


def lower_source(func) -> str:
    """CUDA source of ``func`` under the examples' target, without nvcc."""
    return lower_with(func, {})


def in_order(src: str, *parts) -> bool:
    """Whether ``parts`` occur in ``src`` in this order (each after the previous one)."""
    at = 0
    for part in parts:
        at = src.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


def kernel_body(src: str) -> str:
    """The ``__global__`` function of a generated source."""
    return src[src.index('extern "C" __global__ void __launch_bounds__'):]


class CpuAllocator:
    """Stand-in for a tilescale-core allocator on the CPU: hands out CPU tensors filled with
    garbage (so zeroing is observable) and records every allocation."""

    def __init__(self, num_ranks=2, rank=0):
        self.num_ranks = num_ranks
        self.local_rank = rank
        self.device = torch.device("cpu")
        self.closed = False
        self.table = torch.tensor([rank, num_ranks] + [(i + 1) << 32 for i in range(num_ranks)], dtype=torch.uint64)
        self.allocations = []

    def _allocate_tensor(self, shape, dtype, return_peers=False):
        shape = (shape,) if isinstance(shape, int) else shape
        self.allocations.append((tuple(shape), dtype))
        local = torch.full(tuple(shape), 7, dtype=dtype)
        if not return_peers:
            return local
        return [local if r == self.local_rank else torch.full(tuple(shape), 7, dtype=dtype)
                for r in range(self.num_ranks)]

    @property
    def heap_bytes(self) -> int:
        """Heap bytes of the recorded allocations on tilescale-core's heap: each at least one
        byte, rounded up to the heap's 256-byte alignment."""
        sizes = (max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
                 for shape, dtype in self.allocations)
        return sum(-(-n // 256) * 256 for n in sizes)


def build_rejected(cls, args: dict, exc, match=None, *, compiles: list | None = None, num_ranks: int = 2):
    """``cls(**args)`` with ``allocator`` a :class:`CpuAllocator` of ``num_ranks`` ranks (unless
    ``args`` names another) raises ``exc`` (matching ``match``) before allocating anything on
    the heap and, given the ``compiles`` record of :func:`record_compiles`, before compiling
    anything; the exception."""
    alloc = CpuAllocator(num_ranks=num_ranks)
    with pytest.raises(exc, match=match) as info:
        cls(**{"allocator": alloc, **args})
    assert alloc.allocations == []
    assert compiles is None or compiles == []
    return info.value


def call_rejected(op, call, exc, match) -> None:
    """``call(op)`` raises ``exc`` (matching ``match``) before any launch: the op's recording
    kernel saw no call and its epoch is still 0."""
    with pytest.raises(exc, match=match):
        call(op)
    assert op.kernel.calls == [] and op.epoch == 0


def rejects_before_allocating(cls, good: dict, cases: list):
    """The test that constructor ``cls`` rejects bad arguments before allocating or compiling
    anything, one case per ``(changes, exc, match)`` of ``cases``: ``cls`` built on a 2-rank
    :class:`CpuAllocator` with ``good`` arguments updated by ``changes`` (which may set the
    allocator's ``num_ranks``) raises ``exc`` matching ``match`` (:func:`build_rejected`);
    ``exc`` None: it builds.  A test module assigns it to its test's name."""

    @pytest.mark.parametrize("kwargs,exc,match", cases)
    def test(kwargs, exc, match, compiles):
        args = dict(good, **kwargs)
        num_ranks = args.pop("num_ranks", 2)
        if exc is None:
            cls(**{"allocator": CpuAllocator(num_ranks=num_ranks), **args})
        else:
            build_rejected(cls, args, exc, match, compiles=compiles, num_ranks=num_ranks)

    return test


def gemm_sequential_on_cpu(cls, dtype, caplog):
    """A GEMM op ``cls`` (``m_local, k, n = 256, 128, 256``) on a 2-rank :class:`CpuAllocator`
    with the automatic plan: the CPU is not a CUDA device, so it takes the sequential plan and
    logs why; the allocator and the op."""
    import logging

    alloc = CpuAllocator(num_ranks=2)
    with caplog.at_level(logging.WARNING, logger="tilescale_examples"):
        op = cls(alloc, 256, 128, 256, dtype)
    assert op.algorithm == op.plan == "sequential" and "not a CUDA device" in op.algorithm_reason
    assert f"{cls.__name__}: cpu is not a CUDA device; using the sequential plan" in caplog.text
    return alloc, op


def gemm_fused_on_one_rank(cls, dtype, compiles):
    """A GEMM op ``cls`` (``256, 128, 256``) on one rank, the fused plan available
    (``fused_available``): the plan is the stock GEMM alone, with nothing on the heap; the op."""
    alloc = CpuAllocator(num_ranks=1)
    op = cls(alloc, 256, 128, 256, dtype)
    assert op.algorithm == "fused" and "nothing to communicate" in op.algorithm_reason
    assert alloc.allocations == [] and compiles == ["gemm_tma_store"]  # the sync pipeline's TMA-store epilogue
    assert op.output.shape == (256, 256)
    return op


def gemm_heap_bytes_per_plan(cls, args: tuple, world: int) -> dict:
    """``{plan: heap bytes}`` that ``cls(allocator, *args, algorithm=plan)`` allocates on a
    ``world``-rank :class:`CpuAllocator`, for the fused and sequential plans (the fused one
    available: ``fused_available``); ``cls.heap_bytes`` equals each, and the larger without a plan."""
    sizes = {}
    for algorithm in ("fused", "sequential"):
        alloc = CpuAllocator(num_ranks=world)
        cls(alloc, *args, algorithm=algorithm)
        sizes[algorithm] = alloc.heap_bytes
        assert cls.heap_bytes(*args, world_size=world, algorithm=algorithm, device="cpu") == sizes[algorithm]
    assert cls.heap_bytes(*args, world_size=world, device="cpu") == max(sizes.values())
    return sizes


def gpu_rank_test(*worlds: int, timeout: float, cache: str, jobs=None, rank_timeout: float = 240):
    """The marks of a multi-rank GPU test, run on its ranks by the tilescale pytest plugin's
    ``ranks`` marker: once per world size in ``worlds`` (the ``world`` parameter), the test
    function runs on ``world`` spawned ranks (``rank`` and ``world_size`` filled in by each;
    ranks share GPUs under ``TILESCALE_SHARE_GPUS=1``, else a world larger than the GPU count
    is skipped with the reason), killed after ``rank_timeout`` s with every rank's stack; the
    ``kernel_cache`` fixture gives it the session's TileLang cache ``cache``, ``jobs()``
    (precompile jobs, or None) compiled into it first; ``timeout`` s for the whole test
    (pytest-timeout). Skipped, with the reason, without a GPU (``gpu``)."""

    def mark(test):
        for m in (pytest.mark.kernel_cache(cache, jobs), pytest.mark.ranks("world", timeout=rank_timeout),
                  pytest.mark.parametrize("world", list(worlds)), pytest.mark.timeout(timeout), pytest.mark.gpu):
            test = m(test)
        return test

    return mark


def run_gpu_ranks(body, world: int, tmp_path_factory, name: str, timeout: float = 240) -> list:
    """Run ``body(rank, world, cache_dir)`` on ``world`` ranks (NCCL with one GPU per rank,
    gloo when they share GPUs: ``run_ranks(backend="auto")``; ``timeout`` s deadline) with a
    TileLang cache shared by the session, and return the ranks' results. For the chaos tests,
    which kill ranks on purpose and examine what the others saw; every other multi-rank GPU
    test runs through the tilescale plugin's ``ranks`` marker (:func:`gpu_rank_test`)."""
    from tilescale_core.multiprocess import run_ranks

    return run_ranks(body, world, args=(session_cache(tmp_path_factory, name),), backend="auto", timeout=timeout)


#: A TileLang cache directory the GPU tests use instead of one per pytest session (kept across
#: sessions: ``ci/device-check.sh`` points it at the repository's ``.tlcache``).
KEPT_CACHE_ENV = "TILESCALE_TEST_KERNEL_CACHE"


def session_cache(tmp_path_factory, name: str) -> str:
    """The GPU tests' TileLang cache ``name``: ``$TILESCALE_TEST_KERNEL_CACHE`` when set, else
    ``tilelang-cache-NAME`` in this pytest session's temporary directory."""
    return os.environ.get(KEPT_CACHE_ENV) or str(tmp_path_factory.getbasetemp() / f"tilelang-cache-{name}")


def open_rank_heap(rank: int, world: int, cache_dir: str, size: int, device: str | None = None):
    """A GPU rank body's setup: the shared TileLang cache, a 30 s wait timeout (a lost signal
    traps instead of hanging), the device (default: ``rank_device(rank)``, i.e. cuda:0 when
    the ranks share one GPU, the rank's own GPU otherwise) and a distributed heap."""
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    os.environ.setdefault("TILESCALE_WAIT_TIMEOUT_MS", "30000")
    import torch.distributed as dist
    from tilescale_core.multiprocess import rank_device

    device = rank_device(rank) if device is None else device

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    return tilelang.get_allocator(size=size, device=device, is_distributed=True, local_rank=rank,
                                  num_local_ranks=world, group=dist.group.WORLD)


def close_rank_heap(alloc, rank: int, checks: int) -> dict:
    """A GPU rank body's teardown (device sync, barrier, collective close); its report."""
    import torch.distributed as dist

    if torch.device(alloc.device).type == "cuda":
        torch.cuda.synchronize(alloc.device)
    dist.barrier()
    alloc.close()
    return {"rank": rank, "checks": checks}


class RecordedKernel(str):
    """What :func:`record_compiles` hands out for a compiled kernel: its name (a ``str``), with
    an ``initialize`` that does nothing (there is no module to give a table to)."""

    def initialize(self, allocator=None, stream=None):
        return self


class LaunchRecorder:
    """Stands in for a compiled kernel on the CPU: appends each launch's arguments (with
    ``tag``: ``(tag, arguments)``) to ``launched``; ``initialize`` (the table binding before
    a launch) does nothing."""

    def __init__(self, launched: list, tag=None):
        self.launched, self.tag = launched, tag

    def initialize(self, allocator=None, stream=None):
        return self

    def __call__(self, *args):
        self.launched.append(args if self.tag is None else (self.tag, args))


def record_compiles(monkeypatch, *modules) -> list:
    """Replace ``compile_once`` in ``modules`` (and the collectives' and
    the reduction engine's) with recorders: returns the list of compiled kernels' names, so a
    CPU test checks what an object builds without nvcc (compiles are tested separately)."""
    from tilescale_examples import base as collective
    from tilescale_examples.collectives import reduce_engine

    built = []

    def fake(func, *args, **kwargs):
        built.append(RecordedKernel(func.attrs["global_symbol"]))
        return built[-1]

    for module in (*modules, collective, reduce_engine):
        if hasattr(module, "compile_once"):
            monkeypatch.setattr(module, "compile_once", fake)
    monkeypatch.setattr(collective, "_KERNELS", {})  # kernels an earlier test compiled stay out
    return built


#: ``lower_with``'s results in this process: (structural hash of the function, pass configs) ->
#: CUDA source. Several tests check the same kernel (the MoE dispatch takes ~14 s to lower);
#: each configuration is lowered once per pytest run.
_LOWERED: dict = {}


def lower_with(func, pass_configs: dict) -> str:
    """CUDA source of ``func`` under the examples' target and TileLang ``pass_configs``
    (lowered once per process for structurally equal functions: lowering is deterministic)."""
    from tilelang import tvm

    key = (tvm.ir.structural_hash(func, map_free_vars=True), repr(sorted(dict(pass_configs).items())))
    hit = _LOWERED.get(key)
    if hit is not None and tvm.ir.structural_equal(hit[0], func, map_free_vars=True):
        return hit[1]
    with tvm.transform.PassContext(config=dict(pass_configs)), tvm.target.Target(TARGET):
        src = tilelang.lower(func, target=TARGET).kernel_source
    _LOWERED[key] = (func, src)
    return src


def nvcc_resources(src: str, tmp_path) -> tuple:
    """``(registers per thread, spill store bytes)`` of the one kernel in a generated source,
    compiled to an sm_90a cubin with the toolkit, the way TileLang compiles kernels
    (``ptxas -v``)."""
    import re

    _, log, _ = TOOLKIT.compile(src, tmp_path, "cubin", "sm_90a", ptxas_verbose=True)
    return int(re.findall(r"Used (\d+) registers", log)[-1]), int(re.findall(r"(\d+) bytes spill stores", log)[-1])


def random_tensor(shape, dtype, generator, device):
    """Fresh test data: normal floats, or int32 in [-1000, 1000), made on the CPU from
    ``generator`` (reproducible) and moved to ``device``."""
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, tuple(shape), generator=generator, dtype=torch.int32).to(device)
    return torch.randn(tuple(shape), generator=generator).to(dtype).to(device)


def poison(t) -> None:
    """Fill ``t`` with a value no correct result has: NaN for floats, -123456789 for ints."""
    t.fill_(-123456789 if not t.dtype.is_floating_point else float("nan"))


def replay_with_graphs(call, fill, poison, keep, count: int, rng) -> None:
    """The CUDA-graph part of a fused op's GPU test: ``fill(0)`` and an eager ``call()`` (the
    warm-up loads the module before the capture) kept as result 0, two graphs of ``call()``
    captured, then for ``i`` in ``1 .. count - 1``: ``fill(i)`` (fresh inputs), ``poison()``
    (the op's outputs and buffers), now and then (5%) a straggler (a sleep of 1k-200k cycles
    on the stream), an eager call every 7th call and otherwise a replay of graph ``i % 2``,
    and ``keep(i, result)`` (copy it on the stream). Synchronises and resets the graphs at the
    end; the caller checks what it kept."""
    fill(0)
    keep(0, call())
    torch.cuda.synchronize()
    captured = []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = call()
        captured.append((graph, got))
    for i in range(1, count):
        fill(i)
        poison()
        if rng.random() < 0.05:
            torch.cuda._sleep(rng.randrange(1000, 200_000))
        if i % 7 == 3:
            got = call()
        else:
            graph, got = captured[i % 2]
            graph.replay()
        keep(i, got)
    torch.cuda.synchronize()
    for graph, _ in captured:
        graph.reset()


def parts_rank_body(rank: int, world: int, cache_dir: str, parts, heap_bytes: int = 2**28) -> dict:
    """A GPU rank body made of test parts: a heap (:func:`open_rank_heap`), then each
    ``part(alloc, rank, world, rng)`` of ``parts`` (module-level functions returning ``(checked
    calls, failures)``; ``rng`` seeded by the rank); raises on any failure, else the rank's
    report (:func:`close_rank_heap`)."""
    import random

    alloc = open_rank_heap(rank, world, cache_dir, heap_bytes)
    rng = random.Random(rank)
    checks, failures = 0, []
    for part in parts:
        done, bad = part(alloc, rank, world, rng)
        checks += done
        failures += bad
    assert not failures, f"{len(failures)} failure(s): {failures[:10]}"
    return close_rank_heap(alloc, rank, checks)


def side_stream_beside(side_call, main_call, checks=()) -> int:
    """The side-stream case of a GPU test: ``side_call()`` on a fresh side stream (ordered
    after the current stream's work so far) while ``main_call()`` runs on the current stream
    (a second instance, say), then a device synchronisation and each of ``checks`` (callables
    that raise on a wrong result). Returns the number of checks run."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        side_call()
    main_call()
    torch.cuda.synchronize()
    for check in checks:
        check()
    return len(checks)


def side_stream_pairs(pairs, build, inputs, check, rank: int, world: int) -> tuple:
    """The side-stream part of a GPU test (a :func:`parts_rank_body` part's result): for each
    pair of constructor cases in ``pairs``, ``build(case)`` both instances (poisoned by
    ``build``), ``inputs(op, seed)`` every rank's call arguments of fresh data, the first
    instance called on a side stream beside the second on the current stream
    (:func:`side_stream_beside`), then ``check(op, got, every, what)`` (failure messages) of
    each result; ``(checked calls, failures)``."""
    checks, bad = 0, []
    for index, pair in enumerate(pairs):
        ops = [build(case) for case in pair]
        every = [inputs(op, 700 + 10 * index + v) for v, op in enumerate(ops)]
        got = [None, None]

        def call(v):
            def run():
                got[v] = ops[v](*every[v][rank])
            return run

        def checked(v):
            what = f"rank {rank}/{world} side stream {index} instance {v}"
            return lambda: bad.extend(check(ops[v], got[v], every[v], what))

        checks += side_stream_beside(call(0), call(1), (checked(0), checked(1)))
        for op in ops:
            op.close()
    return checks, bad


def case_part_checks(cases, b2b_cases, back_to_back: dict, graph_cases, replays: dict):
    """``checks(world)`` for :func:`parts_gpu_test` of the usual three parts: two checked calls
    per case (eager, then once more), ``back_to_back[world]`` per back-to-back case and
    ``replays[world] + 1`` per graph case."""
    return lambda world: (2 * len(cases) + back_to_back[world] * len(b2b_cases)
                          + (replays[world] + 1) * len(graph_cases))


def parts_gpu_test(parts, checks, kernels, cache_name: str, label: str, timeout: float, worlds=(1, 2, 4)):
    """A multi-rank GPU test (:func:`gpu_rank_test`; for a module's ``test_...`` name) made of
    test ``parts`` (see :func:`parts_rank_body`): once per world size in ``worlds``,
    ``kernels()`` (precompile jobs) compiled into the session cache ``cache_name`` first, then
    every rank runs the parts and must report ``checks(world)`` checked calls (printing
    ``label``); ``timeout`` s for the test, 40 s less for its ranks."""
    parts = tuple(parts)

    @gpu_rank_test(*worlds, timeout=timeout, rank_timeout=timeout - 40, cache=cache_name, jobs=kernels)
    def test(world, rank, world_size, kernel_cache):
        expect_checks(parts_rank_body(rank, world_size, kernel_cache, parts), checks(world_size), label)

    return test


def same_on_every_rank(value) -> bool:
    """Whether every rank of the default process group passed an equal ``value`` (compared by
    ``repr``; a collective call: every rank must make it)."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return len({repr(v) for v in values}) == 1


def expect_checks(report: dict, checks: int, label: str = "") -> dict:
    """A rank's ``report`` (:func:`close_rank_heap`) says it checked ``checks`` calls; prints
    ``<label> world <n>: <checks> checked calls per rank`` from rank 0. The report."""
    assert report["checks"] == checks, f"rank {report['rank']}: {report['checks']} checked calls, expected {checks}"
    if label and report["rank"] == 0:
        import torch.distributed as dist

        print(f"{label} world {dist.get_world_size()}: {checks} checked calls per rank")
    return report




def gemm_inputs(m: int, n: int, k: int, dtype, seed: int) -> tuple:
    """Fresh GEMM operands ``(a (m, k), b (k, n))`` of ``dtype`` on the GPU, normal floats from
    ``seed``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn((m, k), generator=g, device="cuda").to(dtype),
            torch.randn((k, n), generator=g, device="cuda").to(dtype))


def assert_gemm_matches(kernel, twin, m: int, n: int, k: int, dtype, why: str, seeds=range(3)) -> None:
    """A GEMM ``kernel(a, b, out)`` on fresh operands of every seed: its poisoned output within
    the library's bound of the float32 product (``count_outside``), a repeated call bit for
    bit the same, and ``twin(a, b, out)`` (another kernel of the same products in the same
    order) bit for bit the same too (``why`` says why it must be)."""
    from tilescale_examples.overlap.gemm import count_outside

    for seed in seeds:
        a, b = gemm_inputs(m, n, k, dtype, seed)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        kernel(a, b, out)
        bad, worst = count_outside(out, a.float() @ b.float(), dtype)
        assert bad == 0, f"seed {seed}: {bad} elements outside the bound (worst {worst:.2f}x)"
        again = torch.full_like(out, float("nan"))
        kernel(a, b, again)
        assert torch.equal(again, out)
        ref = torch.full_like(out, float("nan"))
        twin(a, b, ref)
        assert torch.equal(ref, out), why


def assert_gemm_back_to_back(kernel, m: int, n: int, k: int, dtype, calls: int = 200) -> tuple:
    """``calls`` calls of a GEMM ``kernel(a, b, out)`` without host synchronisation over four
    fresh operand pairs in turn, each into its own poisoned output: the first four within the
    bound of the float32 product, every later one bit for bit its pair's first. Returns
    ``(inputs, outputs)`` (the four pairs, all ``calls`` outputs)."""
    from tilescale_examples.overlap.gemm import count_outside

    inputs = [gemm_inputs(m, n, k, dtype, 100 + i) for i in range(4)]
    outs = [torch.full((m, n), float("nan"), dtype=dtype, device="cuda") for _ in range(calls)]
    for i, out in enumerate(outs):
        kernel(*inputs[i % 4], out)
    torch.cuda.synchronize()
    for i in range(4):
        bad, _ = count_outside(outs[i], inputs[i][0].float() @ inputs[i][1].float(), dtype)
        assert bad == 0, f"call {i}"
    assert all(torch.equal(outs[i], outs[i % 4]) for i in range(4, calls))
    return inputs, outs


def assert_gemm_two_streams(kernel, inputs, expected, calls: int = 20) -> None:
    """``calls`` calls of a GEMM ``kernel(a, b, out)`` on each of two side streams at once,
    stream ``j`` on ``inputs[j]`` into its own poisoned output: each output must be
    ``expected[j]`` bit for bit (a kernel that keeps no state between calls)."""
    side = [torch.cuda.Stream() for _ in range(2)]
    pair = [torch.full_like(expected[j], float("nan")) for j in range(2)]
    torch.cuda.synchronize()
    for j, stream in enumerate(side):
        with torch.cuda.stream(stream):
            for _ in range(calls):
                kernel(*inputs[j], pair[j])
    torch.cuda.synchronize()
    for j in range(2):
        assert torch.equal(pair[j], expected[j]), f"stream {j}"


def assert_gemm_graph_replays(call, inputs, expected) -> None:
    """A GEMM ``call(a, b, out)`` captured once in a CUDA graph on copies of ``inputs[0]``,
    then replayed with every later ``inputs[i] = (a, b)`` copied into the captured operands
    and a poisoned output: each replay must give ``expected[i]`` bit for bit."""
    a, b = (t.clone() for t in inputs[0])
    out = torch.empty_like(expected[0])
    call(a, b, out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(a, b, out)
    for i in range(1, len(inputs)):
        a.copy_(inputs[i][0])
        b.copy_(inputs[i][1])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[i]), f"graph replay {i}"
