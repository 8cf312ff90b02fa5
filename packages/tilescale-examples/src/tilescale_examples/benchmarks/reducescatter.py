"""Reduce-scatter bus bandwidth: TileScale's ReduceScatter against NCCL and torch symmetric memory.

``python -m tilescale_examples.benchmarks.reducescatter [--ranks 4] [--min-bytes 4096]
[--max-bytes 1073741824] [--iters 20] [--dtype float16 bfloat16 ...]`` (or under
``tilescale-run -n 4 [--share-gpus] -m ...``).

For every dtype and input size S (4 KiB .. 1 GiB by 4x; each rank's input is ``(ranks, S /
ranks)``, its output one shard) it builds a
:class:`~tilescale_examples.collectives.reducescatter.ReduceScatter` and checks its output once against
the baseline's: ``torch.allclose`` for floats (the kernel adds in rank order in float32, NCCL
in its ring order in the dtype), bit-exact for int32. Then it times back-to-back calls on an
ordinary input tensor (staging counted) and of the baseline:

* ``torch.distributed.reduce_scatter_tensor`` (sum) over **NCCL** with one rank per GPU;
* where the backend lacks it (gloo with CUDA tensors, in the torch versions we have seen),
  ``all_reduce`` of a copy of the input, then row ``rank``: the title then says
  "all_reduce + slice over gloo". Gloo runs when ranks share a GPU: time-sliced, not a
  bandwidth measurement.

With one GPU per rank it also times ``rs(rs.input)`` against torch symmetric memory's
``reduce_scatter_out`` (:mod:`tilescale_examples.benchmarks._symm_baseline`). Bus bandwidth as
nccl-tests define it for reduce-scatter: ``busbw = (n - 1) / n * S / t`` with S the input
size. The shared machinery is :mod:`tilescale_examples.benchmarks._collective_cli`.
"""

from tilescale_examples.benchmarks._collective_cli import entry

__all__ = ["main", "run", "bus_bandwidth"]

main, run, bus_bandwidth = entry("reducescatter")

if __name__ == "__main__":
    raise SystemExit(main())
