"""``python -m tilescale_examples.demo [--json PATH] [--out DIR] [--iters N]``: TileScale at work
on whatever this machine has (``nox -s demo`` runs it from a clean clone).

1. The doctor's short summary: versions, toolkit, GPUs, and which memory paths work here
   (and why not).
2. **With GPUs**: one rank per visible GPU (at least 2; with one GPU, 2 ranks share it over a
   gloo group, and the table's title says that the times are time-sliced). The ranks run the
   quick-start ring put (:mod:`tilescale_examples.tutorials.ring_put`), then
   :class:`~tilescale_examples.collectives.allgather.AllGather`,
   :class:`~tilescale_examples.collectives.allreduce.AllReduce` and
   :class:`~tilescale_examples.overlap.ag_gemm.AllGatherGEMM`, two sizes each, against the
   torch.distributed baseline measured in the same run (NCCL when every rank has its own GPU).
   Every output is checked against the baseline's on fresh random data, with the output
   poisoned first. One table: op, size, TileScale time, baseline time, ratio, check. Exit 1
   when a check failed.
3. **Without a GPU**: the same objects are built by 2 ranks over a host-memory heap (gloo),
   so the same kernels are lowered and compiled by nvcc for sm_90a; the table says how long
   each compile took and where the CUDA source and binaries went. Exit 0, with one line
   saying what a GPU machine adds.

``--json PATH`` writes the rows (and the mode, title and doctor summary) as JSON.
``--verbose`` shows what is quiet by default: TileLang's two log lines per kernel compile
("begins to compile", "completes") and every rank's log messages (by default only rank 0's,
so that a message every rank logs alike, such as a plan fallback, prints once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tilescale_examples.benchmarks._report import format_bytes, format_table, ratio

__all__ = ["CASES", "Case", "Row", "doctor_summary", "kernels_of", "main", "poison_then_stage", "quiet_logs",
           "run_compile", "run_gpu"]

#: Ranks when there are no GPUs (compile mode) or one GPU (ranks share it).
MIN_RANKS = 2
#: Deadline of the rank processes, seconds.
RANK_TIMEOUT_S = 300
#: Device-side wait timeout in the ranks (a lost signal traps instead of hanging).
WAIT_TIMEOUT_MS = "30000"
COMPILE_HEADERS = ["op", "size", "kernels", "compile s"]
GPU_HEADERS = ["op", "size", "TileScale us", "baseline us", "ratio", "check"]


@dataclass(frozen=True)
class Case:
    """One row of the demo: ``op`` at ``size`` (elements per rank, or ``m_local`` rows for
    AllGatherGEMM), with its dtype."""

    op: str
    size: int
    dtype: str

    def label(self, world: int) -> str:
        """The size column: total bytes moved per rank, or the GEMM's shape."""
        if self.op == "AllGatherGEMM":
            return f"{world * self.size}x{GEMM_N}x{GEMM_K}"
        itemsize = _ITEMSIZE[self.dtype]
        total = self.size * itemsize * (world if self.op == "all-gather" else 1)
        return format_bytes(total)


#: Columns and reduction dimension of the AllGatherGEMM cases.
GEMM_N, GEMM_K = 4096, 4096
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
#: Every row, in order: the ring put, then two sizes of each collective.
CASES = (
    Case("ring put", 1 << 16, "float32"),
    Case("ring put", 1 << 22, "float32"),
    Case("all-gather", 1 << 18, "float16"),     # per-rank shard elements
    Case("all-gather", 1 << 24, "float16"),
    Case("all-reduce", 1 << 19, "float16"),     # tensor elements
    Case("all-reduce", 1 << 25, "float16"),
    Case("AllGatherGEMM", 512, "bfloat16"),     # m_local rows
    Case("AllGatherGEMM", 2048, "bfloat16"),
)


