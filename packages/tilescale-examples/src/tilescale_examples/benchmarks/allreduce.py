"""All-reduce bus bandwidth: TileScale's AllReduce against NCCL and torch symmetric memory.

``python -m tilescale_examples.benchmarks.allreduce [--ranks 4] [--min-bytes 4096]
[--max-bytes 1073741824] [--iters 20] [--dtype float16 bfloat16 ...]
[--algorithm auto|one_shot|two_shot]`` (or under ``tilescale-run -n 4 [--share-gpus] -m ...``).

For every dtype and size S (4 KiB .. 1 GiB by 4x) it builds an
:class:`~tilescale_examples.collectives.allreduce.AllReduce` of S bytes (``--algorithm``: the size table,
or one algorithm forced, to re-tune the table), checks its output once against
``torch.distributed.all_reduce`` (``torch.allclose`` for floats: the order of the additions
differs; bit-exact for int32), then times back-to-back calls of both: TileScale with an
ordinary tensor as input (staging into the heap counted), NCCL on a copy of it (all_reduce
works in place). With one GPU per rank it also times TileScale on its own symmetric input
buffer against torch symmetric memory's one-shot / two-shot all-reduce on a ``symm_mem``
buffer (:mod:`tilescale_examples.benchmarks._symm_baseline`). Bus bandwidth as nccl-tests
define it for all-reduce: ``busbw = 2 (n - 1) / n * S / t``. The shared machinery is
:mod:`tilescale_examples.benchmarks._collective_cli`.
"""

from tilescale_examples.benchmarks._collective_cli import entry

__all__ = ["main", "run", "bus_bandwidth"]

main, run, bus_bandwidth = entry("allreduce")

if __name__ == "__main__":
    raise SystemExit(main())
