"""A persistent GEMM ``C = A @ B``: one block per SM, each computing output tiles in turn with
the async pipeline (:mod:`~tilescale_examples.overlap.gemm_async`), its producer warp loading
the next tile's ``k`` steps while the compute warpgroups finish and store the current one.

Why
---

A grid of one block per output tile (:func:`~tilescale_examples.overlap.gemm.build_gemm_kernel`)
pays, for every tile, the block's start (its barriers initialised, the pipeline's first
``num_stages`` loads issued from an empty ring and waited for) and its end (the epilogue's
stores, with no load in flight). With one block per SM that holds its shared memory for the
whole kernel, the pipeline runs from tile to tile without draining: the producer's ring of
stages runs on across tiles (the running step number ``i * steps + kk`` of a block's ``i``-th
tile gives each step its stage and barrier parities, :func:`~tilescale_examples.overlap.gemm_async.load_steps`),
so while the compute warpgroups store tile ``i`` the first stages of tile ``i + 1`` are
already loaded. cuBLAS's and CUTLASS's Hopper GEMMs are persistent for this reason.

Tile order
----------

Block ``b`` of ``blocks`` computes tiles ``b, b + blocks, b + 2 * blocks, ...`` of the output's
``(m / block_m) * (n / block_n)`` tiles, numbered by :func:`tile_order`: with a panel of ``P``
row blocks (``tiles.swizzle``, as the one-block-per-tile grid's ``T.use_swizzle``), panel by
panel, column by column within a panel, rows fastest (the blocks running at once share the
columns of ``B`` in L2); without (``swizzle`` 0), row by row, columns fastest (the grid's own
order). The tiles running at once are consecutive in that order, as the grid's waves are.

The kernel has no state between calls (no counters, no workspace): back-to-back calls, CUDA
graph replays and concurrent calls on other streams need nothing else. Each tile's products are
added in ``k`` order into one float32 accumulator, as in the one-block-per-tile kernels: the
same bits.
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from dataclasses import replace
from typing import Optional

from tilescale_examples.overlap.gemm import GemmTiles, check_gemm_dims, check_positive, default_tiles, store_tile

__all__ = ["build_persistent_gemm", "tile_order", "persistent_blocks", "DEFAULT_BLOCKS"]

#: Blocks of the persistent grid when the caller names none: an H100 / H200 has 132 SMs.
DEFAULT_BLOCKS = 132


def tile_order(t, row_blocks: int, col_blocks: int, panel: int, minimum=min) -> tuple:
    """``(row block, column block)`` of the ``t``-th output tile in the persistent GEMM's order
    (module docstring) of a ``row_blocks x col_blocks`` grid of tiles, with a rasterization
    panel of ``panel`` row blocks (0: row by row). ``t`` may be an int or a TileLang
    expression (then pass ``minimum=T.min``)."""
    if not panel:
        return t // col_blocks, t % col_blocks
    span = panel * col_blocks  # tiles of a whole panel
    first = t // span * panel  # the panel's first row block
    rows = minimum(panel, row_blocks - first)  # the last panel may be shorter
    return first + t % span % rows, t % span // rows


def persistent_blocks(m: int, n: int, tiles: GemmTiles, sm_count: int) -> int:
    """Blocks of the persistent grid for an ``(m, n)`` output in ``tiles``: one per SM, no more
    than there are tiles."""
    return max(1, min(sm_count, (m // tiles.block_m) * (n // tiles.block_n)))


def build_persistent_gemm(m: int, n: int, k: int, dtype: str = "bfloat16", tiles: Optional[GemmTiles] = None,
                          blocks: int = DEFAULT_BLOCKS, store: str = "direct"):
    """The persistent GEMM ``T.prim_func`` (module docstring) ``gemm_persistent(A, B, C)``:
    ``C = A @ B`` with ``A: (m, k)``, ``B: (k, n)``, ``C: (m, n)`` of ``dtype`` (float32
    accumulation), over ``tiles`` (default :func:`~tilescale_examples.overlap.gemm.default_tiles`
    of ``n``; always the async pipeline, whatever ``tiles.pipeline`` says, so at least 2 stages;
    ``tiles.swizzle`` is the tile order's panel) on a grid of ``min(blocks, tiles)`` blocks of
    ``tiles.threads + 128`` threads (``blocks``: the SM count; more than that only queues
    blocks behind each other, and is correct). ``store`` is how each tile is written
    (:data:`~tilescale_examples.overlap.gemm.STORES`: ``"tma"`` through a shared tile of its
    own, beside the stages, so at most :func:`~tilescale_examples.overlap.gemm.tma_store_stages`
    stages; the TMA store of one tile runs while the next tile's first steps compute, under the
    symbol ``gemm_persistent_tma_store``). Every dimension must be a multiple of its tile
    (``ValueError`` naming it)."""
    import tilelang.language as T

    from tilescale_examples.overlap.gemm_async import (PRODUCER_REGISTERS, PRODUCER_THREADS, compute_steps,
                                                       consumer_registers, load_steps, pipeline_stages)

    tiles = replace(tiles or default_tiles(n), pipeline="async")
    check_gemm_dims("build_persistent_gemm", tiles, m=m, k=k, n=n)
    check_positive("blocks", blocks)
    BM, BN, TH = tiles.block_m, tiles.block_n, tiles.threads
    RB, CB, steps = m // BM, n // BN, k // tiles.block_k
    G = min(blocks, RB * CB)
    stages, load, compute = pipeline_stages(dtype, tiles), load_steps(steps, tiles), compute_steps(steps, tiles)
    store_out, consumer_nreg, panel = store_tile(tiles, dtype, store), consumer_registers(TH), tiles.swizzle

    @T.prim_func
    def gemm_persistent(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype)):
        with T.Kernel(G, threads=TH + PRODUCER_THREADS) as bx:
            C_f = T.alloc_fragment((BM, BN), "float32")
            A_s, B_s, full, empty = stages()
            tx = T.get_thread_binding()
            count = (RB * CB - bx + G - 1) // G  # this block's tiles: bx, bx + G, ...
            if tx < PRODUCER_THREADS:
                T.set_max_nreg(PRODUCER_REGISTERS, 0)
                if tx < 32:
                    for i in T.serial(count):
                        row, col = tile_order(bx + i * G, RB, CB, panel, T.min)
                        load(A, B, A_s, B_s, full, empty, row * BM, col * BN, i * steps)
            else:
                T.set_max_nreg(consumer_nreg, 1)
                for i in T.serial(count):
                    row, col = tile_order(bx + i * G, RB, CB, panel, T.min)
                    compute(A_s, B_s, full, empty, C_f, i * steps)
                    store_out(C_f, C, row * BM, col * BN)

    symbol = "gemm_persistent" if store == "direct" else "gemm_persistent_tma_store"
    return gemm_persistent.with_attr("global_symbol", symbol)
