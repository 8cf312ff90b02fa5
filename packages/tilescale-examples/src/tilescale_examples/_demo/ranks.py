"""The demo's rank bodies: :func:`compile_rank` (no GPU: every case built over a host-memory
heap, so its kernels are lowered and compiled by nvcc) and :func:`gpu_rank` (every case
checked against its torch.distributed baseline, then both timed), with the logging
(:func:`quiet_logs`) and kernel counting (:func:`kernels_of`) around them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from tilescale_examples._demo.cases import CASES, Row, build_case, heap_bytes, poison_then_stage
from tilescale_examples.benchmarks._report import ratio

__all__ = ["RANK_LOGGERS", "quiet_logs", "kernels_of", "progress", "compile_rank", "gpu_rank"]

#: Device-side wait timeout in the ranks (a lost signal traps instead of hanging).
WAIT_TIMEOUT_MS = "30000"


def progress(message: str) -> None:
    """One progress line of the demo, with the time."""
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


#: Loggers whose messages print from rank 0 only (unless ``--verbose``).
RANK_LOGGERS = ("tilescale_examples", "tilescale_core", "tilescale_lang", "tilescale_host", "tilelang")


def quiet_logs(rank: int = 0, verbose: bool = False) -> None:
    """The demo's logging, in the demo's processes only (the libraries' defaults stay as they
    are elsewhere): TileLang's INFO lines (two per kernel compile) off unless ``verbose``; on a
    rank other than 0, the loggers of :data:`RANK_LOGGERS` at ERROR unless ``verbose``, so that
    what every rank logs alike (a plan fallback warning) prints once, from rank 0."""
    import tilelang  # its import sets its logger to INFO: set the level after it

    logging.getLogger(tilelang.__name__).setLevel(logging.INFO if verbose else logging.WARNING)
    if rank != 0 and not verbose:
        for name in RANK_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def _is_jit_kernel(obj) -> bool:
    from tilelang.jit.kernel import JITKernel

    return isinstance(obj, JITKernel)


def kernels_of(obj, is_kernel: Callable[[Any], bool] | None = None) -> int:
    """How many distinct compiled kernels ``obj`` holds: its attributes, followed through
    containers and through objects of the examples (the demo's included), e.g. an
    AllGatherGEMM's own GEMM and its AllGather's kernel. A kernel TileLang found in its cache
    counts like one it compiled (a count of new cubin files would miss it)."""
    is_kernel = _is_jit_kernel if is_kernel is None else is_kernel
    found, seen, todo = set(), set(), [obj]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if is_kernel(x):
            found.add(id(x))
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(x)
        elif hasattr(x, "__dict__") and type(x).__module__.startswith("tilescale_examples"):
            todo.extend(vars(x).values())
    return len(found)



def _steps(rank: int, world: int, doing: str):
    """Every case of :data:`CASES` with its label on ``world`` ranks; rank 0 first prints a
    progress line, ``step i/n: doing`` (``doing`` formatted with the case's ``op`` and ``label``)."""
    for i, case in enumerate(CASES, 1):
        label = case.label(world)
        if rank == 0:
            progress(f"step {i}/{len(CASES)}: {doing.format(op=case.op, label=label)}")
        yield case, label


def compile_rank(rank: int, world: int, cache_dir: str, verbose: bool = False) -> list[dict] | None:
    """Compile mode: build every case on a host-memory heap (no kernel runs); rank 0 times
    each build, counts its kernels and lists the files it added to TileLang's cache."""
    import torch.distributed as dist

    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    group = dist.group.WORLD
    quiet_logs(rank, verbose)
    alloc = BaseAllocator(heap_bytes(world, "cpu"), device="cpu", is_distributed=True, local_rank=rank,
                          num_local_ranks=world, group=group, backend=HostBackend())
    rows = []
    try:
        for case, label in _steps(rank, world, "lower + nvcc compile {op} {label} (sm_90a)"):
            before = _files(cache_dir)
            start = time.perf_counter()
            built = build_case(case, alloc, group, rank, world, "cpu", with_baseline=False)
            seconds = time.perf_counter() - start
            kernels = kernels_of(built.obj)
            built.close()
            dist.barrier(group)
            new = sorted(set(_files(cache_dir)) - set(before))
            wanted = [f for f in new if f.endswith((".cu", ".cubin", ".so")) and not f.endswith("host_kernel.cu")]
            rows.append(asdict(Row(case.op, label, kernels=kernels, compile_s=seconds, files=wanted)))
    finally:
        alloc.close()
    return rows if rank == 0 else None


def _files(root: str) -> list[str]:
    return [str(p) for p in Path(root).rglob("*") if p.is_file()]


def gpu_rank(rank: int, world: int, iters: int, verbose: bool = False) -> list[dict] | None:
    """GPU mode: every case built, checked against its baseline and timed; rank 0 returns the rows."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device
    from tilescale_examples.benchmarks._collectives import outputs_match
    from tilescale_examples.benchmarks._timing import time_ms
    from tilescale_examples.base import collective_device

    quiet_logs(rank, verbose)
    os.environ.setdefault("TILESCALE_WAIT_TIMEOUT_MS", WAIT_TIMEOUT_MS)
    device = torch.device(rank_device(rank))
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    flag_device = collective_device(group, device)
    alloc = tilelang.get_allocator(size=heap_bytes(world, device), device=device, is_distributed=True,
                                   local_rank=rank, num_local_ranks=world, group=group)
    rows = []
    try:
        for case, label in _steps(rank, world, "{op} {label}: build, check, time"):
            built = build_case(case, alloc, group, rank, world, device, with_baseline=True)
            ref = torch.empty_like(built.output)
            built.baseline(built.inputs, ref)
            poison_then_stage(built)
            torch.cuda.synchronize(device)
            dist.barrier(group)  # every rank's poison is in place before any peer writes
            out = built.call(*built.inputs)
            torch.cuda.synchronize(device)
            dist.barrier(group)  # every peer's writes have landed
            ok = outputs_match(out.float(), ref.float(), built.tol) if built.tol else torch.equal(out, ref)
            bad = torch.tensor([0 if ok else 1], dtype=torch.int32, device=flag_device)
            dist.all_reduce(bad, group=group)
            ts_ms = time_ms(lambda: built.call(*built.inputs), iters, group, device)
            ref_ms = time_ms(lambda: built.baseline(built.inputs, ref), iters, group, device)
            failed = int(bad.item())
            rows.append(asdict(Row(case.op, label, kernels=kernels_of(built.obj), tilescale_us=ts_ms * 1e3,
                                   baseline_us=ref_ms * 1e3,
                                   ratio=ratio(ref_ms, ts_ms), baseline=built.baseline_name,
                                   check="ok" if failed == 0 else f"FAIL ({failed} rank(s))")))
            built.close()
            del ref, out
        torch.cuda.synchronize(device)
        dist.barrier(group)
    finally:
        alloc.close()
    return rows if rank == 0 else None