@dataclass
class Row:
    """One result: ``kernels``, the distinct compiled kernels the op's object holds
    (:func:`kernels_of`: compiled now or found in TileLang's cache); compile mode also fills
    ``compile_s`` and ``files`` (what the build added to the cache); GPU mode the times
    (microseconds), ``ratio`` (baseline / TileScale: above 1, TileScale is faster),
    ``baseline`` (what ran) and ``check``."""

    op: str
    size: str
    kernels: int = 0
    compile_s: float = 0.0
    files: list = field(default_factory=list)
    tilescale_us: float = float("nan")
    baseline_us: float = float("nan")
    ratio: float = float("nan")
    baseline: str = ""
    check: str = ""


def _progress(message: str) -> None:
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
    containers and through objects of the examples (and of this module), e.g. an
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
        elif hasattr(x, "__dict__") and (type(x).__module__ == __name__
                                         or type(x).__module__.startswith("tilescale_examples")):
            todo.extend(vars(x).values())
    return len(found)


# ------------------------------------------------------------------------------ doctor
def doctor_summary() -> list[str]:
    """The doctor's short summary: TileScale and key package versions, toolkit, torch's CUDA
    build, GPUs and each memory path (``tilescale_core.doctor``)."""
    from tilescale_core import doctor

    keep = ("tilescale", "tilelang ", "torch ", "cuda-bindings ", "python ")
    lines = [line for line in doctor.package_lines() if line.startswith(keep)]
    return lines + doctor.cuda_lines() + doctor.gpu_lines() + doctor.memory_path_lines()


# ------------------------------------------------------------------------------ adapter
# The only place the demo touches the examples' classes and kernel builders: each maker
# builds one case through the public constructor and returns (object, call, inputs,
# baseline, tolerance). ``call(inputs)`` runs TileScale and returns the output;
# ``baseline(inputs, out)`` writes the torch.distributed result into ``out``.
class _Built:
    def __init__(self, obj, call, inputs, baseline_name, baseline, tol, output):
        self.obj, self.call, self.inputs = obj, call, inputs
        self.baseline_name, self.baseline, self.tol, self.output = baseline_name, baseline, tol, output

    def close(self) -> None:
        close = getattr(self.obj, "close", None)
        if close is not None:
            close()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _random(shape, dtype, seed: int):
    from tilescale_examples.benchmarks._collectives import random_input
    import torch

    return random_input(shape, _torch_dtype(dtype), torch.Generator().manual_seed(seed))


class _RingPut:
    """The quick-start kernel (``ring_put.build_ring_put``) on two symmetric tensors."""

    def __init__(self, alloc, n: int, dtype: str):
        import tilelang

        from tilescale_examples.base import TARGET
        from tilescale_examples.tutorials.ring_put import build_ring_put

        self.kernel = tilelang.compile(build_ring_put(n, dtype), target=TARGET, compile_once=True)
        self.kernel.initialize(allocator=alloc)
        self.src = tilelang.tensor((n,), _torch_dtype(dtype), allocator=alloc)
        self.dst = tilelang.tensor((n,), _torch_dtype(dtype), allocator=alloc)

    def __call__(self, src):
        self.kernel(src, self.dst)
        return self.dst

    def close(self) -> None:
        self.kernel = self.src = self.dst = None


def _ring_baselines():
    def p2p(dist, group, rank, world, x, out):
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world, group),
                                       dist.P2POp(dist.irecv, out, (rank - 1) % world, group)])
        for req in reqs:
            req.wait()

    def gather_select(dist, group, rank, world, x, out):
        import torch

        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        out.copy_(parts[(rank - 1) % world])

    def gather_select_host(dist, group, rank, world, x, out):
        import torch

        staged = x.cpu()  # a backend without CUDA tensors (gloo, ranks sharing a GPU)
        parts = [torch.empty_like(staged) for _ in range(world)]
        dist.all_gather(parts, staged, group=group)
        out.copy_(parts[(rank - 1) % world])

    return (("batch_isend_irecv ring", p2p), ("all_gather + select", gather_select),
            ("all_gather through host memory + select", gather_select_host))


