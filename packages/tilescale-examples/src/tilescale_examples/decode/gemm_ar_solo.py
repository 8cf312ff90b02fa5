"""The one-rank kernels of :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`:
with ``world_size = 1`` the all-reduce of a rank's product is that product, so nothing is
staged for peers, no flag is released at system scope and no block waits.

* ``split_k = 1`` (:func:`build_solo_kernel`, symbol ``gemm_allreduce_solo``): the GEMM's
  float32 tile rounded to the dtype and stored into ``Out`` (its real rows), the output the
  fused kernel gives one rank (``round(float32(round(c))) = round(c)``).
* ``split_k = S > 1`` (symbol ``gemm_allreduce_solo_split``): the ``S`` units of a tile run as
  in the fused kernel (the module :mod:`~tilescale_examples.decode.gemm_ar_kernel`, "Split
  k"), each storing its float32 partial (real rows) into split ``s`` of ``Stage`` (buffer 0:
  no peer reads it, and the next call's kernel starts after this one ends). Then one thread
  adds 1 to the tile's counter ``Flags[t * FLAG_STRIDE]`` (``atom.add.acq_rel.gpu``, after
  a barrier of the block: the partial's release; its acquire for the last). Every call adds
  ``S`` to every tile's counter, so the unit that reads ``count % S == S - 1`` before its add
  is the tile's last: it reads the ``S`` partials and adds them in split order in float32,
  rounded once into ``Out`` (the fused kernel's bits: its sum of one rank's splits); the
  other units go on to their next tile without waiting. The counters are never reset (zeroed
  once by the op), so CUDA-graph replays are calls like any other.

Both keep the fused kernel's signature (:func:`~tilescale_examples.decode.gemm_ar_kernel.
build_gemm_ar_kernel`), its persistent grid and tile order, and its call counter ``State``;
the split one needs ``tiles`` counter words (``Flags`` of at least ``tiles * FLAG_STRIDE``
words, :func:`solo_flag_words`).
"""

# (no `from __future__ import annotations`: TileLang reads the kernel's annotations)

from tilescale_examples.collectives.reduce_kernel import FLAG_STRIDE, step_macros
from tilescale_examples.overlap.gemm import GemmTiles, gemm_mainloop

__all__ = ["build_solo_kernel", "solo_flag_words"]


def solo_flag_words(tiles: int, split_k: int) -> int:
    """``Flags`` words the one-rank kernel of ``tiles`` output tiles needs: one counter per
    tile, :data:`FLAG_STRIDE` words apart, with ``split_k > 1``; none without a split."""
    return tiles * FLAG_STRIDE if split_k > 1 else 0


def _padded_rows(m: int, block_m: int) -> int:
    return -(-m // block_m) * block_m


def build_solo_kernel(m: int, k: int, n: int, dtype: str, tiles: GemmTiles, split_k: int = 1):
    """The one-rank ``T.prim_func`` of :func:`~tilescale_examples.decode.gemm_ar_kernel.
    build_gemm_ar_kernel` (same signature; the arguments already checked there): see the
    module docstring."""
    import tilelang.language as T

    build = _build_unsplit if split_k == 1 else _build_split
    kernel, symbol = build(T, m, k, n, dtype, tiles, split_k)
    return kernel.with_attr("global_symbol", symbol)


def _build_unsplit(T, m: int, k: int, n: int, dtype: str, tiles: GemmTiles, S: int):
    TH, BM, BN = tiles.threads, tiles.block_m, tiles.block_n
    mp = _padded_rows(m, BM)
    MT, NT = mp // BM, mp // BM * (n // BN)
    mainloop = gemm_mainloop(k, dtype, tiles)
    count_call = step_macros(T, 1, TH, 1, 4, 1).count_call
    nflags, nstate = T.dynamic("nflags"), T.dynamic("nstate")

    @T.prim_func
    def gemm_allreduce_solo(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype),
                            Stage: T.Tensor((2 * mp, n), dtype), Out: T.Tensor((m, n), dtype),
                            Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"),
                            blocks: T.int32, iters: T.int32):
        with T.Kernel(blocks, threads=TH) as bx:
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

    return gemm_allreduce_solo, "gemm_allreduce_solo"


def _build_split(T, m: int, k: int, n: int, dtype: str, tiles: GemmTiles, S: int):
    TH, BM, BN = tiles.threads, tiles.block_m, tiles.block_n
    mp = _padded_rows(m, BM)
    MT, NU = mp // BM, mp // BM * (n // BN) * S  # units: tiles x splits
    mainloop = gemm_mainloop(k // S, dtype, tiles, k_offset=True)
    count_call = step_macros(T, 1, TH, 1, 4, 1).count_call
    nflags, nstate = T.dynamic("nflags"), T.dynamic("nstate")

    @T.prim_func
    def gemm_allreduce_solo_split(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype),
                                  Stage: T.Tensor((2 * S * mp, n), "float32"), Out: T.Tensor((m, n), dtype),
                                  Flags: T.Tensor((nflags,), "uint64"), State: T.Tensor((nstate,), "int64"),
                                  blocks: T.int32, iters: T.int32):
        with T.Kernel(blocks, threads=TH) as bx:
            tx = T.get_thread_binding()
            C_f = T.alloc_fragment((BM, BN), "float32")
            before = T.alloc_shared((1,), "uint64")  # the tile counter's value before this unit's add
            epoch = T.alloc_var("int64")
            epoch = State[bx] + 1
            for i in T.serial((NU - bx + blocks - 1) // blocks):
                t = (i * blocks + bx) // S  # the output tile of this unit
                mainloop(A, B, C_f, t % MT * BM, t // MT * BN, bx % S * (k // S))
                for r, c in T.Parallel(BM, BN):
                    if r < m - t % MT * BM:  # the real rows only
                        Stage[bx % S * mp + t % MT * BM + r, t // MT * BN + c] = C_f[r, c]
                T.sync_threads()
                if tx == 0:
                    before[0] = T.atomic_add(Flags[t * FLAG_STRIDE], 1, memory_order="acq_rel", return_prev=True)
                T.sync_threads()
                if before[0] % S == S - 1:  # the tile's last unit: every partial is in Stage
                    for r, c in T.Parallel(BM, BN):
                        if r < m - t % MT * BM:
                            Out[t % MT * BM + r, t // MT * BN + c] = T.Cast(
                                dtype, _split_order_sum(Stage, mp, t % MT * BM + r, t // MT * BN + c, S))
            count_call(State, bx, tx, epoch)

    return gemm_allreduce_solo_split, "gemm_allreduce_solo_split"


def _split_order_sum(Stage, mp: int, r, c, S: int):
    """``Stage[0 * mp + r, c] + ... + Stage[(S - 1) * mp + r, c]`` in float32, left to right."""
    total = Stage[r, c]
    for s in range(1, S):
        total = total + Stage[s * mp + r, c]
    return total
