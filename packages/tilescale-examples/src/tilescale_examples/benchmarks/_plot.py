"""Charts of benchmark tables (records of :mod:`~tilescale_examples.benchmarks._export`) and of
profiler traces; needs matplotlib (``pip install "tilescale-examples[plot]"``).

The chart follows from the headers (:func:`chart_kind`):

- ``"lines"``: a size column (``size`` with cells such as ``"4 KiB"``, or numeric bytes) or a
  ``tokens`` column on a log-2 x axis; a panel of the bandwidth columns (``... GB/s``) and one of
  the ratio columns (``ratio``, ``x ...``, ``vs ...``, ``speedup``, ``A/B``), or of the time
  columns (``... us``) when there are neither. One line per column and group, a group being one
  value of the table's group columns (:data:`GROUP_COLUMNS`: ranks, op, phase, ...); with two or
  more group columns, the one with the most values (at most :data:`MAX_FACETS`) gets a panel per value.
- ``"gemm"``: a ``TFLOP/s`` column: bars of every TFLOP/s column per shape (``m_local``,
  ``M x N x K`` or ``m``/``n``/``k``).
- ``"bars"``: anything else: bars per row of its time columns (one to four in one unit: the
  measurement beside its baseline), else of its ratio columns.
- ``"timeline"``: a Chrome trace (``{"traceEvents": [...]}``, as
  :meth:`tilescale_lang.profiler.EventProfiler.save` writes it): one track per (rank, block,
  warp) on the y axis, time on the x axis, one colour per task.

Command line: ``python -m tilescale_examples.benchmarks._plot TABLE.json [-o OUT.png]``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["parse_bytes", "chart_kind", "make_figure", "plot_table", "main", "GROUP_COLUMNS"]

#: Columns whose values split a table's rows into groups (one line each).
GROUP_COLUMNS = ("ranks", "op", "phase", "routing", "path", "dtype", "algorithm", "direction")
#: Headers of an x axis in bytes, and of one counted in tokens.
SIZE_COLUMNS = ("size", "bytes", "nbytes", "message size", "total size")
COUNT_COLUMNS = ("tokens",)
#: At most this many panels side by side (one per value of a group column).
MAX_FACETS = 4
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_BYTES = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*")
_STYLES = ("-", "--", ":", "-.")
_MISSING = "plotting benchmark tables needs matplotlib: pip install \"tilescale-examples[plot]\""


def _matplotlib():
    """``(Figure, FigureCanvasAgg, rc_context, PIL.Image)``, imported on first use (Pillow is
    a dependency of matplotlib). Raises ImportError naming the ``[plot]`` extra."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from PIL import Image
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    return Figure, FigureCanvasAgg, matplotlib.rc_context, Image


