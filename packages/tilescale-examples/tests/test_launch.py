"""How the ops launch their kernels (tilescale_examples._launch): one lean launcher prepared per
kernel, only the changing arguments passed per call, a new preparation whenever a prepared
argument differs; kernels of other backends (and test stand-ins) called directly (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tilescale_lang.lean
from tilescale_examples import _launch


class FakeLean:
    """Stands for tilescale_lang.lean.LeanLaunch: records its preparation and its calls."""

    prepared: list = []

    def __init__(self, kernel, args, changing):
        self.kernel, self.positions, self.sized_positions, self.calls = kernel, tuple(changing), (1,), []
        FakeLean.prepared.append(args)

    def trusted(self, *values):
        self.calls.append(values)


def test_one_preparation_until_a_prepared_argument_differs(monkeypatch):
    FakeLean.prepared = []
    monkeypatch.setattr(tilescale_lang.lean, "prepare", FakeLean)
    kernel, cache = SimpleNamespace(execution_backend="tvm_ffi"), {}
    buf, sized, x1, x2 = torch.zeros(8), torch.zeros(4, 4), torch.ones(3), torch.ones(5)
    _launch.launch(cache, kernel, (x1, sized, buf, 7), changing=(0,))
    _launch.launch(cache, kernel, (x2, sized, buf, 7), changing=(0,))
    (lean, fixed, objects, keyed), = cache.values()
    assert len(FakeLean.prepared) == 1 and [c[0] for c in lean.calls] == [x1, x2]
    assert fixed == [1, 2, 3] and objects == [sized, buf, 7] and [i for i, _, _ in keyed] == [1, 2, 3]
    _launch.launch(cache, kernel, (x1, sized.view(4, 4), buf, 7), changing=(0,))  # another object, the same key
    assert len(FakeLean.prepared) == 1
    _launch.launch(cache, kernel, (x1, sized, torch.zeros(8), 7), changing=(0,))  # another buffer
    _launch.launch(cache, kernel, (x1, sized.view(2, 8), torch.zeros(8), 7), changing=(0,))  # same address, new sizes
    _launch.launch(cache, kernel, (x1, sized.view(2, 8), torch.zeros(8), 8), changing=(0,))  # another scalar
    assert len(FakeLean.prepared) == 4 and len(cache) == 1
    assert _launch.prepared_launch(cache, kernel) is cache[id(kernel)][0]  # what benchmarks.launch times raw
    with pytest.raises(KeyError, match="no lean launcher prepared"):
        _launch.prepared_launch(cache, SimpleNamespace(execution_backend="tvm_ffi"))


def test_a_kept_launch_moves_only_the_views_of_a_movable_launch():
    """KeptLaunch.moving(): the positions of the views where the launch may move (its frozen
    launch takes their addresses), none where every tensor must stay (the frozen launch has
    every parameter fixed: the MoE dispatcher's, the GEMMs' whose TMA descriptors describe
    their operands); the views themselves are never kept."""
    x, y, own = torch.zeros(8), torch.zeros(4, 2), torch.zeros(2)
    args = (x.view(2, 4), own, y.view(-1), 7)
    fixed = _launch.KeptLaunch((x, y), args, (0, 2), views=((0, 0), (2, 1)), plain=True)
    movable = _launch.KeptLaunch((x, y), args, (0, 2), views=((0, 0), (2, 1)), movable=(0, 0))
    assert fixed.moving() == [] and fixed.plain and not movable.plain
    assert movable.moving() == [0, 2]
    assert fixed.args == [None, own, None, 7] and movable.args == fixed.args


def test_other_backends_and_stand_ins_are_called_directly(monkeypatch):
    FakeLean.prepared = []
    monkeypatch.setattr(tilescale_lang.lean, "prepare", FakeLean)
    seen = []
    stand_in = lambda *args: seen.append(args)  # noqa: E731
    _launch.launch({}, stand_in, (1, 2), changing=(0,))
    class CythonKernel:
        execution_backend = "cython"

        def __call__(self, *args):
            seen.append(args)

    _launch.launch({}, CythonKernel(), (3,), changing=(0,))
    assert seen == [(1, 2), (3,)] and FakeLean.prepared == []


# ------------------------------------------------------------------------------ the library's kernels
def _kernels():
    from tilescale_examples.collectives.put_exchange import build_put_exchange_kernel
    from tilescale_examples.collectives.reduce_kernel import PASS_CONFIGS, build_reduce_kernel
    from tilescale_examples.decode.norm_kernel import build_norm_kernel
    from tilescale_examples.moe.combine import build_combine_kernel
    from tilescale_examples.moe.dispatch import build_dispatch_kernel
    from tilescale_examples.moe.ll_combine import build_ll_combine_kernel
    from tilescale_examples.moe.ll_dispatch import build_ll_dispatch_kernel, build_ll_recv_kernel

    return {
        "one_shot": (lambda: build_reduce_kernel("one_shot", "bfloat16", 4), PASS_CONFIGS),
        "two_shot": (lambda: build_reduce_kernel("two_shot", "bfloat16", 4), PASS_CONFIGS),
        "put_exchange": (lambda: build_put_exchange_kernel(4096, "float16", 2, 2, 2048), None),
        "rmsnorm": (lambda: build_norm_kernel("bfloat16", 2, 4096, fp8="per_token"), None),
        "moe_dispatch": (lambda: build_dispatch_kernel(8, 2, 64, 16, "float16", "int32", 8), None),
        "moe_combine": (lambda: build_combine_kernel(8, 2, 64, 16, "float16", 8, 256), None),
        "ll_dispatch": (lambda: build_ll_dispatch_kernel(8, 2, 256, 16, blocks=8, fp8=True), None),
        "ll_send": (lambda: build_ll_dispatch_kernel(8, 2, 256, 16, blocks=8, phase="send"), None),
        "ll_recv": (lambda: build_ll_recv_kernel(8, blocks=8), None),
        "ll_combine": (lambda: build_ll_combine_kernel(8, 2, 256, 16, blocks=8), None),
    }


@pytest.mark.parametrize("name", list(_kernels()))
def test_the_ops_kernels_launch_lean(name):
    """Every kernel the ops launch through ``_launch_kernel`` is one the lean launcher makes
    itself (no host-built argument, no unknown launch attribute, no cluster): otherwise its
    calls would fall back to TileLang's launcher and pay its cost (lowered on the CPU)."""
    from tilescale_lang.aot import launch_info
    from tilescale_lang.lean_describe import _unsupported

    build, pass_configs = _kernels()[name]
    func = build()
    artifact = launch_info.lower(func, "sm_90a", pass_configs or {})
    info = launch_info.describe(func, artifact)
    assert _unsupported(artifact.device_mod) is None
    assert info["launches"] and all(launch["cluster"] is None for launch in info["launches"])


