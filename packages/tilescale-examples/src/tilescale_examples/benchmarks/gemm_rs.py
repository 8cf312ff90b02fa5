"""GEMM + reduce-scatter: TileScale's :class:`~tilescale_examples.overlap.gemm_rs.GemmReduceScatter`
against ``torch.matmul`` + ``reduce_scatter_tensor``, torch async-TP's
``fused_matmul_reduce_scatter``, ``torch.matmul`` alone (no communication) and stock
TileLang's GEMM of the same tiles, all in the same run.

``python -m tilescale_examples.benchmarks.gemm_rs [--ranks 2] [--m-local 1024,2048,4096,8192]
[--k 8192] [--n 3584] [--dtype bfloat16] [--iters 20]`` (or under ``tilescale-run -n N
[--share-gpus] -m ...``). The shared machinery and the columns are described in
:mod:`tilescale_examples.benchmarks._overlap`.
"""

from tilescale_examples.benchmarks._overlap import entry, tflops

__all__ = ["main", "run", "tflops"]

main, run = entry("gemm_rs")

if __name__ == "__main__":
    raise SystemExit(main())
