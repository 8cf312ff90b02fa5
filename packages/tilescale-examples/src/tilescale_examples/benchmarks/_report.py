"""Formatting helpers shared by the benchmarks: sizes, bandwidths, ratios and tables.

Every benchmark prints one table whose last column(s) compare a TileScale measurement with a
baseline measured in the same run (torch, NCCL or cuBLAS).

Every table goes through :func:`print_table`. After :func:`save_tables` (what a benchmark's
``--out DIR`` does, see :func:`tilescale_examples.benchmarks._harness.parse_args`) it also
saves each table it prints into that directory
(:func:`~tilescale_examples.benchmarks._export.export_table`: ``<name>.csv``, ``<name>.json``
and, with matplotlib, the chart ``<name>.png``), named after the benchmark: ``putget``, then
``putget_2``, ``putget_3`` for its later tables (the names of the published samples).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["format_bytes", "gb_per_s", "ratio", "format_table", "print_table", "print_checked", "print_outcome",
           "collect", "worst_line", "size_sweep", "save_tables", "table_name"]


def format_bytes(nbytes: int) -> str:
    """Return ``nbytes`` as a short binary-unit string: ``4 KiB``, ``64 MiB``, ``1 GiB``."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def gb_per_s(nbytes: float, milliseconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second) of moving ``nbytes`` in ``milliseconds``."""
    if milliseconds <= 0:
        raise ValueError(f"milliseconds must be > 0, got {milliseconds}")
    return nbytes / (milliseconds * 1e-3) / 1e9


def ratio(measured: float, baseline: float) -> float:
    """``measured / baseline``; NaN when the baseline is zero."""
    return float("nan") if baseline == 0 else measured / baseline


def size_sweep(lo: int, hi: int, factor: int = 4) -> list[int]:
    """Sizes in bytes from ``lo`` to ``hi`` inclusive, multiplying by ``factor``."""
    if lo <= 0 or hi < lo or factor < 2:
        raise ValueError(f"need 0 < lo <= hi and factor >= 2, got {lo}, {hi}, {factor}")
    sizes = []
    n = lo
    while n <= hi:
        sizes.append(n)
        n *= factor
    return sizes


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return a fixed-width text table; floats get 3 decimals (1 above 100)."""
    cells = [[_cell(v) for v in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells for {len(headers)} headers")
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


class _Saving:
    """Where :func:`print_table` saves its tables (``out_dir`` None: nowhere), the benchmark
    they are named after and how many it has saved."""

    out_dir: Path | None = None
    benchmark: str = ""
    count: int = 0


def save_tables(out_dir: str | Path | None, benchmark: str = "") -> None:
    """From now on, :func:`print_table` also saves every table it prints into ``out_dir``
    (None: stops saving), as :func:`table_name` of ``benchmark``; the count starts again."""
    if out_dir is not None and not benchmark:
        raise ValueError("save_tables needs the benchmark's name (the tables' file names)")
    _Saving.out_dir = None if out_dir is None else Path(out_dir)
    _Saving.benchmark, _Saving.count = benchmark, 0


def table_name(benchmark: str, index: int) -> str:
    """The file stem of a benchmark's ``index``-th table (1-based): ``benchmark`` for the
    first, ``benchmark_<index>`` after it."""
    if index < 1:
        raise ValueError(f"index must be >= 1, got {index}")
    return benchmark if index == 1 else f"{benchmark}_{index}"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]],
                file: TextIO | None = None) -> list[Path]:
    """Print ``title`` and the table to ``file`` (stdout by default), then flush. After
    :func:`save_tables`, also save it (CSV, JSON, PNG) and say where in one line; returns
    the paths saved (none without :func:`save_tables`)."""
    out = file or sys.stdout
    print(f"\n== {title}", file=out)
    print(format_table(headers, rows), file=out)
    paths: list[Path] = []
    if _Saving.out_dir is not None:
        from tilescale_examples.benchmarks._export import export_table

        _Saving.count += 1
        name = table_name(_Saving.benchmark, _Saving.count)
        paths = export_table(_Saving.out_dir, name, title, headers, rows)
        print(f"saved: {', '.join(p.name for p in paths)} in {_Saving.out_dir}", file=out)
    out.flush()
    return paths


def print_checked(tables: dict, title, headers: Sequence[str], failures: Sequence[str], goals: Sequence[str],
                  reference: str, args: Any, device_name: str) -> None:
    """A fused op's emulated-peer report: one table per key of ``tables``, titled
    ``<title(key)>, emulated peers (one <device_name>), <args.dtype>; GPU time per call of
    <args.iters> back-to-back calls, mean over the emulated ranks``, the first 20
    ``failures``, the ``goals`` lines, then the verdict line ``correctness (every rank's
    fused output against <reference>): ok`` (or the failure count)."""
    for key, rows in tables.items():
        print_table(f"{title(key)}, emulated peers (one {device_name}), {args.dtype}; GPU time per call of "
                    f"{args.iters} back-to-back calls, mean over the emulated ranks", headers, rows)
    for failure in list(failures)[:20]:
        print("FAILED:", failure)
    for line in goals:
        print(line)
    verdict = "ok" if not failures else f"{len(failures)} FAILURE(S)"
    print(f"correctness (every rank's fused output against {reference}): {verdict}")


def collect(results: Iterable[tuple]) -> tuple[list, list]:
    """``(rows, failures)`` of a sweep's ``results``: pairs ``(rows, failures)`` of its cases,
    each case's ``rows`` a list of table rows."""
    rows, failures = [], []
    for case_rows, case_failures in results:
        rows += case_rows
        failures += case_failures
    return rows, failures


def worst_line(label: str, values: Sequence[float], goal: float, higher_is_better: bool = True) -> str:
    """A goal's line: ``<label>: <worst of values> (goal >= <goal>)`` (the smallest value, or
    the largest with ``goal <=`` when ``higher_is_better`` is False), or ``<label>: not
    measured`` when ``values`` is empty."""
    values = [v for v in values if isinstance(v, float)]
    if not values:
        return f"{label}: not measured"
    worst, sign = (min(values), ">=") if higher_is_better else (max(values), "<=")
    return f"{label}: {worst:.3f} (goal {sign} {goal})"


def print_outcome(failures: Sequence[str], goals: Sequence[str], checked: str) -> int:
    """A benchmark's last lines: every failure (``FAILED: ...``), the ``goals`` lines, then the
    verdict ``correctness (<checked>): ok`` (or the failure count); returns the exit status
    (0, or 1 when anything failed)."""
    for failure in failures:
        print("FAILED:", failure)
    for line in goals:
        print(line)
    print(f"correctness ({checked}): {'ok' if not failures else f'{len(failures)} FAILURE(S)'}")
    return 1 if failures else 0