def test_the_launch_benchmarks_goals_are_read_from_the_default_launcher():
    from tilescale_examples.benchmarks.launch import goal_lines

    rows = [["torch.add", "torch", 6.5, 1.0, 0.78, "-"],
            ["AllReduce one-shot", "TileLang", 16.6, 2.55, 2.0, "ok"],
            ["AllReduce one-shot", "lean", 22.0, 3.39, 2.66, "ok"],
            ["AllReduceResidualRMSNorm", "TileLang", 40.4, 6.22, 4.88, "ok"],
            ["all-reduce kernel, raw", "TileLang", 8.1, 9.0, 9.0, "-"],
            ["empty kernel", "TileLang", 7.0, 9.5, 9.5, "-"]]  # launches alone: not ops
    assert goal_lines(rows) == ["worst op vs torch.add: 6.22 (AllReduceResidualRMSNorm; goal <= 1.2)",
                                "worst op vs symm_mem one-shot all-reduce: 4.88 (AllReduceResidualRMSNorm; goal <= 0.8)"]
    assert goal_lines(rows[:1]) == ["TileScale ops: not measured"]
    pair = ["MoE dispatch + combine, 128 tokens", "TileLang", 80.0, 12.3, 9.6, "ok"]  # two calls: half per call
    assert goal_lines(rows + [pair]) == [
        "worst op vs torch.add: 6.22 (AllReduceResidualRMSNorm; goal <= 1.2)",
        "worst op vs symm_mem one-shot all-reduce: 4.88 (AllReduceResidualRMSNorm; goal <= 0.8)"]
    assert goal_lines(rows[:2] + [pair]) == [
        "worst op vs torch.add: 6.15 (MoE dispatch + combine, 128 tokens, per call; goal <= 1.2)",
        "worst op vs symm_mem one-shot all-reduce: 4.80 (MoE dispatch + combine, 128 tokens, per call; goal <= 0.8)"]
    # with the enqueue columns (each call's cost alone): their worst ratio too, the pair's per call
    timed = [r + [r[2] / 2, r[3] / 2] for r in rows[:2] + [pair]]
    assert goal_lines(timed) == [
        "worst op vs torch.add: 6.15 (MoE dispatch + combine, 128 tokens, per call; goal <= 1.2)",
        "worst op's enqueue cost vs torch.add's: 3.08 (MoE dispatch + combine, 128 tokens, per call; goal <= 1.2)",
        "worst op vs symm_mem one-shot all-reduce: 4.80 (MoE dispatch + combine, 128 tokens, per call; goal <= 0.8)"]


