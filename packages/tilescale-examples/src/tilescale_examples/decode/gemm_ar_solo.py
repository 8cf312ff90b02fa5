"""The one-rank kernel of :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`
without a ``k`` split (symbol ``gemm_allreduce_solo``): with ``world_size = 1`` the all-reduce
of a rank's product is that product, so nothing is staged, no flag is released and no block
waits; the GEMM's float32 tile is rounded to the dtype and stored into ``Out`` (its real
rows), the output the fused kernel gives one rank (``round(float32(round(c))) = round(c)``).
It keeps the fused kernel's signature (:func:`~tilescale_examples.decode.gemm_ar_kernel.
build_gemm_ar_kernel`), persistent grid, tile order and call counter ``State``. (With a
split, one rank runs :mod:`~tilescale_examples.decode.gemm_ar_split`'s kernel, which stores
the tile's sum of splits into ``Out`` the same way.)
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from tilescale_examples.collectives.reduce_kernel import step_macros
from tilescale_examples.decode.gemm_ar_common import gemm_ar_prim_func, padded_rows
from tilescale_examples.overlap.gemm import GemmTiles, gemm_mainloop

__all__ = ["build_solo_kernel"]


def build_solo_kernel(m: int, k: int, n: int, dtype: str, tiles: GemmTiles):
    """The one-rank unsplit ``T.prim_func`` of :func:`~tilescale_examples.decode.gemm_ar_kernel.
    build_gemm_ar_kernel` (same signature; the arguments already checked there): see the
    module docstring."""
    import tilelang.language as T

    TH, BM, BN = tiles.threads, tiles.block_m, tiles.block_n
    mp = padded_rows(m, BM)
    MT, NT = mp // BM, mp // BM * (n // BN)
    mainloop = gemm_mainloop(k, dtype, tiles)
    count_call = step_macros(T, 1, TH, 1, 4, 1).count_call

    @T.macro
    def body(A, B, Stage, Out, Flags, State, blocks, iters, bx):
        tx = T.get_thread_binding()
        C_f = T.alloc_fragment((BM, BN), "float32")
        epoch = T.alloc_var("int64")
        epoch = State[bx] + 1
        for i in T.serial((NT - bx + blocks - 1) // blocks):
            t = i * blocks + bx
            mainloop(A, B, C_f, t % MT * BM, t // MT * BN)
            for r, c in T.Parallel(BM, BN):
                if r < m - t % MT * BM:  # the real rows only
                    Out[t % MT * BM + r, t // MT * BN + c] = T.Cast(dtype, C_f[r, c])
        count_call(State, bx, tx, epoch)

    return gemm_ar_prim_func(T, m, k, n, dtype, TH, 2 * mp, dtype, body, "gemm_allreduce_solo")
