"""The tilescale pytest plugin, driven through pytester: CPU (gloo) multi-rank tests, skips,
failures with the rank's traceback, timeouts, and the validation record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

RANK_TESTS = '''
import os
import pytest
import torch
import torch.distributed as dist
from tilescale_host.testing import multirank


@pytest.mark.ranks(2, cpu_only=True, timeout=60)
@pytest.mark.parametrize("scale", [1, 10])
def test_all_reduce(rank, world_size, scale, tmp_path):
    t = torch.tensor([float(rank * scale)])
    dist.all_reduce(t)
    assert world_size == 2 and t.item() == scale
    (tmp_path / f"rank{rank}").write_text(str(os.getpid()))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.ranks("world", cpu_only=True, timeout=60)
def test_rank_count_from_a_parameter(rank, world_size, world):
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert world_size == world and t.item() == world and 0 <= rank < world


@multirank(2, cpu_only=True, timeout=60)
def test_rank_one_fails(rank):
    if rank == 1:
        raise AssertionError("rank one saw a wrong value")


@multirank(2, cpu_only=True, timeout=3)
def test_hangs(rank):
    import time
    if rank == 0:
        time.sleep(60)


@multirank(2, timeout=30)
def test_needs_gpus(rank):
    pass


@pytest.mark.requires_capability("no_such_thing")
def test_gated_unknown():
    pass


@pytest.mark.requires_capability("always")
def test_gated_present():
    pass


@pytest.mark.tilescale_gpu
def test_gpu_only():
    pass
'''

SCRUB = ("TILESCALE_SHARE_GPUS", "TILESCALE_VALIDATION_RECORD", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")

CONFTEST = '''
from tilescale_host.testing import register_capability
register_capability("always", lambda: True)
'''


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One inner pytest session (in a subprocess, without GPUs) shared by the checks below."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_ranks.py").write_text(RANK_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a GPU machine
    record = root / "records"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "--tilescale-record", str(record)],
        cwd=root, env=env, capture_output=True, text=True, timeout=180,
    )
    return pytest.RunResult(proc.returncode, proc.stdout.splitlines(), proc.stderr.splitlines(), 0.0), record


def test_outcomes(result):
    res, _ = result
    res.assert_outcomes(passed=5, failed=2, skipped=3)


def test_failing_rank_traceback_is_the_failure(result):
    res, _ = result
    res.stdout.fnmatch_lines(["*rank 1 of 2 failed:*", "*AssertionError: rank one saw a wrong value*"])


def test_timeout_fails_instead_of_hanging(result):
    res, _ = result
    # rank 0 hangs; on a loaded machine rank 1 may still be starting when the deadline passes
    res.stdout.fnmatch_lines(["*ranks [[]0*[]] did not finish within 3 s*test timeout 3 s*"])


def test_skip_reasons(result):
    res, _ = result
    res.stdout.fnmatch_lines_random([
        "*no CUDA GPU is visible; this test runs 2 ranks on GPUs*",
        "*unknown capability 'no_such_thing'*",
        "*no CUDA GPU is visible (torch.cuda.device_count() == 0)*",
    ])


def test_validation_record(result):
    _, record = result
    (path,) = record.glob("tilescale-validation-*.jsonl")
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    session, tests, summary = lines[0], lines[1:-1], lines[-1]
    assert session["kind"] == "session" and session["gpu_count"] == 0 and session["mode"] == "one-rank-per-GPU"
    by_id = {t["nodeid"].split("::")[1]: t for t in tests}
    assert by_id["test_all_reduce[1]"]["outcome"] == "passed"
    assert by_id["test_all_reduce[1]"]["ranks"] == 2 and by_id["test_all_reduce[1]"]["mode"] == "cpu"
    assert by_id["test_rank_one_fails"]["outcome"] == "failed"
    assert by_id["test_needs_gpus"]["outcome"] == "skipped"
    assert "no CUDA GPU" in by_id["test_needs_gpus"]["skip_reason"]
    assert by_id["test_gated_present"]["capabilities"] == ["always"]
    assert by_id["test_gated_unknown"]["skip_reason"].startswith("unknown capability 'no_such_thing'")
    assert by_id["test_rank_count_from_a_parameter[3]"]["ranks"] == 3
    assert summary["kind"] == "summary" and summary["counts"] == {"ran": 5, "failed": 2, "skipped": 3}
    assert set(summary["skipped"]) == {t["nodeid"] for t in tests if t["outcome"] == "skipped"}


def test_share_mode_runs_instead_of_skipping_on_too_few_gpus(pytester, clean_env, monkeypatch):
    """Skip decisions only (no GPU here): with 1 fake GPU, 4 ranks skip unless TILESCALE_SHARE_GPUS=1."""
    pytester.makeconftest(textwrap.dedent('''
        import pytest
        from tilescale_host import testing
        testing.gpu_count = lambda: 1

        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(pyfuncitem):
            return True  # the decision is under test, not the run
    '''))
    pytester.makepyfile(test_share='''
        import pytest

        @pytest.mark.ranks(4)
        def test_four(rank):
            pass
    ''')
    pytester.runpytest_subprocess("-rs").assert_outcomes(skipped=1)
    monkeypatch.setenv("TILESCALE_SHARE_GPUS", "1")
    res = pytester.runpytest_subprocess("--tilescale-record", str(pytester.path / "rec"))
    res.assert_outcomes(passed=1)
    (path,) = (pytester.path / "rec").glob("*.jsonl")
    test_line = json.loads(path.read_text(encoding="utf-8").splitlines()[1])
    assert test_line["mode"] == "shared" and test_line["ranks"] == 4


def test_a_rank_count_naming_no_parameter_is_a_usage_error(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.parametrize('world', [2])\n"
                        "@pytest.mark.ranks('wrld', cpu_only=True)\ndef test_x(rank, world):\n    pass\n")
    res = pytester.runpytest_subprocess()
    res.stderr.fnmatch_lines(["*ranks('wrld') names no parametrize argument of the test (it has *'world'*)*"])


def test_rank_fixture_outside_ranks_test_is_a_usage_error(pytester):
    pytester.makepyfile("def test_x(rank):\n    pass\n")
    res = pytester.runpytest_subprocess()
    res.stdout.fnmatch_lines(["*needs @pytest.mark.ranks(n)*"])


def test_no_record_by_default(pytester, clean_env):
    pytester.makepyfile("import pytest\n@pytest.mark.tilescale_gpu\ndef test_x():\n    pass\n")
    pytester.runpytest_subprocess()
    assert not list(pytester.path.rglob("tilescale-validation-*.jsonl"))


def test_skips_added_by_other_plugins_are_recorded(pytester, clean_env):
    pytester.makeconftest('''
        import pytest

        def pytest_collection_modifyitems(config, items):
            for item in items:
                item.add_marker(pytest.mark.skip(reason="skipped by a conftest"))
    ''')
    pytester.makepyfile("import pytest\n@pytest.mark.requires_capability('tma')\ndef test_x():\n    pass\n")
    pytester.runpytest_subprocess("--tilescale-record", str(pytester.path / "rec")).assert_outcomes(skipped=1)
    (path,) = (pytester.path / "rec").glob("*.jsonl")
    summary = json.loads(path.read_text(encoding="utf-8").splitlines()[-1])
    assert list(summary["skipped"].values()) == ["skipped by a conftest"]


def test_plain_gpu_marker_is_not_claimed_unless_aliased(pytester, clean_env, monkeypatch):
    """The plugin registers and gates only ``tilescale_gpu``; a project opts ``gpu`` in."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, even on a GPU machine
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\ndef test_plain():\n    pass\n"
                        "@pytest.mark.tilescale_gpu\ndef test_ours():\n    pass\n")
    res = pytester.runpytest_subprocess("-rs", "--strict-markers")
    res.stdout.fnmatch_lines(["*'gpu' not found in `markers` configuration option*"])
    pytester.makeconftest(
        "from tilescale_host.pytest_plugin import add_gpu_marker_alias\n"
        "def pytest_configure(config):\n    add_gpu_marker_alias(config, 'gpu')\n"
    )
    res = pytester.runpytest_subprocess("-rs", "--strict-markers")
    res.assert_outcomes(skipped=2)
    res.stdout.fnmatch_lines(["*no CUDA GPU is visible (torch.cuda.device_count() == 0)*"])
    pytester.runpytest_subprocess("-m", "not gpu", "--strict-markers").assert_outcomes(skipped=1, deselected=1)
