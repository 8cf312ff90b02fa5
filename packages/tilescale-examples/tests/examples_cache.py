"""The GPU tests' TileLang caches, filled in parallel before the first ranks start.

A rank compiles its kernels under the host-wide compile lock, one after the other; a test
that builds kernels for several dtypes and world sizes would spend most of its time there.
:func:`warm_cache` compiles them first in worker processes (:mod:`tilescale_examples.testing.precompile`),
once per pytest session and cache, so the ranks' compiles are cache hits."""

from __future__ import annotations

import os

#: Name of the session's TileLang cache of the reduction tests (a ``kernel_cache`` name).
CACHE_NAME = "reductions"
#: The wait timeout the ranks compile with (``open_rank_heap``'s default; part of the flags).
WAIT_TIMEOUT_MS = "30000"

_warm: set = set()


def reduction_kernels() -> list:
    """Jobs of every reduction kernel the GPU tests build (all-reduce one-shot, two-shot and
    Lamport, reduce-scatter; float16, bfloat16, float32, int32; 2 and 4 ranks)."""
    from tilescale_examples.testing.precompile import reduction_jobs

    return reduction_jobs(("one_shot", "two_shot", "reduce_scatter", "lamport"),
                          ("float16", "bfloat16", "float32", "int32"), (2, 4))


def warm_cache(tmp_path_factory, jobs=None, name: str = CACHE_NAME) -> str:
    """Compile ``jobs`` (:func:`tilescale_examples.testing.precompile.precompile` jobs; default
    :func:`reduction_kernels`) into the session cache ``name`` (the directory
    :func:`examples_helpers.session_cache` gives that name), once per session; returns
    the cache directory."""
    from tilescale_examples.testing.precompile import precompile

    from examples_helpers import session_cache

    cache = session_cache(tmp_path_factory, name)
    jobs = reduction_kernels() if jobs is None else list(jobs)
    key = (cache, repr(jobs))
    if key not in _warm:
        precompile(jobs, cache, env={"TILESCALE_WAIT_TIMEOUT_MS": os.environ.get("TILESCALE_WAIT_TIMEOUT_MS", WAIT_TIMEOUT_MS)})
        _warm.add(key)
    return cache
