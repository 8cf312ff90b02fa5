"""Saving a benchmark's table: ``<name>.csv``, ``<name>.json`` and, with matplotlib, ``<name>.png``.

A table record is a plain dict, the JSON file's content::

    {"name": "putget", "title": "...", "headers": ["size", "copy_ GB/s", ...],
     "rows": [["4 KiB", 0.261, ...], ...], "hardware": "one NVIDIA H200 (...)", "date": "2026-12-02"}

Cells keep the types the benchmark printed (``int``, ``float``, ``str`` such as ``"4 KiB"`` or
``"n/a"``); a float that is not finite is stored as the text it prints as (``"nan"``), so the
JSON stays strict. :mod:`tilescale_examples.benchmarks._plot` draws a record.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import math
import numbers
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["table_record", "dumps_record", "write_table", "read_table", "export_table", "default_name", "describe_hardware"]

#: Keys of a table record, in the order the JSON file holds them.
RECORD_KEYS = ("name", "title", "headers", "rows", "hardware", "date")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _value(cell: Any) -> Any:
    """A cell as JSON can hold it, keeping the printed type: bools, ints, finite floats, str."""
    if cell is None or isinstance(cell, (bool, str)):
        return cell
    if isinstance(cell, numbers.Integral):
        return int(cell)
    if isinstance(cell, numbers.Real):
        value = float(cell)
        return value if math.isfinite(value) else str(value)
    return str(cell)


def table_record(name: str, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
                 hardware: str | None = None, date: str | None = None) -> dict:
    """The record of one printed table (see the module docstring).

    Args:
        name: file stem for the saved files: letters, digits, ``.``, ``_``, ``-``.
        title: the table's title as printed.
        headers: column names; rows: one sequence of cells per row, as many as ``headers``.
        hardware: where it ran, e.g. ``"one NVIDIA H200 (CUDA 13.0, torch 2.11)"``.
        date: when it ran, ISO ``YYYY-MM-DD``.

    Raises:
        ValueError: a bad ``name`` or a row whose length differs from ``headers``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"name must be letters, digits, '.', '_' or '-' (a file stem), got {name!r}")
    headers = [str(h) for h in headers]
    cells = []
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells for {len(headers)} headers")
        cells.append([_value(c) for c in row])
    return {"name": name, "title": str(title), "headers": headers, "rows": cells,
            "hardware": hardware, "date": date}


def dumps_record(record: dict) -> str:
    """The JSON text of a table record: one line per key and one per row (strict JSON: no NaN)."""
    def dump(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)

    items = []
    for key in RECORD_KEYS:
        if key == "rows" and record["rows"]:
            items.append(' "rows": [\n' + ",\n".join(f"  {dump(row)}" for row in record["rows"]) + "\n ]")
        else:
            items.append(f" {dump(key)}: {dump(record[key])}")
    return "{\n" + ",\n".join(items) + "\n}\n"


def write_table(out_dir: str | Path, name: str, title: str, headers: Sequence[str],
                rows: Sequence[Sequence[Any]], **meta: Any) -> list[Path]:
    """Write ``<out_dir>/<name>.csv`` (a header line, then the rows) and ``<name>.json`` (the
    whole :func:`table_record`); ``meta``: its ``hardware`` and ``date``. Creates ``out_dir``.
    Returns the two paths."""
    record = table_record(name, title, headers, rows, **meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / f"{name}.csv", out / f"{name}.json"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(record["headers"])
        writer.writerows(["" if c is None else c for c in row] for row in record["rows"])
    json_path.write_text(dumps_record(record), encoding="utf-8")
    return [csv_path, json_path]


def _parse_cell(text: str) -> Any:
    """A CSV cell back as the type it was printed from: int, float (finite), else the text."""
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if kind is int or math.isfinite(value) else text
    return text


def read_table(path: str | Path) -> dict:
    """The record of a ``.json`` file written by :func:`write_table`, or of a ``.csv`` one
    (cells parsed back to int / float where they read as one; name = the file's stem, title
    empty, hardware and date None: the CSV holds only the table).

    Raises:
        ValueError: a JSON file that lacks ``headers`` or ``rows``, or another suffix.
    """
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not {"headers", "rows"} <= data.keys():
            raise ValueError(f"{path} is not a table record (needs 'headers' and 'rows')")
        record = {key: data.get(key) for key in RECORD_KEYS}
        record["name"], record["title"] = record["name"] or path.stem, record["title"] or ""
        return record
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            lines = list(csv.reader(f))
        if not lines:
            raise ValueError(f"{path} is empty")
        return {"name": path.stem, "title": "", "headers": lines[0],
                "rows": [[_parse_cell(c) for c in row] for row in lines[1:]], "hardware": None, "date": None}
    raise ValueError(f"{path}: expected a .json or .csv table")


def default_name(title: str, words: int = 6) -> str:
    """A file stem for a table known only by its title: its first ``words`` words, lower case,
    joined by ``-``, then 6 hex digits of the whole title's hash (titles that share their
    start still get distinct names)."""
    slug = "-".join(re.findall(r"[a-z0-9]+", title.lower())[:words]) or "table"
    return f"{slug}-{hashlib.sha1(title.encode()).hexdigest()[:6]}"


def describe_hardware() -> str | None:
    """``"<count> x <GPU name> (CUDA <version>, torch <version>)"`` of the visible GPUs, or
    None without torch or a GPU."""
    try:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            return None
        name = torch.cuda.get_device_name(0)
    except Exception:  # no torch, no driver: nothing to say
        return None
    return f"{count} x {name} (CUDA {torch.version.cuda}, torch {torch.__version__.split('+')[0]})"


def export_table(out_dir: str | Path, name: str, title: str, headers: Sequence[str],
                 rows: Sequence[Sequence[Any]], *, plot: bool = True, hardware: str | None = None,
                 date: str | None = None) -> list[Path]:
    """What a benchmark's ``--out DIR`` does with each table: :func:`write_table` with the
    hardware (default :func:`describe_hardware`) and date (default today), then, when ``plot``,
    the chart ``<name>.png`` (:func:`~tilescale_examples.benchmarks._plot.plot_table`). Without
    matplotlib, or for a table with nothing to draw, the PNG is skipped with one line on
    stderr. Returns the paths written."""
    hardware = describe_hardware() if hardware is None else hardware
    date = datetime.date.today().isoformat() if date is None else date
    paths = write_table(out_dir, name, title, headers, rows, hardware=hardware, date=date)
    if plot:
        from tilescale_examples.benchmarks._plot import plot_table

        try:
            paths.append(plot_table(read_table(paths[1]), Path(out_dir) / f"{name}.png"))
        except (ImportError, ValueError) as exc:
            print(f"{name}: no plot ({exc})", file=sys.stderr)
    return paths