def parse_bytes(value: Any) -> int:
    """Bytes of a size cell: an int, or text as ``_report.format_bytes`` prints it
    (``"4 KiB"``, ``"1.125 MiB"``, ``"512 B"``; ``"64MiB"`` and ``"4096"`` too).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return int(round(value))
    match = _BYTES.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"not a size in bytes: {value!r}")
    return int(round(float(match[1]) * _UNITS[match[2] or "B"]))


def _number(cell: Any) -> float:
    """A cell as a float; NaN for text that is not a number (``"n/a"``)."""
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell)
    try:
        return float(cell)
    except (TypeError, ValueError):
        return math.nan


def column_kind(header: str) -> str | None:
    """``"bandwidth"`` (GB/s), ``"tflops"``, ``"time"`` (us, µs, ms), ``"ratio"`` or None."""
    h = header.strip()
    if "GB/s" in h:
        return "bandwidth"
    if "TFLOP/s" in h:
        return "tflops"
    if re.search(r"(^|\s)(us|µs|ms)$", h):
        return "time"
    if (h in ("ratio", "speedup") or h.startswith(("ratio ", "x ", "vs ")) or " vs " in h
            or ("/" in h and "/s" not in h)):
        return "ratio"
    return None


def _is_size_header(header: str) -> bool:
    h = header.strip().lower()
    return h in SIZE_COLUMNS or h.endswith(" bytes")


def _x_column(record: dict) -> int | None:
    """Index of the x column of a ``"lines"`` chart: a size column whose cells all read as
    bytes, else a tokens column of numbers; None if neither."""
    headers, rows = record["headers"], record["rows"]
    for wanted, ok in ((_is_size_header, parse_bytes), (lambda h: h.strip().lower() in COUNT_COLUMNS, float)):
        for i, h in enumerate(headers):
            if wanted(h) and rows:
                try:
                    [ok(r[i]) for r in rows]
                except (TypeError, ValueError):
                    continue
                return i
    return None


def chart_kind(record: dict) -> str:
    """``"timeline"``, ``"gemm"``, ``"lines"`` or ``"bars"`` (see the module docstring)."""
    if "traceEvents" in record:
        return "timeline"
    kinds = [column_kind(h) for h in record["headers"]]
    if "tflops" in kinds:
        return "gemm"
    return "lines" if _x_column(record) is not None else "bars"


def _label(headers: Sequence[str], i: int) -> str:
    """Legend name of column ``i``: the header without its unit; a header that repeats
    (``ratio`` after each op) gets the name of the column before it in front."""
    h = headers[i]
    name = re.sub(r"\s*(GB/s|TFLOP/s|us|µs|ms)$", "", h).strip() or "TileScale"
    if headers.count(h) > 1 and i > 0:
        return f"{_label(headers, i - 1)} {name}"
    return name


def _value_text(header: str, value: Any) -> str:
    """A group or row-name cell as text: ``2 ranks``, ``1 rank``, ``132 blocks``, or the text."""
    if isinstance(value, str):
        return value
    return f"{value} {header[:-1] if header.endswith('s') and value == 1 else header}"


def _group_text(headers: Sequence[str], cols: Sequence[int], values: Sequence[Any]) -> str:
    return ", ".join(_value_text(headers[c], v) for c, v in zip(cols, values))


def _title(fig, record: dict) -> None:
    """Figure title: the record's title (at most two lines), then hardware and date, wrapped
    to the figure's width."""
    width = int(fig.get_figwidth() * 13)
    lines = textwrap.wrap(record.get("title") or record.get("name") or "", width)
    if len(lines) > 2:
        lines = lines[:2]
        lines[1] = lines[1][:width - 3] + "..."
    meta = ", ".join(str(m) for m in (record.get("hardware"), record.get("date")) if m)
    fig.suptitle("\n".join(lines + textwrap.wrap(meta, width)), fontsize=8)


