"""The collective benchmarks (all-gather, reduce-scatter, all-to-all, all-reduce) on the CPU:
bus-bandwidth factors, titles, heap sizing, the check's tolerance, the baseline probe and its
fallbacks (a fake ``torch.distributed`` and a real 2-rank gloo group), argument checks and the
no-GPU exit; the harness every benchmark shares (timing on ``tilescale_host.bench``, ``--out
DIR``). The timed part needs GPUs (``ci/device-check.sh bench``)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from examples_helpers import exits_naming, output_without_gpu

from tilescale_examples.benchmarks import _collective_cli as CLI
from tilescale_examples.benchmarks import _collective_run as R
from tilescale_examples.benchmarks import _collectives as C
from tilescale_examples.benchmarks import _harness as H
from tilescale_examples.benchmarks import _timing as T
from tilescale_examples.benchmarks import allgather, allreduce, alltoall, reducescatter

NAMES = ["allgather", "reducescatter", "alltoall", "allreduce"]
ENTRIES = {"allgather": allgather, "reducescatter": reducescatter, "alltoall": alltoall, "allreduce": allreduce}
#: nccl-tests' bus factors: (n - 1) / n, twice that for all-reduce.
TWICE = {"allreduce": 2}


# ------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("name", NAMES)
def test_bus_bandwidth_is_nccl_tests_factor(name):
    op, k = C.OPS[name], TWICE.get(name, 1)
    assert [op.bus_factor(n) for n in (2, 4, 8)] == [k / 2, k * 3 / 4, k * 7 / 8]
    expect = k * 0.75 * (4 << 30) / 1e9
    assert C.bus_bandwidth(4 << 30, 4, 1000.0, name) == pytest.approx(expect)
    assert ENTRIES[name].bus_bandwidth(4 << 30, 4, 1000.0) == pytest.approx(expect)


@pytest.mark.parametrize("name", NAMES)
def test_bus_factor_matches_the_collectives_bus_bytes(name):
    """The benchmark counts the same bytes as the class's ``bus_bytes()`` (S = world shards)."""
    op, world, shard = C.OPS[name], 4, 10
    fake = SimpleNamespace(world_size=world, shard_numel=shard, itemsize=2, numel=world * shard,
                           reduce_scatter=SimpleNamespace(itemsize=2),
                           input=torch.zeros(op.input_rows(world), shard, dtype=torch.float16),
                           output=torch.zeros(op.output_rows(world), shard, dtype=torch.float16))
    assert op.collective().bus_bytes(fake) == pytest.approx(op.bus_factor(world) * world * shard * 2)


def test_iters_and_shards():
    assert C.iters_for(4096, 20) == 20 and C.iters_for(1 << 30, 20) == 3 and C.iters_for(128 << 20, 20) == 10
    assert C.shard_numel(4096, 4, 2) == 512 and C.shard_numel(2, 4, 2) == 1


def test_heap_bytes_per_op_is_what_the_collectives_allocate(monkeypatch):
    """The heap of a sweep is the collectives' own ``heap_bytes`` (a dry run of each
    constructor) summed over the sizes, plus the slack: for every algorithm it is exactly what
    the constructors allocate (plans at 132 SMs)."""
    from examples_helpers import CpuAllocator, record_compiles

    record_compiles(monkeypatch)
    sizes = (4096, 1000 * 4096 + 2)
    for name in NAMES:
        op, cls = C.OPS[name], C.OPS[name].collective()
        for world in (1, 2, 4):
            for itemsize, dtype in ((2, torch.float16), (4, torch.float32)):
                for algorithm in cls.ALGORITHMS:
                    used = 0
                    for nbytes in sizes:
                        alloc = CpuAllocator(num_ranks=world)
                        cls(alloc, op.shape(C.shard_numel(nbytes, world, itemsize), world), dtype,
                            max_blocks=132, algorithm=algorithm)
                        used += alloc.heap_bytes
                    got = C.heap_bytes(name, sizes, world, dtype, max_blocks=132, algorithm=algorithm)
                    assert got - C.HEAP_SLACK == used, (name, world, dtype, algorithm)


# ------------------------------------------------------------------------------ titles
@pytest.mark.parametrize("name", NAMES)
def test_titles_per_op_and_backend(name):
    op = C.OPS[name]
    gloo = CLI.title(name, 4, "gloo", 1, "float16")
    assert gloo.startswith(f"{op.name} bus bandwidth, 4 ranks, float16, 4 ranks sharing 1 GPU(s)")
    assert f"torch.distributed.{op.baselines[0].name} over gloo (host staging, NOT NCCL" in gloo
    assert "time-sliced, not a bandwidth measurement" in gloo and "busbw = (n-1)/n * size / t" in gloo
    assert ("staging counted" in gloo) == op.reduces
    nccl = CLI.title(name, 8, "nccl", 8, "bfloat16")
    assert nccl.startswith(f"{op.name} bus bandwidth, 8 ranks, bfloat16, one rank per GPU (8 GPUs)")
    assert f"torch.distributed.{op.baselines[0].name} over NCCL;" in nccl and "NOT" not in nccl


