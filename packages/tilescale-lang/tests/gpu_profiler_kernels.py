"""A profiled all-gather for the profiler's multi-rank GPU test: every block puts its part of
this rank's chunk to every rank with a signal (task "put"), then waits for the same part
from every rank (task "wait"); each rank saves its Perfetto trace with one time origin.

Importable by spawned rank processes (no pytest import)."""

# (no `from __future__ import annotations`: TileLang evaluates the kernels' annotations)

import os

import tilelang
import tilelang.language as T

from lang_gpu_helpers import Checks, open_rank

TARGET = {"kind": "cuda", "arch": "sm_90a"}
MAX_RANKS = 8
BLOCKS = 4
CHUNK = 1 << 16  # float32 elements per rank
CAPACITY = 8  # events per block and launch
TASKS = ["put", "wait"]
CALLS = 3


def profiled_allgather_kernel():
    part = CHUNK // BLOCKS

    @T.prim_func
    def profiled_allgather(Src: T.Tensor((CHUNK,), "float32"), Dst: T.Tensor((MAX_RANKS * CHUNK,), "float32"),
                           Sig: T.Tensor((MAX_RANKS * BLOCKS,), "uint64"),
                           Prof: T.Tensor((BLOCKS, 1 + 2 * CAPACITY), "uint64"), epoch: T.int64):
        with T.Kernel(BLOCKS, threads=256) as bx:
            tx = T.get_thread_binding()
            me = T.get_rank()
            n = T.get_num_ranks()
            if tx == 0:
                T.profile_event(Prof, 0, is_start=True)
            for p in T.serial(n):
                T.put_signal_block(Src[bx * part], Dst[me * CHUNK + bx * part], part, Sig[me * BLOCKS + bx],
                                   epoch, "set", (me + p) % n)
            if tx == 0:
                T.profile_event(Prof, 0, is_start=False)
                T.profile_event(Prof, 1, is_start=True)
            if tx < n:
                T.signal_wait_until(Sig[tx * BLOCKS + bx], "ge", epoch)
            T.sync_threads()
            if tx == 0:
                T.profile_event(Prof, 1, is_start=False)

    return profiled_allgather


def _chunk(rank: int, call: int):
    import torch

    return torch.rand(CHUNK, generator=torch.Generator().manual_seed(1000 * call + rank))


def profiled_allgather_body(rank: int, world: int, cache_dir: str, out_dir: str) -> dict:
    """``CALLS`` profiled all-gathers with fresh data into a poisoned output, each checked;
    the last call's trace is saved as ``out_dir/trace-rank{rank}.json`` with the origin shared
    by every rank (ranks on one GPU read one ``%globaltimer``)."""
    import torch
    import torch.distributed as dist

    from tilescale_lang.profiler import EventProfiler

    alloc, sync = open_rank(rank, world, cache_dir)
    check = Checks()
    kernel = tilelang.compile(profiled_allgather_kernel(), target=TARGET, compile_once=True)
    kernel.initialize(allocator=alloc)
    src = tilelang.tensor((CHUNK,), torch.float32, allocator=alloc)
    dst = tilelang.tensor((MAX_RANKS * CHUNK,), torch.float32, allocator=alloc)
    sig = tilelang.tensor((MAX_RANKS * BLOCKS,), torch.uint64, allocator=alloc)
    sig.zero_()
    prof = EventProfiler(blocks=BLOCKS, capacity=CAPACITY, device=src.device)
    for call in range(1, CALLS + 1):
        src.copy_(_chunk(rank, call).to(src.device))
        dst.fill_(float("nan"))
        prof.reset()
        sync()  # every rank's poison is in place before any peer writes
        kernel(src, dst, sig, prof.buffer, call)
        sync()
        want = torch.cat([_chunk(r, call) for r in range(world)])
        check(torch.equal(dst[:world * CHUNK].cpu(), want), f"call {call}: gathered data differs from every rank's chunk")
    spans, unmatched = prof.spans()
    events, dropped = prof.events()
    starts = [None] * world
    dist.all_gather_object(starts, min(s.start_ns for s in spans))
    path = os.path.join(out_dir, f"trace-rank{rank}.json")
    prof.save(path, task_names=TASKS, rank=rank, origin_ns=min(starts))
    sync()
    alloc.close()
    return dict(check.report, path=path, spans=[(s.block, s.task, s.start_ns, s.end_ns) for s in spans],
                unmatched=len(unmatched), dropped=dropped, events=len(events))
