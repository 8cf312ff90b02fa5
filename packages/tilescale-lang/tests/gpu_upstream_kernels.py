"""Kernels and the per-rank body of the GPU tests for upstream TileScale compatibility: the
one-word GPU barrier, remote atomics, remote TMA (load, store, reduce; PEs outside the group),
``compile_root`` / ``@tilelang.jit(compile_once=...)``, ``create_host_device_tensor`` and
``tilelang.distributed.bench``.  Importable by spawned rank processes."""

from __future__ import annotations

import tilelang
import tilelang.language as T

TARGET = {"kind": "cuda", "arch": "sm_90a"}
NUM_BLOCKS, THREADS = 64, 128
GRID = 32
TILE, N = 64, 256


# ------------------------------------------------------------------------------ kernels
def upstream_barrier(num_blocks: int = NUM_BLOCKS, threads: int = THREADS, words: int = 1):
    """Upstream's test_barrier_gpu kernel, unchanged (``words=1``: its one-word barrier)."""

    @T.prim_func
    def main(A: T.Tensor([threads], "int32"), bar: T.Tensor([words], "uint32"), B: T.Tensor([num_blocks, threads], "int32")):
        with T.Kernel(num_blocks, threads=threads) as bid:
            tid = T.get_thread_binding()
            _w = T.alloc_local([words], "uint32")  # noqa: F841 (keeps ``words`` in the closure)
            T.init_barrier_gpu(bar, num_blocks)
            b = T.alloc_shared([threads], "int32")
            val = T.alloc_local([1], "int32")
            val[0] = 1
            T.atomic_add(A[tid], val[0])
            T.sync_barrier_gpu(bar)
            T.copy(A, b)
            T.copy(b, B[bid, :])

    return main


def repeated_barrier(words: int = 1):
    """``iters`` generations of the ``words``-word GPU barrier per launch, alternating the
    fused and the split form; after each, every block checks every other block's stamp
    (``base + i``: pass a larger base on every launch of the same storage)."""

    @T.prim_func
    def word_barrier(Bar: T.Tensor((words,), "uint32"), Slots: T.Tensor((GRID,), "int32"), Err: T.Tensor((4,), "int32"),
                     iters: T.int32, base: T.int32):
        with T.Kernel(GRID, threads=128) as bx:
            tx = T.get_thread_binding()
            v = T.alloc_var("int32")
            _w = T.alloc_local([words], "uint32")  # noqa: F841 (keeps ``words`` in the closure)
            T.init_barrier_gpu(Bar, GRID)
            for i in T.serial(iters):
                if tx == 0:
                    T.st(Slots[bx], base + i, scope="gpu", sem="relaxed")
                if i % 2 == 0:
                    T.sync_barrier_gpu(Bar)
                else:
                    T.arrive_barrier_gpu(Bar)
                    T.wait_barrier_gpu(Bar)
                if tx == 0:
                    for b in T.serial(GRID):
                        T.ld(Slots[b], v, scope="gpu", sem="relaxed")
                        if v < base + i:
                            Err[0] = Err[0] + 1

    return word_barrier


