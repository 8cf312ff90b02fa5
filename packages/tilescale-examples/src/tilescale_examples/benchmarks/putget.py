"""Put/get bandwidth through a peer mapping, and the call overhead of a distributed kernel.

``python -m tilescale_examples.benchmarks.putget [--ranks 1|2] [--max-bytes N] [--iters K]
[--rounds R] [--direction both|one] [--out DIR]``

* Bandwidth: ``T.put_warp`` / ``T.get_warp`` / ``T.put_block`` / ``T.get_block`` of S bytes
  (4 KiB .. 1 GiB) from this rank's heap to the peer's mapping of it (1 rank: peer = self,
  the rank's own heap through the table; 2 ranks: the other process's heap, on its own GPU
  when there are two (over NVLink), else on the same GPU, through CUDA IPC or VMM), against
  ``torch`` ``copy_`` of the same bytes into the same peer mapping (device to device: the copy
  engine) and, with one GPU per rank and an NCCL group, NCCL ``send``/``recv``. Every rank
  sends at once (``--direction both``) or rank 0 alone (``one``). Bandwidth counts bytes read
  + written (2 S / t) for every column; goal: ratio >= 0.9 (>= 0.97 over NVLink) from 64 MiB
  up. Each size is timed in ``--rounds`` rounds that take the columns in turn, every rank
  starting each timing together (each column's time in a round: the median of ``--iters``
  calls, each timed on its own from an idle GPU, a quarter of them from 64 MiB up, at least
  5; :func:`~tilescale_examples.benchmarks._timing.local_rounds`); a column's figure is its
  median round.
* Call overhead: host time per launch of an initialised distributed kernel against a stock
  TileLang kernel with the same body, the two taking turns in five rounds of ``--calls``
  launches (best round each; goal: ratio <= 1.05;
  :func:`~tilescale_examples.benchmarks._timing.host_us_rounds`). A round's time runs from an
  idle GPU to the end of the launches' GPU work (one synchronisation before and one after).
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

import os

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import format_bytes, gb_per_s, print_table, ratio, size_sweep

TARGET = {"kind": "cuda", "arch": "sm_90a"}
WARPS_PER_BLOCK = 16
THREADS = 32 * WARPS_PER_BLOCK


def build_copy(op: str, nmax: int, blocks: int, unroll: int = 4, unit_bytes: int = 0):
    """A bandwidth kernel: ``op`` in put_warp|get_warp|put_block|get_block over ``n`` int32
    elements.  The workers are the warps (warp ops) or the blocks (block ops) of a
    ``blocks``-block grid.  ``unit_bytes`` 0: one contiguous 16-byte aligned chunk per worker;
    otherwise units of ``unit_bytes`` dealt round-robin (worker w copies units w, w + W, ...),
    so that at any moment the grid works on one contiguous window.  ``unroll`` is the warp
    ops' ``unroll_factor``."""
    import tilelang.language as T

    warp_op = op.endswith("_warp")
    workers = blocks * (WARPS_PER_BLOCK if warp_op else 1)
    intrinsic = getattr(T, op)
    warp_mul = WARPS_PER_BLOCK if warp_op else 1
    warp_flag = 1 if warp_op else 0
    extra = {"unroll_factor": unroll} if warp_op else {}
    if unit_bytes % 16:
        raise ValueError(f"unit_bytes must be a multiple of 16, got {unit_bytes}")
    unit = unit_bytes // 4

    if unit == 0:

        @T.prim_func
        def copy_kernel(A: T.Tensor((nmax,), "int32"), B: T.Tensor((nmax,), "int32"), n: T.int32, pe: T.int32):
            with T.Kernel(blocks, threads=THREADS) as bx:
                tx = T.get_thread_binding()
                worker = bx * warp_mul + tx // 32 * warp_flag
                chunk = ((n + workers - 1) // workers + 3) // 4 * 4
                start = worker * chunk
                if start < n:
                    intrinsic(T.address_of(A[start]), T.address_of(B[start]), T.min(chunk, n - start), pe, **extra)

        return copy_kernel

    @T.prim_func
    def copy_units(A: T.Tensor((nmax,), "int32"), B: T.Tensor((nmax,), "int32"), n: T.int32, pe: T.int32):
        with T.Kernel(blocks, threads=THREADS) as bx:
            tx = T.get_thread_binding()
            worker = bx * warp_mul + tx // 32 * warp_flag
            units = (n + unit - 1) // unit
            for k in T.serial((units + workers - 1) // workers):
                # A variable, not the product: TileLang 0.1.15's pointer-type pass fails ("Can't
                # fetch the lanes of a scalable vector") on A[x * unit] when unit % 65536 >= 32768
                # (docs/lang.md, Copies).
                start = T.alloc_var("int32")
                start = (worker + k * workers) * unit
                if start < n:
                    intrinsic(T.address_of(A[start]), T.address_of(B[start]), T.min(unit, n - start), pe, **extra)

    return copy_units


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


# Work split measured best on the H200 (docs/benchmarks.md): warps each copy one contiguous
# chunk; blocks take 64 KiB units round-robin (one contiguous chunk per block reached only
# 0.77-0.80 of torch's copy at 1 GiB, units 0.93).
DEFAULT_UNIT_BYTES = {"warp": 0, "block": 64 << 10}


def run(rank: int, world: int, max_bytes: int, iters: int, calls: int, min_bytes: int = 4096, blocks_per_sm: int = 2, unroll: int = 4, unit_bytes: dict | None = None, direction: str = "both", rounds: int = 5) -> list | None:
    import tilelang
    import torch
    import torch.distributed as dist
    from tilescale_core.multiprocess import rank_device

    device = torch.device(rank_device(rank))  # its own GPU, or shared round-robin
    torch.cuda.set_device(device)
    nmax = max_bytes // 4
    alloc = tilelang.get_allocator(size=2 * max_bytes + (64 << 20), device=device, is_distributed=True, local_rank=rank, num_local_ranks=world, group=dist.group.WORLD)
    try:
        A = tilelang.tensor((nmax,), torch.int32, allocator=alloc)
        B_all = tilelang.tensor((nmax,), torch.int32, allocator=alloc, return_peers=True)
        B = B_all[rank]
        A.copy_(_pattern(nmax, rank, device))
        peer = (rank + 1) % world
        B_peer = B_all[peer]  # the peer's B through this process's mapping of its heap
        sends = direction == "both" or rank == 0
        nccl = dist.get_backend() == "nccl" and world == 2
        # One full wave: the copy kernels fit two 512-thread blocks per SM (<= 64 registers
        # per thread, checked by the CPU suite); a second wave would leave SMs idle at the end.
        blocks = torch.cuda.get_device_properties(device).multi_processor_count * blocks_per_sm
        ops = ("put_warp", "get_warp", "put_block", "get_block")
        units = dict(DEFAULT_UNIT_BYTES, **(unit_bytes or {}))
        kernels = {}
        for op in ops:
            k = tilelang.compile(build_copy(op, nmax, blocks, unroll, units[op.split("_")[1]]), target=TARGET, compile_once=True, compile_group=dist.group.WORLD)
            kernels[op] = k.initialize(allocator=alloc)
        dist.barrier()
        rows, failures = [], []
        for nbytes in size_sweep(min_bytes, max_bytes, 4):
            n = nbytes // 4
            for op in ops:  # correctness first, on a poisoned destination
                failures += _check_copy(op, kernels[op], A, B, n, rank, world)
            it = iters if nbytes < (64 << 20) else max(5, iters // 4)
            # a rank that does not send (--direction one) runs only NCCL's exchange
            columns = [("copy_", lambda: B_peer[:n].copy_(A[:n]))] + [(op, _launcher(kernels[op], A, B, n, peer)) for op in ops]
            columns = [(name, fn if sends else None) for name, fn in columns]
            if nccl:
                columns.append(("nccl", _send_recv(A, B, n, rank, direction)))
            timed = _timing.local_rounds(columns, rounds, it)  # every rank starts each measurement together
            nccl_bw = gb_per_s(2 * nbytes, timed["nccl"]) if nccl else float("nan")
            ref_bw = gb_per_s(2 * nbytes, timed["copy_"]) if sends else float("nan")
            row = [format_bytes(nbytes), ref_bw, nccl_bw if nccl else "n/a"]
            for op in ops:
                bw = gb_per_s(2 * nbytes, timed[op]) if sends else float("nan")
                row += [bw, ratio(bw, ref_bw)]
            rows.append(row)
            dist.barrier()
        # call overhead
        tiny_a = torch.arange(1024, dtype=torch.int32, device=device)
        tiny_b = tilelang.tensor((1024,), torch.int32, allocator=alloc)
        dist_k = tilelang.compile(build_overhead(True), target=TARGET, compile_once=True, compile_group=dist.group.WORLD).initialize(allocator=alloc)
        stock_k = tilelang.compile(build_overhead(False), target=TARGET)
        dist_us, stock_us = _timing.host_us_rounds([lambda: dist_k(tiny_a, tiny_b, -1), lambda: stock_k(tiny_a, tiny_b, -1)], calls)
        dist.barrier()
        return [rows, failures, dist_us, stock_us, alloc.path if hasattr(alloc, "path") else "?"]
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        alloc.close()


def _pattern(n: int, rank: int, device):
    """The source data of ``rank``: distinct per element and per rank (int32, on ``device``)."""
    import torch

    return torch.arange(n, dtype=torch.int32, device=device) * 3 + rank


def _launcher(kernel, A, B, n: int, peer: int):
    return lambda: kernel(A, B, n, peer)


def _send_recv(A, B, n: int, rank: int, direction: str):
    """NCCL's point-to-point baseline between 2 ranks: rank 0 sends ``A[:n]`` to rank 1
    (``one``), or both ranks send to each other at once (``both``)."""
    import torch.distributed as dist

    peer = 1 - rank
    if direction == "one":
        return (lambda: dist.send(A[:n], peer)) if rank == 0 else (lambda: dist.recv(B[:n], peer))

    def both():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, A[:n], peer), dist.P2POp(dist.irecv, B[:n], peer)]):
            work.wait()

    return both