def _runs(xs: list[float], ys: list[float]) -> list[tuple[list[float], list[float]]]:
    """Split points into runs wherever an x repeats (a table of several runs of one sweep);
    each run sorted by x."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys):
        if any(x == px for px, _ in runs[-1]):
            runs.append([])
        runs[-1].append((x, y))
    return [tuple(map(list, zip(*sorted(run)))) for run in runs if run]


def _scale_y(ax, values: list[float], ratio: bool) -> None:
    """Log y axis when the positive values span more than 20x; a reference line at 1 for ratios."""
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    if finite and max(finite) / min(finite) > 20:
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if max(finite) / min(finite) < 1000 else (1.0,)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if ratio:
        ax.axhline(1.0, color="0.5", linewidth=0.8, zorder=0)


class _Layout(NamedTuple):
    """How a ``"lines"`` chart lays a table out."""

    x: int  # the x column
    in_bytes: bool  # x is a size in bytes (else a count)
    panels: list[tuple[str, list[int]]]  # rows of panels: (kind, its columns)
    facet: int | None  # the column with a panel per value (side by side)
    series: list[int]  # the group columns that split each panel's lines


def _layout(record: dict) -> _Layout:
    """The :class:`_Layout` of a ``"lines"`` chart (see the module docstring).

    Raises:
        ValueError: no GB/s, ratio or time column.
    """
    headers, rows = record["headers"], record["rows"]
    x = _x_column(record)
    kinds = [column_kind(h) for h in headers]
    panels = [(k, [i for i, kk in enumerate(kinds) if kk == k]) for k in ("bandwidth", "ratio")]
    panels = [p for p in panels if p[1]] or [("time", [i for i, k in enumerate(kinds) if k == "time"])]
    if not panels[0][1]:
        raise ValueError(f"table {record.get('name')!r} has no GB/s, ratio or time column to draw")
    groups = [i for i, h in enumerate(headers) if h in GROUP_COLUMNS and i != x]
    facet = None
    if len(groups) >= 2:
        counts = {g: len({str(r[g]) for r in rows}) for g in groups}
        facet = max((g for g in groups if counts[g] <= MAX_FACETS), key=lambda g: counts[g], default=None)
    return _Layout(x, _is_size_header(headers[x]), panels, facet, [g for g in groups if g != facet])


def _draw_series(ax, headers: Sequence[str], rows: Sequence[Sequence[Any]], lay: _Layout,
                 cols: Sequence[int]) -> list[float]:
    """One panel's lines: per group of ``lay.series`` and column of ``cols``, split into runs
    where a size repeats (colour per group, line style per column; a single group: colour per
    column). Returns the values drawn."""
    keys = list(dict.fromkeys(tuple(r[g] for g in lay.series) for r in rows))
    values = []
    for si, key in enumerate(keys):
        mine = [r for r in rows if tuple(r[g] for g in lay.series) == key]
        xs = [_x_value(r[lay.x], lay.in_bytes) for r in mine]
        for ci, c in enumerate(cols):
            ys = [_number(r[c]) for r in mine]
            values += ys
            runs = _runs(xs, ys)
            for ri, (rx, ry) in enumerate(runs):
                name = _label(headers, c)
                if len(keys) > 1:
                    name = f"{_group_text(headers, lay.series, key)}: {name}"
                if len(runs) > 1:
                    name += f" (run {ri + 1})"
                color = f"C{(si if len(keys) > 1 else ci) % 10}"
                style = _STYLES[(ci if len(keys) > 1 else ri) % len(_STYLES)]
                ax.plot(rx, ry, style, color=color, marker="os^v"[ri % 4], markersize=3, linewidth=1.2, label=name)
    return values


def _x_value(cell: Any, in_bytes: bool) -> float:
    return float(parse_bytes(cell)) if in_bytes else _number(cell)


def _x_axis(ax, xs: list[float], in_bytes: bool, label: str) -> None:
    """Ticks at (up to eight of) the sizes, labelled ``4 KiB`` or as counts."""
    from tilescale_examples.benchmarks._report import format_bytes

    step = max(1, math.ceil(len(xs) / 8))
    ax.set_xticks(xs[::step])
    ax.set_xticklabels([format_bytes(int(x)) if in_bytes else f"{x:g}" for x in xs[::step]],
                       rotation=45 if in_bytes else 0, fontsize=7)
    ax.set_xlabel("size" if in_bytes else label)
    ax.minorticks_off()


def _lines(fig, record: dict) -> None:
    """The ``"lines"`` chart: panels of :func:`_layout`, lines of :func:`_draw_series`."""
    headers, rows = record["headers"], record["rows"]
    lay = _layout(record)
    facets = list(dict.fromkeys(r[lay.facet] for r in rows)) if lay.facet is not None else [None]
    if all(isinstance(v, (int, float)) for v in facets):
        facets.sort()  # 2, 4, 8 ranks in that order, whatever the table's
    axes = fig.subplots(len(lay.panels), len(facets), sharex="col", sharey="row", squeeze=False)
    xs = sorted({_x_value(r[lay.x], lay.in_bytes) for r in rows})
    for col, value in enumerate(facets):
        mine = [r for r in rows if lay.facet is None or r[lay.facet] == value]
        for row, (kind, cols) in enumerate(lay.panels):
            ax = axes[row][col]
            _scale_y(ax, _draw_series(ax, headers, mine, lay, cols), kind == "ratio")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
            if col == 0:
                ax.set_ylabel({"bandwidth": "GB/s", "ratio": "ratio", "time": "us"}[kind])
            if row == 0 and lay.facet is not None:
                ax.set_title(f"{headers[lay.facet]}: {value}" if isinstance(value, str)
                             else _value_text(headers[lay.facet], value))
            if row == len(lay.panels) - 1:
                _x_axis(ax, xs, lay.in_bytes, headers[lay.x])
            if col == len(facets) - 1:
                ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=6.5, frameon=False)


def _shape(headers: Sequence[str], row: Sequence[Any]) -> str:
    """A GEMM row's shape label: ``M x N x K``, else ``m_local N``, else ``MxNxK`` of m/n/k."""
    index = {h.strip(): i for i, h in enumerate(headers)}
    if "M x N x K" in index:
        return str(row[index["M x N x K"]])
    if "m_local" in index:
        return f"m_local {row[index['m_local']]}"
    dims = [str(row[index[d]]) for d in ("m", "n", "k") if d in index]
    return "x".join(dims) or "?"


