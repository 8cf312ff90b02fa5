"""Remote TMA bandwidth against ``T.put_block`` and the copy engine, in the same run.

``python -m tilescale_examples.benchmarks.remote_tma [--ranks 1|2] [--max-bytes N] [--iters K] [--out DIR]``

Every rank moves S bytes (1 MiB .. 1 GiB) of a ``(rows, 256)`` float16 matrix from its heap
into the next rank's copy of another one (1 rank: peer = self, its own heap through the
table; 2 ranks: the other process's heap, on the same GPU when there is one):

* **remote TMA**: each block takes 64 x 256 tiles round-robin; a TMA load brings the tile
  into shared memory (local descriptor) and ``T.tma_copy(..., dst_pe=peer)`` stores it through
  the peer's descriptor; two shared buffers let the store of tile i overlap the load of i+1;
* **put_block**: ``T.put_block`` with 64 KiB units dealt round-robin to the blocks (the
  fastest split in ``putget``);
* **copy engine**: torch ``copy_`` into the peer's view of the destination.

Bandwidth counts bytes read + written (2 S / t), t the median of ``--iters`` calls (a quarter
of them from 64 MiB up, at least 5), each timed on its own from an idle GPU
(:func:`~tilescale_examples.benchmarks._timing.local_ms`).  Every size is first checked on a
poisoned destination.
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

import os

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import format_bytes, gb_per_s, print_table, ratio, size_sweep

TARGET = {"kind": "cuda", "arch": "sm_90a"}
COLS = 256  # float16 elements per row (512 B)
TILE_ROWS = 64  # rows per TMA tile (32 KiB)
THREADS = 128


def build_tma_put(max_rows: int, blocks: int):
    """``(A, B, tiles, pe)``: tiles ``bx, bx + blocks, ...`` of A (local) stored into B on ``pe``."""
    import tilelang.language as T

    @T.prim_func
    def tma_put(A: T.Tensor((max_rows, COLS), "float16"), B: T.Tensor((max_rows, COLS), "float16"),
                tiles: T.int32, pe: T.int32):
        with T.Kernel(blocks, threads=THREADS) as bx:
            s = T.alloc_shared((2, TILE_ROWS, COLS), "float16")
            bar = T.alloc_barrier([1, 1])
            for it in T.serial((tiles - bx + blocks - 1) // blocks):
                t = bx + it * blocks
                buf = it % 2
                T.tma_store_wait(1)  # the store that read s[buf] two tiles ago is done
                T.sync_threads()
                T.tma_copy(A[t * TILE_ROWS:(t + 1) * TILE_ROWS, :], s[buf, :, :], barrier=bar[buf])
                if T.shuffle_elect(THREADS):
                    T.barrier_arrive(bar[buf])
                T.mbarrier_wait_parity(bar[buf], (it // 2) % 2)
                T.tma_copy(s[buf, :, :], B[t * TILE_ROWS:(t + 1) * TILE_ROWS, :], dst_pe=pe)
            T.tma_store_wait(0)

    return tma_put


def _pattern(rows: int, rank: int):
    import torch

    return (torch.arange(rows * COLS, device="cuda").view(rows, COLS) % 2039 + rank).half()


def run(rank: int, world: int, max_bytes: int, iters: int, min_bytes: int) -> list:
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device
    from tilescale_examples.benchmarks.putget import build_copy

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    max_rows = max_bytes // (2 * COLS)
    alloc = tilelang.get_allocator(size=2 * max_bytes + (64 << 20), device=dev, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=dist.group.WORLD)
    try:
        A = tilelang.tensor((max_rows, COLS), torch.float16, allocator=alloc)
        views = tilelang.tensor((max_rows, COLS), torch.float16, allocator=alloc, return_peers=True)
        B = views[rank]
        peer = (rank + 1) % world
        src = (rank - 1) % world
        A.copy_(_pattern(max_rows, rank))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        group = dist.group.WORLD
        tma = tilelang.compile(build_tma_put(max_rows, sms), target=TARGET, compile_root=0, compile_group=group)
        tma.initialize(allocator=alloc)
        nmax = max_bytes // 4
        put = tilelang.compile(build_copy("put_block", nmax, 2 * sms, unit_bytes=64 << 10), target=TARGET,
                               compile_root=0, compile_group=group).initialize(allocator=alloc)
        A32, B32 = A.view(-1).view(torch.int32), B.view(-1).view(torch.int32)
        runs = {
            "remote TMA": lambda rows: tma(A, B, rows // TILE_ROWS, peer),
            "put_block": lambda rows: put(A32, B32, rows * COLS // 2, peer),
            "copy engine": lambda rows: views[peer][:rows].copy_(A[:rows]),
        }
        rows_out, failures = [], []
        for nbytes in size_sweep(min_bytes, max_bytes, 4):
            rows = nbytes // (2 * COLS)
            row = [format_bytes(nbytes)]
            bws = {}
            for name, fn in runs.items():
                B.fill_(-7.0)
                torch.cuda.synchronize()
                dist.barrier()
                fn(rows)
                torch.cuda.synchronize()
                dist.barrier()
                if not torch.equal(B[:rows], _pattern(rows, src)) or (rows < max_rows and bool((B[rows] != -7.0).any())):
                    failures.append(f"rank {rank} {name} {format_bytes(nbytes)}: wrong data")
                dist.barrier()
                it = iters if nbytes < (64 << 20) else max(5, iters // 4)
                ms = _timing.local_ms(lambda: fn(rows), it)
                bws[name] = gb_per_s(2 * nbytes, ms)
                dist.barrier()
            row += [f"{bws['remote TMA']:.1f}", f"{bws['put_block']:.1f}", f"{bws['copy engine']:.1f}",
                    ratio(bws["remote TMA"], bws["put_block"]), ratio(bws["remote TMA"], bws["copy engine"])]
            rows_out.append(row)
        return [rows_out, failures, alloc.path if hasattr(alloc, "path") else "?"]
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        alloc.close()


def main(argv=None) -> int:
    p = _harness.parser("remote_tma", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1, help="1 (peer = self) or 2 (two processes, sharing a GPU if one)")
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=20)
    args = _harness.parse_args(p, argv)
    if args.min_bytes % (2 * COLS * TILE_ROWS) or args.max_bytes % (2 * COLS * TILE_ROWS):
        p.error(f"sizes must be multiples of one tile ({2 * COLS * TILE_ROWS} bytes)")
    from tilescale_core.multiprocess import run_ranks

    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    results = run_ranks(run, args.ranks, args=(args.max_bytes, args.iters, args.min_bytes), backend="auto",
                        timeout=900)
    rows, _, path = results[0]
    failures = [f for r in results for f in r[1]]
    print_table(
        f"remote TMA store vs put_block vs copy engine ({args.ranks} rank(s), heap path {path}; "
        f"GB/s = (read+write)/s; {TILE_ROWS}x{COLS} float16 tiles)",
        ["size", "remote TMA GB/s", "put_block GB/s", "copy engine GB/s", "TMA/put_block", "TMA/copy engine"], rows)
    for f in failures[:20]:
        print("FAILED:", f)
    print(f"\ncorrectness (every method and size, poisoned destination): {'ok' if not failures else 'FAILED'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