def remote_atomics():
    """Every rank adds into rank ``pe``'s buffers: scalar atomics of five types, float16 /
    bfloat16 pairs, a returned previous value and a tile of float32."""

    @T.prim_func
    def ratomics(F: T.Tensor((256,), "float32"), H: T.Tensor((256,), "float16"), Bf: T.Tensor((256,), "bfloat16"),
                 I: T.Tensor((8,), "int32"), U: T.Tensor((8,), "uint64"), M: T.Tensor((64, 64), "float32"),
                 Src: T.Tensor((64, 64), "float32"), Prev: T.Tensor((8,), "float32"), pe: T.int32):
        with T.Kernel(1, threads=128) as _:
            tx = T.get_thread_binding()
            f = T.alloc_fragment((64, 64), "float32")
            pair = T.alloc_local((2,), "float16")
            bpair = T.alloc_local((2,), "bfloat16")
            T.copy(Src, f)
            pair[0] = T.float16(0.5)
            pair[1] = T.float16(0.25)
            bpair[0] = T.bfloat16(2.0)
            bpair[1] = T.bfloat16(4.0)
            T.atomic_add(F[tx], 1.0, dst_pe=pe)
            T.atomic_add(H[tx], 1.0, dst_pe=pe)
            T.atomic_add(Bf[tx], 2.0, memory_order="release", dst_pe=pe)
            T.atomic_add(I[0], 1, dst_pe=pe)
            T.atomic_add(U[0], 1, memory_order="acq_rel", dst_pe=pe)
            T.atomic_addx2(H[128 + (tx % 64) * 2], pair, dst_pe=pe)
            T.atomic_addx2(Bf[128 + (tx % 64) * 2], bpair, dst_pe=pe)
            if tx == 0:
                Prev[0] = T.atomic_add(F[200], 1.0, return_prev=True, dst_pe=pe)
            T.atomic_add(M, f, dst_pe=pe)

    return ratomics


