"""GEMM + reduce-scatter: TileScale's :class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter`
against ``torch.matmul`` + ``reduce_scatter_tensor``, torch async-TP's ``fused_matmul_reduce_scatter``,
``torch.matmul`` alone (no communication) and stock TileLang's GEMM of the same tiles, all in the
same run. Its command line, columns and machinery are those of ``ag_gemm`` for the other op:
:mod:`tilescale_examples.benchmarks._overlap`.
"""

from tilescale_examples.benchmarks._overlap import entry, tflops

__all__ = ["main", "run", "tflops"]

main, run = entry("gemm_rs")

if __name__ == "__main__":
    raise SystemExit(main())