def test_reduction_titles_name_the_algorithm_and_the_symmetric_memory_ops():
    t = CLI.title("allreduce", 2, "nccl", 2, "bfloat16", None,
                "torch symmetric memory: torch.ops.symm_mem.one_shot_all_reduce / two_shot_all_reduce_", "auto")
    assert t.startswith("all-reduce (auto) bus bandwidth, 2 ranks")
    assert "torch.ops.symm_mem.one_shot_all_reduce / two_shot_all_reduce_" in t and "vs symm = symm us / TS heap us" in t


def test_symm_baseline_is_na_when_ranks_share_a_gpu_and_names_its_ops():
    from tilescale_examples.benchmarks._symm_baseline import CANDIDATES, SymmBaseline

    shared = SymmBaseline("allreduce", None, "cpu", "gloo", True)
    assert shared.reason.startswith("n/a (ranks share a GPU") and "n/a (ranks share a GPU" in shared.title()
    times = shared.measure(None, None, None, None, 1)
    assert times.fastest() == (None, shared.reason) and times.fastest(graph=True) == (None, shared.reason)
    assert SymmBaseline("allgather", None, "cpu", "nccl", False).reason.startswith("n/a (torch symmetric memory has no")
    names = [n for families in CANDIDATES.values() for _, ns in families for n in ns]
    if not any(hasattr(torch.ops.symm_mem, n) for n in names):
        # torch before symmetric memory (2.4, the lowest supported) has none: the baseline says n/a
        pytest.skip(f"torch {torch.__version__} has no torch.ops.symm_mem ops")
    for op, families in CANDIDATES.items():  # one op of each family exists (CPU builds too)
        for family, ns in families:
            assert any(hasattr(torch.ops.symm_mem, n) for n in ns), (op, family, ns)


def test_symm_times_pick_the_fastest_op_eager_and_replayed():
    from tilescale_examples.benchmarks._symm_baseline import SymmTimes

    times = SymmTimes(eager={"one_shot_all_reduce_out": 0.004, "two_shot_all_reduce_": 0.003},
                      graph={"one_shot_all_reduce_out": 0.002})
    assert times.fastest() == ("two_shot_all_reduce_", 0.003)
    assert times.fastest(graph=True) == ("one_shot_all_reduce_out", 0.002)
    assert SymmTimes(graph_reason="n/a (x graph: capture: RuntimeError)").fastest(True) == (
        None, "n/a (x graph: capture: RuntimeError)")
    # the reduction columns: TileScale heap 2 us, graph 1 us; symm 3 us eager, 2 us replayed
    assert R._symm_cells(0.002, times, 0.001) == [2.0, 3.0, "two_shot_all_reduce_", 1.5,
                                                 2.0, "one_shot_all_reduce_out", 2.0]
    assert R._symm_cells(0.002, times, None)[4:] == [2.0, "one_shot_all_reduce_out", "-"]
    na = SymmTimes(reason="n/a (ranks share a GPU)", graph_reason="n/a (ranks share a GPU)")
    assert R._symm_cells(0.002, na, 0.001) == [2.0, "n/a", "n/a (ranks share a GPU)", "n/a",
                                              "n/a", "n/a (ranks share a GPU)", "n/a"]
    assert len(R._symm_cells(0.002, times, 0.001)) == len(C.SYMM_HEADERS)


def test_titles_name_the_fallback_that_ran():
    rs = CLI.title("reducescatter", 4, "gloo", 1, "float32", "all_reduce + slice")
    assert "baseline torch.distributed.all_reduce + slice over gloo" in rs
    a2a = CLI.title("alltoall", 2, "gloo", 1, "uint8", "all_gather + select")
    assert "baseline torch.distributed.all_gather + select over gloo" in a2a
    assert [b.name for b in C.OPS["reducescatter"].baselines] == ["reduce_scatter_tensor", "all_reduce + slice"]
    assert [b.name for b in C.OPS["alltoall"].baselines] == ["all_to_all_single", "all_to_all", "all_gather + select"]


# ------------------------------------------------------------------------------ graph timing
class FakeGraph:
    """A stand-in for a captured graph: ``replay`` runs the captured calls again."""

    def __init__(self, fn, calls):
        self.fn, self.calls, self.replays = fn, calls, 0

    def replay(self):
        self.replays += 1
        return [self.fn() for _ in range(self.calls)][-1]


def fake_capture(fn, calls):
    fn()  # the eager warm-up call
    graph = FakeGraph(fn, calls)
    return graph, fn()


