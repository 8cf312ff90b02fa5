"""``python -m tilescale_examples.demo``: end to end without a GPU (every kernel lowered and
compiled by nvcc for sm_90a, every row in the table and the JSON), and on GPUs (marked ``gpu``:
every row checked against torch.distributed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from examples_helpers import have_gpu, needs_nvcc

from tilescale_examples import demo


def _run_demo(tmp_path, timeout: float):
    out_json = tmp_path / "demo.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, "-m", "tilescale_examples.demo", "--json", str(out_json),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=timeout, env=env)
    return res, (json.loads(out_json.read_text(encoding="utf-8")) if out_json.exists() else None)


def _expected_rows(world: int) -> list[tuple[str, str]]:
    return [(c.op, c.label(world)) for c in demo.CASES]


def test_cases_cover_every_op_at_two_sizes():
    ops = [c.op for c in demo.CASES]
    assert ops == ["ring put"] * 2 + ["all-gather"] * 2 + ["all-reduce"] * 2 + ["AllGatherGEMM"] * 2
    for op in set(ops):
        assert len({c.size for c in demo.CASES if c.op == op}) == 2, op


def test_poison_then_stage_keeps_an_input_that_is_also_the_output():
    """The two-shot all-reduce returns its staging buffer, which is also its input: the
    poison must not reach the input, and a separate output must be poisoned."""
    import torch

    shared = torch.arange(8, dtype=torch.float32)
    aliased = demo._Built(None, None, (shared,), "", None, None, shared)
    demo.poison_then_stage(aliased)
    assert torch.equal(shared, torch.arange(8, dtype=torch.float32))

    x, out = torch.arange(4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16)
    demo.poison_then_stage(demo._Built(None, None, (x,), "", None, None, out))
    assert torch.isnan(out).all() and torch.equal(x, torch.arange(4, dtype=torch.float16))


@needs_nvcc
@pytest.mark.timeout(600)
def test_demo_without_gpu_compiles_every_kernel(tmp_path):
    if have_gpu():
        pytest.skip("a GPU is visible: the demo takes its GPU path (test_demo_on_gpus)")
    res, report = _run_demo(tmp_path, timeout=580)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    out = res.stdout
    # the doctor's summary first, then one progress line per step, the table, the closing line
    assert out.index("doctor:") < out.index("step 1/8") < out.index("step 8/8") < out.index("== no GPU here")
    assert "VMM fabric" in out and "toolkit:" in out
    assert "On a GPU machine the same command runs these kernels" in out
    assert report["mode"] == "compile"
    assert [(r["op"], r["size"]) for r in report["rows"]] == _expected_rows(demo.MIN_RANKS)
    table = out[out.index("== no GPU here"):]
    for op, size in _expected_rows(demo.MIN_RANKS):
        assert any(line.split()[:1] and op in line and size in line for line in table.splitlines()), (op, size)
    cubins = 0
    for row in report["rows"]:
        assert row["compile_s"] > 0
        for path in row["files"]:
            assert path.startswith(str(tmp_path / "out")) and os.path.getsize(path) > 0, path
            if path.endswith(".cubin"):
                cubins += 1
                with open(path, "rb") as f:
                    assert f.read(4) == b"\x7fELF", path
        sources = [open(p).read() for p in row["files"] if p.endswith("device_kernel.cu")]
        assert any("tilescale::" in src for src in sources), row  # TileScale's device code inside
        assert row["kernels"] >= sum(p.endswith(".cubin") for p in row["files"])
    # every kernel each object holds, whether its build compiled it or found it in the cache:
    # AllGatherGEMM (sequential plan here) has its AllGather's kernel and its GEMM
    assert [r["kernels"] for r in report["rows"]] == [1] * 6 + [2] * 2
    # ring put, all-gather and all-reduce x 2, AllGatherGEMM x 2 (all-gather + GEMM): at least 9
    # distinct kernels (an all-reduce's all-gather may equal an all-gather row's kernel)
    assert cubins >= 9
    # quiet by default: no TileLang compile log lines; the plan fallback once per AllGatherGEMM
    # row (rank 0's), not once per rank
    assert "TileLang begins to compile" not in out + res.stderr
    assert res.stderr.count("using the sequential plan") == 2, res.stderr


def test_kernels_of_counts_every_kernel_an_object_holds():
    """An AllGatherGEMM (sequential plan) holds two kernels, its GEMM and its AllGather's, even
    when TileLang found one in its cache and the build added one cubin; a kernel held twice
    counts once, and objects of other packages are not searched."""
    from tilelang.jit.kernel import JITKernel

    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.collectives.allgather import AllGather

    gemm, gather = JITKernel.__new__(JITKernel), JITKernel.__new__(JITKernel)
    inner = AllGather.__new__(AllGather)
    inner.kernel = gather
    obj = AllGatherGEMM.__new__(AllGatherGEMM)
    obj.all_gather, obj.kernel, obj.own_kernel, obj.chunks = inner, gemm, None, [(0, 1)]
    assert demo.kernels_of(obj) == 2
    obj.own_kernel = gemm  # the fused plan with one rank: kernel is own_kernel
    assert demo.kernels_of(obj) == 2
    obj.extra = {"k": [gather, (JITKernel.__new__(JITKernel),)]}  # through containers
    assert demo.kernels_of(obj) == 3

    class Foreign:  # not an examples object: not searched
        kernel = None

    foreign = Foreign()
    foreign.kernel = JITKernel.__new__(JITKernel)
    assert demo.kernels_of(demo._Built(foreign, None, None, "", None, None, None)) == 0
    assert demo.kernels_of(None) == 0
    obj.back = obj  # cycles end
    assert demo.kernels_of(demo._Built(obj, None, None, "", None, None, None)) == 3


@pytest.fixture
def restore_log_levels():
    import logging

    names = demo.RANK_LOGGERS
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def test_quiet_logs_silences_tilelang_info_and_other_ranks(restore_log_levels):
    import logging

    import tilelang  # noqa: F401  (its import sets its logger to INFO)

    tl, examples = logging.getLogger("tilelang.jit.kernel"), logging.getLogger("tilescale_examples.overlap.stream_ops")
    demo.quiet_logs(1, verbose=True)  # (each of the demo's processes calls it once)
    assert tl.isEnabledFor(logging.INFO) and examples.isEnabledFor(logging.WARNING)
    demo.quiet_logs(0)
    assert not tl.isEnabledFor(logging.INFO) and tl.isEnabledFor(logging.WARNING)
    assert examples.isEnabledFor(logging.WARNING)  # rank 0 keeps its warnings
    demo.quiet_logs(1)
    assert not examples.isEnabledFor(logging.WARNING) and examples.isEnabledFor(logging.ERROR)
    assert not tl.isEnabledFor(logging.WARNING)
    for name in ("tilescale_core.allocator", "tilescale_lang.codegen", "tilescale_host.x"):
        assert not logging.getLogger(name).isEnabledFor(logging.WARNING), name


def test_verbose_flag():
    assert demo._parser().parse_args(["--verbose"]).verbose is True
    assert demo._parser().parse_args([]).verbose is False


def _log_body(rank, world_size, verbose):
    import logging

    from tilescale_examples import demo as demo_mod

    demo_mod.quiet_logs(rank, verbose)
    logging.getLogger("tilescale_examples.overlap.stream_ops").warning("every rank logs this alike")
    return "ok"


@pytest.mark.timeout(300)
def test_a_message_every_rank_logs_prints_once(capfd):
    """As in the demo's ranks: a warning every rank logs (a plan fallback) prints once, from
    rank 0; with ``--verbose``, once per rank."""
    from tilescale_core.multiprocess import run_ranks

    assert run_ranks(_log_body, 2, args=(False,), backend="gloo", timeout=240) == ["ok", "ok"]
    assert capfd.readouterr().err.count("every rank logs this alike") == 1
    assert run_ranks(_log_body, 2, args=(True,), backend="gloo", timeout=240) == ["ok", "ok"]
    assert capfd.readouterr().err.count("every rank logs this alike") == 2


def test_render_gpu_table_has_every_column():
    rows = [dict(op="all-gather", size="1 MiB", tilescale_us=12.0, baseline_us=24.0, ratio=2.0,
                 baseline="all_gather_into_tensor", check="ok")]
    text = demo.render("gpu", "T", rows)
    assert text.splitlines()[1].split() == ["op", "size", "TileScale", "us", "baseline", "us", "ratio", "check"]
    assert "all-gather: all_gather_into_tensor" in text and "2.000" in text


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_demo_on_gpus(tmp_path):
    """One rank per GPU (2 sharing one GPU): every row checked against torch.distributed."""
    import torch

    res, report = _run_demo(tmp_path, timeout=380)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-4000:]
    gpus = torch.cuda.device_count()
    world = max(demo.MIN_RANKS, gpus)
    assert report["mode"] == "gpu"
    assert [(r["op"], r["size"]) for r in report["rows"]] == _expected_rows(world)
    assert all(r["check"] == "ok" for r in report["rows"]), report["rows"]
    assert all(r["tilescale_us"] > 0 and r["baseline_us"] > 0 for r in report["rows"])
    if gpus == 1:
        assert "SHARING 1 GPU: times are time-sliced, NOT a speed measurement" in report["title"]
    else:
        assert "one per GPU" in report["title"] and "NCCL" in report["title"]
    print(res.stdout[res.stdout.index("== TileScale vs torch"):])
