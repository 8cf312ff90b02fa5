"""The benchmark tables published in docs/benchmarks.md, as table records (JSON) and plots.

``python ci/bench_tables_from_docs.py`` parses every markdown table of docs/benchmarks.md that
has a measurement column (GB/s, TFLOP/s, a time or a ratio) and writes it as a table record
(``tilescale_examples.benchmarks._export.table_record``) to
``packages/tilescale-examples/tests/data/bench_samples/<name>.json``, the samples the CPU suite
draws (``tests/test_plots.py``); stale JSON files there are removed. Each record carries the
date and hardware that the paragraphs above its table state (the nearest date in its section;
hardware from the same paragraph, else the table before it: "same machine"); a figure (an
image line with its caption) is not read.

Names: the section heading's benchmark module (``putget``), ``_2``, ``_3`` for its later
tables; a heading naming as many modules as its section has tables gives each its own
(``ag_gemm``, ``gemm_rs``). The docs leave out units the benchmarks print in some headers
(:data:`UNITS` puts them back, so that the records read like the benchmarks' own).

Options: ``--check`` exits 1 (writing nothing) when the samples differ from the docs;
``--png DIR`` also draws the tables of :data:`FIGURES` into ``DIR/<name>.png`` (the figures of
docs/benchmarks.md: ``--png docs/img``; needs matplotlib).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SAMPLES = ROOT / "packages" / "tilescale-examples" / "tests" / "data" / "bench_samples"
#: Headers the docs print without the unit the benchmark prints, per sample name prefix.
UNITS = {
    "putget": {op: f"{op} GB/s" for op in ("put_warp", "get_warp", "put_block", "get_block")},
    "ag_gemm": {c: f"{c} TFLOP/s" for c in ("TileScale", "NCCL + cuBLAS", "async-TP", "matmul alone", "stock TileLang")},
}
UNITS["gemm_rs"] = UNITS["block_rasterization"] = UNITS["overlapped_gemms_on_the_async_pipeline"] = UNITS["ag_gemm"]
#: Samples drawn into docs/img (the figures docs/benchmarks.md shows).
FIGURES = ("putget", "heap", "heap_2", "emulated", "moe", "remote_tma", "ag_gemm", "gemm_rs")

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HARDWARE = re.compile(r"\b(?:(?:one|two|four|eight|\d+) )?(?:NVIDIA )?[ABHL]\d{2,3}\b(?: \([^)]*\))?")
MODULE = re.compile(r"`(?:tilescale_examples\.benchmarks)?\.(\w+)`")


def _cell(text: str):
    """A markdown cell as the type the benchmark printed: int, float or the text."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _hardware(paragraph: str) -> str | None:
    """The GPU a paragraph names (``one NVIDIA H200 (driver ..., CUDA ..., torch ...)``),
    without dates; None when it names none."""
    match = HARDWARE.search(paragraph)
    if match is None:
        return None
    text = match[0]
    if "NVIDIA" not in text:
        text = re.sub(r"([ABHL]\d{2,3})", r"NVIDIA \1", text, count=1)
    text = re.sub(r"\(\s*" + DATE.pattern + r",\s*", "(", text)
    return re.sub(r"\s+", " ", text)


def _blocks(markdown: str) -> list[tuple[str, object]]:
    """``markdown`` as blocks: ``("heading", text)``, ``("para", joined lines)``, ``("table",
    lines)`` and ``("blank", "")``."""
    blocks: list[tuple[str, object]] = []
    for line in markdown.splitlines():
        kind = "heading" if line.startswith("#") else "table" if line.startswith("|") else "para" if line.strip() else "blank"
        if kind == "heading":
            blocks.append((kind, line.lstrip("#").strip()))
        elif kind != "blank" and blocks and blocks[-1][0] == kind:
            blocks[-1] = (kind, blocks[-1][1] + ([line] if kind == "table" else " " + line.strip()))
        else:
            blocks.append((kind, [line] if kind == "table" else line.strip()))
    return blocks


