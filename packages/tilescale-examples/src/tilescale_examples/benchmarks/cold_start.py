"""Cold start: the serving ops' kernels compiled into an empty cache against loaded from a precompiled one.

``python -m tilescale_examples.benchmarks.cold_start [--cache DIR] [--compile-only] [--ops NAME ...]
[--bytes 4096] [--dtype bfloat16|float16] [--sm-count N] [--out DIR]``

A serving process builds its ops when it starts. On an empty TileLang cache each constructor
compiles its kernels with nvcc (seconds each, and a toolkit on every serving machine); with a
cache filled beforehand by :func:`~tilescale_examples.testing.precompile.precompile_op` (on a
build machine with nvcc, no GPU needed) it loads them: no nvcc, no lowering. Two fresh
processes, one after the other:

1. **compile**: ``precompile_op`` of every op below at world 1, for GPUs of ``--sm-count`` SMs
   (default: the visible GPU's, else 132), into ``--cache`` (default: a new temporary
   directory, which must be empty): the seconds each op's kernels take to compile, what its
   constructor pays on an empty cache. Needs no GPU; ``--compile-only`` stops here. The times are kept in the cache
   as ``cold_start.json``; a later run given that cache (the same ops, sizes, SM count and
   versions) prints them instead of compiling again (the table's title says so).
2. **load** (one GPU): one rank with ``TILELANG_CACHE_DIR`` the cache builds each op and calls
   it once (its kernels loaded, the first launch made), timed: the construction and the call
   to its end on the GPU (the op's outputs are poisoned between them, untimed); the result is
   checked against torch on a fresh random input (the launch benchmark's check; the GEMM's
   by its relative error) and the files the op added to the cache are counted (0 where the
   cache served every kernel).

The ops: those of :mod:`~tilescale_examples.benchmarks.launch` (``AllReduce`` one-shot,
``AllGather``, ``AllToAll``, ``ReduceScatter``, ``AllReduceResidualRMSNorm``, MoE dispatch +
combine of 128 tokens; ``--bytes`` per call) and the demo's ``AllGatherGEMM`` (512 rows,
k = n = 4096); ``--ops`` names some of them (their row names).

The goal (issue 47): the load phase's total at most 2 s.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._report import print_table

__all__ = ["HEADERS", "GOAL_LOAD_S", "RECORD", "AG_GEMM", "specs", "signature", "read_record", "rows", "main"]

HEADERS = ["op", "kernels", "compile s (empty cache)", "load s (precompiled)", "compile / load", "files added",
           "check"]
#: The goal: every op of :func:`specs` built and called once in at most this many seconds.
GOAL_LOAD_S = 2.0
#: The compile phase's record, kept in the cache directory.
RECORD = "cold_start.json"
#: The demo's AllGatherGEMM row: m_local rows, k, n.
AG_GEMM, AG_SHAPE = "AllGatherGEMM 512x4096x4096", (512, 4096, 4096)


def specs(numel: int, dtype) -> dict:
    """``{name: (cls, args, kwargs)}``: the ops built (``cls(allocator, *args, world_size=1,
    **kwargs)``), those of :func:`~tilescale_examples.benchmarks.launch.op_specs` for
    ``numel`` elements of ``dtype`` but its rows of the MoE dispatch alone and its decode-size
    GEMMs, and the demo's AllGatherGEMM."""
    from tilescale_examples.benchmarks.launch import GEMM_AR_ROW, GEMM_ROWS, MOE_DISPATCH_ROW, op_specs
    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM

    # the dispatch's kernel is the MoE row's; the demo's GEMM below
    launch_only = (MOE_DISPATCH_ROW, *GEMM_ROWS, GEMM_AR_ROW)
    serving = {name: spec for name, spec in op_specs(numel, dtype).items() if name not in launch_only}
    return {**serving, AG_GEMM: (AllGatherGEMM, AG_SHAPE + (dtype,), {})}


