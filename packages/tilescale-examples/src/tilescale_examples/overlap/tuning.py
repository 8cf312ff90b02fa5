"""GEMM tiles chosen by measurement: :func:`tune_tiles` runs tilescale-lang's rank-consistent
autotuner (:func:`tilescale_lang.autotune.tune`, ``docs/autotune.md``) over the library GEMM's
search space (:func:`tilescale_lang.autotune.gemm_space`) for one shape and returns the winner
as :class:`~tilescale_examples.overlap.gemm.GemmTiles`, the same on every rank of the group.

The tiles are the overlapped GEMMs' keyword arguments::

    tiles, result = tune_tiles(world_size * m_local, n, k, torch.bfloat16, device=device, group=group)
    op = AllGatherGEMM(allocator, m_local, k, n, torch.bfloat16, group=group, **dataclasses.asdict(tiles))

Each candidate is compiled (the library GEMM with the candidate's tiles and the epilogue the ops
give them, :func:`~tilescale_examples.overlap.gemm.default_store`; no heap; all of them first, in parallel worker
processes, when tuning), run on random operands, checked with
the overlapped GEMMs' own element-wise bound (:func:`~tilescale_examples.overlap.gemm.count_outside`)
and timed; the winner is cached on disk by GPU, toolkit, versions, dtype, shape and search
space, so a later call (any process, any rank) reads it without timing. ``mode`` (or
``$TILESCALE_AUTOTUNE``): ``"on"``, ``"cache_only"`` (a miss raises) or ``"off"`` (the space's
first candidate).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, build_gemm_kernel, count_outside, default_store

__all__ = ["tune_tiles", "tiles_of", "GEMM_BUILDER", "SWIZZLES"]

#: The library GEMM's builder, as the parallel compile's worker processes import it.
GEMM_BUILDER = "tilescale_examples.overlap.gemm:build_gemm_kernel"


#: The library GEMM's rasterization panel widths the tuner tries (0: none).
SWIZZLES = (0, 8)


def tiles_of(config: dict) -> GemmTiles:
    """The :class:`GemmTiles` of an autotuner config: its five tile axes (``ValueError`` for a
    config without them), its ``swizzle`` (0 when the space has no such axis), its ``pipeline``
    (``"sync"`` likewise) and its ``warp_policy`` (``"square"`` likewise)."""
    from tilescale_lang.autotune import GEMM_TILE_AXES

    fields = GEMM_TILE_AXES
    missing = [name for name in fields if name not in config]
    if missing:
        raise ValueError(f"config {config!r} lacks the tile axes {missing}")
    return GemmTiles(**{name: int(config[name]) for name in fields}, swizzle=int(config.get("swizzle", 0)),
                     pipeline=str(config.get("pipeline", "sync")), warp_policy=str(config.get("warp_policy", "square")))


def tune_tiles(m: int, n: int, k: int, dtype: Union[torch.dtype, str], *, device=None, group=None,
               mode: Optional[str] = None, space=None, timer=None, cache_dir=None, seed: int = 0,
               target=None, workers: Optional[int] = None) -> Tuple[GemmTiles, Any]:
    """The fastest correct tiles of the library GEMM ``C (m, n) = A (m, k) @ B (k, n)`` on this
    GPU, and the autotuner's :class:`~tilescale_lang.autotune.TuneResult` (the timings, and
    ``source``: ``"tuned"``, ``"cache"`` or ``"off"``).

    Args:
        m, n, k: the GEMM's dimensions (for AllGatherGEMM ``world_size * m_local``; for
            GemmReduceScatter the rows of ``a``).
        dtype: float16 or bfloat16 (``torch.dtype`` or its name).
        device: where to run the candidates (default the current CUDA device).
        group: the ``torch.distributed`` group that must agree (default the world group when
            initialised); collective over it: every rank calls with the same arguments.
        mode: ``"on"``, ``"cache_only"`` or ``"off"``; None reads ``$TILESCALE_AUTOTUNE``.
        space: a :class:`~tilescale_lang.autotune.SearchSpace` over the five tile axes and
            optionally ``swizzle`` (default :func:`~tilescale_lang.autotune.gemm_space` of the
            shape with ``swizzle=SWIZZLES``).
        timer: ``timer(launch) -> ms`` (default the autotuner's).
        cache_dir: the cache directory (default TileLang's).
        seed: of the random operands.
        target: TileLang target (default ``sm_90a``).
        workers: processes that compile the candidates in parallel before the first is timed
            (only when tuning, not on a cache hit; default one per candidate, at most the CPU
            count; 1: each candidate compiles when it is tried, as with another ``target``).

    Raises:
        TypeError / ValueError: naming a bad argument, before anything is compiled.
        tilescale_lang.autotune.NoValidCandidate / AutotuneCacheMiss: as :func:`~tilescale_lang.autotune.tune`.
    """
    from tilescale_lang.autotune import gemm_space, tune

    from tilescale_examples.base import TARGET, check_dtype

    dtype = check_dtype(dtype, DTYPES)
    name = DTYPES[dtype]
    space = gemm_space(m, n, k, name, swizzle=SWIZZLES) if space is None else space
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn((m, k), generator=g, device=device).to(dtype)
    b = (torch.randn((k, n), generator=g, device=device) / k ** 0.5).to(dtype)
    reference = {}

    def builder_args(config) -> tuple:  # the same in build() and the workers': their compile is a cache hit
        tiles = tiles_of(config)
        return m, n, k, name, tiles, default_store(tiles)

    def build(config):
        import tilelang

        kernel = tilelang.compile(build_gemm_kernel(*builder_args(config)), target=target or TARGET)
        out = torch.empty((m, n), dtype=dtype, device=device)

        def launch():
            kernel(a, b, out)
            return out

        return launch

    def check(out) -> bool:
        if "ref" not in reference:
            reference["ref"] = a.float() @ b.float()
        return count_outside(out, reference["ref"], dtype)[0] == 0

    def compile_all(configs) -> None:  # in parallel worker processes: build() then hits TileLang's disk cache
        from tilescale_examples.testing.precompile import precompile

        precompile([(GEMM_BUILDER, builder_args(c), None) for c in configs], workers=workers)

    parallel = workers != 1 and (target is None or target == TARGET)  # the workers compile for TARGET
    result = tune(space, build, name="library_gemm", dtype=dtype, shapes={"m": m, "n": n, "k": k}, check=check,
                  extra={"store": "default_store"},
                  group=group, policy="root", mode=mode, timer=timer, cache_dir=cache_dir,
                  prepare=compile_all if parallel else None)
    return tiles_of(result.config), result