def remote_tma():
    """A 64x64 float16 tile per block: TMA load from ``ld``'s A, TMA store into ``st``'s B,
    TMA reduce-add of the tile (as float32) into ``red``'s C.  -1: the local tensor."""

    @T.prim_func
    def rtma(A: T.Tensor((N, N), "float16"), B: T.Tensor((N, N), "float16"), C: T.Tensor((N, N), "float32"),
             ld: T.int32, st: T.int32, red: T.int32):
        with T.Kernel(N // TILE, N // TILE, threads=128) as (bx, by):
            s = T.alloc_shared((TILE, TILE), "float16")
            sf = T.alloc_shared((TILE, TILE), "float32")
            bar = T.alloc_barrier([1])
            T.tma_copy(A[bx * TILE:(bx + 1) * TILE, by * TILE:(by + 1) * TILE], s, barrier=bar[0], src_pe=ld)
            if T.shuffle_elect(128):
                T.barrier_arrive(bar[0])
            T.mbarrier_wait_parity(bar[0], 0)
            T.tma_copy(s, B[bx * TILE:(bx + 1) * TILE, by * TILE:(by + 1) * TILE], dst_pe=st)
            T.tma_store_wait(0)
            for i, j in T.Parallel(TILE, TILE):
                sf[i, j] = T.Cast("float32", s[i, j])
            T.fence_proxy_async()
            T.sync_threads()
            T.atomic_add(C[bx * TILE:(bx + 1) * TILE, by * TILE:(by + 1) * TILE], sf, use_tma=True, dst_pe=red)
            T.tma_store_wait(0)

    return rtma


_cache: dict = {}


def compiled(name: str):
    """Compile ``name`` the way upstream users do: ``compile_root=0`` over the world group
    (``@tilelang.jit(compile_once=True, ...)`` for the upstream barrier kernel)."""
    if name not in _cache:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() else None
        if name == "upstream_barrier":
            @tilelang.jit(out_idx=-1, target=TARGET, compile_once=True, compile_group=group)
            def get_kernel(num_blocks, threads):
                return upstream_barrier(num_blocks, threads)

            _cache[name] = get_kernel(NUM_BLOCKS, THREADS)
        else:
            func = {"repeated_barrier": repeated_barrier, "remote_atomics": remote_atomics, "remote_tma": remote_tma}[name]()
            _cache[name] = tilelang.compile(func, target=TARGET, compile_root=0, compile_group=group)
    return _cache[name]


# ------------------------------------------------------------------------------ rank body
def rank_body(rank: int, world: int, cache_dir: str) -> dict:
    from lang_gpu_helpers import Checks, open_rank

    alloc, sync = open_rank(rank, world, cache_dir)
    dev = alloc.device
    check = Checks()
    report = check.report
    _barriers(dev, check)
    sync()
    _atomics(rank, world, alloc, check, sync)
    _tma(rank, world, alloc, check, sync)
    _host_device_and_bench(dev, check)
    sync()
    alloc.close()
    return report


def _barriers(dev, check):
    import torch

    k = compiled("upstream_barrier")
    for _ in range(3):  # upstream's test, repeated with fresh storage
        a = torch.zeros(THREADS, dtype=torch.int32, device=dev)
        bar = torch.zeros(1, dtype=torch.uint32, device=dev)
        out = k(a, bar)
        check(bool(torch.all(out == NUM_BLOCKS)), f"upstream barrier: {out.unique().tolist()}")
    kr = compiled("repeated_barrier")
    bar = torch.zeros(1, dtype=torch.uint32, device=dev)
    slots = torch.zeros(GRID, dtype=torch.int32, device=dev)
    err = torch.zeros(4, dtype=torch.int32, device=dev)
    for launch in range(3):  # the same word across launches: no reset
        kr(bar, slots, err, 1000, launch * 1000)
    torch.cuda.synchronize()
    check(int(err[0].item()) == 0, f"one-word barrier let a block through early {int(err[0].item())} times")
    word = int(bar.view(torch.int32).item()) & 0xFFFFFFFF
    check(word & 0xFFFF == 0 and (word >> 16) & 0x7FFF == GRID, f"barrier word after 3000 generations 0x{word:08x}")
    check((word >> 31) == (3000 % 2), f"phase bit after 3000 generations: 0x{word:08x}")


def _atomics(rank, world, alloc, check, sync):
    import torch

    k = compiled("remote_atomics").initialize(allocator=alloc)
    F = tilelang.tensor((256,), torch.float32, allocator=alloc)
    H = tilelang.tensor((256,), torch.float16, allocator=alloc)
    Bf = tilelang.tensor((256,), torch.bfloat16, allocator=alloc)
    I = tilelang.tensor((8,), torch.int32, allocator=alloc)
    U = tilelang.tensor((8,), torch.uint64, allocator=alloc)
    M = tilelang.tensor((64, 64), torch.float32, allocator=alloc)
    Src = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank + 7)).to(alloc.device)
    Prev = torch.full((8,), -1.0, device=alloc.device)
    for t in (F, H, Bf, I, U):
        t.zero_()
    M0 = torch.randn(64, 64, generator=torch.Generator().manual_seed(99))
    M.copy_(M0)
    sync()
    k(F, H, Bf, I, U, M, Src, Prev, 0)  # every rank adds into rank 0
    sync()
    if rank == 0:
        w = world
        check(torch.equal(F[:128].cpu(), torch.full((128,), float(w))), "remote float32 atomic_add")
        check(float(F[200].item()) == w, f"returned-value atomics: F[200] = {float(F[200].item())}")
        check(torch.equal(H[:128].cpu(), torch.full((128,), float(w), dtype=torch.float16)), "remote float16 atomic_add")
        check(torch.equal(Bf[:128].cpu(), torch.full((128,), 2.0 * w, dtype=torch.bfloat16)), "remote bfloat16 atomic_add")
        check(int(I[0].item()) == 128 * w and int(U[0].item()) == 128 * w, f"integer atomics {int(I[0].item())}")
        pairs = H[128:].view(64, 2).cpu().float()
        check(torch.equal(pairs, torch.tensor([[1.0 * w, 0.5 * w]]).expand(64, 2)), "remote float16x2 atomic_addx2")
        bpairs = Bf[128:].view(64, 2).cpu().float()
        check(torch.equal(bpairs, torch.tensor([[4.0 * w, 8.0 * w]]).expand(64, 2)), "remote bfloat16x2 atomic_addx2")
        want = M0 + sum(torch.randn(64, 64, generator=torch.Generator().manual_seed(r + 7)) for r in range(w))
        check(torch.allclose(M.cpu(), want, atol=1e-5), "remote tile atomic_add")
    prev = float(Prev[0].item())
    check(prev == float(prev) and 0.0 <= prev <= world - 1, f"previous value {prev}")
    sync()


