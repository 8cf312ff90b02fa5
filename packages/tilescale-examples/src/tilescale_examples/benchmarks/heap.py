"""Symmetric-heap benchmark: time-to-ready of a heap and the latency of ``tilelang.tensor``.

Run ``python -m tilescale_examples.benchmarks.heap`` on a GPU machine.  For each memory path
(CUDA IPC, VMM) and each rank count (1, 2, 4 by default; ranks share GPUs when there are
fewer GPUs than ranks, over a gloo group) it measures:

* time-to-ready: wall time of ``tilelang.get_allocator(size=1 GiB, ...)`` on every rank
  (the slowest rank counts; median of ``--repeats`` after one small warm-up heap; the ranks
  start each heap together), against ``cudaMalloc`` of the same size measured in the same
  processes;
* ``tilelang.tensor`` latency on the initialised heap (µs per call, with and without
  ``return_peers``), against ``torch.empty`` of the same shape on the same device.

Without a GPU (or with ``--host``) it measures what a CPU can: the ``tilelang.tensor`` latency
on a one-rank heap over host memory (the same Python path) against CPU ``torch.empty``.

Every time is ``tilescale_host.bench``'s host clock: ``time.perf_counter`` from an idle GPU to
the end of the calls' GPU work (one ``torch.cuda.synchronize`` before and one after the timed
calls, nothing to wait for where CUDA is not in use), the slowest rank's for the heaps and
cudaMalloc (``do_bench(clock="host")``), this rank's mean over ``--calls`` calls after one
warm-up call for the latencies (``perf_fn(clock="host")``).

``python -m tilescale_examples.benchmarks.heap [--size BYTES] [--ranks 1,2,4] [--paths ipc,vmm]
[--repeats 3] [--calls 2000] [--host] [--out DIR]``
"""

from __future__ import annotations

import os

from tilescale_host.bench import do_bench, perf_fn

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._report import format_bytes, print_table, ratio

__all__ = ["bench_rank", "host_tensor_latency", "main"]


def _slowest_median_ms(make, free, repeats: int, before=None) -> float:
    """Median over ``repeats`` calls of ``make()`` of the slowest rank's host milliseconds
    (``do_bench(clock="host")``); ``free(x)`` releases what a call made, outside the timed
    interval (before the next call, and after the last); ``before()`` runs first before each
    call, also outside it."""
    made = []

    def prepare():
        while made:
            free(made.pop())
        if before is not None:
            before()

    try:
        return do_bench(lambda: made.append(make()), 0, repeats, clock="host", before=prepare)
    finally:
        while made:
            free(made.pop())


def _time_to_ready(rank, world_size, size, use_vmm, repeats):
    """``(path, ms)``: the heap's memory path and the median of the slowest rank's time to
    make a heap of ``size`` bytes, every rank starting each together."""
    import torch.distributed as dist

    import tilelang

    def make(nbytes):
        return tilelang.get_allocator(
            size=nbytes, local_rank=rank, num_local_ranks=world_size, group=dist.group.WORLD, use_vmm=use_vmm
        )

    make(1 << 20).close()  # warm-up: driver IPC/VMM state, socket paths, gloo buffers
    paths = []

    def close(heap):
        paths.append(heap.path)
        heap.close()

    ms = _slowest_median_ms(lambda: make(size), close, repeats, before=dist.barrier)
    return paths[-1], ms


def _cuda_malloc_time(size, repeats):
    """Median of the slowest rank's milliseconds of a ``cudaMalloc`` of ``size`` bytes."""
    import torch

    from tilescale_core import driver, ipc

    driver.ensure_context(torch.cuda.current_device())
    return _slowest_median_ms(lambda: ipc.malloc(size), ipc.free, repeats)


def _per_call_us(fn, calls):
    """This rank's host microseconds per call of ``fn``: ``calls`` calls after one warm-up
    (``perf_fn(clock="host")``)."""
    return perf_fn(fn, 1, calls, clock="host", group="local")[1] * 1e3


def _tensor_latency(rank, world_size, use_vmm, calls, shape):
    import torch
    import torch.distributed as dist

    import tilelang

    nbytes = 4 * shape[0] * (2 * calls + 4) + (1 << 20)
    with tilelang.get_allocator(
        size=nbytes, local_rank=rank, num_local_ranks=world_size, group=dist.group.WORLD, use_vmm=use_vmm
    ) as a:
        plain = _per_call_us(lambda: tilelang.tensor(shape, "float32", allocator=a), calls)
        peers = _per_call_us(lambda: tilelang.tensor(shape, "float32", allocator=a, return_peers=True), calls)
        torch.cuda.synchronize()
        dist.barrier()
    baseline = _per_call_us(lambda: torch.empty(shape, dtype=torch.float32, device="cuda"), calls)
    return plain, peers, baseline