def _gemm_baselines():
    def into_tensor(dist, group, gathered, a):
        dist.all_gather_into_tensor(gathered, a, group=group)

    def views(dist, group, gathered, a):
        dist.all_gather(list(gathered.chunk(dist.get_world_size(group))), a, group=group)

    def through_host(dist, group, gathered, a):
        import torch

        staged = a.cpu()  # a backend without CUDA tensors (gloo, ranks sharing a GPU)
        parts = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, staged, group=group)
        gathered.copy_(torch.cat(parts))

    return (("all_gather_into_tensor + matmul", into_tensor), ("all_gather + matmul", views),
            ("all_gather through host memory + matmul", through_host))


def _first_working(candidates, probe) -> tuple[str, Callable]:
    """The first ``(name, fn)`` of ``candidates`` for which ``probe(fn)`` is true (a backend
    may lack an operation, e.g. gloo's P2P on CUDA tensors); every rank probes alike."""
    for name, fn in candidates:
        try:
            if probe(fn):
                return name, fn
        except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError):
            pass
    raise RuntimeError(f"no torch.distributed baseline works on this group (tried {[n for n, _ in candidates]})")


def build_case(case: Case, alloc, group, rank: int, world: int, device, with_baseline: bool) -> _Built:
    """Build ``case`` through the examples' public API (collective: every rank, same order).
    ``with_baseline`` False (compile mode) skips inputs and baselines."""
    import torch

    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.collectives.allgather import AllGather
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.benchmarks import _collectives as C

    dtype = _torch_dtype(case.dtype)
    seed = rank * 7919 + case.size % 1000003
    if case.op == "ring put":
        obj = _RingPut(alloc, case.size, case.dtype)
        if not with_baseline:
            return _Built(obj, None, None, "", None, None, None)
        import torch.distributed as dist

        x = obj.src
        x.copy_(_random(x.shape, case.dtype, seed))
        prev = (rank - 1) % world
        expected = _random(x.shape, case.dtype, prev * 7919 + case.size % 1000003)  # what rank - 1 sends

        plain = x.clone()  # the baseline's input: ordinary torch memory, as a torch user has

        def probe(fn):
            out = torch.zeros_like(plain)
            fn(dist, group, rank, world, plain, out)
            torch.cuda.synchronize(device)
            return bool(torch.equal(out.cpu(), expected))

        candidates = _ring_baselines()
        if dist.get_backend(group) != "nccl":  # gloo: collectives first, P2P on CUDA tensors last
            candidates = candidates[1:] + candidates[:1]
        name, fn = _first_working(candidates, probe)
        return _Built(obj, obj, (x,), name, lambda xs, out: fn(dist, group, rank, world, plain, out), None, obj.dst)
    if case.op == "all-gather":
        obj = AllGather(alloc, (case.size,), dtype, group=group)
        op = C.OPS["allgather"]
    elif case.op == "all-reduce":
        obj = AllReduce(alloc, (case.size,), dtype, group=group)
        op = C.OPS["allreduce"]
    elif case.op == "AllGatherGEMM":
        obj = AllGatherGEMM(alloc, case.size, GEMM_K, GEMM_N, dtype, group=group)
        if not with_baseline:
            return _Built(obj, None, None, "", None, None, None)
        import torch.distributed as dist

        a = _random((case.size, GEMM_K), case.dtype, seed).to(device)
        b = (_random((GEMM_K, GEMM_N), case.dtype, seed + 1).float() / GEMM_K ** 0.5).to(dtype).to(device)
        gathered = torch.empty((world * case.size, GEMM_K), dtype=dtype, device=device)

        def probe(fn):
            fn(dist, group, gathered, a)
            torch.cuda.synchronize(device)
            return bool(torch.equal(gathered[rank * case.size:(rank + 1) * case.size], a))

        name, fn = _first_working(_gemm_baselines(), probe)

        def baseline(xs, out):
            fn(dist, group, gathered, xs[0])
            torch.matmul(gathered, xs[1], out=out)

        return _Built(obj, lambda a_, b_: obj(a_, b_), (a, b), name, baseline, (2e-2, 2e-2), obj.output)
    else:
        raise ValueError(f"unknown op {case.op!r}")
    if not with_baseline:
        return _Built(obj, None, None, "", None, None, None)
    x = obj.input
    x.copy_(_random(x.shape, case.dtype, seed))
    plain = x.clone()  # the baseline's input: ordinary torch memory (a gloo group takes no heap tensors)
    name, fn = C.pick_baseline(op, group, device, dtype)
    tol = C.tolerance(op, case.dtype, world)
    return _Built(obj, obj, (x,), name, lambda xs, out: fn(out.view(-1), plain.reshape(-1)), tol, obj.output)


