"""Kernels and per-rank bodies for the GPU tests (importable by spawned rank processes).

Every kernel is rank-agnostic: compiled once (the first run fills TileLang's disk cache,
later ranks and runs load it) and given its rank through ``kernel.initialize``.
"""

from __future__ import annotations

import os

import tilelang
import tilelang.language as T

TARGET = {"kind": "cuda", "arch": "sm_90a"}
NMAX = 1 << 20  # elements per copy buffer
GRID = 4  # blocks per rank for barrier_blocks
GPU_GRID = 32  # blocks for the grid barrier

_cache: dict = {}


def _compile(key, build, **kw):
    if key not in _cache:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() else None
        _cache[key] = tilelang.compile(build(), target=TARGET, compile_once=True, compile_group=group, **kw)
    return _cache[key]


def copy_kernel(dtype: str):
    """mode 0 put_warp, 1 get_warp, 2 put_block, 3 get_block of n elements at offset off."""

    def build():
        @T.prim_func
        def copies(A: T.Tensor((NMAX,), dtype), B: T.Tensor((NMAX,), dtype), n: T.int32, pe: T.int32, mode: T.int32, off: T.int32):
            with T.Kernel(1, threads=128) as _:
                tx = T.get_thread_binding()
                _unused = T.alloc_local((1,), dtype)  # noqa: F841 (keeps dtype in the closure)
                if mode == 0:
                    if tx < 32:
                        T.put_warp(T.address_of(A[off]), T.address_of(B[off]), n, dst_pe=pe)
                elif mode == 1:
                    if tx < 32:
                        T.get_warp(T.address_of(A[off]), T.address_of(B[off]), n, src_pe=pe, unroll_factor=2)
                elif mode == 2:
                    T.put_block(T.address_of(A[off]), T.address_of(B[off]), n, dst_pe=pe)
                else:
                    T.get_block(T.address_of(A[off]), T.address_of(B[off]), n, src_pe=pe)

        return copies

    return _compile(("copy", dtype), build)


def rows_copy_kernel(dtype: str):
    """mode 0 put_rows_block (unroll 4), 1 get_rows_block (unroll 8): ``rows`` rows of ``row``
    elements, ``ss`` / ``ds`` apart in A / B, from element ``off`` of both."""

    def build():
        @T.prim_func
        def row_copies(A: T.Tensor((NMAX,), dtype), B: T.Tensor((NMAX,), dtype), rows: T.int32, row: T.int32,
                       ss: T.int32, ds: T.int32, pe: T.int32, mode: T.int32, off: T.int32):
            with T.Kernel(1, threads=256) as _:
                _unused = T.alloc_local((1,), dtype)  # noqa: F841 (keeps dtype in the closure)
                if mode == 0:
                    T.put_rows_block(T.address_of(A[off]), T.address_of(B[off]), rows, row, ss, ds, dst_pe=pe)
                else:
                    T.get_rows_block(T.address_of(A[off]), T.address_of(B[off]), rows, row, ss, ds, src_pe=pe,
                                     unroll_factor=8)

        return row_copies

    return _compile(("rows", dtype), build)


def remote_copy_kernel():
    """T.copy with dst_pe (put through shared memory) and with src_pe (get), 2-D tiles."""

    def build():
        @T.prim_func
        def rcopy(A: T.Tensor((64, 256), "float32"), B: T.Tensor((64, 256), "float32"), C: T.Tensor((64, 256), "float32"), pe: T.int32):
            with T.Kernel(4, threads=128) as bx:
                s = T.alloc_shared((16, 256), "float32")
                T.copy(A[bx * 16 : bx * 16 + 16, :], s)
                T.copy(s, B[bx * 16 : bx * 16 + 16, :], dst_pe=pe)
                T.copy(A[bx * 16 : bx * 16 + 16, :], C[bx * 16 : bx * 16 + 16, :], src_pe=pe)

        return rcopy

    return _compile(("rcopy",), build)


def rank_kernel(backend: str = "tvm_ffi"):
    def build():
        @T.prim_func
        # Two parameters: stock tilelang 0.1.15's nvrtc launcher builds a malformed
        # kernelParams tuple for a kernel with a single parameter (a stock bug).
        def ranks(R: T.Tensor((2,), "int32"), Scale: T.int32):
            with T.Kernel(1, threads=32) as _:
                R[0] = T.get_rank() * Scale
                R[1] = T.get_num_ranks() * Scale

        return ranks

    return _compile(("rank", backend), build, execution_backend=backend)