def test_graph_time_is_replay_time_over_captured_calls():
    """``timer`` times ``replays`` replays of the one graph; the result is per captured call."""
    seen = []

    def timer(replay, replays):  # 50 us per replay, whatever it holds
        seen.append((replay, replays))
        replay()
        return 0.05

    count = iter(range(100))
    ms, graph, result = T.graph_ms_per_call(lambda: next(count), 10, 7, timer, capture=fake_capture)
    assert ms == pytest.approx(0.005)  # 50 us / 10 calls
    assert seen == [(graph.replay, 7)] and graph.calls == 10 and graph.replays == 1
    assert result == 1  # what the captured call returned (after the warm-up call's 0)
    ms, _, _ = T.graph_ms_per_call(lambda: None, 1, 3, lambda replay, n: 0.004, capture=fake_capture)
    assert ms == pytest.approx(0.004)
    for calls, replays in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="calls and replays must be >= 1"):
            T.graph_ms_per_call(lambda: None, calls, replays, timer, capture=fake_capture)


def test_graph_time_with_time_ms_as_timer(monkeypatch):
    """The collectives' timer: ``time_ms`` bound to the group and device, called per replay."""
    calls = []
    monkeypatch.setattr(T, "time_ms", lambda fn, iters, group, device: (calls.append((iters, group, device)), 0.03)[1])
    monkeypatch.setattr(T, "capture_calls", fake_capture)  # the default capture, looked up per call
    timer = lambda fn, n: T.time_ms(fn, n, group="g", device="d")  # noqa: E731
    ms, _, _ = T.graph_ms_per_call(lambda: 0, 3, 20, timer)
    assert ms == pytest.approx(0.01) and calls == [(20, "g", "d")]


def test_poison_fills_what_no_check_accepts():
    f, i, u = torch.zeros(3), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8)
    for t in (f, i, u):
        T.poison_(t)
    assert torch.isnan(f).all() and (i == 2**31 - 1).all() and (u == 255).all()
    assert not C.outputs_match(f, torch.zeros(3), (1e-3, 1e-3)) and not C.outputs_match(i, torch.zeros(3, dtype=torch.int32), None)


def test_check_cell_names_the_failed_check():
    assert R._check_cell(0, 0) == "ok"
    assert R._check_cell(1, 0) == "FAIL (1 rank(s))"
    assert R._check_cell(0, 2) == "FAIL graph (2 rank(s))"
    assert R._check_cell(2, 1) == "FAIL (2 rank(s)), FAIL graph (1 rank(s))"


def test_graph_goal_line_states_the_ratio_against_the_goal():
    line = CLI.graph_goal_line(1, "bfloat16", 2.9, "one_shot_all_reduce_out", 3.94)
    assert line.startswith("4 KiB all-reduce replayed from a CUDA graph, 1 rank(s), bfloat16: TileScale 2.90 us, "
                           "torch.ops.symm_mem.one_shot_all_reduce_out 3.94 us per call")
    assert "TileScale / symm one-shot = 0.736 (goal <= 0.8 at one rank on one H200: met)" in line
    assert "= 1.015 (goal <= 0.8 at one rank on one H200: NOT met)" in CLI.graph_goal_line(1, "float16", 4.0, "x", 3.94)


@pytest.mark.parametrize("name", NAMES)
def test_graph_columns_and_options(name):
    p = CLI.parser(name)
    args = p.parse_args([])
    assert args.graph is True and args.graph_calls == 10
    args = p.parse_args(["--no-graph", "--graph-calls", "4", "--ranks", "1"])
    assert args.graph is False and args.graph_calls == 4 and args.ranks == 1
    assert C.HEADERS[-2:] == ["TileScale graph us", "check"]  # a wrong graph result shows in the check column
    assert C.SYMM_HEADERS[-3:] == ["symm graph us", "symm graph op", "graph vs symm"]
    t = CLI.title(name, 1, "nccl", 1, "float16", graph_calls=10)
    assert "1 rank: bus bandwidth 0 by definition, compare the us columns" in t
    assert "TileScale graph us: GPU time per call of 10 calls captured in one CUDA graph" in t
    assert "graph" not in CLI.title(name, 2, "nccl", 2, "float16")  # --no-graph
    symm = CLI.title(name, 2, "nccl", 2, "float16", symm="torch symmetric memory: x", graph_calls=10)
    assert "graph vs symm = symm graph us / TileScale graph us" in symm