# ------------------------------------------------------------------------------ rank bodies
def _heap_bytes(world: int) -> int:
    """Symmetric heap per rank for every case (the heap returns bytes only at close)."""
    total = 64 << 20
    for case in CASES:
        item = _ITEMSIZE[case.dtype]
        if case.op == "AllGatherGEMM":
            from tilescale_examples.overlap.ag_gemm import heap_bytes

            total += heap_bytes(world, case.size, GEMM_K, _torch_dtype(case.dtype))
        elif case.op == "all-reduce":
            total += 4 * (case.size + world) * item * 2
        else:
            total += (world + 1) * case.size * item
        total += 2 * world * 1024 * 8 + 4096
    return total


def _compile_rank(rank: int, world: int, cache_dir: str, verbose: bool = False) -> list[dict] | None:
    """Compile mode: build every case on a host-memory heap (no kernel runs); rank 0 times
    each build, counts its kernels and lists the files it added to TileLang's cache."""
    import torch.distributed as dist

    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    group = dist.group.WORLD
    quiet_logs(rank, verbose)
    alloc = BaseAllocator(_heap_bytes(world), device="cpu", is_distributed=True, local_rank=rank,
                          num_local_ranks=world, group=group, backend=HostBackend())
    rows = []
    try:
        for i, case in enumerate(CASES, 1):
            label = case.label(world)
            if rank == 0:
                _progress(f"step {i}/{len(CASES)}: lower + nvcc compile {case.op} {label} (sm_90a)")
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


def poison_then_stage(built: _Built) -> None:
    """Poison ``built.output`` with NaN (a missed element cannot pass the check), then write
    the inputs again: an output may share memory with an input (the two-shot all-reduce
    returns its staging buffer, which is also ``input``), and a user writes the input after
    whatever the output held."""
    fresh = [x.clone() for x in built.inputs]
    built.output.fill_(float("nan"))
    for x, value in zip(built.inputs, fresh):
        x.copy_(value)


def _gpu_rank(rank: int, world: int, iters: int, verbose: bool = False) -> list[dict] | None:
    """GPU mode: every case built, checked against its baseline and timed; rank 0 returns the rows."""
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device
    from tilescale_examples.benchmarks._collectives import outputs_match, time_ms
    from tilescale_examples.base import collective_device

    quiet_logs(rank, verbose)
    os.environ.setdefault("TILESCALE_WAIT_TIMEOUT_MS", WAIT_TIMEOUT_MS)
    device = torch.device(rank_device(rank))
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    flag_device = collective_device(group, device)
    alloc = tilelang.get_allocator(size=_heap_bytes(world), device=device, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=group)
    rows = []
    try:
        for i, case in enumerate(CASES, 1):
            label = case.label(world)
            if rank == 0:
                _progress(f"step {i}/{len(CASES)}: {case.op} {label}: build, check, time")
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


# ------------------------------------------------------------------------------ drivers
def run_compile(out_dir: Path, verbose: bool = False) -> tuple[str, list[dict]]:
    """Compile mode (no GPU): ``(title, rows)``; sources and binaries go under ``out_dir``."""
    from tilescale_core.multiprocess import run_ranks

    cache = out_dir / "tilelang-cache"
    cache.mkdir(parents=True, exist_ok=True)
    env = {"TILELANG_CACHE_DIR": str(cache)}
    os.environ.update(env)  # the spawned ranks inherit it
    rows = run_ranks(_compile_rank, MIN_RANKS, args=(str(cache), verbose), backend="gloo", timeout=RANK_TIMEOUT_S, env=env)[0]
    title = (f"no GPU here: the demo's kernels lowered and compiled by nvcc for sm_90a, as for "
             f"{MIN_RANKS} ranks (each object built by {MIN_RANKS} ranks over a host-memory heap)")
    return title, rows