def _check_copy(op: str, kernel, A, B, n: int, rank: int, world: int) -> list[str]:
    """Run ``op`` once over ``n`` elements into a poisoned ``B`` and compare this rank's ``B``
    with the rank that fed it (put: the rank whose peer is us; get: our peer); the element
    after the range must keep its poison.  Returns failure messages (empty when correct)."""
    import torch
    import torch.distributed as dist

    peer = (rank + 1) % world
    B.fill_(-7)
    torch.cuda.synchronize()
    dist.barrier()
    kernel(A, B, n, peer)
    torch.cuda.synchronize()
    dist.barrier()
    source = (rank - 1) % world if op.startswith("put") else peer
    bad = []
    want = _pattern(n, source, B.device)
    if not torch.equal(B[:n], want):
        wrong = int((B[:n] != want).sum())
        bad.append(f"rank {rank} {op} n={n}: {wrong} wrong elements")
    if n < B.numel() and int(B[n]) != -7:
        bad.append(f"rank {rank} {op} n={n}: wrote past the end")
    dist.barrier()
    return bad


def main(argv=None) -> int:
    p = _harness.parser("putget", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1, help="1 (peer = self) or 2 (two processes sharing GPU 0)")
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="rounds per size; each times every column in turn, the median round counts")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--blocks-per-sm", type=int, default=2, help="grid = SMs x this (default 2: one full wave)")
    p.add_argument("--unroll", type=int, default=4, help="unroll_factor of the warp ops")
    p.add_argument("--warp-unit-bytes", type=int, default=DEFAULT_UNIT_BYTES["warp"], help="warp ops: 0 = one contiguous chunk per warp, else round-robin units of this size")
    p.add_argument("--block-unit-bytes", type=int, default=DEFAULT_UNIT_BYTES["block"], help="block ops: as --warp-unit-bytes, per block")
    p.add_argument("--direction", default="both", choices=["both", "one"], help="both: every rank sends at once; one: rank 0 alone")
    args = _harness.parse_args(p, argv)
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be >= 1")
    from tilescale_core.multiprocess import auto_backend, run_ranks

    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    backend = auto_backend(args.ranks, share=False)  # NCCL with one GPU per rank, else gloo
    results = run_ranks(run, args.ranks, args=(args.max_bytes, args.iters, args.calls, args.min_bytes, args.blocks_per_sm, args.unroll, {"warp": args.warp_unit_bytes, "block": args.block_unit_bytes}, args.direction, args.rounds), backend=backend, timeout=900)
    rows, _, dist_us, stock_us, path = results[0]
    failures = [f for r in results for f in r[1]]
    heads = ["size", "copy_ GB/s", "NCCL GB/s"]
    for op in ("put_warp", "get_warp", "put_block", "get_block"):
        heads += [f"{op} GB/s", "ratio"]
    import torch

    gpus = min(torch.cuda.device_count(), args.ranks)
    print_table(f"put/get through a peer mapping ({args.ranks} rank(s) on {gpus} GPU(s), direction {args.direction}, heap path {path}, grid SMs x {args.blocks_per_sm} x 512 threads, warp unroll {args.unroll}, units warp {args.warp_unit_bytes or 'one chunk'} / block {args.block_unit_bytes or 'one chunk'} B; baseline torch copy_ into the same peer mapping; NCCL send/recv only with one GPU per rank; GB/s = (read+write)/s; ratio = op / copy_)", heads, rows)
    print_table("call overhead (host us per launch)", ["distributed", "stock", "ratio"], [[dist_us, stock_us, ratio(dist_us, stock_us)]])
    big = [r for r in rows if r[0].endswith("GiB") or (r[0].endswith("MiB") and float(r[0].split()[0]) >= 64)]
    worst = min((r[i] for r in big for i in range(4, len(r), 2)), default=float("nan"))
    check = not failures
    for f in failures[:20]:
        print("FAILED:", f)
    print(f"\ncorrectness (every op and size, poisoned destination, vs torch): {'ok' if check else 'FAILED'}; worst ratio from 64 MiB up: {worst:.3f} (goal >= 0.9); "
          f"overhead ratio {ratio(dist_us, stock_us):.3f} (goal <= 1.05)")
    return 0 if check else 1


if __name__ == "__main__":
    raise SystemExit(main())
