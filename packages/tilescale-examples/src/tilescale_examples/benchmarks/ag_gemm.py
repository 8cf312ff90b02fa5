"""All-gather + GEMM: TileScale's :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM` against
``all_gather_into_tensor`` + ``torch.matmul``, torch async-TP's ``fused_all_gather_matmul``,
``torch.matmul`` of the gathered operand alone and stock TileLang's GEMM of the same tiles, all in
the same run (``python -m tilescale_examples.benchmarks.ag_gemm --help``; usage, columns and
machinery, shared with ``gemm_rs``: :mod:`tilescale_examples.benchmarks._overlap`).
"""

from tilescale_examples.benchmarks._overlap import entry, tflops

__all__ = ["main", "run", "tflops"]

main, run = entry("ag_gemm")

if __name__ == "__main__":
    raise SystemExit(main())