def host_tensor_latency(calls: int, shape=(1024,)) -> tuple[float, float]:
    """``(tilelang.tensor µs, torch.empty µs)`` per call on a one-rank heap over host memory
    (tilescale_core.testing.HostBackend) and on the CPU."""
    import tilelang
    import torch
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    nbytes = 256 * (calls + 4) + 4 * shape[0] * (calls + 4)
    heap = BaseAllocator(nbytes, device="cpu", is_distributed=False, backend=HostBackend())
    try:
        plain = _per_call_us(lambda: tilelang.tensor(shape, "float32", allocator=heap), calls)
    finally:
        heap.close()
    return plain, _per_call_us(lambda: torch.empty(shape, dtype=torch.float32), calls)


def bench_rank(rank: int, world_size: int, use_vmm: bool, size: int, repeats: int, calls: int) -> dict:
    """Rank body: every measurement of one (path, world size) pair; rank 0's dict is reported."""
    import torch

    os.environ.pop("TILESCALE_USE_VMM", None)
    from tilescale_core.multiprocess import rank_device

    torch.cuda.set_device(rank_device(rank))
    torch.empty(1, device="cuda")  # CUDA context outside the timings
    path, ready = _time_to_ready(rank, world_size, size, use_vmm, repeats)
    malloc = _cuda_malloc_time(size, repeats)
    plain, peers, empty = _tensor_latency(rank, world_size, use_vmm, calls, (1024,))
    return {"path": path, "ready_ms": ready, "malloc_ms": malloc, "tensor_us": plain, "peers_us": peers, "empty_us": empty}


def main(argv=None) -> int:
    """Parse arguments, run every (path, ranks) case, print two tables."""
    parser = _harness.parser("heap", __doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 30, help="heap bytes per rank (default 1 GiB)")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--paths", default="ipc,vmm", help="ipc and/or vmm")
    parser.add_argument("--repeats", type=int, default=3, help="heaps timed per case (median)")
    parser.add_argument("--calls", type=int, default=2000, help="tilelang.tensor calls timed per case")
    parser.add_argument("--host", action="store_true", help="only the host-memory tensor latency (also the default without a GPU)")
    args = _harness.parse_args(parser, argv)

    import torch

    from tilescale_core.multiprocess import run_ranks

    if args.host or not torch.cuda.is_available():
        plain, empty = host_tensor_latency(args.calls)
        print_table(
            f"tilelang.tensor latency on a host-memory heap (CPU, 1 rank, 1024 float32, {args.calls} calls"
            f"{'' if args.host else '; no GPU here: heap time-to-ready not measured'})",
            ["tensor us", "torch.empty us", "ratio"],
            [[plain, empty, ratio(plain, empty)]],
        )
        return 0
    ready_rows, tensor_rows = [], []
    for label in args.paths.split(","):
        use_vmm = {"ipc": False, "vmm": True}[label.strip()]
        for n in (int(x) for x in args.ranks.split(",")):
            try:
                r = run_ranks(bench_rank, n, args=(use_vmm, args.size, args.repeats, args.calls), timeout=300)[0]
            except Exception as exc:  # report and go on with the other cases
                print(f"{label} x{n}: failed: {type(exc).__name__}: {str(exc)[-1500:]}")
                continue
            ready_rows.append(
                [r["path"], n, r["ready_ms"], r["malloc_ms"], ratio(r["ready_ms"], r["malloc_ms"])]
            )
            tensor_rows.append(
                [r["path"], n, r["tensor_us"], r["peers_us"], r["empty_us"], ratio(r["tensor_us"], r["empty_us"])]
            )
    gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    print_table(
        f"time-to-ready of a {format_bytes(args.size)} heap per rank ({gpus}; median of {args.repeats})",
        ["path", "ranks", "ready ms", "cudaMalloc ms", "ratio"],
        ready_rows,
    )
    print_table(
        f"tilelang.tensor latency on an initialised heap (1024 float32, {args.calls} calls)",
        ["path", "ranks", "tensor us", "return_peers us", "torch.empty us", "ratio"],
        tensor_rows,
    )
    return 0 if len(ready_rows) == len(args.paths.split(",")) * len(args.ranks.split(",")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
