"""do_bench / perf_fn: the pure aggregation on CPU; timing and 4-rank aggregation on a GPU."""

from __future__ import annotations

import pytest

from tilescale_host.bench import aggregate_rank_times, do_bench, perf_fn, summarize


def test_aggregate_rank_times():
    per_rank = [[1.0, 5.0, 2.0], [3.0, 1.0, 2.0]]
    assert aggregate_rank_times(per_rank, "max") == [3.0, 5.0, 2.0]
    assert aggregate_rank_times(per_rank, "mean") == [2.0, 3.0, 2.0]
    assert aggregate_rank_times([[4.0]], "max") == [4.0]
    with pytest.raises(ValueError, match="aggregate must be one of"):
        aggregate_rank_times(per_rank, "sum")
    with pytest.raises(ValueError):
        aggregate_rank_times([[1.0], [1.0, 2.0]], "max")


def test_summarize():
    times = [3.0, 1.0, 2.0, 10.0]
    assert summarize(times, "median") == 2.5
    assert summarize(times, "mean") == 4.0
    assert (summarize(times, "min"), summarize(times, "max")) == (1.0, 10.0)
    assert summarize(times, "all") == times
    with pytest.raises(ValueError, match="return_mode"):
        summarize(times, "p99")


def test_argument_checks_come_first():
    with pytest.raises(ValueError, match="rep must be at least 1"):
        do_bench(lambda: None, rep=0)
    with pytest.raises(ValueError, match="warmup must be non-negative"):
        perf_fn(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="return_mode"):
        do_bench(lambda: None, return_mode="p50")


@pytest.mark.gpu
def test_do_bench_single_process():
    import torch

    x = torch.randn(1 << 22, device="cuda")
    ms = do_bench(lambda: x.mul_(1.0), warmup=3, rep=10)
    assert 0 < ms < 100
    assert len(do_bench(lambda: x.mul_(1.0), warmup=1, rep=5, flush_l2=False, return_mode="all")) == 5
    out, ms = perf_fn(lambda: x.sum(), warmup=2, rep=5)
    assert out.shape == () and ms > 0


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
    return maxed, mean, local


@pytest.mark.gpu
def test_do_bench_aggregates_four_ranks_sharing_one_gpu(monkeypatch):
    from tilescale_core.multiprocess import find_free_port, run_ranks

    monkeypatch.setenv("TILESCALE_SHARE_GPUS", "1")
    monkeypatch.setenv("TILESCALE_MASTER_PORT", str(find_free_port()))
    out = run_ranks(_bench_rank, 4, backend=None, timeout=120)
    maxed = [m for m, _, _ in out]
    means = [m for _, m, _ in out]
    locals_ = [loc for _, _, loc in out]
    assert max(maxed) == min(maxed), "every rank reports the same aggregated time"
    assert max(means) == min(means)
    assert maxed[0] >= 0.8 * 3.0, "the slowest rank spins at least ~3 ms per repetition"
    assert locals_[3] > locals_[0]