def run_gpu(gpus: int, iters: int, verbose: bool = False) -> tuple[str, list[dict]]:
    """GPU mode: ``(title, rows)`` from one rank per GPU (2 sharing when there is one)."""
    from tilescale_core.multiprocess import auto_backend, run_ranks

    world = max(MIN_RANKS, gpus)
    backend = auto_backend(world, gpus, share=False)
    env = {"TILESCALE_SHARE_GPUS": "1" if gpus < world else "0"}
    rows = run_ranks(_gpu_rank, world, args=(iters, verbose), backend=backend, timeout=RANK_TIMEOUT_S, env=env)[0]
    if backend == "nccl":
        mode = f"{world} ranks, one per GPU; baseline torch.distributed over NCCL"
    else:
        mode = (f"{world} ranks SHARING {gpus} GPU: times are time-sliced, NOT a speed measurement; "
                f"baseline torch.distributed over {backend}")
    title = f"TileScale vs torch, same run: {mode}; ratio = baseline / TileScale (above 1: TileScale faster)"
    return title, rows


def render(mode: str, title: str, rows: list[dict]) -> str:
    """The table (and, in compile mode, the files of each row)."""
    if mode == "gpu":
        body = format_table(GPU_HEADERS, [[r["op"], r["size"], r["tilescale_us"], r["baseline_us"], r["ratio"],
                                           r["check"]] for r in rows])
        names = sorted({f"{r['op']}: {r['baseline']}" for r in rows})
        return f"== {title}\n{body}\nbaselines: " + "; ".join(names)
    body = format_table(COMPILE_HEADERS, [[r["op"], r["size"], r["kernels"], r["compile_s"]] for r in rows])
    root = os.path.commonpath([f for r in rows for f in r["files"]]) if any(r["files"] for r in rows) else ""
    files = [f"  {r['op']} {r['size']}: " + (", ".join(os.path.relpath(f, root) for f in r["files"])
                                             or "no new files (kernels found in the cache)") for r in rows]
    return (f"== {title}\n{body}\nkernels: the distinct compiled kernels each object holds (compiled now "
            f"or found in TileLang's cache)\nCUDA sources (device_kernel.cu) and binaries (kernel.cubin; executable.so "
            f"embeds it) under {root}:\n" + "\n".join(files))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tilescale_examples.demo", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the rows (and mode, title, doctor summary) as JSON")
    p.add_argument("--out", metavar="DIR", help="compile mode: where sources and binaries go "
                                                "(default: a new directory under the system's temp dir)")
    p.add_argument("--iters", type=int, default=10, help="GPU mode: timed calls per row (default 10)")
    p.add_argument("--verbose", action="store_true", help="show TileLang's compile log lines and every rank's "
                                                          "log messages (default: rank 0's warnings only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 unless a GPU check failed."""
    args = _parser().parse_args(argv)
    if args.iters < 1:
        _parser().error("--iters must be >= 1")
    quiet_logs(0, args.verbose)
    start = time.perf_counter()
    _progress("doctor: versions, toolkit, GPUs, memory paths")
    summary = doctor_summary()
    print("\n".join(f"  {line}" for line in summary), flush=True)
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        mode = "gpu"
        _progress(f"{gpus} GPU(s): {max(MIN_RANKS, gpus)} ranks run {len(CASES)} cases")
        title, rows = run_gpu(gpus, args.iters, args.verbose)
    else:
        mode = "compile"
        import tempfile

        out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tilescale-demo-"))
        _progress(f"no GPU: {MIN_RANKS} ranks lower and compile {len(CASES)} cases into {out_dir}")
        title, rows = run_compile(out_dir.resolve(), args.verbose)
    print("\n" + render(mode, title, rows), flush=True)
    failed = [r for r in rows if mode == "gpu" and r["check"] != "ok"]
    if mode == "compile":
        print("\nOn a GPU machine the same command runs these kernels on one rank per GPU, checks every "
              "output against torch.distributed and times both in the same run.")
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s"
          + (f"; {len(failed)} check(s) FAILED" if failed else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": mode, "title": title, "doctor": summary, "rows": rows},
                                              indent=2, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