def _bars(ax, categories: list[str], series: list[tuple[str, list[float]]], ylabel: str, ratio: bool) -> None:
    """Grouped bars: one cluster per category, one bar per series in it, with a legend."""
    width = 0.8 / max(1, len(series))
    values = []
    for si, (name, ys) in enumerate(series):
        xs = [i - 0.4 + width * (si + 0.5) for i in range(len(categories))]
        ax.bar(xs, ys, width, label=name, color=f"C{si % 10}")
        values += ys
    _scale_y(ax, values, ratio)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, rotation=30 if max(map(len, categories), default=0) > 8 else 0,
                       ha="right" if max(map(len, categories), default=0) > 8 else "center", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", linewidth=0.4, alpha=0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=6.5, frameon=False)


def _gemm(fig, record: dict) -> None:
    """The ``"gemm"`` chart: TFLOP/s per shape (and group) per variant."""
    headers, rows = record["headers"], record["rows"]
    groups = [i for i, h in enumerate(headers) if h in GROUP_COLUMNS]
    categories = [" ".join([_shape(headers, r)] + [str(r[g]) for g in groups]) for r in rows]
    series = [(_label(headers, i), [_number(r[i]) for r in rows]) for i in _bar_columns(record)]
    _bars(fig.subplots(), categories, series, "TFLOP/s", ratio=False)


def _bar_columns(record: dict) -> list[int]:
    """Columns drawn as bars. ``"gemm"``: the TFLOP/s columns. ``"bars"``: the time columns
    when there are one to four of them in one unit (the measurement beside its baseline), else
    the ratio columns, else the time columns."""
    headers = record["headers"]
    kinds = [column_kind(h) for h in headers]
    if "tflops" in kinds:
        return [i for i, k in enumerate(kinds) if k == "tflops"]
    times = [i for i, k in enumerate(kinds) if k == "time"]
    one_unit = len({headers[i].split()[-1] for i in times}) == 1 and len(times) <= 4
    return (times if one_unit else []) or [i for i, k in enumerate(kinds) if k == "ratio"] or times


def _fallback_bars(fig, record: dict) -> None:
    """The ``"bars"`` chart: the :func:`_bar_columns` per row, each row named by its columns
    that are neither measurements nor ``check``."""
    headers, rows = record["headers"], record["rows"]
    kinds = [column_kind(h) for h in headers]
    cols = _bar_columns(record)
    if not cols or not rows:
        raise ValueError(f"table {record.get('name')!r} has no ratio or time column to draw")
    names = [i for i, k in enumerate(kinds) if k is None and headers[i] != "check"]
    categories = [_group_text(headers, names, [r[i] for i in names]) or str(n + 1) for n, r in enumerate(rows)]
    series = [(_label(headers, i), [_number(r[i]) for r in rows]) for i in cols]
    unit = "ratio" if kinds[cols[0]] == "ratio" else headers[cols[0]].split()[-1]
    _bars(fig.subplots(), categories, series, unit, ratio=unit == "ratio")


