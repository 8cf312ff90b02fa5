"""do_bench / perf_fn / perf_rounds: arguments, aggregation, rounds order and the host clock on
the CPU; the GPU clock and its stream hold against a simulated CUDA timeline on the CPU; real
timing and 4-rank aggregation on a GPU."""

from __future__ import annotations

import contextlib
import math
import time

import pytest

from tilescale_host import _bench_clock
from tilescale_host.bench import (
    LOCAL,
    aggregate_rank_times,
    do_bench,
    gather_rank_times,
    perf_fn,
    perf_rounds,
    slowest_rank,
    summarize,
)

NAN = float("nan")


def test_aggregate_rank_times():
    per_rank = [[1.0, 5.0, 2.0], [3.0, 1.0, 2.0]]
    assert aggregate_rank_times(per_rank, "max") == [3.0, 5.0, 2.0]
    assert aggregate_rank_times(per_rank, "mean") == [2.0, 3.0, 2.0]
    assert aggregate_rank_times([[4.0]], "max") == [4.0]
    with pytest.raises(ValueError, match="aggregate must be one of"):
        aggregate_rank_times(per_rank, "sum")
    with pytest.raises(ValueError):
        aggregate_rank_times([[1.0], [1.0, 2.0]], "max")


def test_aggregate_leaves_out_ranks_that_did_not_run():
    per_rank = [[NAN, 2.0, NAN], [4.0, NAN, NAN], [6.0, 1.0, NAN]]
    got = aggregate_rank_times(per_rank, "max")
    assert got[:2] == [6.0, 2.0] and math.isnan(got[2])
    assert aggregate_rank_times(per_rank, "mean")[:2] == [5.0, 1.5]


def test_summarize():
    times = [3.0, 1.0, 2.0, 10.0]
    assert summarize(times, "median") == 2.5
    assert summarize(times, "mean") == 4.0
    assert (summarize(times, "min"), summarize(times, "max")) == (1.0, 10.0)
    assert summarize(times, "all") == times
    assert summarize([NAN, 1.0, 3.0], "median") == 2.0 and math.isnan(summarize([NAN, NAN], "min"))
    with pytest.raises(ValueError, match="return_mode"):
        summarize(times, "p99")


def test_argument_checks_come_first():
    with pytest.raises(ValueError, match="rep must be a positive int, got 0"):
        do_bench(lambda: None, rep=0)
    with pytest.raises(ValueError, match="warmup must be a non-negative int, got -1"):
        perf_fn(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="return_mode"):
        do_bench(lambda: None, return_mode="p50")