# ------------------------------------------------------------------------------ the check
def test_tolerance_only_for_float_reductions():
    assert C.tolerance("allgather", "float16", 4) is None
    assert C.tolerance("alltoall", "float32", 4) is None
    assert C.tolerance("reducescatter", "int32", 4) is None
    assert C.tolerance("reducescatter", "float16", 4) == (1e-3, pytest.approx(1e-2))
    assert C.tolerance("reducescatter", "float32", 2) == (1e-5, pytest.approx(3e-5))
    x = torch.tensor([1.0, 2.0])
    assert C.outputs_match(x, x.clone(), None) and not C.outputs_match(x, x + 1e-7, None)
    assert C.outputs_match(x, x + 1e-7, (1e-5, 0.0)) and not C.outputs_match(x, x[:1], (1e-5, 1.0))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_reduce_scatter_tolerance_accepts_other_orders_and_rejects_errors(dtype, world):
    """NCCL adds in its ring order and rounds every partial sum in the dtype; the kernel adds
    in rank order in float32 and rounds once. The check must accept that and still catch a
    missing contribution or a wrong element."""
    from tilescale_examples.collectives.reducescatter import torch_reference

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(world)
    inputs = [C.random_input((world, 200_000), dt, g) for _ in range(world)]
    tol = C.tolerance("reducescatter", dtype, world)
    for rank in (0, world - 1):
        ref = torch_reference(inputs, rank)
        for start in range(world):  # every rotation of the rank order, rounded at each step
            ring = inputs[start][rank]
            for k in range(1, world):
                ring = ring + inputs[(start + k) % world][rank]
            assert C.outputs_match(ring, ref, tol), (start, (ring.float() - ref.float()).abs().max())
        missing = ref.float() - inputs[world - 1][rank].float()
        assert not C.outputs_match(missing.to(dt), ref, tol)
        wrong = ref.clone()
        wrong[12345] += 0.5
        assert not C.outputs_match(wrong, ref, tol)


def test_random_input_ranges():
    g = torch.Generator().manual_seed(0)
    f = C.random_input((1000,), torch.bfloat16, g)
    assert f.dtype == torch.bfloat16 and -1 <= f.min() and f.max() <= 1 and f.std() > 0.5
    u = C.random_input((2, 1000), torch.uint8, g)
    assert u.shape == (2, 1000) and int(u.max()) > 200
    i = C.random_input((1000,), torch.int32, g)
    assert i.dtype == torch.int32 and -1000 <= int(i.min()) < 0 < int(i.max()) < 1000


# ------------------------------------------------------------------------------ baseline probe
class FakeDist:
    """A one-rank ``torch.distributed`` whose collectives can refuse (raise) or answer wrong."""

    ReduceOp = SimpleNamespace(SUM="sum")

    def __init__(self, refuse=(), wrong=(), exc=RuntimeError):
        self.refuse, self.wrong, self.exc, self.calls = set(refuse), set(wrong), exc, []

    def get_world_size(self, group):
        return 1

    def get_rank(self, group):
        return 0

    def _run(self, name, pairs):
        self.calls.append(name)
        if name in self.refuse:
            raise self.exc(f"{name} is not supported by this backend")
        for out, x in pairs:
            out.copy_(-x if name in self.wrong else x)

    def all_gather_into_tensor(self, out, x, group=None):
        self._run("all_gather_into_tensor", [(out, x)])

    def all_gather(self, outs, x, group=None):
        self._run("all_gather", [(o, x) for o in outs])

    def reduce_scatter_tensor(self, out, x, op=None, group=None):
        assert op == "sum"
        self._run("reduce_scatter_tensor", [(out, x)])

    def all_reduce(self, t, op=None, group=None):
        assert op == "sum"
        self._run("all_reduce", [(t, t.clone())])

    def all_to_all_single(self, out, x, group=None):
        self._run("all_to_all_single", [(out, x)])

    def all_to_all(self, outs, xs, group=None):
        self._run("all_to_all", list(zip(outs, xs)))


#: (op, what the fake refuses or gets wrong, the baseline expected)
FALLBACKS = [
    ("allgather", {}, "all_gather_into_tensor"),
    ("allgather", {"refuse": ["all_gather_into_tensor"]}, "all_gather"),
    ("allgather", {"wrong": ["all_gather_into_tensor"]}, "all_gather"),
    ("reducescatter", {}, "reduce_scatter_tensor"),
    ("reducescatter", {"refuse": ["reduce_scatter_tensor"], "exc": NotImplementedError}, "all_reduce + slice"),
    ("alltoall", {}, "all_to_all_single"),
    ("alltoall", {"refuse": ["all_to_all_single"], "exc": ValueError}, "all_to_all"),
    ("alltoall", {"refuse": ["all_to_all_single"], "wrong": ["all_to_all"]}, "all_gather + select"),
]


@pytest.mark.parametrize("name,fake,expect", FALLBACKS)
def test_pick_baseline_falls_back(name, fake, expect):
    dist = FakeDist(**fake)
    picked, fn = C.pick_baseline(name, None, "cpu", torch.float32, dist=dist)
    assert picked == expect
    rows = C.OPS[name].input_rows(1)
    x = torch.arange(rows * 3, dtype=torch.float32) + 1
    out = torch.zeros(C.OPS[name].output_rows(1) * 3)
    fn(out, x)  # the returned callable runs the chosen baseline on flat tensors
    assert torch.equal(out, x)


def test_pick_baseline_without_a_working_candidate_raises():
    dist = FakeDist(refuse=["all_to_all_single", "all_to_all", "all_gather"])
    with pytest.raises(RuntimeError, match="no torch.distributed baseline for all-to-all"):
        C.pick_baseline("alltoall", None, "cpu", torch.float16, dist=dist)
    assert dist.calls == ["all_to_all_single", "all_to_all", "all_gather"]


