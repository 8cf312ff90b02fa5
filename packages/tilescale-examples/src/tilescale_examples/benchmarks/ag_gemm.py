"""All-gather + GEMM: TileScale's overlapped AllGatherGEMM against all_gather_into_tensor
followed by torch.matmul (NCCL + cuBLAS), measured in the same run.

``python -m tilescale_examples.benchmarks.ag_gemm [--ranks 4] [--k 8192] [--n 3584]
[--m-local 512,1024,2048,4096] [--dtype bfloat16] [--iters 20] [--ag-blocks 16]`` (or under
``tilescale-run -n 4 [--share-gpus] -m ...``).

For every ``m_local`` it builds an :class:`~tilescale_examples.ag_gemm.AllGatherGEMM`, checks
its output once against the baseline's (``torch.allclose``, rtol 2e-2: both accumulate in
float32 but in different orders), then times back-to-back calls of both with CUDA events
(the slowest rank). It prints TFLOP/s of the whole step (``2 * world * m_local * n * k`` per
call) and the ratio TileScale / baseline (above 1: faster). With ranks sharing a GPU (gloo,
time-sliced) the numbers are not a performance measurement; the title says so.
"""

from __future__ import annotations

import argparse
import os

from tilescale_examples.benchmarks.collectives import run_on_ranks, time_ms
from tilescale_examples.report import print_table, ratio

__all__ = ["main", "run", "tflops"]

HEADERS = ["m_local", "M x N x K", "TileScale TFLOP/s", "baseline TFLOP/s", "ratio", "TileScale us", "baseline us", "check"]


def tflops(flops: float, milliseconds: float) -> float:
    """TFLOP/s of ``flops`` floating-point operations in ``milliseconds``."""
    return flops / (milliseconds * 1e-3) / 1e12


def run(rank: int, world: int, group, device, args) -> list | None:
    """One rank's part; returns ``[rows, failures]`` on rank 0 (None elsewhere)."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_examples.ag_gemm import AllGatherGEMM

    dtype = getattr(torch, args.dtype)
    sizes = [int(m) for m in args.m_local.split(",")]
    heap = sum(2 * world * m * args.k * dtype.itemsize for m in sizes) + (64 << 20)
    alloc = tilelang.get_allocator(size=heap, device=device, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=group)
    flag_device = device if dist.get_backend(group) == "nccl" else "cpu"
    rows, failures = [], 0
    gen = torch.Generator().manual_seed(rank * 7919 + 1)
    b = (torch.randn(args.k, args.n, generator=gen) / args.k ** 0.5).to(dtype).to(device)
    for m in sizes:
        agg = AllGatherGEMM(alloc, m, args.k, args.n, dtype, group=group, ag_blocks=args.ag_blocks)
        a = torch.randn(m, args.k, generator=gen).to(dtype).to(device)
        gathered = torch.empty(world * m, args.k, dtype=dtype, device=device)
        ref = torch.empty(world * m, args.n, dtype=dtype, device=device)

        def baseline():
            dist.all_gather_into_tensor(gathered, a, group=group)
            torch.matmul(gathered, b, out=ref)

        baseline()
        out = agg(a, b)
        torch.cuda.synchronize(device)
        ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=flag_device)
        dist.all_reduce(flag, group=group)
        bad = int(flag.item())
        failures += bad
        ts_ms = time_ms(lambda: agg(a, b), args.iters, group, device)
        ref_ms = time_ms(baseline, args.iters, group, device)
        flops = agg.flops()
        rows.append([m, f"{world * m}x{args.n}x{args.k}", tflops(flops, ts_ms), tflops(flops, ref_ms),
                     ratio(ref_ms, ts_ms), ts_ms * 1e3, ref_ms * 1e3, "ok" if bad == 0 else f"FAIL ({bad} rank(s))"])
        agg.close()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return [rows, failures] if rank == 0 else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tilescale_examples.benchmarks.ag_gemm",
                                description="AllGatherGEMM against all_gather_into_tensor + torch.matmul, same run.")
    p.add_argument("--ranks", type=int, default=4, help="ranks to spawn (ignored under tilescale-run)")
    p.add_argument("--m-local", default="512,1024,2048,4096", help="comma-separated rows per rank")
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=3584, help="output columns per rank")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ag-blocks", type=int, default=16, help="blocks (SMs) of the all-gather producer")
    return p


def main(argv=None) -> int:
    """0 when every check passed (or there is no GPU to measure on), 1 otherwise."""
    p = _parser()
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error("--ranks must be >= 1")
    try:
        sizes = [int(m) for m in args.m_local.split(",")]
    except ValueError:
        p.error(f"--m-local must be comma-separated ints, got {args.m_local!r}")
    if any(m < 1 for m in sizes) or args.k < 1 or args.n < 1:
        p.error("--m-local, --k and --n must be positive")
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("all-gather + GEMM benchmark: no CUDA GPU visible, nothing to measure")
        return 0
    result, backend, world = run_on_ranks(run, args.ranks, args)
    if result is None:
        return 0
    rows, failures = result
    if backend == "nccl":
        mode = f"one rank per GPU ({min(gpus, world)} GPUs); baseline all_gather_into_tensor over NCCL + torch.matmul (cuBLAS)"
    else:
        mode = (f"{world} ranks sharing {min(gpus, world)} GPU(s): time-sliced, NOT a performance measurement; "
                f"baseline all_gather_into_tensor over {backend} (host staging) + torch.matmul")
    print_table(f"all-gather + GEMM, {world} ranks, {args.dtype}, {mode}; ratio = baseline time / TileScale time", HEADERS, rows)
    print(f"\ncorrectness (allclose rtol 2e-2 vs the baseline's output, every size): "
          f"{'ok' if failures == 0 else f'{failures} FAILURE(S)'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
