"""``python -m tilescale_examples.benchmarks [NAME ...] [--out DIR]``: run every benchmark (or
the named ones), each in its own process, and print one summary line per benchmark. ``--out
DIR`` is passed on to each: every table is also saved into ``DIR`` (``<name>.csv``,
``<name>.json`` and, with matplotlib, ``<name>.png``; ``<name>`` is the benchmark's, then
``<name>_2``, ... for its later tables).

Without a CUDA GPU there is nothing to measure: it prints one line per benchmark saying so and
exits 0. With GPUs it exits 1 when any benchmark failed (a wrong output or a crash).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from tilescale_examples.benchmarks import BENCHMARKS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tilescale_examples.benchmarks",
                                description="Run TileScale's benchmarks, each in its own process.")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="passed on to every benchmark: save every table into DIR (CSV, JSON, PNG with matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in ``argv`` (default: all of :data:`BENCHMARKS`), passing
    ``--out DIR`` on to each."""
    args = _parser().parse_args(argv)
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        for name in names:
            print(f"{name}: skipped: no CUDA GPU visible, nothing to measure (run it on a GPU machine)")
        return 0
    summary = []
    for name in names:
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", f"tilescale_examples.benchmarks.{name}"]
                             + ([] if args.out is None else ["--out", args.out]))
        summary.append((name, rc, time.perf_counter() - start))
    print("\n== benchmarks")
    for name, rc, seconds in summary:
        print(f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} ({seconds:.0f} s)")
    return 0 if all(rc == 0 for _, rc, _ in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
