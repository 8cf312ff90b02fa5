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

This module is the command line and the drivers; what runs is in :mod:`tilescale_examples._demo`
(:mod:`~tilescale_examples._demo.cases`: the cases and their baselines;
:mod:`~tilescale_examples._demo.ranks`: the rank bodies).
``--verbose`` shows what is quiet by default: TileLang's two log lines per kernel compile
("begins to compile", "completes") and every rank's log messages (by default only rank 0's,
so that a message every rank logs alike, such as a plan fallback, prints once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tilescale_examples._demo.cases import CASES, Case, Row, _Built, poison_then_stage
from tilescale_examples._demo.ranks import (RANK_LOGGERS, compile_rank, gpu_rank, kernels_of, progress,
                                            quiet_logs)
from tilescale_examples.benchmarks._report import format_table

__all__ = ["CASES", "Case", "Row", "doctor_summary", "kernels_of", "main", "poison_then_stage", "quiet_logs",
           "run_compile", "run_gpu", "render", "RANK_LOGGERS"]

#: Ranks when there are no GPUs (compile mode) or one GPU (ranks share it).
MIN_RANKS = 2
#: Deadline of the rank processes, seconds.
RANK_TIMEOUT_S = 300
COMPILE_HEADERS = ["op", "size", "kernels", "compile s"]
GPU_HEADERS = ["op", "size", "TileScale us", "baseline us", "ratio", "check"]


# ------------------------------------------------------------------------------ doctor
def doctor_summary() -> list[str]:
    """The doctor's short summary: TileScale and key package versions, toolkit, torch's CUDA
    build, GPUs and each memory path (``tilescale_core.doctor``)."""
    from tilescale_core import doctor

    keep = ("tilescale", "tilelang ", "torch ", "cuda-bindings ", "python ")
    lines = [line for line in doctor.package_lines() if line.startswith(keep)]
    return lines + doctor.cuda_lines() + doctor.gpu_lines() + doctor.memory_path_lines()



# ------------------------------------------------------------------------------ drivers
def run_compile(out_dir: Path, verbose: bool = False) -> tuple[str, list[dict]]:
    """Compile mode (no GPU): ``(title, rows)``; sources and binaries go under ``out_dir``."""
    from tilescale_core.multiprocess import run_ranks

    cache = out_dir / "tilelang-cache"
    cache.mkdir(parents=True, exist_ok=True)
    env = {"TILELANG_CACHE_DIR": str(cache)}
    os.environ.update(env)  # the spawned ranks inherit it
    rows = run_ranks(compile_rank, MIN_RANKS, args=(str(cache), verbose), backend="gloo", timeout=RANK_TIMEOUT_S, env=env)[0]
    title = (f"no GPU here: the demo's kernels lowered and compiled by nvcc for sm_90a, as for "
             f"{MIN_RANKS} ranks (each object built by {MIN_RANKS} ranks over a host-memory heap)")
    return title, rows


def run_gpu(gpus: int, iters: int, verbose: bool = False) -> tuple[str, list[dict]]:
    """GPU mode: ``(title, rows)`` from one rank per GPU (2 sharing when there is one)."""
    from tilescale_core.multiprocess import auto_backend, run_ranks

    world = max(MIN_RANKS, gpus)
    backend = auto_backend(world, gpus, share=False)
    env = {"TILESCALE_SHARE_GPUS": "1" if gpus < world else "0"}
    rows = run_ranks(gpu_rank, world, args=(iters, verbose), backend=backend, timeout=RANK_TIMEOUT_S, env=env)[0]
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
    progress("doctor: versions, toolkit, GPUs, memory paths")
    summary = doctor_summary()
    print("\n".join(f"  {line}" for line in summary), flush=True)
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        mode = "gpu"
        progress(f"{gpus} GPU(s): {max(MIN_RANKS, gpus)} ranks run {len(CASES)} cases")
        title, rows = run_gpu(gpus, args.iters, args.verbose)
    else:
        mode = "compile"
        import tempfile

        out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tilescale-demo-"))
        progress(f"no GPU: {MIN_RANKS} ranks lower and compile {len(CASES)} cases into {out_dir}")
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
