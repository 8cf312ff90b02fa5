"""All-gather bus bandwidth: the put_block all-gather against torch.distributed, same run.

``python -m tilescale_examples.benchmarks.allgather [--ranks 4] [--min-bytes 4096]
[--max-bytes 1073741824] [--iters 20] [--dtype float16] [--algorithm auto|sm|copy] [--out DIR]`` spawns the ranks itself (one per
GPU with an NCCL group when there are enough GPUs, else sharing the GPUs with a gloo group);
under ``tilescale-run -n 4 [--share-gpus] -m tilescale_examples.benchmarks.allgather`` it
uses the launcher's ranks and ``init_dist``'s group instead.

For every output size S (4 KiB .. 1 GiB by 4x; shard = S / ranks) it builds an
:class:`~tilescale_examples.collectives.allgather.AllGather`, checks its output once against the
baseline's (bit-exact), then times back-to-back calls of both:

* TileScale: ``AllGather.__call__`` with ``--algorithm`` (or ``--engine``; default ``auto``: the put_block kernel
  below :data:`~tilescale_examples.collectives.allgather.COPY_ENGINE_MIN_BYTES`, copy engines through the
  peer mapping from there; the grid column says ``copy engine`` for those rows; no host
  synchronisation between calls either way);
* baseline: ``torch.distributed.all_gather_into_tensor`` (or ``all_gather`` into views where
  the backend lacks it) on the host group: **NCCL** with one rank per GPU, **gloo** when ranks
  share a GPU (gloo stages through host memory and TCP; it is not NCCL, and the table title
  says which one ran).

Bus bandwidth as nccl-tests define it for all-gather: ``busbw = (n - 1) / n * S / t``. The
shared machinery is :mod:`tilescale_examples.benchmarks._collective_cli`.
"""

from tilescale_examples.benchmarks._collective_cli import entry

__all__ = ["main", "run", "bus_bandwidth"]

main, run, bus_bandwidth = entry("allgather")

if __name__ == "__main__":
    raise SystemExit(main())
