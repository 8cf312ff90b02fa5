"""All-to-all bus bandwidth: the put_block all-to-all against torch.distributed, same run.

``python -m tilescale_examples.benchmarks.alltoall [--ranks 4] [--min-bytes 4096]
[--max-bytes 1073741824] [--iters 20] [--dtype float16]`` (or under ``tilescale-run -n 4
[--share-gpus] -m ...``).

For every size S (4 KiB .. 1 GiB by 4x; each rank sends ``(ranks, S / ranks)``: row ``p`` to
rank ``p``) it builds an :class:`~tilescale_examples.collectives.alltoall.AllToAll`, checks its output
once against the baseline's (bit-exact), then times back-to-back calls of ``a2a(a2a.input)``
and of the baseline: ``torch.distributed.all_to_all_single`` with equal splits (over
**NCCL** with one rank per GPU), else ``all_to_all`` on lists of rows, else ``all_gather``
of every input and a selection of row ``rank`` (whichever the backend runs first, named in
the title). Gloo runs when ranks share a GPU: time-sliced, not a bandwidth measurement.

Bus bandwidth as nccl-tests define it for all-to-all: ``busbw = (n - 1) / n * S / t``. The
shared machinery is :mod:`tilescale_examples.benchmarks._collective_cli`.
"""

from tilescale_examples.benchmarks._collective_cli import entry

__all__ = ["main", "run", "bus_bandwidth"]

main, run, bus_bandwidth = entry("alltoall")

if __name__ == "__main__":
    raise SystemExit(main())
