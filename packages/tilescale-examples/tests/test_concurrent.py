"""benchmarks.concurrent on the CPU: every emulated rank's op gets a kernel of its own
(testing.emulated.build_concurrent) and gives it back (release_kernels); the command line's
errors, the line without a GPU, the table's columns and the size-table summary; the presets of
the loading round and the watchdog that ends a deadlocked case. The timed part needs a GPU
(``ci/device-check.sh bench-concurrent``)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from examples_helpers import CpuAllocator, exits_naming, output_without_gpu

from tilescale_examples.benchmarks import BENCHMARKS, concurrent
from tilescale_examples.collectives.allreduce import AllReduce
from tilescale_examples.testing.emulated import build_concurrent, release_kernels


def test_every_rank_gets_a_kernel_of_its_own_until_released(compiles):
    allocs = [CpuAllocator(num_ranks=3, rank=r) for r in range(3)]
    ops, kernels = build_concurrent(lambda r: AllReduce(allocs[r], (64,), torch.bfloat16, algorithm="one_shot"), 3)
    assert [op.allocator for op in ops] == allocs
    assert compiles == ["allreduce_one_shot", "allreduce_one_shot_copy1", "allreduce_one_shot_copy2"]
    assert len({id(k) for k in kernels}) == 3 and [op.kernel for op in ops] == kernels
    shared = AllReduce(CpuAllocator(num_ranks=3), (64,), torch.bfloat16, algorithm="one_shot")
    assert len(compiles) == 4  # every copy is pinned to its rank: a fourth allocator needs a fourth
    for op in ops + [shared]:
        op.close()
    release_kernels(kernels)
    again = AllReduce(CpuAllocator(num_ranks=3), (32,), torch.bfloat16, algorithm="one_shot")
    assert len(compiles) == 4 and again.kernel is kernels[0]  # released: the first copy serves again
    assert not any(key.startswith("_tilescale_pinned") for key in again.kernel.__dict__)


def test_command_line_errors_and_no_gpu(monkeypatch, capsys):
    assert "concurrent" in BENCHMARKS
    assert output_without_gpu(concurrent.main, [], monkeypatch, capsys) == (
        "concurrent benchmark: no CUDA GPU visible, nothing to measure\n")
    for argv, message in ((["--ranks", "1"], "--ranks must be in [2, 8]"), (["--iters", "0"], "--iters >= 1"),
                          (["--min-bytes", "8"], "--min-bytes must be at least 16"),
                          (["--min-bytes", "8192", "--max-bytes", "4096"], "at most --max-bytes"),
                          (["--algorithms", "lamport", "lamport"], "must not repeat"),
                          (["--op", "norm", "--algorithms", "two_shot"], "--op norm takes --algorithms lamport"),
                          (["--op", "norm", "--dtype", "float32"], "--dtype bfloat16 or float16"),
                          (["--hidden", "12"], "--hidden must be a positive multiple of 8"),
                          (["--case-timeout", "0"], "--case-timeout must be positive")):
        exits_naming(concurrent.main, argv, message, capsys)


def test_columns_largest_win_and_summary():
    assert concurrent.HEADERS == ["ranks", "size", "lamport us", "one_shot us", "lamport/one_shot", "check"]
    assert concurrent.headers(["one_shot"]) == ["ranks", "size", "one_shot us", "check"]
    rows = [[2, 4096, 2.0, 3.0, 0.667, "ok"], [2, 8192, 2.5, 3.1, 0.806, "ok"], [2, 16384, 3.5, 3.2, 1.094, "ok"],
            [2, 32768, 3.0, 4.0, 0.75, "ok"]]
    assert concurrent.largest_win(rows) == 8192  # up to the first size where it loses, not after
    assert concurrent.largest_win([[4, 4096, 3.0, 2.0, 1.5, "ok"]]) is None
    lines = concurrent.summary_lines({2: rows, 4: [[4, 4096, 3.0, 2.0, 1.5, "ok"]]}, ["lamport", "one_shot"],
                                     {1: 4096, 2: 32 << 10, 4: 16 << 10})
    assert lines == ["2 ranks: lamport faster than one_shot up to 8 KiB (shipped entry: 32 KiB)",
                     "4 ranks: lamport faster than one_shot at no size (shipped entry: 16 KiB)"]
    assert concurrent.summary_lines({2: rows}, ["one_shot", "two_shot"]) == [
        "2 ranks: one_shot faster than two_shot up to 8 KiB"]


def test_shapes_and_sizes_of_the_sweep():
    from argparse import Namespace

    assert concurrent.shape_of("allreduce", 4096, 2, 4096) == (2048,)
    assert concurrent.shape_of("norm", 4096, 2, 4096) == (1, 4096)  # at least one token row
    assert concurrent.shape_of("norm", 65536, 2, 4096) == (8, 4096)
    args = Namespace(op="norm", min_bytes=4096, max_bytes=65536, hidden=4096)
    assert concurrent.sizes(args, 2) == [8192, 16384, 32768, 65536]  # 4 KiB is one row of 8 KiB, as 8 KiB is
    assert concurrent.sizes(Namespace(op="allreduce", min_bytes=4096, max_bytes=16384, hidden=4096), 2) == [
        4096, 8192, 16384]


def test_inputs_and_failures_of_both_ops(compiles):
    """The round's inputs and checks on CPU stand-ins (the round itself needs streams)."""
    from tilescale_examples.collectives.reduce_engine import torch_reference
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    ars = [AllReduce(CpuAllocator(num_ranks=2, rank=r), (64,), torch.bfloat16, algorithm="one_shot") for r in range(2)]
    args = concurrent._inputs(ars, 0)
    assert [len(a) for a in args] == [1, 1] and args[0][0].shape == (64,) and not torch.equal(args[0][0], args[1][0])
    total = torch_reference([a[0] for a in args])
    assert concurrent._failures(ars, [total, total.clone()], args, "ar") == []
    wrong = total.clone()
    wrong[3] += 1
    assert concurrent._failures(ars, [total, wrong], args, "ar") == ["ar rank 1: 1 wrong elements"]
    norms = [AllReduceResidualRMSNorm(CpuAllocator(num_ranks=2, rank=r), (2, 256), torch.bfloat16, threads=64,
                                      algorithm="lamport") for r in range(2)]
    args = concurrent._inputs(norms, 0)
    assert [tuple(t.shape) for t in args[1]] == [(2, 256), (2, 256), (256,)]
    outs = [t for r, op in enumerate(norms) for t in op.reference(args, r)]  # (y, residual_out) per rank
    assert concurrent._failures(norms, outs, args, "norm") == []
    outs[3] = outs[3] + 1  # rank 1's residual_out
    assert concurrent._failures(norms, outs, args, "norm")[0].startswith("norm rank 1 residual_out:")