def _tma(rank, world, alloc, check, sync):
    import torch

    k = compiled("remote_tma").initialize(allocator=alloc)
    A = tilelang.tensor((N, N), torch.float16, allocator=alloc)
    B = tilelang.tensor((N, N), torch.float16, allocator=alloc)
    C = tilelang.tensor((N, N), torch.float32, allocator=alloc)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def a_of(r, step):
        return torch.randn(N, N, generator=torch.Generator().manual_seed(1000 * step + r)).half()

    c0 = torch.randn(N, N, generator=torch.Generator().manual_seed(4242))
    cases = [  # (ld, st, red) -> expected B and C on this rank
        ((nxt, -1, nxt), lambda s: a_of(nxt, s), lambda s: c0 + a_of(rank, s).float()),
        ((-1, nxt, -1), lambda s: a_of(prv, s), lambda s: c0 + a_of(rank, s).float()),
        ((nxt, nxt, prv), lambda s: a_of(rank, s), lambda s: c0 + a_of((rank + 2) % world, s).float()),
        ((9, 9, 8), None, None),  # PEs above 7: no operation
        ((world, world, world), None, None) if world < 8 else ((9, 9, 9), None, None),  # not in the group
    ]
    for step, ((ld, st, red), want_b, want_c) in enumerate(cases):
        A.copy_(a_of(rank, step).to(A.device))
        B.fill_(-7.0)
        C.copy_(c0.to(C.device))
        sync()
        k(A, B, C, ld, st, red)
        sync()
        if want_b is None:
            check(bool((B == -7.0).all()) and torch.equal(C.cpu(), c0), f"remote TMA with PEs {(ld, st, red)} did something")
        else:
            check(torch.equal(B.cpu(), want_b(step)), f"remote TMA copy, PEs {(ld, st, red)}")
            check(torch.allclose(C.cpu(), want_c(step), atol=1e-6), f"remote TMA reduce, PEs {(ld, st, red)}")
        sync()


def _host_device_and_bench(dev, check):
    import torch
    from tilelang.distributed.bench import do_bench, perf_fn
    from tilelang.distributed.shared_memory import create_host_device_tensor

    host, device = create_host_device_tensor((1024,), torch.float32)
    ref = torch.randn(1024)
    host.copy_(ref)
    device.mul_(2.0)
    torch.cuda.synchronize()
    check(torch.equal(host, ref * 2) and device.device == torch.device(dev), "create_host_device_tensor round trip")
    x = torch.randn(1 << 16, device=dev)
    out, ms = perf_fn(lambda: x * 2, warmup=2, rep=5)
    check(ms > 0 and torch.equal(out, x * 2), "tilelang.distributed.bench.perf_fn")
    check(do_bench(lambda: x.mul_(1.0), warmup=1, rep=3, flush_l2=False) > 0, "tilelang.distributed.bench.do_bench")


TMA_DEBUG_SCRIPT = r"""
import sys, torch, tilelang
import gpu_upstream_kernels as G  # on PYTHONPATH; TILESCALE_DEBUG=1 in the environment
alloc = tilelang.get_allocator(size=2**24)
k = tilelang.compile(G.remote_tma(), target=G.TARGET).initialize(allocator=alloc)
A = tilelang.tensor((G.N, G.N), torch.float16, allocator=alloc)
B = tilelang.tensor((G.N, G.N), torch.float16, allocator=alloc)
C = tilelang.tensor((G.N, G.N), torch.float32, allocator=alloc)
try:
    k(A, B, C, 9, -1, -1)
    torch.cuda.synchronize()
except Exception as exc:
    print("HOST-ERROR:", type(exc).__name__, str(exc)[:300], flush=True)
    sys.exit(3)
print("NO-ERROR", flush=True)
"""
