"""The plumbing of the multi-rank GPU tests (``examples_helpers.gpu_rank_test``), on the CPU:
the marks it applies, the ``kernel_cache`` fixture's directory reaching every rank of a
``ranks`` test (a CPU gloo group here) as an argument, equal on every rank, and the
side-stream part's bookkeeping (``side_stream_pairs``, its streams stood in for)."""

from __future__ import annotations

import pytest
from examples_helpers import KEPT_CACHE_ENV, expect_checks, gpu_rank_test, same_on_every_rank


def _marks(test) -> dict:
    return {m.name: m for m in test.pytestmark}


def test_gpu_rank_test_marks():
    def body(world, rank, world_size, kernel_cache):
        pass

    marks = _marks(gpu_rank_test(1, 2, 4, timeout=300, rank_timeout=200, cache="x", jobs=list)(body))
    assert marks["ranks"].args == ("world",) and marks["ranks"].kwargs == {"timeout": 200}
    assert marks["parametrize"].args == ("world", [1, 2, 4])
    assert marks["timeout"].args == (300,) and "gpu" in marks
    assert marks["kernel_cache"].args == ("x", list)


@pytest.mark.kernel_cache("plumbing")
@pytest.mark.ranks("world", timeout=120, cpu_only=True)
@pytest.mark.parametrize("world", [1, 2])
def test_kernel_cache_reaches_every_rank(world, rank, world_size, kernel_cache):
    import os

    assert world_size == world and 0 <= rank < world
    assert kernel_cache == os.environ.get(KEPT_CACHE_ENV) or kernel_cache.endswith("tilelang-cache-plumbing")
    assert same_on_every_rank(kernel_cache) and same_on_every_rank(rank) == (world == 1)
    report = expect_checks({"rank": rank, "checks": 3}, 3, "plumbing")
    assert report["checks"] == 3
    with pytest.raises(AssertionError, match="expected 4"):
        expect_checks({"rank": rank, "checks": 3}, 4)


def test_side_stream_pairs_calls_checks_and_closes(monkeypatch):
    import examples_helpers

    order = []

    def beside(side_call, main_call, checks=()):  # the CUDA streams stood in for: the same calls, in order
        side_call()
        main_call()
        for check in checks:
            check()
        return len(checks)

    class Op:
        def __init__(self, case):
            self.case, self.closed = case, False

        def __call__(self, x):
            order.append((self.case, x))
            return x * self.case

        def close(self):
            self.closed = True

    monkeypatch.setattr(examples_helpers, "side_stream_beside", beside)
    built = []

    def build(case):
        built.append(Op(case))
        return built[-1]

    def check(op, got, every, what):
        return [] if got == every[1][0] * op.case else [f"{what}: {got}"]

    checks, bad = examples_helpers.side_stream_pairs([(2, 3), (5, 7)], build, lambda op, seed: [(seed,), (seed + 1,)],
                                                     check, rank=1, world=2)
    assert checks == 4 and bad == [] and all(op.closed for op in built)
    assert order == [(2, 701), (3, 702), (5, 711), (7, 712)]  # rank 1's inputs, side instance first
    _, bad = examples_helpers.side_stream_pairs([(2, 3)], build, lambda op, seed: [(seed,), (seed + 1,)],
                                                lambda op, got, every, what: [f"{what}: {got}"], rank=0, world=2)
    assert bad == ["rank 0/2 side stream 0 instance 0: 1400", "rank 0/2 side stream 0 instance 1: 2103"]
