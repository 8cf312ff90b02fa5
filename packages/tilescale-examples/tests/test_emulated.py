"""Emulated peers (N ranks as N regions of one buffer): the bookkeeping on the CPU, and the
unchanged reduction kernels checked bit for bit on one GPU with N = 2 and 4 (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch
from examples_cache import WAIT_TIMEOUT_MS, warm_cache
from examples_helpers import exits_naming

from tilescale_examples.testing.emulated import ALIGNMENT, PRESET, EmulatedPeers, run_round


def test_regions_tables_and_symmetric_offsets():
    peers = EmulatedPeers(3, 1000, "cpu")
    assert peers.region_bytes == 1024 and len(peers.bases) == 3
    assert all(b % ALIGNMENT == 0 for b in peers.bases)
    assert [b - peers.bases[0] for b in peers.bases] == [0, 1024, 2048]
    ranks = [peers.rank(r) for r in range(3)]
    assert ranks[1].table.tolist() == [1, 3, *peers.bases] and ranks[1].num_ranks == 3
    a = [r._allocate_tensor((10,), torch.float32) for r in ranks]  # the same sequence on every rank
    b = [r._allocate_tensor((3, 4), torch.int32) for r in ranks]
    for r in range(3):
        assert a[r].data_ptr() == peers.bases[r] and b[r].data_ptr() == peers.bases[r] + 256
    views = ranks[0]._allocate_tensor((4,), torch.float16, return_peers=True)
    assert [v.data_ptr() - peers.bases[r] for r, v in enumerate(views)] == [512] * 3
    b[2].fill_(5)  # rank 2's tensor is region 2's bytes, whoever writes it
    assert torch.equal(peers.view(2, 256, (3, 4), torch.int32), torch.full((3, 4), 5, dtype=torch.int32))
    with pytest.raises(MemoryError, match="emulated rank 0: 2048 bytes at offset 768 exceed the region of 1024"):
        ranks[0]._allocate_tensor((512,), torch.float32)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        peers.rank(3)
    peers.close()
    assert ranks[0].closed
    with pytest.raises(RuntimeError, match="closed"):
        ranks[0]._allocate_tensor((1,), torch.float32)


def test_run_round_presets_flags_and_points_each_kernel_at_its_rank():
    peers = EmulatedPeers(2, 4096, "cpu")
    log = []

    class Coll:
        def __init__(self, r):
            self.allocator, self.device = peers.rank(r), torch.device("cpu")
            self.flags = self.allocator._allocate_tensor((4,), torch.uint64)
            self.flags.view(torch.int64).fill_(3)
            self.input = r

        def bind_table(self):
            log.append(("init", int(self.allocator.table[0])))

        def __call__(self, x):
            assert int(self.flags.view(torch.int64)[0]) == PRESET
            log.append(("call", x))
            return x * 10

    colls = [Coll(0), Coll(1)]
    assert run_round(colls) == [0, 10]
    assert log == [("init", 0), ("call", 0), ("init", 1), ("call", 1)]
    with pytest.raises(ValueError, match="pass them in rank order"):
        run_round(colls[::-1])
    log.clear()  # a preset of the caller's replaces the fill (here: one the calls' assertion sees)
    assert run_round(colls, call=lambda c: c(c.input + 1), preset=lambda cs: [
        c.flags.view(torch.int64).fill_(PRESET) for c in cs] and log.append("preset")) == [10, 20]
    assert log == ["preset", ("init", 0), ("call", 1), ("init", 1), ("call", 2)]


CASES = [("allreduce", "auto", 4096), ("allreduce", "one_shot", 3 * 4096 + 16),
         ("allreduce", "two_shot", (4 << 20) + 48), ("reducescatter", "auto", 1 << 20)]


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 4])
def test_emulated_kernels_match_the_reference_on_gpu(ranks, tmp_path_factory, monkeypatch):
    """Each case: three rounds with fresh inputs and poisoned outputs (both halves of the
    double buffer), every rank's output bit-exact; then the timing path runs, a round
    captured in a CUDA graph is replayed and checked bit for bit, and the call numbers' A/B
    runs, its host-numbered kernel checked against the op's."""
    from tilescale_examples.benchmarks.emulated import build, bytes_moved, check_round, time_graph, time_kernels

    monkeypatch.setenv("TILELANG_CACHE_DIR", warm_cache(tmp_path_factory))  # the rank tests' kernels
    monkeypatch.setenv("TILESCALE_WAIT_TIMEOUT_MS", WAIT_TIMEOUT_MS)
    for op, algorithm, nbytes in CASES:
        for dtype in (torch.float16, torch.bfloat16):
            peers, colls = build(op, algorithm, ranks, nbytes, dtype, torch.device("cuda"))
            for seed in range(3):
                bad = check_round(op, colls, seed)
                assert not bad, bad
            assert time_kernels(colls, 2) > 0 and bytes_moved(colls[0]) >= 2 * nbytes // ranks
            ms, bad = time_graph(op, colls, 3, seed=7)  # after the eager calls: captured kernels rebind
            assert ms > 0 and not bad, bad
            _host_numbered_kernel_matches(colls)  # last: its bare launches advance the device counters alone
            for c in colls:
                c.close()
            peers.close()


