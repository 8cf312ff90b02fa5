"""All-gather bus bandwidth: the put_block all-gather against torch.distributed, same run.

``python -m tilescale_examples.benchmarks.allgather [--ranks 4] [--min-bytes 4096]
[--max-bytes 1073741824] [--iters 20] [--dtype float16]`` spawns the ranks itself (one per
GPU with an NCCL group when there are enough GPUs, else sharing the GPUs with a gloo group);
under ``tilescale-run -n 4 [--share-gpus] -m tilescale_examples.benchmarks.allgather`` it
uses the launcher's ranks and ``init_dist``'s group instead.

For every output size S (4 KiB .. 1 GiB by 4x; shard = S / ranks) it builds an
:class:`~tilescale_examples.allgather.AllGather`, checks its output once against the
baseline's (bit-exact), then times back-to-back calls of both:

* TileScale: ``AllGather.__call__`` (one kernel, no host synchronisation between calls);
* baseline: ``torch.distributed.all_gather_into_tensor`` on the host group: **NCCL** with one
  rank per GPU, **gloo** when ranks share a GPU (gloo stages through host memory and TCP; it
  is not NCCL, and the table title says which one ran).

Bus bandwidth as nccl-tests define it for all-gather: ``busbw = (n - 1) / n * S / t`` with
``t`` the time per call (CUDA events around a batch, the slowest rank). The ratio column is
TileScale / baseline (above 1: faster). With ranks sharing a GPU the kernels' spin waits
run by time-slicing, so those numbers show correctness and scheduling, not bandwidth.
"""

from __future__ import annotations

import argparse
import os
import warnings

from tilescale_examples.report import format_bytes, gb_per_s, print_table, ratio, size_sweep

__all__ = ["main", "run", "bus_bandwidth"]

HEADERS = ["size", "shard", "blocks", "TileScale GB/s", "baseline GB/s", "ratio",
           "TileScale us", "baseline us", "check"]


def bus_bandwidth(output_bytes: int, world: int, milliseconds: float) -> float:
    """nccl-tests' all-gather bus bandwidth in GB/s: ``(n - 1) / n * output_bytes / t``."""
    return gb_per_s((world - 1) / world * output_bytes, milliseconds)


def _iters_for(nbytes: int, iters: int) -> int:
    """Fewer timed calls for large outputs (at least 3)."""
    return max(3, min(iters, iters * (64 << 20) // max(nbytes, 1)))


def _time_ms(fn, iters: int, group, device) -> float:
    """Milliseconds per call of ``iters`` back-to-back calls (after 2 warm-up calls), timed
    with CUDA events on each rank; the slowest rank's time (every rank gets the same)."""
    import torch
    import torch.distributed as dist

    from tilescale_host import synchronize_streams

    stream = torch.cuda.current_stream(device)
    for _ in range(2):
        fn()
    synchronize_streams([stream], timeout=300.0)
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        fn()
    end.record(stream)
    synchronize_streams([stream], timeout=300.0)  # a lost signal fails instead of hanging
    ms = torch.tensor([start.elapsed_time(end) / iters], dtype=torch.float64,
                      device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms.item())


def _baseline(group, device):
    """``all_gather_into_tensor``, or where the group's backend lacks it (older gloo with CUDA
    tensors), ``all_gather`` into views of the output; the choice is the same on every rank."""
    import torch
    import torch.distributed as dist

    probe_in = torch.ones(1, device=device)
    probe_out = torch.zeros(dist.get_world_size(group), device=device)
    try:
        dist.all_gather_into_tensor(probe_out, probe_in, group=group)
        ok = bool(torch.all(probe_out == 1))
    except (RuntimeError, NotImplementedError, ValueError):
        ok = False
    if ok:
        return dist.all_gather_into_tensor

    def all_gather_views(out, x, group=None):
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), x, group=group)

    all_gather_views.__name__ = "all_gather"
    return all_gather_views