def exchange_kernel():
    """ld/st/atom_add/notify/wait between ring neighbours, one thread per rank."""

    def build():
        @T.prim_func
        def exchange(Flag: T.Tensor((4,), "uint32"), Data: T.Tensor((4,), "uint64"), Cnt: T.Tensor((4,), "uint32"), Out: T.Tensor((8,), "uint64"), step: T.int32):
            with T.Kernel(1, threads=32) as _:
                tx = T.get_thread_binding()
                if tx == 0:
                    me = T.get_rank()
                    n = T.get_num_ranks()
                    nxt = (me + 1) % n
                    prv = (me + n - 1) % n
                    v = T.alloc_var("uint64")
                    T.st(Data[0], step * 100 + me, scope="sys", sem="relaxed", dst_pe=nxt)
                    T.st(Flag[0], step, scope="sys", sem="release", dst_pe=nxt)
                    Out[3] = T.wait_eq(Flag[0], step)
                    T.ld(Data[0], v, scope="sys", sem="acquire")
                    Out[0] = v
                    T.ld(Data[0], v, scope="sys", sem="relaxed", src_pe=nxt)
                    Out[1] = v
                    T.notify(Cnt[0], 0, 1, sig_op="add")
                    Out[2] = T.atom_add(Cnt[1], 1, scope="sys", sem="acq_rel")
                    if me == 0:
                        T.wait_ge(Cnt[0], step * n, scope="gpu")
                    T.wait_ge(Flag[0], step, peer=prv)
                    T.wait_lt(Flag[1], 1)
                    T.wait_ne(Data[1], 1, semantics="volatile")
                    T.ld(Flag[0], v, nc=True, na=True)
                    Out[4] = v

        return exchange

    return _compile(("exchange",), build)


def barrier_blocks_kernel():
    def build():
        @T.prim_func
        def bblocks(Bar: T.Tensor((8,), "uint32"), Cnt: T.Tensor((4,), "uint32"), Err: T.Tensor((4,), "int32"), iters: T.int32):
            with T.Kernel(GRID, threads=128) as _:
                tx = T.get_thread_binding()
                v = T.alloc_var("uint32")
                for i in T.serial(iters):
                    if tx == 0:
                        for p in T.serial(T.get_num_ranks()):
                            T.notify(Cnt[0], p, 1, sig_op="add")
                    T.barrier_blocks(Bar)
                    if tx == 0:
                        T.ld(Cnt[0], v, scope="sys", sem="acquire")
                        if v < T.Cast("uint32", (i + 1) * GRID * T.get_num_ranks()):
                            Err[0] = 1
                for i in T.serial(8):
                    T.sync_blocks(Bar)

        return bblocks

    return _compile(("barrier_blocks",), build)


def grid_barrier_kernel():
    """The two-word GPU barrier under repetition (the one-word test's kernel, two words)."""
    import gpu_upstream_kernels

    assert gpu_upstream_kernels.GRID == GPU_GRID
    return _compile(("grid_barrier",), lambda: gpu_upstream_kernels.repeated_barrier(words=2))


# ------------------------------------------------------------------------------ rank bodies
def _seed(tag: int, rank: int, step: int) -> int:
    return (tag * 1_000_003 + rank * 7919 + step) & 0x7FFFFFFF