def gloo_rank_body(rank: int, world: int) -> dict:
    """Every baseline candidate of every op and dtype on a real gloo group (CPU tensors),
    checked against the example's ``torch_reference``; and what the probe picks."""
    import torch.distributed as dist

    results = {}
    for name, op in C.OPS.items():
        for dtype_name in op.dtypes:
            dtype = getattr(torch, dtype_name)
            inputs = [C.random_input((op.input_rows(world), 5), dtype, torch.Generator().manual_seed(p))
                      for p in range(world)]
            expect = op.reference(inputs, rank).reshape(-1)
            tol = C.tolerance(op, dtype_name, world)
            for baseline in op.baselines:
                out = torch.zeros_like(expect)
                try:
                    baseline.call(dist, out, inputs[rank].reshape(-1), dist.group.WORLD, rank, world)
                    results[name, dtype_name, baseline.name] = C.outputs_match(out, expect, tol)
                except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as e:
                    results[name, dtype_name, baseline.name] = f"refused: {e}"[:200]
            results[name, dtype_name, "picked"] = C.pick_baseline(op, dist.group.WORLD, "cpu", dtype)[0]
    return results


@pytest.mark.timeout(120)
def test_baselines_on_a_real_gloo_group():
    import warnings

    from tilescale_core.multiprocess import run_ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        reports = run_ranks(gloo_rank_body, 2, backend="gloo", timeout=100)
    assert reports[0].keys() == reports[1].keys()
    for report in reports:
        for (name, dtype, which), value in report.items():
            op = C.OPS[name]
            if which == "picked":
                assert value in [b.name for b in op.baselines]
            elif which == op.baselines[-1].name:
                assert value is True, (name, dtype, which, value)  # the last resort always works
            else:
                assert value is True or str(value).startswith("refused"), (name, dtype, which, value)


# ------------------------------------------------------------------------------ main
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("argv,message", [
    (["--ranks", "0"], "--ranks must be >= 1"),
    (["--graph-calls", "0"], "--graph-calls must be >= 1"),
    (["--min-bytes", "0"], "need 0 < --min-bytes <= --max-bytes"),
    (["--min-bytes", "8192", "--max-bytes", "4096"], "need 0 < --min-bytes <= --max-bytes"),
    (["--dtype", "float64"], "invalid choice"),
])
def test_main_rejects_bad_arguments(name, argv, message, capsys):
    exits_naming(ENTRIES[name].main, argv, message, capsys)


def test_dtype_choices_per_op(capsys):
    # ReduceScatter does not sum uint8
    exits_naming(reducescatter.main, ["--dtype", "uint8"], "invalid choice: 'uint8'", capsys)
    assert CLI.parser("reducescatter").parse_args(["--dtype", "int32"]).dtype == ["int32"]
    assert CLI.parser("reducescatter").parse_args([]).dtype == ["float16", "bfloat16"]
    assert CLI.parser("alltoall").parse_args([]).dtype == ["float16"]
    assert CLI.parser("allreduce").parse_args(["--algorithm", "two_shot"]).algorithm == "two_shot"
    assert CLI.parser("allgather").parse_args([]).algorithm == "auto"
    for flag in ("--engine", "--algorithm"):  # --engine: the 0.1.0 name of the option
        assert R.options("allgather", CLI.parser("allgather").parse_args([flag, "copy"])) == {"algorithm": "copy"}
    assert R.options("alltoall", CLI.parser("alltoall").parse_args([])) == {}
    exits_naming(allreduce.main, ["--algorithm", "three_shot"], "invalid choice: 'three_shot'", capsys)


@pytest.mark.parametrize("name", NAMES)
def test_main_without_gpus_has_nothing_to_measure(name, monkeypatch, capsys):
    out = output_without_gpu(ENTRIES[name].main, ["--ranks", "4"], monkeypatch, capsys)
    assert out == f"{C.OPS[name].name} benchmark: no CUDA GPU visible, nothing to measure\n"


def test_entry_points_pickle_for_spawned_ranks():
    for name in NAMES:
        run = pickle.loads(pickle.dumps(ENTRIES[name].run))
        assert run.func is R.run and run.args == (name,)
    assert pickle.loads(pickle.dumps(H._spawned_rank)) is H._spawned_rank


def test_heap_benchmark_host_mode_prints_its_table(capsys):
    from tilescale_examples.benchmarks import heap

    assert heap.main(["--host", "--calls", "20"]) == 0
    out = capsys.readouterr().out
    assert "tilelang.tensor latency on a host-memory heap" in out and "torch.empty us" in out
    plain, empty = heap.host_tensor_latency(20)
    assert plain > 0 and empty > 0


