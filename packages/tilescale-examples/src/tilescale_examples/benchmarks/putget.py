"""Put/get bandwidth through a peer mapping, and the call overhead of a distributed kernel.

``python -m tilescale_examples.benchmarks.putget [--ranks 1|2] [--max-bytes N] [--iters K]``

* Bandwidth: ``T.put_warp`` / ``T.get_warp`` / ``T.put_block`` / ``T.get_block`` of S bytes
  (4 KiB .. 1 GiB) from this rank's heap to the peer's mapping of it (1 rank: peer = self,
  the rank's own heap through the table; 2 ranks: the other process's heap on the same GPU,
  through CUDA IPC or VMM), against ``torch`` device-to-device ``copy_`` of the same bytes.
  Bandwidth counts bytes read + written (2 S / t); goal: ratio >= 0.9 from 64 MiB up.
* Call overhead: host time per launch of an initialised distributed kernel against a stock
  TileLang kernel with the same body (goal: ratio <= 1.05).
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

import argparse
import os
import statistics
import time

from tilescale_examples.report import format_bytes, gb_per_s, print_table, ratio, size_sweep

TARGET = {"kind": "cuda", "arch": "sm_90a"}
WARPS_PER_BLOCK = 16
THREADS = 32 * WARPS_PER_BLOCK


def build_copy(op: str, nmax: int, blocks: int):
    """A bandwidth kernel: ``op`` in put_warp|get_warp|put_block|get_block over ``n`` int32
    elements, split into 16-byte aligned chunks per warp (warp ops) or per block."""
    import tilelang.language as T

    warp_op = op.endswith("_warp")
    workers = blocks * (WARPS_PER_BLOCK if warp_op else 1)
    intrinsic = getattr(T, op)
    warp_mul = WARPS_PER_BLOCK if warp_op else 1
    warp_flag = 1 if warp_op else 0

    @T.prim_func
    def copy_kernel(A: T.Tensor((nmax,), "int32"), B: T.Tensor((nmax,), "int32"), n: T.int32, pe: T.int32):
        with T.Kernel(blocks, threads=THREADS) as bx:
            tx = T.get_thread_binding()
            worker = bx * warp_mul + tx // 32 * warp_flag
            chunk = ((n + workers - 1) // workers + 3) // 4 * 4
            start = worker * chunk
            if start < n:
                intrinsic(T.address_of(A[start]), T.address_of(B[start]), T.min(chunk, n - start), pe)

    return copy_kernel


def build_overhead(distributed: bool):
    """A tiny kernel (1024 int32) with the same body, with or without a TileScale intrinsic."""
    import tilelang.language as T

    if distributed:

        @T.prim_func
        def tiny_dist(A: T.Tensor((1024,), "int32"), B: T.Tensor((1024,), "int32"), pe: T.int32):
            with T.Kernel(1, threads=256) as _:
                T.put_block(A, B, 1024, dst_pe=pe)

        return tiny_dist

    @T.prim_func
    def tiny_stock(A: T.Tensor((1024,), "int32"), B: T.Tensor((1024,), "int32"), pe: T.int32):
        with T.Kernel(1, threads=256) as _:
            for i in T.Parallel(1024):
                B[i] = A[i] + pe * 0

    return tiny_stock


def _time_ms(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _host_us(fn, calls: int) -> float:
    import torch

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def run(rank: int, world: int, max_bytes: int, iters: int, calls: int) -> list | None:
    import tilelang
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    nmax = max_bytes // 4
    alloc = tilelang.get_allocator(size=2 * max_bytes + (64 << 20), device="cuda:0", is_distributed=True, local_rank=rank, num_local_ranks=world, group=dist.group.WORLD)
    try:
        A = tilelang.tensor((nmax,), torch.int32, allocator=alloc)
        B = tilelang.tensor((nmax,), torch.int32, allocator=alloc)
        A.copy_(torch.arange(nmax, dtype=torch.int32, device="cuda:0"))
        B.zero_()
        peer = (rank + 1) % world
        blocks = torch.cuda.get_device_properties(0).multi_processor_count * 4
        ops = ("put_warp", "get_warp", "put_block", "get_block")
        kernels = {}
        for op in ops:
            k = tilelang.compile(build_copy(op, nmax, blocks), target=TARGET, compile_once=True, compile_group=dist.group.WORLD)
            kernels[op] = k.initialize(allocator=alloc)
        dist.barrier()
        rows = []
        for nbytes in size_sweep(4096, max_bytes, 4):
            n = nbytes // 4
            it = iters if nbytes < (64 << 20) else max(5, iters // 4)
            ref_ms = _time_ms(lambda: B[:n].copy_(A[:n]), it)
            ref_bw = gb_per_s(2 * nbytes, ref_ms)
            row = [format_bytes(nbytes), f"{ref_bw:.1f}"]
            for op in ops:
                k = kernels[op]
                ms = _time_ms(lambda: k(A, B, n, peer), it)
                bw = gb_per_s(2 * nbytes, ms)
                row += [f"{bw:.1f}", ratio(bw, ref_bw)]
            rows.append(row)
            dist.barrier()
        # correctness spot check of the last put: B on `peer` holds our A prefix
        torch.cuda.synchronize()
        dist.barrier()
        check = bool(torch.equal(B[:1024].cpu(), torch.arange(1024, dtype=torch.int32)))
        # call overhead
        tiny_a = torch.arange(1024, dtype=torch.int32, device="cuda:0")
        tiny_b = tilelang.tensor((1024,), torch.int32, allocator=alloc)
        dist_k = tilelang.compile(build_overhead(True), target=TARGET, compile_once=True, compile_group=dist.group.WORLD).initialize(allocator=alloc)
        stock_k = tilelang.compile(build_overhead(False), target=TARGET)
        dist_us = _host_us(lambda: dist_k(tiny_a, tiny_b, -1), calls)
        stock_us = _host_us(lambda: stock_k(tiny_a, tiny_b, -1), calls)
        dist.barrier()
        if rank != 0:
            return None
        return [rows, check, dist_us, stock_us, alloc.path if hasattr(alloc, "path") else "?"]
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        alloc.close()


def _rank_main(rank, world, max_bytes, iters, calls):
    return run(rank, world, max_bytes, iters, calls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1, help="1 (peer = self) or 2 (two processes sharing GPU 0)")
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    from tilescale_core.multiprocess import run_ranks

    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    results = run_ranks(_rank_main, args.ranks, args=(args.max_bytes, args.iters, args.calls), backend="gloo", timeout=900)
    rows, check, dist_us, stock_us, path = results[0]
    heads = ["size", "torch GB/s"]
    for op in ("put_warp", "get_warp", "put_block", "get_block"):
        heads += [f"{op} GB/s", "ratio"]
    print_table(f"put/get through a peer mapping ({args.ranks} rank(s), heap path {path}; GB/s = (read+write)/s)", heads, rows)
    print_table("call overhead (host us per launch)", ["distributed", "stock", "ratio"], [[dist_us, stock_us, ratio(dist_us, stock_us)]])
    big = [r for r in rows if r[0].endswith("GiB") or (r[0].endswith("MiB") and float(r[0].split()[0]) >= 64)]
    worst = min((r[i] for r in big for i in range(3, len(r), 2)), default=float("nan"))
    print(f"\ncorrectness spot check: {'ok' if check else 'FAILED'}; worst ratio from 64 MiB up: {worst:.3f} (goal >= 0.9); "
          f"overhead ratio {ratio(dist_us, stock_us):.3f} (goal <= 1.05)")
    return 0 if check else 1


if __name__ == "__main__":
    raise SystemExit(main())
