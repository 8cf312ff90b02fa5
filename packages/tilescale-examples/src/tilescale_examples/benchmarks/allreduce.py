"""All-reduce bus bandwidth: reduce-scatter + all-gather against torch.distributed.all_reduce.

``python -m tilescale_examples.benchmarks.allreduce [--ranks 4] [--min-bytes 4096]
[--max-bytes 1073741824] [--iters 20] [--dtype float16|bfloat16|float32|int32]`` (or under
``tilescale-run -n 4 [--share-gpus] -m ...``).

For every size S (4 KiB .. 1 GiB by 4x) it builds an
:class:`~tilescale_examples.allreduce.AllReduce` of S bytes, checks its output once against
``torch.distributed.all_reduce`` (``torch.allclose`` for floats: the order of the additions
differs; bit-exact for int32), then times back-to-back calls of both. Bus bandwidth as
nccl-tests define it for all-reduce: ``busbw = 2 (n - 1) / n * S / t``. The shared machinery
is :mod:`tilescale_examples.benchmarks.collectives`.
"""

from tilescale_examples.benchmarks.collectives import entry

__all__ = ["main", "run", "bus_bandwidth"]

main, run, bus_bandwidth = entry("allreduce")

if __name__ == "__main__":
    raise SystemExit(main())