@pytest.mark.parametrize("name", ["ag_gemm", "gemm_rs"])
def test_overlap_benchmark_numbers_and_arguments(name, monkeypatch, capsys):
    import importlib

    from tilescale_examples.benchmarks import _overlap as overlap

    entry = importlib.import_module(f"tilescale_examples.benchmarks.{name}")
    assert entry.tflops(2e12, 1000.0) == pytest.approx(2.0)
    for argv, message in ((["--ranks", "0"], "--ranks must be >= 1"),
                          (["--m-local", "a,b"], "--m-local must be comma-separated ints"),
                          (["--k", "0"], "must be positive"),
                          (["--rounds", "0"], "must be positive"),
                          (["--m-local", "1000"], "m_local=1000 is not a multiple of block_m=128"),
                          (["--n", "3000"], "n=3000 is not a multiple of block_n=256"),
                          (["--tiles", "128x256"], "--tiles must be BMxBNxBK"),
                          (["--tiles", "128x256x64:3:256:8:1"], "--tiles must be BMxBNxBK"),
                          (["--tiles", "128xax64"], "--tiles must hold ints only"),
                          (["--tiles", "128x256x64:3:200"], "threads must be a multiple of 128"),
                          (["--tiles", "128x512x64", "--n", "3840"], "n=3840 is not a multiple of block_n=512"),
                          (["--tiles", "128x256x64", "--tune"], "--tiles and --tune pick the tiles two ways")):
        exits_naming(entry.main, argv, message, capsys)
    assert overlap.parse_tiles("64x128x32") == dict(block_m=64, block_n=128, block_k=32, num_stages=3, threads=256,
                                                    swizzle=0)
    assert overlap.parse_tiles("128x256x64:4:384:8") == dict(block_m=128, block_n=256, block_k=64, num_stages=4,
                                                             threads=384, swizzle=8)
    assert (overlap.TILES_FORMAT.format(**overlap.parse_tiles("128x256x64:3:256:8"), pipeline="async")
            == "128x256x64 s3 t256 w8 async")
    exits_naming(entry.main, ["--pipeline", "async", "--tiles", "128x256x64:1"],
                 "num_stages must be >= 2 for the async pipeline", capsys)
    exits_naming(entry.main, ["--pipeline", "fast"], "invalid choice: 'fast'", capsys)
    assert "nothing to measure" in output_without_gpu(entry.main, ["--pipeline", "async"], monkeypatch, capsys)
    args = overlap.parser(name).parse_args(["--pipeline", "async"])
    assert "TileScale's GEMM with the async pipeline" in overlap.title(name, 1, "gloo", 1, args)
    assert "no CUDA GPU visible, nothing to measure" in output_without_gpu(entry.main, [], monkeypatch, capsys)
    run = pickle.loads(pickle.dumps(entry.run))
    assert run.func is overlap.run and run.args == (name,)
    assert pickle.loads(pickle.dumps(overlap._run_op)) is overlap._run_op
    args = overlap.parser(name).parse_args([])
    assert (args.ranks, args.m_local, args.k, args.n, args.dtype) == (2, "1024,2048,4096,8192", 8192, 3584, "bfloat16")


def test_interleaved_rounds_take_every_column_in_turn_and_keep_each_columns_median(monkeypatch):
    """The overlap benchmarks' rounds (``_timing.interleaved_ms`` on ``perf_rounds``): every
    round times every column in turn, each timing as ``time_ms`` (2 warm-up calls, ``iters``
    timed calls, the device's stream, the wait timeout); a slow round (a clock drop) moves no
    median."""
    order, clock, seen = [], iter([10, 20, 99, 98, 11, 21, 12, 22, 13, 23]), []

    def perf_fn(fn, warmup, rep, **kw):
        seen.append((warmup, rep, kw["aggregate"], kw["stream"], kw["timeout"]))
        order.append(fn())
        return None, next(clock)

    monkeypatch.setattr(T, "perf_fn", perf_fn)
    monkeypatch.setattr(T, "_stream", lambda device: f"stream of {device}")
    got = T.interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, 20, 5, None, "cpu")
    assert order == ["a", "b"] * 5
    assert got == {"a": 12, "b": 22}
    assert set(seen) == {(2, 20, "none", "stream of cpu", T.WAIT_S)}  # the slowest rank: perf_rounds' max


def test_overlap_benchmark_titles_say_when_ranks_share_a_gpu():
    from tilescale_examples.benchmarks import _overlap as overlap

    args = overlap.parser("ag_gemm").parse_args([])
    assert "one rank per GPU (2 GPU(s)); collective over NCCL" in overlap.title("ag_gemm", 2, "nccl", 2, args)
    shared = overlap.title("gemm_rs", 4, "gloo", 1, args)
    assert shared.startswith("GEMM + reduce-scatter, 4 rank(s), bfloat16, k=8192, n=3584 per rank")
    assert "SHARING 1 GPU(s): time-sliced, NOT a performance measurement" in shared
    assert len(overlap.HEADERS) == 3 + 5 + 4 + 1


