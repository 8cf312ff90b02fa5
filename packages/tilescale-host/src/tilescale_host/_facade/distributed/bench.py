"""``tilelang.distributed.bench``: CUDA-event benchmarking (upstream TileScale's module path).

``from tilelang.distributed.bench import perf_fn, do_bench`` -- the same functions as
:mod:`tilescale_host.bench` (and ``tilelang.distributed.host``), with TileScale's
``perf_rounds`` (interleaved rounds of several functions).
"""

from tilescale_host.bench import aggregate_rank_times, do_bench, perf_fn, perf_rounds, summarize

__all__ = ["aggregate_rank_times", "do_bench", "perf_fn", "perf_rounds", "summarize"]
