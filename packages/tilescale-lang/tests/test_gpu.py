"""GPU tests: every intrinsic on 1 rank (peer = self) and on 2 and 4 ranks sharing one GPU.

Run with ``pytest -m gpu``; skipped with a reason when no GPU is visible.  Kernels are
compiled once into a session-wide TileLang disk cache and loaded by every later rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    from lang_gpu_helpers import session_cache

    return session_cache(tmp_path_factory, "tilelang-cache")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_intrinsics_across_ranks(world, cache_dir):
    from tilescale_core.multiprocess import run_ranks

    import gpu_kernels

    reports = run_ranks(gpu_kernels.rank_body, world, args=(cache_dir,), backend="auto", timeout=150)
    for rep in reports:
        assert rep["checks"] > 100
        assert rep["errors"] == [], f"rank {rep['rank']}: {rep['errors'][:10]}"


def test_initialize_orders_and_backends(cache_dir):
    from tilescale_core.multiprocess import run_ranks

    import gpu_kernels

    out = run_ranks(gpu_kernels.initialize_orders_body, 2, args=(cache_dir,), backend="auto", timeout=180)
    unavailable = []
    for rank, o in enumerate(out):
        # refused on the host before initialize (it used to run as "rank 0 of 0 ranks")
        assert "KernelNotInitializedError" in o["before_init"] and "'ranks'" in o["before_init"], o
        assert o["untouched"] == [-5, -5], o
        assert o["after_load_init"] == [rank, 2], o
        for backend in ("nvrtc", "cython"):
            if isinstance(o[backend], list):
                assert o[backend] == [rank, 2], (backend, o)
            elif backend == "cython" and "NotImplementedError" in o[backend]:
                pass  # the documented clear error
            else:
                # a backend that cannot build here (no libnvrtc, no cython/compiler) is
                # reported, not hidden: anything else is a failure
                assert any(w in o[backend] for w in ("DynamicLibNotFound", "ImportError", "ModuleNotFound", "C++ compiler")), (backend, o)
                unavailable.append(f"rank {rank} {backend}: {o[backend][:200]}")
    if unavailable:
        pytest.skip("backend(s) could not build on this machine: " + " | ".join(unavailable))


def test_wait_timeout_reports_and_traps(tmp_path):
    import gpu_kernels

    env = dict(os.environ, TILESCALE_WAIT_TIMEOUT_MS="200", TILELANG_CACHE_DIR=str(tmp_path / "cache"))
    script = tmp_path / "stuck_wait.py"  # a file, not -c: T.prim_func reads its source
    script.write_text(gpu_kernels.TIMEOUT_SCRIPT)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-3000:]
    assert "[tilescale] wait timed out after 200 ms" in text, text[-3000:]
    assert "expected 12345" in text and "observed 0" in text and "rank 0" in text
    assert "HOST-ERROR" in text or "CUDA" in text, text[-3000:]


def test_profiler_records_every_block_and_counts_overflow(tmp_path):
    """T.profile_event on a GPU: 8 blocks x 4 warps x 6 events into 4 slots per block; then
    caller-chosen slots (``slot=``): 2 per warp, 8 per block, no counter."""
    import json

    import gpu_kernels

    script = tmp_path / "profile.py"
    script.write_text(gpu_kernels.PROFILER_SCRIPT)
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    first, second, fixed = lines
    assert first["events"] == 8 * 4 and first["dropped"] == 8 * (4 * 4 - 4)  # 16 recorded per block, 4 kept
    assert first["blocks"] == list(range(8)) and first["sm_ok"] and first["durations_ok"]
    assert first["spans"] + first["unmatched"] <= first["events"]
    assert second == {"after_reset": 0}
    # slot=: every warp's start and end in its own two slots, no counter, nothing dropped
    assert fixed == {"fixed_events": 8 * 8, "fixed_dropped": 0, "fixed_spans": 8 * 4, "fixed_unmatched": 0,
                     "fixed_counter": 0, "fixed_pairs_ok": True}, fixed


def _run_script(tmp_path, text, **env):
    script = tmp_path / "script.py"  # a file, not -c: T.prim_func reads its source
    script.write_text(text)
    full_env = {k: v for k, v in os.environ.items() if k != "TILESCALE_CHECK_PE"}
    full_env.update(TILELANG_CACHE_DIR=str(tmp_path / "cache"), **env)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full_env, timeout=180)
    return res, res.stdout + res.stderr


def test_kernel_without_table_traps_on_the_device(tmp_path):
    import gpu_kernels

    res, text = _run_script(tmp_path, gpu_kernels.NO_TABLE_SCRIPT)
    assert "HOST-REFUSED: KernelNotInitializedError" in text, text[-3000:]
    assert res.returncode != 0 and "NO-ERROR" not in text, text[-3000:]
    assert "launched without kernel.initialize(allocator=...)" in text, text[-3000:]


def test_runtime_pe_out_of_range_traps_with_check_pe(tmp_path):
    import gpu_kernels

    res, text = _run_script(tmp_path, gpu_kernels.BAD_PE_SCRIPT, TILESCALE_CHECK_PE="1")
    assert "IN-RANGE [7, 0, 0, 0]" in text, text[-3000:]
    assert res.returncode != 0 and "NO-ERROR" not in text, text[-3000:]
    assert "PE 5 out of range: rank 0 of 1 ranks, block (" in text, text[-3000:]


def test_negative_runtime_size_traps_with_check_pe(tmp_path):
    import gpu_kernels

    res, text = _run_script(tmp_path, gpu_kernels.NEGATIVE_SIZE_SCRIPT, TILESCALE_CHECK_PE="1")
    assert "COPIED 64" in text, text[-3000:]
    assert res.returncode != 0 and "NO-ERROR" not in text, text[-3000:]
    assert "put_block size = -50 is negative: an element count must be >= 0; rank 0 block (" in text, text[-3000:]

@pytest.mark.parametrize("world", [1, 2])
def test_profiler_traces_a_collective_across_ranks(world, tmp_path):
    """A profiled all-gather on ``world`` ranks (sharing one GPU when there is one): every
    output checked, and the merged Perfetto trace holds a put and a wait span for every
    block of every rank, each block's put before its wait, on one time axis."""
    import json

    from tilescale_core.multiprocess import run_ranks
    from tilescale_lang.profiler import TID_BLOCK_STRIDE, merge_chrome_traces, render_timeline

    import gpu_profiler_kernels as G

    reports = run_ranks(G.profiled_allgather_body, world, args=(str(tmp_path / "cache"), str(tmp_path)),
                        backend="auto", timeout=180)
    for rank, rep in enumerate(reports):
        assert rep["errors"] == [] and rep["checks"] == G.CALLS, f"rank {rank}: {rep['errors']}"
        assert rep["events"] == 4 * G.BLOCKS and rep["dropped"] == 0 and rep["unmatched"] == 0, rep
        by_block = {}
        for block, task, start, end in rep["spans"]:
            assert end >= start, f"rank {rank} block {block}: span ends before it starts"
            by_block.setdefault(block, {})[task] = (start, end)
        assert sorted(by_block) == list(range(G.BLOCKS))
        for block, tasks in by_block.items():
            assert sorted(tasks) == [0, 1] and tasks[0][1] <= tasks[1][0], f"rank {rank} block {block}: {tasks}"
    merged_path = tmp_path / "trace.json"
    merge_chrome_traces([rep["path"] for rep in reports], str(merged_path))
    trace = json.loads(merged_path.read_text(encoding="utf-8"))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({(e["pid"], e["tid"] // TID_BLOCK_STRIDE, e["name"]) for e in spans}) == sorted(
        (r, b, name) for r in range(world) for b in range(G.BLOCKS) for name in G.TASKS)
    assert min(e["ts"] for e in spans) == 0.0  # one origin for every rank
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}
    print(f"\n[profiler] {world} rank(s), merged trace {merged_path}:\n{render_timeline(trace, width=60)}")