def test_overlap_benchmark_reference_matches_the_examples_references():
    from tilescale_examples.overlap import ag_gemm, gemm_rs
    from tilescale_examples.benchmarks import _overlap as overlap

    world, m, k, n, dt = 3, 4, 8, 5, torch.float32
    a0, b0 = overlap.rank_inputs("ag_gemm", 0, world, m, k, n, dt, "cpu")
    assert a0.shape == (m, k) and torch.equal(a0, overlap.rank_inputs("ag_gemm", 0, world, m, k, n, dt, "cpu")[0])
    ref, rounded = overlap.reference("ag_gemm", 1, world, m, k, n, dt, "cpu")
    pairs = [overlap.rank_inputs("ag_gemm", p, world, m, k, n, dt, "cpu") for p in range(world)]
    assert rounded is None and torch.allclose(ref, ag_gemm.torch_reference(pairs, 1))
    ins = [overlap.rank_inputs("gemm_rs", p, world, m, k, n, dt, "cpu") for p in range(world)]
    assert ins[0][0].shape == (world * m, k)
    ref, rounded = overlap.reference("gemm_rs", 2, world, m, k, n, dt, "cpu")
    a, b = [x for x, _ in ins], [y for _, y in ins]
    assert torch.allclose(ref, gemm_rs.torch_reference(ins, 2), atol=1e-5)
    assert torch.allclose(rounded, gemm_rs.partial_magnitudes(a, b, 2), atol=1e-5)
    assert overlap.heap_for("ag_gemm", 2, 1024, 8192, 3584, torch.bfloat16) >= 2 * 2 * 1024 * 8192 * 2
    assert overlap.heap_for("gemm_rs", 2, 1024, 8192, 3584, torch.bfloat16) >= 2 * 2 * 1024 * 3584 * 2


# ------------------------------------------------------------------------------ the harness
def test_collective_timing_is_perf_fn_on_the_devices_stream(monkeypatch):
    """``time_ms``: 2 warm-up calls, ``iters`` back-to-back calls on the device's current
    stream, the slowest rank of ``group``, waits that time out (``perf_fn``)."""
    seen = []
    monkeypatch.setattr(T, "perf_fn", lambda fn, warmup, rep, **kw: (seen.append((fn, warmup, rep, kw)), ("out", 0.5))[1])
    monkeypatch.setattr(T, "_stream", lambda device: f"stream of {device}")
    fn = lambda: None  # noqa: E731
    assert T.time_ms(fn, 7, "g", "d") == 0.5
    assert seen == [(fn, 2, 7, {"group": "g", "stream": "stream of d", "timeout": T.WAIT_S})]


def test_held_launch_timing_is_perf_fn_behind_a_stream_hold(monkeypatch):
    seen = []
    monkeypatch.setattr(T, "perf_fn", lambda fn, warmup, rep, **kw: (seen.append((warmup, rep, kw)), (None, 0.25))[1])
    monkeypatch.setattr(T, "_stream", lambda device: f"stream of {device}")
    assert T.held_ms_per_launch(lambda: None, 50, "d") == 0.25
    assert seen == [(0, 50, {"group": "local", "stream": "stream of d", "hold": True})]  # hold sized from 1 call


def test_local_timing_is_do_bench_of_calls_from_an_idle_gpu(monkeypatch):
    seen = []
    monkeypatch.setattr(T, "do_bench", lambda fn, warmup, rep, **kw: (seen.append((warmup, rep, kw)), 0.125)[1])
    assert T.local_ms(lambda: None, 9) == 0.125
    assert seen == [(1, 9, {"flush_l2": False, "group": "local", "before": torch.cuda.synchronize})]


def test_local_rounds_take_the_columns_in_turn_and_keep_each_ones_median_round(monkeypatch):
    """putget's rounds (``perf_rounds`` with ``local_ms`` as the timer): each round times every
    column in turn; a column this rank does not run (None) is NaN (its barriers still happen
    on every rank)."""
    import math

    calls = []
    fake = {"fa": iter([5.0, 1.0, 3.0]), "fb": iter([2.0, 9.0, 4.0])}
    monkeypatch.setattr(T, "local_ms", lambda fn, iters: (calls.append((fn(), iters)), next(fake[fn()]))[1])
    got = T.local_rounds([("a", lambda: "fa"), ("b", lambda: "fb")], 3, 7)
    assert got == {"a": 3.0, "b": 4.0} and calls == [("fa", 7), ("fb", 7)] * 3
    calls.clear()
    fake["fb"] = iter([2.0, 9.0, 4.0])
    got = T.local_rounds([("a", None), ("b", lambda: "fb")], 3, 7)
    assert math.isnan(got["a"]) and got["b"] == 4.0 and calls == [("fb", 7)] * 3
    with pytest.raises(ValueError, match="rounds"):
        T.local_rounds([("a", lambda: "fa")], 0, 7)


