"""``python -m tilescale_examples.benchmarks [NAME ...]``: run every benchmark (or the named
ones), each in its own process, and print one summary line per benchmark.

Without a CUDA GPU there is nothing to measure: it prints one line per benchmark saying so and
exits 0. With GPUs it exits 1 when any benchmark failed (a wrong output or a crash).
"""

from __future__ import annotations

import subprocess
import sys
import time

from tilescale_examples.benchmarks import BENCHMARKS

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in ``argv`` (default: all of :data:`BENCHMARKS`)."""
    names = list(sys.argv[1:] if argv is None else argv) or list(BENCHMARKS)
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
        rc = subprocess.call([sys.executable, "-m", f"tilescale_examples.benchmarks.{name}"])
        summary.append((name, rc, time.perf_counter() - start))
    print("\n== benchmarks")
    for name, rc, seconds in summary:
        print(f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} ({seconds:.0f} s)")
    return 0 if all(rc == 0 for _, rc, _ in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