def parse(markdown: str) -> list[dict]:
    """Every table of ``markdown`` with a measurement column, as ``{"name", "title", "headers",
    "rows", "hardware", "date"}`` (see the module docstring).

    Raises:
        ValueError: a table with no date in the paragraphs of its section above it.
    """
    sys.path.insert(0, str(ROOT / "packages" / "tilescale-examples" / "src"))  # without an install
    from tilescale_examples.benchmarks._export import table_record
    from tilescale_examples.benchmarks._plot import column_kind

    records, hardware, heading, paras, tables = [], None, "", [], []
    for kind, body in _blocks(markdown) + [("heading", "")]:
        if kind == "heading":
            records += _section(heading, tables, table_record, column_kind)
            heading, paras, tables = body, [], []
        elif kind == "para" and not body.startswith("!["):  # a figure and its caption: not a source
            paras.append(body)
        elif kind == "table":
            dated = next((p for p in reversed(paras) if DATE.search(p)), None)
            if dated is None:
                raise ValueError(f"no date above a table in section {heading!r}")
            hardware = _hardware(dated) or hardware
            label = paras[-1] if paras and len(paras[-1]) <= 60 and paras[-1].endswith(":") else None
            tables.append((body, DATE.search(dated)[0], hardware, label))
            paras.append("")  # a later label must follow its own table
    return records


def _section(heading: str, tables: list, table_record, column_kind) -> list[dict]:
    """The records of one section's tables (those with a measurement column)."""
    modules = MODULE.findall(heading)
    title = re.sub(r"\s*\(`.*$", "", heading).strip()
    base = modules[0] if modules else re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")
    kept = []
    for lines, date, hardware, label in tables:
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
        headers, data = rows[0], rows[2:]  # rows[1]: the |---| line
        kept.append((headers, data, date, hardware, label))
    own = len(modules) == len(kept) > 1
    out = []
    for n, (headers, data, date, hardware, label) in enumerate(kept):
        name = modules[n] if own else base + (f"_{len(out) + 1}" if out else "")
        units = next((u for prefix, u in UNITS.items() if name.startswith(prefix)), {})
        headers = [units.get(h, h) for h in headers]
        if not any(column_kind(h) for h in headers):
            continue  # a table of text (ranges, phases): nothing to draw
        out.append(table_record(name, label.rstrip(":") if label else title, headers,
                                [[_cell(c) for c in r] for r in data], hardware=hardware, date=date))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=SAMPLES, help=f"where the JSON records go (default {SAMPLES.relative_to(ROOT)})")
    p.add_argument("--check", action="store_true", help="exit 1 when the stored samples differ from the docs")
    p.add_argument("--png", type=Path, help="also draw the FIGURES samples into this directory")
    args = p.parse_args(argv)
    records = parse(DOC.read_text(encoding="utf-8"))
    from tilescale_examples.benchmarks._export import dumps_record

    wanted = {f"{r['name']}.json": dumps_record(r) for r in records}
    stored = {f.name: f.read_text(encoding="utf-8") for f in args.out.glob("*.json")} if args.out.is_dir() else {}
    if args.check:
        stale = sorted(set(wanted.items()) ^ set(stored.items()))
        for name in sorted({n for n, _ in stale}):
            print(f"{args.out / name}: differs from {DOC.relative_to(ROOT)}")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in set(stored) - set(wanted):
        (args.out / name).unlink()
    for name, text in wanted.items():
        (args.out / name).write_text(text, encoding="utf-8")
    print(f"{len(wanted)} tables -> {args.out}")
    if args.png:
        from tilescale_examples.benchmarks._plot import plot_table

        by_name = {r["name"]: r for r in records}
        for name in FIGURES:
            print(plot_table(by_name[name], args.png / f"{name}.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