def _heap_bytes(sizes, world: int, itemsize: int) -> int:
    total = 64 << 20
    for nbytes in sizes:
        shard = max(1, nbytes // world // itemsize) * itemsize
        total += shard * (world + 1) + 2 * 4096 + 3 * 256  # input, output, flags, alignment
    return total


def run(rank: int, world: int, group, device, args) -> list | None:
    """One rank's part of the benchmark; returns the table rows on rank 0 (None elsewhere)."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_examples.allgather import AllGather

    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = size_sweep(args.min_bytes, args.max_bytes, 4)
    alloc = tilelang.get_allocator(size=_heap_bytes(sizes, world, itemsize), device=device, is_distributed=True,
                                   local_rank=rank, num_local_ranks=world, group=group)
    rows, failures = [], 0
    baseline = _baseline(group, device)
    for nbytes in sizes:
        shard = max(1, nbytes // world // itemsize)
        ag = AllGather(alloc, (shard,), dtype, group=group)  # collective: every rank, same order
        g = torch.Generator().manual_seed(rank * 7919 + nbytes % 1000003)
        x = ag.input
        x.copy_(torch.randn(shard, generator=g).to(dtype))
        ref = torch.empty(world * shard, dtype=dtype, device=device)
        baseline(ref, x, group=group)
        out = ag(x)
        torch.cuda.synchronize(device)
        ok = torch.equal(out.view(-1), ref)
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32,
                            device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(flag, group=group)  # every rank makes this collective, ok or not
        failures += int(flag.item())
        it = _iters_for(world * shard * itemsize, args.iters)
        ts_ms = _time_ms(lambda: ag(x), it, group, device)
        ref_ms = _time_ms(lambda: baseline(ref, x, group=group), it, group, device)
        out_bytes = world * shard * itemsize
        ts_bw, ref_bw = bus_bandwidth(out_bytes, world, ts_ms), bus_bandwidth(out_bytes, world, ref_ms)
        rows.append([format_bytes(out_bytes), format_bytes(shard * itemsize), f"{ag.chunks}x{world}",
                     ts_bw, ref_bw, ratio(ts_bw, ref_bw), ts_ms * 1e3, ref_ms * 1e3,
                     "ok" if int(flag.item()) == 0 else f"FAIL ({int(flag.item())} rank(s))"])
        ag.close()
        del ref
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return [rows, failures, baseline.__name__] if rank == 0 else None


def _title(world: int, backend: str, gpus: int, dtype: str, baseline: str = "all_gather_into_tensor") -> str:
    if backend == "nccl":
        base = f"baseline torch.distributed.{baseline} over NCCL"
        mode = f"one rank per GPU ({gpus} GPUs)"
    else:
        base = (f"baseline torch.distributed.{baseline} over {backend} (host staging, NOT NCCL: "
                "ranks share a GPU)")
        mode = f"{world} ranks sharing {gpus} GPU(s): time-sliced, not a bandwidth measurement"
    return f"all-gather bus bandwidth, {world} ranks, {dtype}, {mode}; {base}; busbw = (n-1)/n * size / t"


def _spawned_rank(rank: int, world: int, args, share: bool):
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    device = torch.device("cuda", rank % torch.cuda.device_count() if share else rank)
    torch.cuda.set_device(device)
    return run(rank, world, dist.group.WORLD, device, args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks to spawn (ignored under tilescale-run)")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest output size in bytes")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="largest output size in bytes")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (fewer above 64 MiB)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "uint8"])
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be >= 2 (the bus bandwidth of one rank is 0)")
    if not 0 < args.min_bytes <= args.max_bytes:
        parser.error("need 0 < --min-bytes <= --max-bytes")
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("all-gather benchmark: no CUDA GPU visible, nothing to measure")
        return 0
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:  # under tilescale-run / torchrun
        import torch.distributed as dist

        from tilelang.distributed.host import init_dist

        warnings.filterwarnings("ignore", category=FutureWarning)
        rank, world, group = init_dist(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
        result = run(rank, world, group, torch.device("cuda", torch.cuda.current_device()), args)
        backend = dist.get_backend(group)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        from tilescale_core.multiprocess import run_ranks

        world = args.ranks
        share = gpus < world
        backend = "gloo" if share else "nccl"
        result = run_ranks(_spawned_rank, world, args=(args, share), backend=backend, timeout=1200)[0]
    rows, failures, baseline = result
    print_table(_title(world, backend, min(gpus, world), args.dtype, baseline), HEADERS, rows)
    print(f"\ncorrectness (bit-exact vs the baseline's output, every size): "
          f"{'ok' if failures == 0 else f'{failures} FAILURE(S)'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