def test_no_benchmark_times_with_its_own_cuda_events():
    """Every timing goes through tilescale_host.bench: no module of the benchmarks creates a
    timing event pair itself."""
    from pathlib import Path

    from tilescale_examples import benchmarks

    sources = sorted(Path(benchmarks.__file__).parent.glob("*.py"))
    assert len(sources) > 20
    assert [p.name for p in sources if "Event(enable_timing" in p.read_text(encoding="utf-8")] == []


def _benchmark(name):
    import importlib

    return importlib.import_module(f"tilescale_examples.benchmarks.{name}")


@pytest.mark.parametrize("name", __import__("tilescale_examples.benchmarks", fromlist=["BENCHMARKS"]).BENCHMARKS)
def test_every_benchmark_has_the_out_option(name, capsys):
    with pytest.raises(SystemExit) as exc:
        _benchmark(name).main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--out DIR" in out, out
    assert out.split()[:5] == ["usage:", "python", "-m", f"tilescale_examples.benchmarks.{name}", "[-h]"]


def test_out_saves_every_table_it_prints(tmp_path, capsys):
    """``--out DIR``: each table printed is also saved (CSV, JSON, PNG) under the benchmark's
    name, the later ones ``<name>_2``, ...; a run without ``--out`` saves nothing."""
    from tilescale_examples.benchmarks import _export, _report, heap

    out = tmp_path / "tables"
    assert heap.main(["--host", "--calls", "20", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["heap.csv", "heap.json", "heap.png"]
    assert f"saved: heap.csv, heap.json, heap.png in {out}" in printed
    record = _export.read_table(out / "heap.json")
    assert record["name"] == "heap" and record["headers"] == ["tensor us", "torch.empty us", "ratio"]
    assert record["title"].startswith("tilelang.tensor latency on a host-memory heap") and len(record["rows"]) == 1
    _report.print_table("a second table", ["size", "x us"], [["4 KiB", 1.0], ["16 KiB", 2.0]])
    assert (out / "heap_2.json").exists() and _export.read_table(out / "heap_2.csv")["rows"][1] == ["16 KiB", 2.0]
    assert "saved: heap_2.csv" in capsys.readouterr().out
    assert heap.main(["--host", "--calls", "20"]) == 0  # no --out: nothing more saved
    _report.print_table("not saved", ["a"], [[1]])
    assert len(list(out.iterdir())) == 6 and "saved:" not in capsys.readouterr().out


def test_out_without_matplotlib_saves_the_table_and_skips_the_plot(tmp_path, monkeypatch, capsys):
    import sys

    from tilescale_examples.benchmarks import _report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    p = H.parser("putget", "d")
    H.parse_args(p, ["--out", str(tmp_path)])
    try:
        _report.print_table("t", ["size", "x GB/s"], [["4 KiB", 1.0]])
    finally:
        _report.save_tables(None)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["putget.csv", "putget.json"]
    assert capsys.readouterr().err.count("putget: no plot") == 1


def test_running_all_benchmarks_passes_out_on(monkeypatch, capsys, tmp_path):
    from tilescale_examples.benchmarks import BENCHMARKS
    from tilescale_examples.benchmarks import __main__ as run_all

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run_all.subprocess, "call", lambda argv: (calls.append(argv), 0)[1])
    assert run_all.main(["putget", "heap", "--out", str(tmp_path)]) == 0
    assert [c[2:] for c in calls] == [["tilescale_examples.benchmarks.putget", "--out", str(tmp_path)],
                                      ["tilescale_examples.benchmarks.heap", "--out", str(tmp_path)]]
    calls.clear()
    assert run_all.main([]) == 0
    assert [c[2:] for c in calls] == [[f"tilescale_examples.benchmarks.{n}"] for n in BENCHMARKS]
    assert run_all.main(["nope"]) == 2 and "unknown benchmark(s) ['nope']" in capsys.readouterr().err


def test_kernel_builds_are_shown_on_rank_0_only(monkeypatch):
    """The benchmarks say what they are doing while compiling: compile_once logs each kernel
    build and its time; show_progress prints those lines on rank 0 (and only there)."""
    import io
    import logging

    import tilelang

    from tilescale_examples import base
    from tilescale_examples.benchmarks import _harness

    log = logging.getLogger("tilescale_examples")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "level", logging.NOTSET)
    monkeypatch.setattr(tilelang, "compile", lambda func, **kw: ("compiled", func))

    class Func:
        attrs = {"global_symbol": "allreduce_one_shot"}

    quiet = io.StringIO()
    _harness.show_progress(1, quiet)
    func = Func()
    assert base.compile_once(func) == ("compiled", func)
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    _harness.show_progress(0, shown)
    _harness.show_progress(0, shown)  # idempotent: one handler
    base.compile_once(Func())
    lines = shown.getvalue().splitlines()
    assert lines[0] == "[benchmark] building kernel allreduce_one_shot ..."
    assert lines[1].startswith("[benchmark] kernel allreduce_one_shot ready (") and lines[1].endswith(" s)")
    assert len(lines) == 2