def test_the_launch_benchmark_times_the_serving_ops_the_moe_dispatch_and_the_overlapped_gemms():
    """Every op the issue names has its rows (built as the benchmark builds them, on a CPU
    stand-in allocator's heap size), the MoE dispatch alone among them, and the overlapped
    GEMMs' shape fits their default tiles."""
    import torch

    from tilescale_examples import AllGatherGEMM, GemmAllReduce, GemmReduceScatter, MoEDispatcher
    from tilescale_examples.benchmarks import launch
    from tilescale_examples.overlap.gemm import GemmTiles, check_gemm_dims

    specs = launch.op_specs(2048, torch.bfloat16)
    assert set(specs) >= {"AllReduce one-shot", "AllGather", "AllToAll", "ReduceScatter", "AllReduceResidualRMSNorm",
                          launch.MOE_DISPATCH_ROW, launch.MOE_ROW, *launch.GEMM_ROWS}
    assert specs[launch.MOE_DISPATCH_ROW][0] is MoEDispatcher and specs[launch.MOE_DISPATCH_ROW][2]["validate"] is False
    assert [specs[name][0] for name in launch.GEMM_ROWS] == [AllGatherGEMM, GemmReduceScatter]
    assert specs[launch.GEMM_AR_ROW][0] is GemmAllReduce and specs[launch.GEMM_AR_ROW][1][:3] == launch.GEMM_AR_SHAPE
    m, k, n = launch.GEMM_SHAPE
    check_gemm_dims("launch", GemmTiles(), m_local=m, k=k, n=n)
    assert launch.heap_bytes(2048, torch.bfloat16) > 4 * MoEDispatcher.heap_bytes(
        dtype=torch.bfloat16, world_size=1, **launch.MOE)


def test_the_launch_benchmarks_profile_reports_one_rows_calls(monkeypatch):
    import torch

    from tilescale_examples.benchmarks import launch as bench

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    seen = []

    def lean_call():
        seen.append("lean")

    def default_call():
        seen.append("default")

    labels = [("AllGather", "lean"), ("AllGather", "TileLang")]
    report = bench._profile([lean_call, default_call], labels, "AllGather", 7)
    assert seen == ["default"] * 7 and "default_call" in report and "profile of 7 calls of AllGather (TileLang)" in report
    assert bench._profile([lean_call], labels[:1], "AllReduce", 1).startswith("--profile: no row named 'AllReduce'")
