"""A rank-consistent autotuner for TileLang kernels (issue 41, item 1); see ``docs/autotune.md``.

* :class:`SearchSpace`: named axes, their product, a validity filter, a stable fingerprint;
  :func:`gemm_space`: the library GEMM's (``block_m``, ``block_n``, ``block_k``,
  ``num_stages``, ``threads``; optional ``swizzle`` and ``persistent``).
* :func:`tune`: compile, check and time each candidate (on the root, or on every rank with
  the slowest deciding), and return the winner, the same on every rank of the group (it is
  the root's, sent to all); cached on disk by GPU, toolkit, versions, dtype, shapes, world
  size and the space's fingerprint, written by the root under a file lock (:class:`TuneCache`).
* :func:`autotune`: the same as a decorator, in the shape of Triton-distributed's
  ``triton_dist.tune.autotune``.
* ``TILESCALE_AUTOTUNE=on|cache_only|off`` sets the mode when ``mode=`` is not passed
  (:func:`resolve_mode`, the one place it is read).

Example (one process or every rank of a group)::

    from tilescale_lang.autotune import gemm_space, tune

    space = gemm_space(m, n, k, "bfloat16")
    def build(config):
        kernel = tilelang.compile(my_gemm(m, n, k, **config), out_idx=[2])
        return lambda: kernel(a, b)
    result = tune(space, build, name="my_gemm", dtype=torch.bfloat16,
                  shapes={"m": m, "n": n, "k": k}, reference=lambda: a @ b)
    kernel = tilelang.compile(my_gemm(m, n, k, **result.config), out_idx=[2])
"""

from __future__ import annotations

from .cache import FORMAT, FORMAT_VERSION, TuneCache, current_environment, key_hash, make_key
from .decorator import Autotuned, autotune
from .gemm import GEMM_DEFAULTS, GEMM_PIPELINES, GEMM_TILE_AXES, gemm_rejection, gemm_space
from .space import SearchSpace
from .trials import Skipped, cuda_event_timer, default_timer
from .tuner import (ENV_VAR, MODES, POLICIES, AutotuneCacheMiss, AutotuneError, NoValidCandidate, TuneResult,
                    resolve_mode, tune)

__all__ = [
    "ENV_VAR", "FORMAT", "FORMAT_VERSION", "GEMM_DEFAULTS", "GEMM_PIPELINES", "GEMM_TILE_AXES", "MODES", "POLICIES",
    "AutotuneCacheMiss", "AutotuneError", "Autotuned", "NoValidCandidate", "SearchSpace", "Skipped", "TuneCache",
    "TuneResult", "autotune", "cuda_event_timer", "current_environment", "default_timer", "gemm_rejection",
    "gemm_space", "key_hash", "make_key", "resolve_mode", "tune",
]