def _random(n: int, dtype, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(0, 255, (n,), generator=g, dtype=torch.int32).to(dtype)


def rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Everything one rank checks; returns a report (errors collected, not raised)."""
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device

    dev = rank_device(rank)  # cuda:0 when ranks share one GPU; its own GPU otherwise
    torch.cuda.set_device(dev)
    alloc = tilelang.get_allocator(size=2**27, device=dev, is_distributed=True, local_rank=rank, num_local_ranks=world, group=dist.group.WORLD)
    report: dict = {"rank": rank, "errors": [], "checks": 0}

    def check(cond, what):
        report["checks"] += 1
        if not cond:
            report["errors"].append(what)

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    # No collective after a failure: a rank that raises skips the closing barrier, and
    # run_ranks reports its traceback and stops the peers (a barrier here would pair with a
    # different collective on the peers and hang instead).
    _copies(rank, world, alloc, check, sync)
    _row_copies(rank, world, alloc, check, sync)
    _remote_copy(rank, world, alloc, check, sync)
    _exchange(rank, world, alloc, check, sync)
    _barriers(rank, world, alloc, check, sync)
    sync()
    alloc.close()
    return report


def _copies(rank, world, alloc, check, sync):
    import torch

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    names = {0: "put_warp", 1: "get_warp", 2: "put_block", 3: "get_block"}
    for dtype_name, tdtype in (("uint8", torch.uint8), ("float16", torch.float16), ("float32", torch.float32)):
        k = copy_kernel(dtype_name).initialize(allocator=alloc)
        A = tilelang.tensor((NMAX,), tdtype, allocator=alloc)
        B = tilelang.tensor((NMAX,), tdtype, allocator=alloc)
        step = 0
        for n in (1, 3, 8, 31, 257, 4096 + 5, 65536, NMAX - 16):
            for off in (0, 1):
                for mode in range(4):
                    step += 1
                    poison = torch.full((NMAX,), 7, dtype=tdtype)
                    a = _random(NMAX, tdtype, _seed(mode, rank, step))
                    A.copy_(a)
                    B.copy_(poison)
                    sync()
                    put = mode in (0, 2)
                    k(A, B, n, nxt if put else prv, mode, off)
                    sync()
                    # put: my B holds prv's A; get: my B holds prv's A (read from prv)
                    src_rank = prv
                    expect = poison.clone()
                    expect[off : off + n] = _random(NMAX, tdtype, _seed(mode, src_rank, step))[off : off + n]
                    got = B.cpu()
                    check(torch.equal(got.view(torch.uint8) if tdtype.itemsize == 1 else got, expect), f"{names[mode]} {dtype_name} n={n} off={off} world={world}")
        # PE -1 at run time is local
        A.copy_(_random(NMAX, tdtype, 99))
        B.fill_(0)
        sync()
        k(A, B, 100, -1, 2, 0)
        sync()
        check(torch.equal(B[:100].cpu(), A[:100].cpu()), f"run-time pe=-1 local {dtype_name}")
        sync()


#: (rows, row, src stride, dst stride) of the strided copies: one word, rows narrower and wider
#: than a round of 256 threads, gaps on either side, odd sizes (1-, 2-, 4-, 8-byte words) and
#: a long run of 1 KiB rows (an all-to-all's head slices).
ROW_CASES = [(1, 1, 1, 1), (3, 5, 7, 5), (7, 8, 8, 24), (40, 64, 512, 64), (40, 64, 64, 512), (129, 300, 301, 300),
             (999, 520, 1040, 520)]


def _row_copies(rank, world, alloc, check, sync):
    import torch

    prv, nxt = (rank - 1) % world, (rank + 1) % world
    for dtype_name, tdtype in (("uint8", torch.uint8), ("float16", torch.float16), ("float32", torch.float32)):
        k = rows_copy_kernel(dtype_name).initialize(allocator=alloc)
        A = tilelang.tensor((NMAX,), tdtype, allocator=alloc)
        B = tilelang.tensor((NMAX,), tdtype, allocator=alloc)
        for step, (rows, row, ss, ds) in enumerate(ROW_CASES):
            r = torch.arange(rows).repeat_interleave(row)
            c = torch.arange(row).repeat(rows)
            for off in (0, 1):
                for mode in (0, 1):
                    poison = torch.full((NMAX,), 7, dtype=tdtype)
                    A.copy_(_random(NMAX, tdtype, _seed(20 + mode, rank, step)))
                    B.copy_(poison)
                    sync()
                    k(A, B, rows, row, ss, ds, nxt if mode == 0 else prv, mode, off)
                    sync()
                    # put: my B holds prv's rows (prv put them); get: my B holds prv's rows (read from prv)
                    expect = poison.clone()
                    expect[off + r * ds + c] = _random(NMAX, tdtype, _seed(20 + mode, prv, step))[off + r * ss + c]
                    got = B.cpu()
                    check(torch.equal(got, expect), f"{('put', 'get')[mode]}_rows_block {dtype_name} rows={rows} "
                          f"row={row} ss={ss} ds={ds} off={off} world={world}")
        sync()


def _remote_copy(rank, world, alloc, check, sync):
    import torch

    k = remote_copy_kernel().initialize(allocator=alloc)
    A = tilelang.tensor((64, 256), torch.float32, allocator=alloc)
    B = tilelang.tensor((64, 256), torch.float32, allocator=alloc)
    C = tilelang.tensor((64, 256), torch.float32, allocator=alloc)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for step in range(3):
        A.copy_(_random(64 * 256, torch.float32, _seed(7, rank, step)).view(64, 256))
        B.fill_(-1)
        C.fill_(-1)
        sync()
        k(A, B, C, nxt)  # B on nxt <- my A; my C <- A on nxt
        sync()
        check(torch.equal(B.cpu().flatten(), _random(64 * 256, torch.float32, _seed(7, prv, step))), f"T.copy dst_pe step {step}")
        check(torch.equal(C.cpu().flatten(), _random(64 * 256, torch.float32, _seed(7, nxt, step))), f"T.copy src_pe step {step}")
        sync()


def _exchange(rank, world, alloc, check, sync):
    import torch

    k = exchange_kernel()
    k.initialize(allocator=alloc, stream=torch.cuda.current_stream().cuda_stream)
    Flag = tilelang.tensor((4,), torch.uint32, allocator=alloc)
    Data = tilelang.tensor((4,), torch.uint64, allocator=alloc)
    Cnt = tilelang.tensor((4,), torch.uint32, allocator=alloc)
    Out = torch.zeros(8, dtype=torch.uint64, device=alloc.device)
    for t in (Flag, Data, Cnt):
        t.zero_()
    sync()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for step in range(1, 6):
        k(Flag, Data, Cnt, Out, step)
        sync()
        o = [int(x) for x in Out.view(torch.int64).cpu()]
        check(o[0] == step * 100 + prv, f"exchange st/wait/ld step {step}: {o[0]}")
        check(o[1] == step * 100 + rank, f"exchange remote ld step {step}: {o[1]}")
        check(o[2] == step - 1, f"exchange atom_add old value step {step}: {o[2]}")
        check(o[3] == step and o[4] == step, f"exchange wait return / nc ld step {step}: {o[3]} {o[4]}")
        sync()
    if rank == 0:
        check(int(Cnt[0].item()) == 5 * world, f"notify add total {int(Cnt[0].item())}")


def _barriers(rank, world, alloc, check, sync):
    import torch

    kb = barrier_blocks_kernel().initialize(allocator=alloc)
    Bar = tilelang.tensor((8,), torch.uint32, allocator=alloc)
    Cnt = tilelang.tensor((4,), torch.uint32, allocator=alloc)
    Err = torch.zeros(4, dtype=torch.int32, device=alloc.device)
    Bar.zero_()
    Cnt.zero_()
    sync()
    kb(Bar, Cnt, Err, 1000)
    sync()
    check(int(Err[0].item()) == 0, "barrier_blocks x1000 ordering")
    check(int(Cnt[0].item()) == 1000 * GRID * world, f"barrier_blocks count {int(Cnt[0].item())}")
    sync()  # every rank has read its count before any rank's relaunch adds to it
    kb(Bar, Cnt, Err, 10)  # repeated launches reuse the counters (no reset)
    sync()
    check(int(Err[0].item()) == 0, "barrier_blocks relaunch")
    # Every rank compiles (a cache hit after the first); only rank 0 runs it.
    kg = grid_barrier_kernel().initialize(allocator=alloc)
    if rank == 0:
        GB = torch.zeros(2, dtype=torch.uint32, device=alloc.device)
        Slots = torch.zeros(GPU_GRID, dtype=torch.int32, device=alloc.device)
        Err.zero_()
        for launch in range(3):
            kg(GB, Slots, Err, 500, launch * 500)
        torch.cuda.synchronize()
        check(int(Err[0].item()) == 0, "grid barrier ordering")
    sync()


def initialize_orders_body(rank: int, world: int, cache_dir: str) -> dict:
    """initialize after the first launch, before it, and on nvrtc / cython."""
    os.environ["TILESCALE_CACHE_DIR_UNUSED"] = ""
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    alloc = tilelang.get_allocator(size=2**24, device=dev, is_distributed=True, local_rank=rank, num_local_ranks=world, group=dist.group.WORLD)
    out: dict = {}
    # no collective after a failure (see rank_body)
    R = torch.full((2,), -5, dtype=torch.int32, device=dev)
    k = rank_kernel("tvm_ffi")
    try:  # refused on the host: the table is empty until initialize
        k(R, 1)
        torch.cuda.synchronize()
        out["before_init"] = R.tolist()
    except Exception as exc:
        out["before_init"] = f"{type(exc).__name__}: {exc}"[:500]
    out["untouched"] = R.tolist()
    k.initialize(allocator=alloc)
    k(R, 1)
    torch.cuda.synchronize()
    out["after_load_init"] = R.tolist()
    for backend in ("nvrtc", "cython"):
        try:
            kb = rank_kernel(backend).initialize(allocator=alloc)
            R.fill_(-5)
            kb(R, 1)
            torch.cuda.synchronize()
            out[backend] = R.tolist()
        except Exception as exc:  # reported, asserted by the test
            out[backend] = f"{type(exc).__name__}: {exc}"[:500]
    torch.cuda.synchronize()
    dist.barrier()
    alloc.close()
    return out


def trap_tail(call: str, extra: str = "") -> str:
    """The end of a script that expects ``call`` to fail on the device: the call, a
    synchronisation, ``HOST-ERROR: <type> <message>`` and exit status 3 when it raised, else
    ``NO-ERROR`` (then ``extra``, a Python expression, printed beside it)."""
    shown = f", {extra}" if extra else ""
    return (f"try:\n    {call}\n    torch.cuda.synchronize()\nexcept Exception as exc:\n"
            f"    print(\"HOST-ERROR:\", type(exc).__name__, str(exc)[:300], flush=True)\n    sys.exit(3)\n"
            f"print(\"NO-ERROR\"{shown}, flush=True)\n")


TIMEOUT_SCRIPT = r"""
import os, sys, torch, tilelang, tilelang.language as T
@T.prim_func
def stuck(F: T.Tensor((4,), "uint32")):
    with T.Kernel(2, threads=32) as _:
        T.wait_eq(F[1], 12345)
k = tilelang.compile(stuck, target={"kind": "cuda", "arch": "sm_90a"})
F = torch.zeros(4, dtype=torch.uint32, device="cuda")
""" + trap_tail('k(F)')


# A kernel launched around the host guard (as a stale or foreign launcher could) must trap on
# the device instead of treating every peer as itself.
NO_TABLE_SCRIPT = r"""
import sys, torch, tilelang, tilelang.language as T
@T.prim_func
def peer_store(F: T.Tensor((4,), "uint32"), pe: T.int32):
    with T.Kernel(1, threads=32) as _:
        T.st(F[0], 7, dst_pe=pe)
k = tilelang.compile(peer_store, target={"kind": "cuda", "arch": "sm_90a"})
F = torch.zeros(4, dtype=torch.uint32, device="cuda")
try:
    k(F, 0)
except Exception as exc:
    print("HOST-REFUSED:", type(exc).__name__, flush=True)
launch = k._tilescale_state["unguarded"]  # bypass the host guard on purpose
""" + trap_tail('launch(F, 0)', 'F.tolist()')

# A run-time PE beyond num_ranks, compiled with TILESCALE_CHECK_PE=1: a trap naming it.
BAD_PE_SCRIPT = r"""
import sys, torch, tilelang, tilelang.language as T
@T.prim_func
def peer_store(F: T.Tensor((4,), "uint32"), pe: T.int32):
    with T.Kernel(2, threads=32) as _:
        T.st(F[0], 7, dst_pe=pe)
alloc = tilelang.get_allocator(size=2**20, device="cuda", is_distributed=False)
k = tilelang.compile(peer_store, target={"kind": "cuda", "arch": "sm_90a"}).initialize(allocator=alloc)
F = tilelang.tensor((4,), torch.uint32, allocator=alloc)
F.zero_()
k(F, 0)  # in range: rank 0 of 1
torch.cuda.synchronize()
print("IN-RANGE", F.tolist(), flush=True)
""" + trap_tail('k(F, 5)')


# A negative run-time copy size, compiled with TILESCALE_CHECK_PE=1: a trap naming it.
NEGATIVE_SIZE_SCRIPT = r"""
import sys, torch, tilelang, tilelang.language as T
@T.prim_func
def put(A: T.Tensor((256,), "float32"), B: T.Tensor((256,), "float32"), n: T.int32, pe: T.int32):
    with T.Kernel(2, threads=128) as _:
        T.put_block(A, B, n - 100, dst_pe=pe)
alloc = tilelang.get_allocator(size=2**20, device="cuda", is_distributed=False)
k = tilelang.compile(put, target={"kind": "cuda", "arch": "sm_90a"}).initialize(allocator=alloc)
A = tilelang.tensor((256,), torch.float32, allocator=alloc)
B = tilelang.tensor((256,), torch.float32, allocator=alloc)
A.fill_(3.0)
B.zero_()
k(A, B, 164, 0)  # 64 elements to rank 0 of 1
torch.cuda.synchronize()
print("COPIED", int((B == 3.0).sum()), flush=True)
""" + trap_tail('k(A, B, 50, 0)  # -50 elements')

# ------------------------------------------------------------------------------ profiler
PROFILER_SCRIPT = r"""
import json, sys, torch, tilelang, tilelang.language as T
from tilescale_lang.profiler import EventProfiler

BLOCKS, WARPS = 8, 4
prof = EventProfiler(blocks=BLOCKS, capacity=4, device="cuda")

@T.prim_func
def work(A: T.Tensor((BLOCKS * 128,), "float32"), Prof: T.Tensor((BLOCKS, 9), "uint64")):
    with T.Kernel(BLOCKS, threads=128) as bx:
        tx = T.get_thread_binding()
        if tx % 32 == 0:
            T.profile_event(Prof, tx // 32, is_start=True)
        for _ in T.serial(1000):
            A[bx * 128 + tx] = A[bx * 128 + tx] * 1.0001 + 1.0
        if tx % 32 == 0:
            T.profile_event(Prof, tx // 32, is_start=False)
            T.profile_event(Prof, 7, is_start=True)   # 3 records per warp and 4 warps: 12 > 4 slots
            T.profile_event(Prof, 7, is_start=False)

k = tilelang.compile(work, target={"kind": "cuda", "arch": "sm_90a"})
A = torch.zeros(BLOCKS * 128, device="cuda")
k(A, prof.buffer)
torch.cuda.synchronize()
events, dropped = prof.events()
spans, unmatched = prof.spans()
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(json.dumps({"events": len(events), "dropped": dropped, "spans": len(spans), "unmatched": len(unmatched),
                  "blocks": sorted({e.block for e in events}), "sm_ok": all(e.sm < sms for e in events),
                  "durations_ok": all(0 <= s.duration_ns < 10**9 for s in spans),
                  "trace_events": len(prof.chrome_trace(["w0", "w1", "w2", "w3"])["traceEvents"])}))
prof.reset()
print(json.dumps({"after_reset": len(prof.events()[0])}))

fixed = EventProfiler(blocks=BLOCKS, capacity=2 * WARPS, device="cuda")

@T.prim_func
def phases(A: T.Tensor((BLOCKS * 128,), "float32"), Prof: T.Tensor((BLOCKS, 17), "uint64")):
    with T.Kernel(BLOCKS, threads=128) as bx:
        tx = T.get_thread_binding()
        if tx % 32 == 0:  # caller-chosen slots: warp w's start in slot 2w, its end in 2w + 1
            T.profile_event(Prof, tx // 32, is_start=True, slot=tx // 32 * 2)
        for _ in T.serial(1000):
            A[bx * 128 + tx] = A[bx * 128 + tx] * 1.0001 + 1.0
        if tx % 32 == 0:
            T.profile_event(Prof, tx // 32, is_start=False, slot=tx // 32 * 2 + 1)

tilelang.compile(phases, target={"kind": "cuda", "arch": "sm_90a"})(A, fixed.buffer)
torch.cuda.synchronize()
events, dropped = fixed.events()
spans, unmatched = fixed.spans()
print(json.dumps({"fixed_events": len(events), "fixed_dropped": dropped, "fixed_spans": len(spans),
                  "fixed_unmatched": len(unmatched), "fixed_counter": int(fixed.buffer.view(torch.int64)[:, 0].abs().sum()),
                  "fixed_pairs_ok": all(s.task == s.warp and 0 <= s.duration_ns < 10**9 for s in spans)}))
"""