def _host_numbered_kernel_matches(colls) -> None:
    """The call numbers' A/B (benchmarks.emulated): both kernels time, and the host-numbered
    build writes the same output as the op's kernel on the same staged input (every rank,
    outputs poisoned in between)."""
    from tilescale_examples.benchmarks import _call_number_ab
    from tilescale_examples.benchmarks.emulated import preset_flags

    host = _call_number_ab.host_number_kernel(colls[0])
    device_ms, host_ms = _call_number_ab.time_call_numbers(colls, 2, host, preset_flags)
    assert device_ms > 0 and host_ms > 0
    for c in colls:
        out = c.stages[0] if c.result is None else c.result  # two-shot: the result replaces its input
        args = c._kernel_args(c.stages[0], c.result, 0)
        preset_flags(colls)
        c.bind_table()
        c.kernel(*args)
        if c.result is None:
            continue  # two-shot overwrote its staged input: one comparison would need a restage
        want = out.clone()
        out.fill_(float("nan"))
        preset_flags(colls)
        c.bind_table(kernel=host)
        host(*args, int(c.state[0]))  # the device kernel's number: the same staging buffer
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"rank {colls.index(c)}: the host-numbered kernel's output differs"


def test_benchmark_arguments_and_byte_counts(capsys, monkeypatch):
    from types import SimpleNamespace

    from tilescale_examples.benchmarks import emulated as B
    from tilescale_examples.collectives.reduce_engine import plan_grid

    for argv, message in ((["--ranks", "0"], "--ranks must be in [1, 64]"),
                          (["--min-bytes", "8", "--max-bytes", "4"], "need 0 < --min-bytes <= --max-bytes"),
                          (["--ops", "allgather"], "invalid choice"), (["--dtype", "int8"], "invalid choice")):
        exits_naming(B.main, argv, message, capsys)
    assert B.shape_of("allreduce", 4096, 4, 2) == (2048,) and B.shape_of("reducescatter", 4096, 4, 2) == (4, 512)
    two = SimpleNamespace(plan=plan_grid("two_shot", 1 << 20, 2, 4))  # 2 MiB: each rank reads and writes 2 MiB
    assert B.bytes_moved(two) == 2 * (2 << 20)
    one = SimpleNamespace(plan=plan_grid("one_shot", 2048, 2, 4))  # 4 KiB: 4 reads and 1 write per row
    assert B.bytes_moved(one) == 5 * 4096
    rs = SimpleNamespace(plan=plan_grid("reduce_scatter", 512, 2, 4))  # 4 KiB input: reads it, writes 1 KiB
    assert B.bytes_moved(rs) == 4096 + 1024
    with pytest.raises(ValueError, match="sources must be >= 1, got 0"):
        B.copy_ms(16, 1, "cpu", sources=0)
    assert B.HEADERS.index("copy B GB/s") == B.HEADERS.index("ratio") + 1  # the footprint baseline next to the plain one
    assert B.HEADERS.index("graph us") == B.HEADERS.index("kernel us") + 1  # the replayed call next to the eager one
    from tilescale_examples.benchmarks import _call_number_ab

    assert _call_number_ab.row(4, "4 KiB", "one_shot", 0.0031, 0.003) == [4, "4 KiB", "one_shot", 3.1, 3.0, 1.033]
    assert len(_call_number_ab.row(2, "1 MiB", "two_shot", 1e-3, 1e-3)) == len(_call_number_ab.HEADERS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--ranks", "2"], ["--ranks", "2", "--no-graph"], ["--ranks", "2", "--no-ab"]):
        assert B.main(argv) == 0
        assert "no CUDA GPU visible" in capsys.readouterr().out


class FakeAllReduce:
    """A one-shot or two-shot all-reduce of emulated rank ``rank`` on the CPU: ``input`` is its
    staging buffer (``buffers[rank]``), a call stages an ordinary tensor there; one-shot sums
    every rank's buffer in rank order into its output, two-shot sums its shard (elements ``i %
    ranks == rank``) of every buffer and writes it into every buffer (its output is its input)."""

    def __init__(self, rank, buffers, mode, broken=False):
        self.rank, self.buffers, self.mode, self.broken = rank, buffers, mode, broken
        self.device, self.input = torch.device("cpu"), buffers[rank]
        self.flags = torch.zeros(4, dtype=torch.uint64)
        self.output = self.input if mode == "two_shot" else torch.zeros_like(self.input)
        self.calls = 0

    def __call__(self, x):
        from tilescale_examples.collectives.reduce_engine import torch_reference

        self.calls += 1
        assert int(self.flags.view(torch.int64)[0]) == PRESET  # preset before the capture
        if x is not self.input:
            self.input.copy_(x)
        if self.broken:
            return self.output
        if self.mode == "one_shot":
            self.output.copy_(torch_reference(self.buffers))
        else:
            mine = torch.arange(self.input.numel()) % len(self.buffers) == self.rank
            total = torch_reference([b[mine] for b in self.buffers])
            for b in self.buffers:
                b[mine] = total
        return self.output


@pytest.mark.parametrize("mode", ["one_shot", "two_shot"])
def test_graph_round_time_per_call_and_its_check(mode, monkeypatch):
    """One captured round of every rank's call: the replay time over the ranks, the inputs of
    the round (two-shot zero copy, else an ordinary tensor), the check after one more replay
    (inputs restaged, outputs poisoned), and a rank whose output is not written is reported."""
    from tilescale_examples.benchmarks import _timing as T
    from tilescale_examples.benchmarks import emulated as B

    class Graph:
        def __init__(self, fn):
            self.replay = fn

    def capture(fn, calls):
        assert calls == 1  # one round per graph
        fn()  # the eager warm-up round
        return Graph(fn), fn()

    monkeypatch.setattr(T, "capture_calls", capture)
    timed = []
    monkeypatch.setattr(T, "held_ms_per_launch", lambda f, n, device: (timed.append(n), f(), 0.012)[2])
    # broken rank 1: one-shot, its own output is unwritten; two-shot, its shard of every output
    for broken, want_bad in ((False, []), (True, [1] if mode == "one_shot" else [0, 1, 2])):
        buffers = [torch.zeros(64) for _ in range(3)]
        colls = [FakeAllReduce(r, buffers, mode, broken=broken and r == 1) for r in range(3)]
        ins = B.graph_inputs(colls, ["x0", "x1", "x2"])
        assert ins == ([c.input for c in colls] if mode == "two_shot" else ["x0", "x1", "x2"])
        ms, bad = B.time_graph("allreduce", colls, 5, seed=1)
        assert ms == pytest.approx(0.004) and timed[-1] == 5  # 12 us per replay of 3 calls
        assert [int(m.split("rank ")[1][0]) for m in bad] == want_bad
        assert all(m.startswith("allreduce graph rank") for m in bad)
        assert [c.calls for c in colls] == [4] * 3  # warm-up, capture, timed replay, checked replay