def signature(names, numel: int, dtype_name: str, sm_count: int) -> dict:
    """What a compile record must match to be reused: the ops ``names``, the size, the SM
    count and the versions of TileLang and the TileScale packages (their kernels and compile
    flags)."""
    from importlib.metadata import version

    return {"ops": list(names), "numel": numel, "dtype": dtype_name,
            "sm_count": sm_count,
            "versions": {p: version(p) for p in ("tilelang", "tilescale-lang", "tilescale-examples")}}


def read_record(cache: Path, wanted: dict) -> dict | None:
    """The compile phase's record in ``cache`` when its signature is ``wanted``, else None."""
    try:
        record = json.loads((cache / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if record.get("signature") == wanted else None


def _compile_phase(cache: str, names, numel: int, dtype_name: str, sm_count: int) -> dict:
    """Worker body (a fresh process): the kernels of the ops ``names`` compiled into
    ``cache``; ``{name: {"kernels", "compile_s"}}``."""
    import torch

    from tilescale_examples.testing.precompile import precompile_op

    out, every = {}, specs(numel, getattr(torch, dtype_name))
    for name in names:
        cls, args, kwargs = every[name]
        start = time.perf_counter()
        symbols = precompile_op(cls, *args, world_size=1, sm_count=sm_count, cache_dir=cache, **kwargs)
        out[name] = {"kernels": len(set(symbols)), "compile_s": time.perf_counter() - start}
    return out


def compile_all(cache: Path, names, numel: int, dtype_name: str, sm_count: int) -> dict:
    """The compile phase of the ops ``names`` in a fresh (spawned) process; writes and
    returns the record."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        ops = pool.submit(_compile_phase, str(cache), list(names), numel, dtype_name, sm_count).result()
    record = {"signature": signature(names, numel, dtype_name, sm_count), "ops": ops, "host": platform.node(),
              "date": time.strftime("%Y-%m-%d")}
    (cache / RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")
    return record


def _files(cache: Path) -> set:
    """Every file under ``cache`` (relative paths)."""
    return {str(Path(d, f).relative_to(cache)) for d, _, names in os.walk(cache) for f in names}


def _load_rank(rank: int, world: int, group, device, cache: str, names, numel: int, dtype_name: str) -> dict:
    """Rank body (one rank, a fresh process): ``{name: (seconds, files added, check)}`` of
    the ops ``names``."""
    import torch

    import tilelang
    from tilescale_examples.benchmarks.launch import _ops, compare, compare_gemm, gemm_run, heap_bytes, poison_outputs
    from tilescale_examples.overlap import ag_gemm

    dtype = getattr(torch, dtype_name)
    m, k, _ = AG_SHAPE
    size = heap_bytes(numel, dtype) + ag_gemm.heap_bytes(1, m, k, dtype)
    alloc = tilelang.get_allocator(size=size, local_rank=rank, num_local_ranks=world, group=group)
    ops = _ops(alloc, numel, dtype, group, device)
    cls, args, kwargs = specs(numel, dtype)[AG_GEMM]
    ops[AG_GEMM] = (lambda: cls(alloc, *args, world_size=1, group=group, **kwargs),) + gemm_run(AG_SHAPE, dtype, device)
    root, out = Path(cache), {}
    for name in names:
        make, make_input, call, reference = ops[name]
        x = make_input()
        want = reference(x)
        before = _files(root)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        op = make()
        built = time.perf_counter()
        poison_outputs(op)  # not timed
        torch.cuda.synchronize(device)
        called = time.perf_counter()
        got = call(op, x)
        torch.cuda.synchronize(device)
        seconds = built - start + time.perf_counter() - called
        check = compare_gemm(got, want) if name == AG_GEMM else compare(got, want)
        out[name] = (seconds, len(_files(root) - before), check)
        op.close()
    return out


def rows(record: dict, loaded: dict) -> list:
    """The table's rows (one per op of the record, then the total) from the compile record and
    the load phase's ``{name: (seconds, files added, check)}``."""
    out, compile_total, load_total = [], 0.0, 0.0
    for name, entry in record["ops"].items():
        seconds, added, check = loaded.get(name, (float("nan"), "n/a", "not run"))
        compile_total += entry["compile_s"]
        load_total += seconds
        out.append([name, entry["kernels"], round(entry["compile_s"], 2), round(seconds, 3),
                    round(entry["compile_s"] / seconds, 1) if seconds > 0 else "n/a", added, check])
    out.append(["total", sum(e["kernels"] for e in record["ops"].values()), round(compile_total, 2),
                round(load_total, 3), round(compile_total / load_total, 1) if load_total > 0 else "n/a",
                sum(r[5] for r in out if isinstance(r[5], int)),
                "ok" if all(r[6] == "ok" for r in out) else "FAILED"])
    return out


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed or the load
    phase compiled a kernel."""
    p = _harness.parser("cold_start", __doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=None, help="the precompiled cache (default: a new temporary one)")
    p.add_argument("--compile-only", action="store_true", help="only the compile phase (no GPU needed)")
    p.add_argument("--ops", nargs="+", default=None, metavar="NAME", help="some of the ops, by row name")
    p.add_argument("--bytes", type=int, default=4096, help="bytes per call of the collectives")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sm-count", type=int, default=None, help="SMs of the GPUs compiled for (default: this GPU's, "
                                                               "else 132)")
    args = _harness.parse_args(p, argv)
    if args.bytes < 16 or args.bytes % 16 or (args.sm_count is not None and args.sm_count < 1):
        p.error("--bytes must be a positive multiple of 16 and --sm-count positive")
    import tempfile

    import torch

    numel = args.bytes // getattr(torch, args.dtype).itemsize
    every = list(specs(numel, getattr(torch, args.dtype)))
    names = args.ops or every
    unknown = [n for n in names if n not in every]
    if unknown:
        p.error(f"--ops: no op named {unknown} (ops: {every})")
    gpus = torch.cuda.device_count()
    if gpus == 0 and not args.compile_only:
        print("cold start benchmark: no CUDA GPU visible, nothing to measure (--compile-only times the compile "
              "phase alone)")
        return 0
    sm_count = args.sm_count or (torch.cuda.get_device_properties(0).multi_processor_count if gpus else 132)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="tilescale-cold-start-"))
    cache.mkdir(parents=True, exist_ok=True)
    record = read_record(cache, signature(names, numel, args.dtype, sm_count))
    reused = record is not None
    if record is None and _files(cache):
        p.error(f"--cache {cache} holds files but no compile record of these ops (its {RECORD}): the compile "
                "phase times compiles into an empty directory; give a new or empty one")
    if record is None:
        print(f"[benchmark] compiling the ops' kernels into {cache} (a fresh process)", file=sys.stderr)
        record = compile_all(cache, names, numel, args.dtype, sm_count)
    if args.compile_only:
        print_table(f"cold start: compile phase into {cache} ({sm_count} SMs)", HEADERS[:3],
                    [[name, e["kernels"], round(e["compile_s"], 2)] for name, e in record["ops"].items()])
        return 0
    os.environ["TILELANG_CACHE_DIR"] = str(cache)  # the spawned rank's cache
    loaded = _harness.run_on_ranks(_load_rank, 1, str(cache), list(names), numel, args.dtype)[0]
    table = rows(record, loaded)
    where = (f"compile times from the record of {record['date']} on {record['host']}" if reused
             else "both phases in this run")
    print_table(f"cold start on {torch.cuda.get_device_name(0)}, world 1: kernels compiled into an empty cache "
                f"against loaded from it ({where})", HEADERS, table)
    total = table[-1][3]
    print(f"\ngoal: load total {total} s <= {GOAL_LOAD_S} s: {'met' if total <= GOAL_LOAD_S else 'NOT met'}")
    failed = table[-1][6] != "ok" or table[-1][5] != 0
    print(f"correctness: {'ok' if table[-1][6] == 'ok' else 'FAILED'}; files the load phase added to the cache: "
          f"{table[-1][5]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