@pytest.mark.parametrize("call,match", [
    (lambda: perf_fn(lambda: None, rep=True), "rep must be a positive int, got True"),
    (lambda: perf_fn(lambda: None, rep=2.0), "rep must be a positive int, got 2.0"),
    (lambda: perf_fn(lambda: None, aggregate="sum"), "aggregate must be one of"),
    (lambda: perf_fn(lambda: None, clock="wall"), r"clock must be one of \('gpu', 'host', 'enqueue'\), got 'wall'"),
    (lambda: perf_fn(lambda: None, hold=0), "hold must be True, False or a positive, finite number of milliseconds"),
    (lambda: perf_fn(lambda: None, hold=math.inf), "hold must be True, False or a positive"),
    (lambda: perf_fn(lambda: None, hold="1"), "hold must be True, False or a positive"),
    (lambda: perf_fn(lambda: None, clock="host", hold=True), "hold needs clock='gpu'"),
    (lambda: perf_fn(lambda: None, timeout=0), "timeout must be a positive, finite number of seconds"),
    (lambda: perf_fn(lambda: None, group="world"), "group must be a process group, None or 'local'"),
    (lambda: do_bench(lambda: None, clock="host", flush_l2=True), "flush_l2 needs clock='gpu'"),
    (lambda: do_bench(lambda: None, before=3), "before must be callable or None"),
    (lambda: perf_rounds({}), "fns must be a non-empty mapping"),
    (lambda: perf_rounds([lambda: None]), "fns must be a non-empty mapping"),
    (lambda: perf_rounds({"a": 1}), r"fns\['a'\] must be callable or None"),
    (lambda: perf_rounds({"a": None}, rounds=0), "rounds must be a positive int, got 0"),
    (lambda: perf_rounds({"a": None}, timer=lambda f: 1.0, hold=True), "timer replaces the built-in clock"),
    (lambda: perf_rounds({"a": None}, timer=lambda f: 1.0, clock="host"), "timer replaces the built-in clock"),
    (lambda: perf_rounds({"a": None}, return_mode="p9"), "return_mode must be one of"),
])
def test_bad_arguments_are_rejected_before_any_work(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ---------------------------------------------------------------------------- rounds (fake timers)
def test_perf_rounds_takes_the_functions_in_turn_and_keeps_each_ones_median_round():
    calls = []
    fake = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def timer(fn):
        calls.append(fn.__name__)
        return next(fake[fn.__name__])

    def a():
        calls.append("warm a")

    def b():
        calls.append("warm b")

    got = perf_rounds({"a": a, "b": b}, 3, warmup=2, timer=timer, group=LOCAL)
    assert got == {"a": 3.0, "b": 4.0} and list(got) == ["a", "b"]
    assert calls == ["warm a"] * 2 + ["warm b"] * 2 + ["a", "b"] * 3


def test_perf_rounds_alternate_reverses_every_second_round():
    order = []
    perf_rounds({"a": lambda: None, "b": lambda: None, "c": lambda: None}, 4, warmup=0, group=LOCAL,
                timer=lambda fn: order.append(fn) or 1.0, alternate=True)
    names = {id(f): n for n, f in zip("abc", dict.fromkeys(order))}
    assert "".join(names[id(f)] for f in order) == "abc" "cba" "abc" "cba"


def test_perf_rounds_statistic_over_rounds_and_functions_not_run_here():
    fake = iter([4.0, 2.0, 8.0])
    seen = []
    got = perf_rounds({"mine": lambda: None, "theirs": None}, 3, warmup=1, group=LOCAL,
                      timer=lambda fn: seen.append(1) or next(fake), return_mode="min")
    assert got["mine"] == 2.0 and math.isnan(got["theirs"]) and len(seen) == 3
    fake = iter([4.0, 2.0, 8.0])
    assert perf_rounds({"x": lambda: None}, 3, timer=lambda fn: next(fake), group=LOCAL,
                       return_mode="all") == {"x": [4.0, 2.0, 8.0]}


def test_perf_rounds_without_a_process_group_needs_no_gpu():
    """group=None and torch.distributed not initialised: no barrier, no gather, no CUDA."""
    assert perf_rounds({"a": lambda: None}, 2, timer=lambda fn: 1.5) == {"a": 1.5}


def test_perf_rounds_barriers_before_every_timing(monkeypatch):
    events = []
    monkeypatch.setattr(_bench_clock, "resolve_group", lambda group: "G")
    monkeypatch.setattr(_bench_clock, "barrier", lambda group, wait: events.append(("barrier", group)))
    monkeypatch.setattr(_bench_clock, "gather", lambda local, group, device=None: [local, [x + 1 for x in local]])
    got = perf_rounds({"a": lambda: None, "b": None}, 2, warmup=0, timer=lambda fn: events.append("t") or 1.0)
    assert events == [("barrier", "G"), ("barrier", "G"), "t", ("barrier", "G"), ("barrier", "G"), "t",
                      ("barrier", "G")]
    # rank 0 timed a (1.0), not b (NaN); the fake rank 1 is one slower: the slowest rank counts
    assert got["a"] == 2.0 and math.isnan(got["b"])


# ---------------------------------------------------------------------------- host clock
def test_host_clock_times_back_to_back_calls_on_the_cpu():
    out, ms = perf_fn(lambda: time.sleep(0.002) or "last", warmup=1, rep=5, clock="host", group=LOCAL)
    assert out == "last" and 1.9 <= ms < 50
    times = do_bench(lambda: time.sleep(0.001), warmup=0, rep=4, clock="host", return_mode="all")
    assert len(times) == 4 and all(0.9 <= t < 50 for t in times)


def test_enqueue_clock_times_each_call_alone_from_an_idle_gpu(monkeypatch):
    """clock="enqueue": each call timed alone, the wait for the GPU before it and after the
    last one outside the interval (a recorded wait that sleeps: not in the times)."""
    from tilescale_host import _bench_clock

    log = []

    def slow_wait(stream=None, timeout=None):
        def wait():
            log.append("wait")
            time.sleep(0.005)
        return wait

    monkeypatch.setattr(_bench_clock, "make_wait", slow_wait)
    out, ms = perf_fn(lambda: log.append("fn") or time.sleep(0.001) or "last", warmup=0, rep=4, clock="enqueue",
                      group=LOCAL)
    assert out == "last" and 0.9 <= ms < 4.5, "the 5 ms waits are not in the time"
    assert log[-9:] == ["wait", "fn"] * 4 + ["wait"]
    times = do_bench(lambda: time.sleep(0.001), warmup=0, rep=3, clock="enqueue", return_mode="all")
    assert len(times) == 3 and all(0.9 <= t < 4.5 for t in times)
    got = perf_rounds({"slow": lambda: time.sleep(0.002), "fast": lambda: None}, 2, warmup=0, rep=2,
                      clock="enqueue", group=LOCAL, return_mode="min")
    assert got["fast"] < 1.0 <= got["slow"]
    with pytest.raises(ValueError, match="hold needs clock='gpu'"):
        perf_fn(lambda: None, clock="enqueue", hold=True)


def test_do_bench_calls_before_outside_the_timed_interval():
    log = []
    times = do_bench(lambda: log.append("fn"), warmup=1, rep=3, clock="host", return_mode="all",
                     before=lambda: (log.append("before"), time.sleep(0.01)))
    assert log == ["before", "fn"] * 4
    assert max(times) < 5, "the 10 ms of before() are not in the times"


def test_host_clock_rounds_alternate_and_keep_the_best():
    got = perf_rounds({"slow": lambda: time.sleep(0.002), "fast": lambda: None}, 3, warmup=0, rep=2,
                      clock="host", group=LOCAL, return_mode="min", alternate=True)
    assert got["fast"] < 1.0 <= got["slow"]


def test_gather_and_slowest_rank_without_a_process_group():
    assert gather_rank_times([1, 2.5]) == [[1.0, 2.5]]
    assert slowest_rank(3.0) == 3.0 and slowest_rank(2.0, group=LOCAL) == 2.0


# ---------------------------------------------------------------------------- GPU clock, simulated
class _FakeCuda:
    """A CUDA timeline in milliseconds: the host's clock advances by ``host_ms`` per enqueue;
    the GPU runs its queue in order, each item starting when both it was enqueued and the
    previous one finished."""

    CYCLES_PER_MS = 1000.0

    def __init__(self, host_ms: float):
        self.host_ms = host_ms
        self.host = 0.0
        self.gpu_free = 0.0
        self.sleeps: list[float] = []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                fake.host += fake.host_ms
                self.t = fake.gpu_free = max(fake.host, fake.gpu_free)

            def query(self):
                return self.t <= fake.host

            def synchronize(self):
                fake.host = max(fake.host, self.t)

            def elapsed_time(self, end):
                return end.t - self.t

        class Stream:
            device = "cuda:0"

        self.Event, self.stream_obj = Event, Stream()

    def kernel(self, ms: float) -> None:
        self.host += self.host_ms
        self.gpu_free = max(self.host, self.gpu_free) + ms

    def install(self, monkeypatch):
        import torch

        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: self.stream_obj)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: setattr(self, "host", max(self.host, self.gpu_free)))
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (self.sleeps.append(cycles / self.CYCLES_PER_MS),
                                                                   self.kernel(cycles / self.CYCLES_PER_MS)))
        monkeypatch.setattr(_bench_clock, "_CYCLES_PER_MS", {"cuda:0": self.CYCLES_PER_MS})
        monkeypatch.setattr(_bench_clock, "host_ms_of_one_call", lambda fn, wait: (fn(), self.host_ms)[1])
        return self