def test_precompile_jobs_are_the_kernels_the_ranks_compile(monkeypatch):
    """kernel_jobs: for each rank count, the op's kernel of each algorithm and the copies the
    other emulated ranks compile (build_concurrent), structurally equal to what the ops build,
    symbols included, so that the run's compiles are cache hits."""
    from examples_helpers import RecordedKernel
    from tilelang import tvm

    from tilescale_examples import base
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm
    from tilescale_examples.testing.precompile import build_job

    built = []

    def recording(func, *args, **kwargs):
        built.append(func)
        return RecordedKernel(func.attrs["global_symbol"])

    monkeypatch.setattr(base, "compile_once", recording)
    monkeypatch.setattr(base, "_KERNELS", {})

    classes = {"allreduce": (AllReduce, (64,)), "norm": (AllReduceResidualRMSNorm, (2, 512))}
    for op, n, algorithm in (("allreduce", 3, "one_shot"), ("allreduce", 2, "lamport"), ("norm", 2, "lamport"),
                             ("norm", 3, "one_shot")):
        built.clear()
        cls, shape = classes[op]
        allocs = [CpuAllocator(num_ranks=n, rank=r) for r in range(n)]
        ops, kernels = build_concurrent(lambda r: cls(allocs[r], shape, torch.bfloat16, algorithm=algorithm), n)
        jobs = concurrent.kernel_jobs(op, [algorithm], "bfloat16", [n], 512)
        assert len(jobs) == n == len(built)
        for want, got in zip([build_job(builder, args) for builder, args, _ in jobs], built):
            assert tvm.ir.structural_equal(want, got), (op, n, algorithm, str(got.attrs["global_symbol"]))
        for o in ops:
            o.close()
        release_kernels(kernels)
    assert len(concurrent.kernel_jobs("norm", ["lamport", "one_shot"], "bfloat16", [2, 4, 8], 4096)) == 2 * 14