def _timeline(fig, trace: dict) -> None:
    """The ``"timeline"`` chart of a Chrome trace: a bar per complete event (``"ph": "X"``)."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not spans:
        raise ValueError("trace has no complete events (\"ph\": \"X\") to draw")
    stride = 1024  # tilescale_lang.profiler.TID_BLOCK_STRIDE: tid = block * stride + warp
    tracks = sorted({(e.get("pid", 0), e.get("tid", 0)) for e in spans})
    row_of = {t: n for n, t in enumerate(tracks)}
    ranks = len({p for p, _ in tracks}) > 1
    warps = any(t % stride for _, t in tracks)
    ax = fig.subplots()
    for ti, task in enumerate(dict.fromkeys(e["name"] for e in spans)):
        mine = [e for e in spans if e["name"] == task]
        ax.barh([row_of[(e.get("pid", 0), e.get("tid", 0))] for e in mine], [e.get("dur", 0.0) for e in mine],
                left=[e["ts"] for e in mine], height=0.8, color=f"C{ti % 10}", label=task)
    step = max(1, math.ceil(len(tracks) / 32))
    ax.set_yticks(range(0, len(tracks), step))
    labels = []
    for pid, tid in tracks[::step]:
        block, warp = divmod(tid, stride)
        labels.append((f"rank {pid} " if ranks else "") + f"block {block}" + (f" warp {warp}" if warps else ""))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("time (us)")
    ax.grid(True, axis="x", linewidth=0.4, alpha=0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=6.5, frameon=False)


def _size(record: dict, kind: str) -> tuple[float, float]:
    """Figure size in inches for a record's chart."""
    if kind == "timeline":
        tracks = len({(e.get("pid"), e.get("tid")) for e in record["traceEvents"] if e.get("ph") == "X"})
        return 8.0, min(10.0, 1.5 + 0.12 * tracks)
    if kind == "lines":
        lay = _layout(record)
        facets = 1 if lay.facet is None else len({str(r[lay.facet]) for r in record["rows"]})
        return 2.2 + 3.4 * facets, 0.8 + 2.5 * len(lay.panels)
    return max(5.5, min(12.0, 3.0 + 0.2 * len(record["rows"]) * len(_bar_columns(record)))), 3.8


def make_figure(record: dict):
    """The matplotlib ``Figure`` (Agg canvas) of a table record or a Chrome trace.

    Raises:
        ImportError: matplotlib is missing (the message names the ``[plot]`` extra).
        ValueError: a table with nothing to draw.
    """
    Figure, FigureCanvasAgg, rc_context, _ = _matplotlib()
    kind = chart_kind(record)
    with rc_context({"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8}):
        fig = Figure(figsize=_size(record, kind), layout="constrained")
        FigureCanvasAgg(fig)
        {"timeline": _timeline, "gemm": _gemm, "lines": _lines, "bars": _fallback_bars}[kind](fig, record)
        if kind == "timeline":
            fig.suptitle(record.get("title") or "profiler trace", fontsize=8)
        else:
            _title(fig, record)
    return fig


def plot_table(record: dict, png_path: str | Path, dpi: int = 100) -> Path:
    """Draw ``record`` (:func:`make_figure`) into the PNG ``png_path`` (256 colours, a few
    tens of KB at the default ``dpi``); returns its path."""
    Image = _matplotlib()[3]
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    make_figure(record).savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, format="png", optimize=True)
    return path


def load(path: str | Path) -> dict:
    """A table record (``.json`` or ``.csv``, see ``_export.read_table``) or a Chrome trace (a
    ``.json`` holding ``traceEvents``)."""
    from tilescale_examples.benchmarks._export import read_table

    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "traceEvents" in data:
            return data
    return read_table(path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tilescale_examples.benchmarks._plot TABLE.json [-o OUT.png]``."""
    p = argparse.ArgumentParser(prog="python -m tilescale_examples.benchmarks._plot",
                                description="Draw a saved benchmark table (.json/.csv) or profiler trace as a PNG.")
    p.add_argument("table", help="a table written by --out (.json or .csv), or a Chrome trace (.json)")
    p.add_argument("-o", "--output", help="PNG to write (default: the table's path with .png)")
    p.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")
    args = p.parse_args(argv)
    try:
        out = plot_table(load(args.table), args.output or Path(args.table).with_suffix(".png"), dpi=args.dpi)
    except (ImportError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