def test_unheld_gpu_clock_counts_the_host_when_launches_outpace_the_gpu(monkeypatch):
    cuda = _FakeCuda(host_ms=0.05).install(monkeypatch)
    out, ms = perf_fn(lambda: cuda.kernel(0.01) or "y", warmup=2, rep=10, group=LOCAL)
    assert out == "y" and ms == pytest.approx(0.055)  # host-bound: 11 enqueues of 0.05 ms for 10 calls


def test_held_gpu_clock_measures_the_gpu_alone(monkeypatch):
    cuda = _FakeCuda(host_ms=0.05).install(monkeypatch)
    _, ms = perf_fn(lambda: cuda.kernel(0.01), warmup=2, rep=10, group=LOCAL, hold=True)
    assert ms == pytest.approx(0.01)
    assert cuda.sleeps == [pytest.approx(2.4)]  # sized from one launch: max(1 ms, 4 * 0.05 ms * (10 + 2))


def test_a_hold_that_runs_out_is_doubled_and_the_timing_repeated(monkeypatch):
    cuda = _FakeCuda(host_ms=0.05).install(monkeypatch)
    _, ms = perf_fn(lambda: cuda.kernel(0.01), warmup=0, rep=100, group=LOCAL, hold=1.0)
    assert cuda.sleeps == [1.0, 2.0, 4.0, 8.0]  # 5 ms of enqueueing outlast 1, 2 and 4 ms of hold
    assert ms == pytest.approx(0.01)


def test_a_hold_that_always_runs_out_warns(monkeypatch):
    cuda = _FakeCuda(host_ms=0.05).install(monkeypatch)
    with pytest.warns(RuntimeWarning, match="the stream hold ran out 4 times"):
        perf_fn(lambda: cuda.kernel(0.01), warmup=0, rep=1000, group=LOCAL, hold=1.0)
    assert cuda.sleeps == [1.0, 2.0, 4.0, 8.0]  # 50 ms of enqueueing outlast every hold


