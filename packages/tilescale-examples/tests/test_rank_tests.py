"""The plumbing of the multi-rank GPU tests (``examples_helpers.gpu_rank_test``), on the CPU:
the marks it applies, and the ``kernel_cache`` fixture's directory reaching every rank of a
``ranks`` test (a CPU gloo group here) as an argument, equal on every rank."""

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
