"""The epilogue that writes a GEMM kernel's output tile (:func:`store_tile`): straight from the
accumulator registers, or through shared memory and a TMA store; re-exported by
:mod:`tilescale_examples.overlap.gemm`."""

# (no `from __future__ import annotations`: TileLang reads the macros' annotations)

__all__ = ["STORES", "tma_store_stages", "check_tma_store_stages", "store_tile", "default_store", "resolve_store"]


#: How :func:`store_tile` writes the output tile (``build_gemm_kernel``'s ``store``):
#: ``"direct"``, each thread's accumulator registers straight to global memory (4-byte stores
#: of two adjacent elements); ``"tma"``, through shared memory (``stmatrix``) and a TMA store
#: of the whole tile, as CUTLASS's Hopper epilogue.
STORES = ("direct", "tma")


def tma_store_stages(tiles, dtype: str = "bfloat16") -> int:
    """The most pipeline stages of ``tiles`` (a :class:`~tilescale_examples.overlap.gemm.GemmTiles`)
    that fit in a Hopper block's shared memory (227 KiB) beside the TMA-store epilogue's
    ``block_m x block_n`` output tile of ``dtype`` (0 if none): the async pipeline's kernels
    keep both (their producer may still be loading when the tile is stored), the sync
    pipeline's lay the tile over its free stages. A stage's bytes are
    :func:`tilescale_lang.autotune.gemm_shared_bytes`' (the tuner's shared-memory check)."""
    from tilescale_lang.autotune.gemm import HOPPER_SMEM_BYTES, dtype_bytes, gemm_shared_bytes

    stage = gemm_shared_bytes(tiles.block_m, tiles.block_n, tiles.block_k, 1, dtype)
    return max(0, (HOPPER_SMEM_BYTES - tiles.block_m * tiles.block_n * dtype_bytes(dtype)) // stage)


def check_tma_store_stages(tiles, dtype: str = "bfloat16") -> None:
    """``ValueError`` naming ``num_stages`` where the async pipeline's stages of ``tiles`` do
    not fit beside the TMA-store epilogue's output tile (more than :func:`tma_store_stages`;
    the sync pipeline lays the tile over its stages: any count fits)."""
    fit = tma_store_stages(tiles, dtype)
    if tiles.pipeline == "async" and tiles.num_stages > fit:
        raise ValueError(f"num_stages={tiles.num_stages} does not fit beside the TMA-store epilogue's "
                         f"{tiles.block_m}x{tiles.block_n} output tile in shared memory with the async pipeline; "
                         f"use num_stages <= {fit}")


def default_store(tiles) -> str:
    """The epilogue the overlapped GEMMs and the tuner use for ``tiles`` (a
    :class:`~tilescale_examples.overlap.gemm.GemmTiles`) when given none: ``"tma"`` with the
    sync pipeline (its output tile lies over the pipeline's free stages: 1.05-1.07x faster
    than the direct store at every measured shape, docs/benchmarks.md), ``"direct"`` with the
    async pipeline (the tile would take a stage's shared memory: slower)."""
    return "tma" if tiles.pipeline == "sync" else "direct"


def resolve_store(store, tiles, dtype: str = "bfloat16") -> str:
    """The ops' ``store`` argument checked against ``tiles``: None means
    :func:`default_store`; else one of :data:`STORES` (``ValueError`` naming ``store``), and
    ``"tma"`` with the async pipeline only where its stages fit beside the output tile
    (:func:`check_tma_store_stages`)."""
    if store is None:
        return default_store(tiles)
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES} or None (the pipeline's default), got {store!r}")
    if store == "tma":
        check_tma_store_stages(tiles, dtype)
    return store


def store_tile(tiles=None, dtype: str = "bfloat16", store: str = "direct"):
    """The plain epilogue of :func:`~tilescale_examples.overlap.gemm.gemm_tile`, a ``T.macro``
    ``store(C_f, C, row, col)``: ``C_f`` rounded into ``C[row:row+block_m, col:col+block_n]``,
    written as ``store`` says
    (:data:`STORES`; ``"tma"`` needs ``tiles`` and ``dtype`` for its ``(block_m, block_n)``
    shared tile: with the sync pipeline TileLang lays it over the pipeline's stages, which are
    free by then; with the async pipeline it lies beside them, so ``tiles.num_stages`` must be
    at most :func:`tma_store_stages`: :func:`check_tma_store_stages`)."""
    import tilelang.language as T

    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    if store == "direct":
        @T.macro
        def store_direct(C_f, C, row, col):
            T.copy(C_f, C[row, col])

        return store_direct
    if tiles is None:
        raise ValueError("store='tma' needs the kernel's tiles (the shared output tile's shape)")
    check_tma_store_stages(tiles, dtype)
    BM, BN = tiles.block_m, tiles.block_n

    @T.macro
    def store_staged(C_f, C, row, col):
        C_s = T.alloc_shared((BM, BN), dtype)
        T.copy(C_f, C_s)
        T.copy(C_s, C[row, col])

    return store_staged