def test_held_rounds_on_the_simulated_gpu(monkeypatch):
    cuda = _FakeCuda(host_ms=0.05).install(monkeypatch)
    got = perf_rounds({"small": lambda: cuda.kernel(0.01), "big": lambda: cuda.kernel(0.2)}, 3, warmup=2,
                      rep=10, hold=True, group=LOCAL)
    assert got == pytest.approx({"small": 0.01, "big": 0.2})
    unheld = perf_rounds({"small": lambda: cuda.kernel(0.01)}, 3, rep=10, group=LOCAL)
    assert unheld["small"] == pytest.approx(0.055)


def test_do_bench_on_the_simulated_gpu_times_each_call(monkeypatch):
    cuda = _FakeCuda(host_ms=0.001).install(monkeypatch)
    sizes = iter([0.1, 0.3, 0.2] * 2)
    times = do_bench(lambda: cuda.kernel(next(sizes)), warmup=0, rep=3, flush_l2=False, group=LOCAL,
                     return_mode="all")
    # the first call starts on an idle GPU one enqueue after its start event (0.001 ms)
    assert times == pytest.approx([0.101, 0.3, 0.2])


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_do_bench_single_process():
    import torch

    x = torch.randn(1 << 22, device="cuda")
    ms = do_bench(lambda: x.mul_(1.0), warmup=3, rep=10)
    assert 0 < ms < 100
    assert len(do_bench(lambda: x.mul_(1.0), warmup=1, rep=5, flush_l2=False, return_mode="all")) == 5
    out, ms = perf_fn(lambda: x.sum(), warmup=2, rep=5)
    assert out.shape == () and ms > 0


@pytest.mark.gpu
def test_hold_hides_the_launch_cost_of_tiny_kernels():
    """Held, a tiny kernel's time is its GPU time: below the unheld (launch-bound) figure."""
    import torch

    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    _, held = perf_fn(lambda: x.add_(1), warmup=3, rep=200, hold=True, stream=stream, timeout=60)
    _, plain = perf_fn(lambda: x.add_(1), warmup=3, rep=200, stream=stream)
    assert 0 < held < plain
    got = perf_rounds({"add": lambda: x.add_(1), "mul": lambda: x.mul_(1)}, 3, rep=50, hold=True)
    assert set(got) == {"add", "mul"} and all(0 < v < 1 for v in got.values())


def _bench_rank(rank, world_size):
    """Rank r spins ~r ms per repetition; max-aggregation must report rank 3's time everywhere."""
    import torch

    from tilescale_host.dist_init import init_dist
    from tilescale_host.utils import get_max_gpu_clock_rate_in_khz

    init_dist(rank, world_size)
    cycles = rank * get_max_gpu_clock_rate_in_khz(0)  # kHz = cycles per ms: ~rank ms of spinning
    fn = (lambda: torch.cuda._sleep(cycles)) if cycles else (lambda: None)
    maxed = do_bench(fn, warmup=2, rep=10, flush_l2=False)
    mean = do_bench(fn, warmup=2, rep=10, flush_l2=False, aggregate="mean")
    local = do_bench(fn, warmup=2, rep=10, flush_l2=False, aggregate="none")
    rounds = perf_rounds({"spin": fn, "idle": lambda: None, "rank0": fn if rank == 0 else None}, 3, rep=2,
                         hold=True)
    return maxed, mean, local, rounds, slowest_rank(float(rank))


@pytest.mark.gpu
def test_do_bench_aggregates_four_ranks_sharing_one_gpu(monkeypatch):
    from tilescale_core.multiprocess import find_free_port, run_ranks

    monkeypatch.setenv("TILESCALE_SHARE_GPUS", "1")
    monkeypatch.setenv("TILESCALE_MASTER_PORT", str(find_free_port()))
    out = run_ranks(_bench_rank, 4, backend=None, timeout=120)
    maxed = [m for m, *_ in out]
    means = [m for _, m, *_ in out]
    locals_ = [loc for _, _, loc, *_ in out]
    assert max(maxed) == min(maxed), "every rank reports the same aggregated time"
    assert max(means) == min(means)
    assert maxed[0] >= 0.8 * 3.0, "the slowest rank spins at least ~3 ms per repetition"
    assert locals_[3] > locals_[0]
    rounds = [r for *_, r, _ in out]
    assert all(r == rounds[0] for r in rounds) and rounds[0]["spin"] >= 0.8 * 3.0
    assert not math.isnan(rounds[0]["rank0"]) and rounds[0]["rank0"] < 0.5
    assert [s for *_, s in out] == [3.0] * 4