def test_pass_every_wait_presets_flags_and_makes_lamport_data_arrive(compiles):
    """The loading round's presets: a flag op's flags above any epoch, a Lamport op's receive
    buffers free of the sentinel (every element reads as arrived), for both ops."""
    from tilescale_examples.collectives.lamport_kernel import SENTINEL_BYTE
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm
    from tilescale_examples.testing.emulated import PRESET

    ops = [AllReduce(CpuAllocator(num_ranks=2, rank=0), (64,), torch.bfloat16, algorithm="one_shot"),
           AllReduce(CpuAllocator(num_ranks=2, rank=0), (64,), torch.bfloat16, algorithm="lamport"),
           AllReduceResidualRMSNorm(CpuAllocator(num_ranks=2, rank=0), (2, 256), torch.bfloat16, threads=64,
                                    algorithm="lamport"),
           AllReduceResidualRMSNorm(CpuAllocator(num_ranks=2, rank=0), (2, 256), torch.bfloat16, threads=64,
                                    algorithm="one_shot")]
    assert (ops[1].stage_buffer.view(torch.uint8) == SENTINEL_BYTE).all()  # fresh: nothing arrived
    concurrent.pass_every_wait(ops)
    for op in (ops[0], ops[3]):
        assert (op.flags.view(torch.int64) == PRESET).all()
    for op in (ops[1], ops[2]):
        assert not (op.stage_buffer.view(torch.uint8) == SENTINEL_BYTE).any()
    for op in ops:
        op.close()


_HANGS = """
import sys, time
from tilescale_examples.benchmarks._harness import watchdog
with watchdog(0.2, "quick case"):
    pass
with watchdog(float(sys.argv[1]), "stuck case"):
    time.sleep(30)
print("not reached")
"""


def test_watchdog_ends_a_stuck_case_naming_it():
    """A body past its deadline ends the process (non-zero) with the case's line and the
    stacks; a body within it leaves nothing armed."""
    run = subprocess.run([sys.executable, "-c", _HANGS, "0.5"], capture_output=True, text=True, timeout=25)
    assert run.returncode != 0 and "not reached" not in run.stdout
    assert "[benchmark] quick case (at most 0.2 s)" in run.stderr
    assert "[benchmark] stuck case (at most 0.5 s)" in run.stderr and "Timeout" in run.stderr
    assert 'File "<string>", line 7 in <module>' in run.stderr  # where it was stuck


def test_each_rank_counts_table_is_reported_before_the_next_rank_count_runs(monkeypatch):
    """run() hands every rank count's rows to ``done`` as soon as its sizes have run, so a
    later rank count that never ends (the watchdog then ends the process) loses only its own."""
    from argparse import Namespace

    from tilescale_examples.testing import precompile

    events = []
    monkeypatch.setattr(precompile, "precompile", lambda jobs: events.append("precompile"))
    monkeypatch.setattr(concurrent, "preload", lambda n, nbytes, *a: events.append(("preload", n, nbytes)))

    def time_case(n, nbytes, dtype, algorithm, iters, device, op, hidden, graph):
        assert graph is False  # --launch eager
        events.append(("case", n, nbytes, algorithm))
        return (1.0 if algorithm == "lamport" else 2.0), []

    monkeypatch.setattr(concurrent, "time_case", time_case)
    args = Namespace(op="allreduce", algorithms=["lamport", "one_shot"], dtype="bfloat16", ranks=[2, 4], hidden=4096,
                     min_bytes=4096, max_bytes=8192, iters=1, case_timeout=30.0, launch="eager")
    tables, failures = concurrent.run(args, "cpu", lambda n, rows: events.append(("done", n, len(rows))))
    assert failures == [] and tables[2] == [[2, 4096, 1.0, 2.0, 0.5, "ok"], [2, 8192, 1.0, 2.0, 0.5, "ok"]]
    assert events == ["precompile", ("preload", 2, 4096), ("preload", 2, 4096),
                      *[("case", 2, b, a) for b in (4096, 8192) for a in ("lamport", "one_shot")], ("done", 2, 2),
                      ("preload", 4, 4096), ("preload", 4, 4096),
                      *[("case", 4, b, a) for b in (4096, 8192) for a in ("lamport", "one_shot")], ("done", 4, 2)]


