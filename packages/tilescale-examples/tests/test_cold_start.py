"""The cold-start benchmark (tilescale_examples.benchmarks.cold_start) on the CPU: its compile
phase into an empty cache (nvcc, a fresh process), the record a later run reuses instead of
compiling again, the refusals, and the table built from both phases' results. Its load phase
needs a GPU."""

from __future__ import annotations

import json

import pytest
from examples_helpers import needs_nvcc

from tilescale_examples.benchmarks import cold_start, launch


def _record(ops):
    return {"signature": {}, "ops": {name: {"kernels": k, "compile_s": s} for name, k, s in ops},
            "host": "h", "date": "2026-12-06"}


def test_rows_put_each_ops_compile_beside_its_load_and_total_them():
    record = _record([("AllReduce one-shot", 1, 6.0), ("MoE", 2, 30.0)])
    rows = cold_start.rows(record, {"AllReduce one-shot": (0.25, 0, "ok"), "MoE": (0.5, 0, "ok")})
    assert rows == [["AllReduce one-shot", 1, 6.0, 0.25, 24.0, 0, "ok"], ["MoE", 2, 30.0, 0.5, 60.0, 0, "ok"],
                    ["total", 3, 36.0, 0.75, 48.0, 0, "ok"]]
    rows = cold_start.rows(record, {"AllReduce one-shot": (0.25, 3, "FAIL (values)")})  # MoE not loaded
    assert rows[0][5:] == [3, "FAIL (values)"] and rows[1][3:] != rows[0][3:] and rows[1][6] == "not run"
    assert rows[-1][5:] == [3, "FAILED"]


def test_a_record_is_reused_only_with_its_signature(tmp_path):
    wanted = cold_start.signature(["AllGather"], 2048, "bfloat16", 132)
    assert wanted["ops"] == ["AllGather"] and set(wanted["versions"]) == {"tilelang", "tilescale-lang",
                                                                           "tilescale-examples"}
    assert cold_start.read_record(tmp_path, wanted) is None  # none
    (tmp_path / cold_start.RECORD).write_text("{not json", encoding="utf-8")
    assert cold_start.read_record(tmp_path, wanted) is None
    record = dict(_record([("AllGather", 1, 2.0)]), signature=wanted)
    (tmp_path / cold_start.RECORD).write_text(json.dumps(record), encoding="utf-8")
    assert cold_start.read_record(tmp_path, wanted) == record
    assert cold_start.read_record(tmp_path, cold_start.signature(["AllGather"], 2048, "bfloat16", 114)) is None


def test_the_ops_are_the_launch_benchmarks_serving_ops_and_the_demos_gemm():
    import torch

    from tilescale_examples import AllGather, AllReduce, MoEDispatcher
    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM

    specs = cold_start.specs(2048, torch.bfloat16)
    assert list(specs)[-1] == cold_start.AG_GEMM and len(specs) == 7
    assert specs["AllReduce one-shot"] == (AllReduce, ((2048,), torch.bfloat16), {"algorithm": "one_shot"})
    assert specs["AllGather"][0] is AllGather and specs[cold_start.AG_GEMM][0] is AllGatherGEMM
    assert any(cls is MoEDispatcher and kwargs["validate"] is False for cls, _, kwargs in specs.values())
    assert not set(specs) & {launch.MOE_DISPATCH_ROW, *launch.GEMM_ROWS}  # the launch benchmark's rows alone


@pytest.mark.parametrize("argv, message", [
    (["--bytes", "100"], "--bytes must be a positive multiple of 16"),
    (["--sm-count", "0"], "--sm-count positive"),
    (["--ops", "AllScatter"], "--ops: no op named ['AllScatter']"),
])
def test_bad_arguments_are_refused(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        cold_start.main(argv + ["--cache", str(tmp_path / "c")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c" / cold_start.RECORD).exists()


def test_a_cache_holding_kernels_without_a_record_is_refused(tmp_path, capsys):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.so").write_bytes(b"x")  # someone's cache: compiles there would be cache hits
    with pytest.raises(SystemExit):
        cold_start.main(["--compile-only", "--ops", "AllGather", "--cache", str(tmp_path)])
    assert "holds files but no compile record" in capsys.readouterr().err


@needs_nvcc
def test_the_compile_phase_compiles_into_an_empty_cache_and_a_later_run_reuses_its_record(tmp_path, capsys,
                                                                                          monkeypatch):
    cache = tmp_path / "cache"
    assert cold_start.main(["--compile-only", "--ops", "AllReduce one-shot", "--cache", str(cache)]) == 0
    record = json.loads((cache / cold_start.RECORD).read_text(encoding="utf-8"))
    entry = record["ops"]["AllReduce one-shot"]
    assert list(record["ops"]) == ["AllReduce one-shot"] and entry["kernels"] == 1 and entry["compile_s"] > 0
    assert any(p.suffix == ".so" for p in cache.rglob("*")), "nothing compiled into the cache"
    out = capsys.readouterr().out
    assert "compile phase" in out and "AllReduce one-shot" in out

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(cold_start, "compile_all", no_compile)
    assert cold_start.main(["--compile-only", "--ops", "AllReduce one-shot", "--cache", str(cache)]) == 0
    with pytest.raises(SystemExit):  # another op list: not this record, and the cache is not empty
        cold_start.main(["--compile-only", "--ops", "AllGather", "--cache", str(cache)])


def test_without_a_gpu_only_the_compile_phase_runs_and_only_when_asked(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(cold_start, "compile_all", lambda *a: pytest.fail("compiled without --compile-only"))
    assert cold_start.main(["--cache", str(tmp_path)]) == 0
    assert "no CUDA GPU visible, nothing to measure" in capsys.readouterr().out


def test_the_load_phase_checks_the_ops_as_the_launch_benchmark_and_the_gemm_by_its_relative_error():
    import torch

    from tilescale_examples.benchmarks.launch import compare, compare_gemm, poison_outputs

    want = torch.randn(4, 8)
    assert compare(want.clone(), want) == "ok" and compare((want,), (want, want)) == "FAIL (1 outputs vs 2)"
    assert compare(want[:2], want) == "FAIL (shape (2, 8) vs (4, 8))"
    longer = torch.cat([want, torch.full((3, 8), float("nan"))])  # a receive buffer: its first rows are the result
    assert compare(longer, want) == "ok" and compare(longer[1:], want) == "FAIL (values)"
    assert compare(want[:, :4], want) == "FAIL (shape (4, 4) vs (4, 8))"
    off = want.clone()
    off[0, 0] += 1.0  # one element wrong: a relative-norm test could miss it, the element-wise one does not
    assert compare(off, want) == "FAIL (values)"
    op = type("Op", (), {"output": torch.zeros(3), "residual_output": torch.zeros(3, dtype=torch.int32),
                         "recv_x": torch.zeros(2, 2)})()
    poison_outputs(op)
    assert op.output.isnan().all() and not op.residual_output.any()  # floating-point outputs only
    assert op.recv_x.isnan().all()
    a, b = torch.randn(64, 256), torch.randn(256, 32)
    ref = a @ b
    assert compare_gemm(ref.bfloat16(), ref) == "ok"
    assert compare_gemm(torch.zeros_like(ref), ref) == "FAIL (values)"
    assert compare_gemm(ref[:8], ref) == "FAIL (shape (8, 32) vs (64, 32))"
