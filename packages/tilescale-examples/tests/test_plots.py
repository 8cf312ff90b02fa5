"""Benchmark tables saved as CSV/JSON (benchmarks/_export.py) and drawn as PNG charts
(benchmarks/_plot.py), from the tables published in docs/benchmarks.md (tests/data/bench_samples,
written by ci/bench_tables_from_docs.py)."""

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from tilescale_examples.benchmarks import _export, _plot
from tilescale_examples.benchmarks._report import format_bytes

SAMPLES = Path(__file__).parent / "data" / "bench_samples"
BUILDER = Path(__file__).resolve().parents[3] / "ci" / "bench_tables_from_docs.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Sample -> (chart kind, per axes in row-major order: lines drawn, or bars for bar charts).
EXPECTED = {
    "putget": ("lines", [5, 4]),  # torch + 4 ops in GB/s; 4 ratios
    "putget_2": ("lines", [10, 8]),  # the same, two runs of one sweep
    "putget_3": ("lines", [5, 4]),
    "remote_tma": ("lines", [3, 2]),
    # a panel per rank count (2, 4, 8); lines per op: GB/s, copy GB/s, copy B GB/s; ratio, ratio B
    "emulated": ("lines", [9, 9, 9, 6, 6, 6]),
    "emulated_2": ("lines", [4, 4, 4, 2, 2, 2]),  # two ops, no copy B columns
    # a panel per phase; lines per routing: GB/s; speedup, vs copy, graph vs copy
    "moe": ("lines", [2, 2, 2, 6, 6, 6]),
    "moe_phases": ("lines", [2]),  # graph vs copy per routing, against tokens
    "decode": ("lines", [4]),  # fused/unfused per rank count (1, 2, 4, 8), against tokens; hidden 4096
    "decode_2": ("lines", [4]),  # the same, hidden 8192
    "decode_3": ("lines", [2]),  # lamport/one-shot per hidden size (4096, 8192), against tokens
    "ag_gemm": ("gemm", [4 * 5]),  # 4 shapes x 5 TFLOP/s columns
    "gemm_rs": ("gemm", [4 * 5]),
    "pipeline_depth_of_the_overlapped_gemms": ("gemm", [8 * 2]),  # (op, m_local) x 3 and 4 stages
    "block_rasterization": ("gemm", [8 * 4]),  # (n, m_local, panel) x 4 TFLOP/s columns
    "block_rasterization_2": ("gemm", [4 * 4]),  # the tuned tiles: (n, m_local) x 4 TFLOP/s columns
    "gemm": ("gemm", [6 * 5]),  # matmul, stock, async, persistent and stream-K TFLOP/s per (m, n)
    "gemm_2": ("gemm", [6 * 5]),  # the same with the row warp policy
    "gemm_3": ("gemm", [6 * 4]),  # 128x224 tiles: matmul, stock, async, persistent
    "gemm_4": ("gemm", [6 * 7]),  # the TMA-store epilogue: matmul, stock(-tma), async(-tma), persistent(-tma)
    "overlapped_gemms_on_the_async_pipeline": ("gemm", [4 * 5]),  # as ag_gemm
    "overlapped_gemms_on_the_async_pipeline_2": ("gemm", [4 * 5]),  # as gemm_rs
    "gemm_allreduce": ("bars", [19 * 3]),  # fused, mm+AR, mm us per (m, tiles)
    "concurrent": ("lines", [3]),  # lamport/one_shot per rank count (2, 4, 8) against the all-reduce size
    "concurrent_2": ("lines", [3]),  # the same for the fused norm
    "cuda_graphs": ("lines", [1]),  # graph vs symm against the all-reduce size
    "cuda_graphs_2": ("lines", [2]),  # Lamport and one-shot vs symm against the size
    "cuda_graphs_3": ("lines", [3, 3, 3]),  # call numbers' A/B: a panel per rank count, a line per op
    "heap": ("bars", [6 * 2]),  # ready ms, cudaMalloc ms per path and ranks
    "heap_2": ("bars", [6 * 3]),
    "signals": ("bars", [2 * 2]),
    "gpu_barrier": ("bars", [1 * 2]),
    "launch": ("bars", [35]),  # host us per call and launcher (the lean launch's parts as rows)
    "launch_2": ("bars", [18 * 2]),  # host us and enqueue us per call (lean launcher)
    "cold_start": ("bars", [8]),  # compile / load per op (and the total)
    "ulysses": ("bars", [12 * 3]),  # ulysses, copy, torch us per (ranks, seq)
    "overlap_emulated": ("bars", [4 * 2]),  # x GEMM alone, x copies then GEMM per (op, ranks)
    "overlap_emulated_2": ("bars", [12 * 4]),  # fused, GEMM alone, matmul, copies ms per (op, ranks, m_local)
    "attention": ("gemm", [6 * 2]),  # tilescale and best torch TFLOP/s per (seq, causal)
    "attention_2": ("gemm", [12 * 2]),  # the same per (seq, causal, pipeline)
    "sp_attention": ("bars", [2 * 3]),  # sp, flash, sequential us per seq
    "sp_attention_2": ("bars", [9 * 3]),  # decode, torch, combine us per (batch, kv, splits)
    "low_latency_moe": ("lines", [6]),  # ratios per phase (dispatch, dispatch+combine) against tokens
}