def test_preload_calls_every_rank_once_in_turn_with_every_wait_passing_then_closes(monkeypatch, compiles):
    """preload: one call per emulated rank, rank order, each launched with its waits preset to
    pass (Lamport receive buffers without a sentinel byte); then every op closed, the kernels
    released and the peers closed."""
    from tilescale_examples.collectives.lamport_kernel import SENTINEL_BYTE

    allocs = [CpuAllocator(num_ranks=2, rank=r) for r in range(2)]
    launched, closed = [], []

    class Launch:  # a rank's kernel: notes at launch time whether any receive byte is the sentinel
        def __init__(self, op, rank):
            self.op, self.rank = op, rank

        def initialize(self, allocator=None, stream=None):
            return self

        def __call__(self, *args):
            launched.append((self.rank, bool((self.op.stage_buffer.view(torch.uint8) == SENTINEL_BYTE).any())))

    class Peers:
        def close(self):
            closed.append("peers")

    def build(n, nbytes, dtype, algorithm, device, op, hidden):
        ops, kernels = build_concurrent(lambda r: AllReduce(allocs[r], (nbytes // 2,), dtype, algorithm=algorithm), n)
        for r, each in enumerate(ops):
            each.kernel = Launch(each, r)
        monkeypatch.setattr(type(ops[0]), "close", lambda self: closed.append(self.allocator.local_rank))
        return Peers(), ops, kernels

    monkeypatch.setattr(concurrent, "build", build)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    concurrent.preload(2, 128, torch.bfloat16, "lamport", torch.device("cpu"))
    assert launched == [(0, False), (1, False)]  # in turn, nothing left to wait for
    assert closed == [0, 1, "peers"]


def test_the_run_gives_every_stream_a_hardware_queue_once_a_gpu_is_found(monkeypatch):
    """emulated_device sets the variables it is given (unless set) only after finding a GPU,
    before the CUDA context; main() asks for CUDA_DEVICE_MAX_CONNECTIONS=32."""
    from argparse import ArgumentParser, Namespace

    from tilescale_examples.benchmarks import _harness

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    args, env = Namespace(ranks=[2]), {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    monkeypatch.setattr(_harness, "visible_gpus", lambda what: 0)
    assert _harness.emulated_device(ArgumentParser(), args, "x", environ=env) is None
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # no GPU: nothing set
    monkeypatch.setattr(_harness, "visible_gpus", lambda what: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _harness.emulated_device(ArgumentParser(), args, "x", environ=env) == torch.device("cuda", 0)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # the user's value stays
    _harness.emulated_device(ArgumentParser(), args, "x", environ=env)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    seen = {}
    monkeypatch.setattr(_harness, "emulated_device", lambda p, a, what, environ=None: seen.update(environ) or None)
    assert concurrent.main([]) == 0 and seen == {"CUDA_DEVICE_MAX_CONNECTIONS": str(concurrent.MAX_CONNECTIONS)}


def test_captured_round_gives_every_rank_a_graph_of_its_own_on_its_own_stream(monkeypatch):
    """captured_round: an eager warm-up round, then one graph per rank captured on that rank's
    stream (one graph of every rank would let CUDA run a waiting rank's branch before the rank
    it waits for); a replay forks every rank's stream from the current one, replays its graph
    there and joins it back; the outputs are poisoned after the capture."""
    import contextlib

    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    class Graph:
        def replay(self):
            events.append(("replay", graphs.index(self), current[-1].name))

    graphs, current = [], [Stream("main")]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    def graph(g, stream=None):  # captures on ``stream``, made current as torch.cuda.graph does
        graphs.append(g)
        events.append(("capture", len(graphs) - 1, stream.name))
        return on(stream)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))

    def op_of(rank):
        def op(x):
            events.append(("call", rank, current[-1].name))
            return torch.zeros(2), torch.zeros(3, dtype=torch.int32)
        return op

    streams = [Stream(f"s{r}") for r in range(3)]
    replay, outs = concurrent.captured_round([op_of(r) for r in range(3)], [(None,)] * 3, streams)
    assert len(outs) == 6 and all(o.isnan().all() for o in outs[0::2])  # poisoned
    assert all((o == torch.iinfo(torch.int32).max).all() for o in outs[1::2])
    eager = [e for r in range(3) for e in (("wait", f"s{r}", "main"), ("call", r, f"s{r}"))]
    joins = [("wait", "main", f"s{r}") for r in range(3)]
    captures = [e for r in range(3) for e in (("capture", r, f"s{r}"), ("call", r, f"s{r}"))]
    assert events == eager + joins + ["sync"] + captures
    events.clear()
    replay()
    assert events == [e for r in range(3) for e in (("wait", f"s{r}", "main"), ("replay", r, f"s{r}"))] + joins