def _drawn(ax, kind: str) -> int:
    """Data lines (labelled: not the reference line at 1) or bars of one axes."""
    if kind == "lines":
        return sum(1 for line in ax.get_lines() if not line.get_label().startswith("_"))
    return sum(len(container) for container in ax.containers)


def _sample(name: str) -> dict:
    return _export.read_table(SAMPLES / f"{name}.json")


def test_every_sample_has_its_expectation():
    assert sorted(p.stem for p in SAMPLES.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_renders_with_the_expected_lines_or_bars(name, tmp_path):
    record = _sample(name)
    kind, counts = EXPECTED[name]
    assert _plot.chart_kind(record) == kind
    assert record["hardware"] and record["date"]
    fig = _plot.make_figure(record)
    axes = [ax for ax in fig.axes if ax.has_data()]
    assert [_drawn(ax, kind) for ax in axes] == counts
    titles = [" ".join(text.get_text().split()) for text in fig.texts]
    assert any(record["date"] in t and record["hardware"] in t for t in titles)
    png = _plot.plot_table(record, tmp_path / f"{name}.png")
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and 1000 < len(data) < 80_000


def test_size_axis_is_log2_with_byte_labels():
    fig = _plot.make_figure(_sample("putget"))
    bottom = fig.axes[-1]
    assert bottom.get_xscale() == "log"
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["4 KiB", "64 KiB", "1 MiB", "16 MiB", "256 MiB"]


@pytest.mark.parametrize("text", ["4 KiB", "1 GiB", "512 B", "64 MiB", "1.125 MiB", "4.5 KiB"])
def test_size_parser_round_trips(text):
    assert format_bytes(_plot.parse_bytes(text)) == text


def test_size_parser_values_and_errors():
    assert _plot.parse_bytes("4 KiB") == 4096
    assert _plot.parse_bytes("1 GiB") == 1 << 30
    assert _plot.parse_bytes("64MiB") == 64 << 20
    assert _plot.parse_bytes("4096") == _plot.parse_bytes(4096) == 4096
    for bad in ("4 KB", "n/a", "", -1, True, None):
        with pytest.raises(ValueError, match="size in bytes"):
            _plot.parse_bytes(bad)


def test_column_kinds():
    kinds = {h: _plot.column_kind(h) for h in ["copy_ GB/s", "TileScale TFLOP/s", "kernel us", "tensor µs",
                                              "ready ms", "ratio", "ratio B", "x async-TP", "vs copy",
                                              "graph vs symm", "TMA/put_block", "speedup", "size", "check"]}
    assert kinds == {"copy_ GB/s": "bandwidth", "TileScale TFLOP/s": "tflops", "kernel us": "time",
                     "tensor µs": "time", "ready ms": "time", "ratio": "ratio", "ratio B": "ratio",
                     "x async-TP": "ratio", "vs copy": "ratio", "graph vs symm": "ratio",
                     "TMA/put_block": "ratio", "speedup": "ratio", "size": None, "check": None}


def test_collective_benchmark_table_draws_bandwidth_and_ratios():
    from tilescale_examples.benchmarks._collectives import HEADERS, SYMM_HEADERS

    headers = HEADERS + SYMM_HEADERS
    rows = []
    for n in (4096, 1 << 20, 1 << 30):
        cells = {"size": format_bytes(n), "shard": format_bytes(n // 4), "check": "ok", "symm op": "one_shot",
                 "symm graph op": "one_shot", "TS heap us": "n/a (ranks share a GPU)"}
        rows.append([cells.get(h, 1.5) for h in headers])
    record = _export.table_record("allreduce", "all-reduce", headers, rows)
    fig = _plot.make_figure(record)
    bandwidth = sum(1 for h in headers if "GB/s" in h)
    ratios = sum(1 for h in headers if _plot.column_kind(h) == "ratio")
    assert [_drawn(ax, "lines") for ax in fig.axes] == [bandwidth, ratios]


def test_gemm_benchmark_table_draws_bars_per_shape_and_variant():
    from tilescale_examples.benchmarks._overlap import HEADERS

    rows = [[m, f"{4 * m} x 3584 x 8192", "fused"] + [600.0] * (len(HEADERS) - 4) + ["ok"] for m in (1024, 2048)]
    fig = _plot.make_figure(_export.table_record("ag_gemm", "all-gather + GEMM", HEADERS, rows))
    variants = sum(1 for h in HEADERS if h.endswith("TFLOP/s"))
    assert _drawn(fig.axes[0], "gemm") == 2 * variants
    assert fig.axes[0].get_xticklabels()[0].get_text() == "4096 x 3584 x 8192"


def _trace() -> dict:
    """A two-rank trace as the profiler writes it: 3 blocks, 2 tasks each, per rank."""
    from tilescale_lang.profiler import Span, chrome_trace, merge_chrome_traces

    per_rank = []
    for rank in range(2):
        spans = [Span(block, 0, block, task, 1000 * task + 100 * block, 1000 * task + 100 * block + 800)
                 for block in range(3) for task in range(2)]
        per_rank.append(chrome_trace(spans, ["wait", "put"], rank=rank, origin_ns=0))
    return merge_chrome_traces(per_rank)


def test_profiler_trace_draws_a_timeline(tmp_path):
    trace = _trace()
    assert _plot.chart_kind(trace) == "timeline"
    fig = _plot.make_figure(trace)
    ax = fig.axes[0]
    assert [len(c) for c in ax.containers] == [6, 6]  # one bar per span, a colour per task
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["rank 0 block 0", "rank 0 block 1"]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert _plot.main([str(path)]) == 0
    assert (tmp_path / "trace.png").read_bytes().startswith(PNG_SIGNATURE)


def test_csv_and_json_round_trip(tmp_path):
    headers = ["size", "copy_ GB/s", "NCCL GB/s", "ratio", "blocks"]
    rows = [["4 KiB", 0.261, "n/a", 1.175, 1], ["1 GiB", 3981.3, float("nan"), 0.923, 132]]
    paths = _export.write_table(tmp_path / "out", "putget", "put/get", headers, rows,
                                hardware="one NVIDIA H200", date="2026-12-04")
    assert [p.name for p in paths] == ["putget.csv", "putget.json"]
    record = _export.read_table(paths[1])
    assert record == _export.table_record("putget", "put/get", headers, rows, hardware="one NVIDIA H200",
                                          date="2026-12-04")
    assert record["rows"][1][2] == "nan"  # not finite: kept as printed, the JSON stays strict
    json.loads(paths[1].read_text(encoding="utf-8"), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    from_csv = _export.read_table(paths[0])
    assert from_csv["headers"] == headers and from_csv["rows"] == record["rows"]
    assert isinstance(from_csv["rows"][1][4], int) and isinstance(from_csv["rows"][0][1], float)


def test_json_has_a_line_per_row():
    record = _export.table_record("t", "t", ["size", "ratio"], [["4 KiB", 1.5], ["8 KiB", 2]], date="2026-12-04")
    text = _export.dumps_record(record)
    assert json.loads(text) == record
    assert '  ["4 KiB", 1.5],\n  ["8 KiB", 2]\n' in text
    assert json.loads(_export.dumps_record(_export.table_record("e", "t", ["a"], [])))["rows"] == []


def test_table_record_rejects_bad_names_and_rows():
    with pytest.raises(ValueError, match="file stem"):
        _export.table_record("../x", "t", ["a"], [[1]])
    with pytest.raises(ValueError, match="2 cells for 1 headers"):
        _export.table_record("x", "t", ["a"], [[1, 2]])
    with pytest.raises(ValueError, match="table"):
        _export.read_table(Path(__file__))


def test_default_name_is_a_short_distinct_file_stem():
    a = _export.default_name("all-reduce bus bandwidth (4 ranks, float16)")
    b = _export.default_name("all-reduce bus bandwidth (4 ranks, bfloat16)")
    assert a.startswith("all-reduce-bus-bandwidth-4-ranks-") and a != b
    _export.table_record(a, "t", ["a"], [])  # a valid name


def test_export_table_writes_table_and_plot(tmp_path):
    rec = _sample("remote_tma")
    paths = _export.export_table(tmp_path, "remote_tma", rec["title"], rec["headers"], rec["rows"],
                                 hardware="h", date="2026-12-04")
    assert [p.name for p in paths] == ["remote_tma.csv", "remote_tma.json", "remote_tma.png"]


def test_missing_matplotlib_names_the_plot_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"pip install \"tilescale-examples\[plot\]\""):
        _plot.make_figure(_sample("putget"))
    assert _plot.main([str(SAMPLES / "putget.json"), "-o", str(tmp_path / "p.png")]) == 1
    assert "tilescale-examples[plot]" in capsys.readouterr().err
    rec = _sample("putget")
    paths = _export.export_table(tmp_path, "putget", rec["title"], rec["headers"], rec["rows"], hardware="h",
                                 date="d")
    assert [p.suffix for p in paths] == [".csv", ".json"]  # the table is saved; the plot is skipped
    assert "putget: no plot" in capsys.readouterr().err


def test_plot_module_imports_matplotlib_lazily():
    tree = ast.parse(Path(_plot.__file__).read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(name.split(".")[0] in ("matplotlib", "PIL") for name in names)


@pytest.mark.skipif(not BUILDER.exists(), reason="ci/ is not beside this checkout's tests")
def test_samples_match_the_published_tables():
    spec = importlib.util.spec_from_file_location("bench_tables_from_docs", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "rerun: python ci/bench_tables_from_docs.py"
    records = {r["name"]: r for r in module.parse(module.DOC.read_text(encoding="utf-8"))}
    assert records["putget"]["rows"][0][:2] == ["4 KiB", 0.261]
    assert records["ag_gemm"]["date"] == "2026-12-07"
    assert not math.isnan(records["moe"]["rows"][0][3])
