"""tilescale-run with real subprocesses: environment, failure propagation, timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from tilescale_host.launcher import build_rank_env, parse_args


def run_launcher(tmp_path, body: str, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tilescale_host.launcher", *args, str(script), "--flag", "x"],
        capture_output=True, text=True, timeout=timeout,
    )
    return proc, time.monotonic() - start


def test_every_rank_gets_torchrun_variables(tmp_path, clean_env):
    proc, _ = run_launcher(
        tmp_path,
        """
        import json, os, sys
        keys = ["LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TILESCALE_SHARE_GPUS"]
        print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv, "name": __name__}))
        """,
        "-n", "3", "--share-gpus", "--master-port", "29555",
    )
    assert proc.returncode == 0, proc.stderr
    seen = {}
    for line in proc.stdout.splitlines():
        prefix, _, payload = line.partition("] ")
        seen[prefix] = json.loads(payload)
    assert sorted(seen) == ["[rank 0", "[rank 1", "[rank 2"]
    for r in range(3):
        got = seen[f"[rank {r}"]
        assert got["env"] == {
            "LOCAL_RANK": str(r), "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "TILESCALE_SHARE_GPUS": "1",
        }
        assert got["argv"][1:] == ["--flag", "x"] and got["name"] == "__main__"


FAIL_RANK_ONE = """
    import os, time
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        raise ValueError("boom from rank one")
    time.sleep(120)
    """


def test_one_failing_rank_stops_the_others_in_one_line(tmp_path, clean_env):
    """A rank that raised: one line from the launcher, no traceback (issue 46)."""
    proc, elapsed = run_launcher(tmp_path, FAIL_RANK_ONE, "-n", "3", "--grace", "2")
    assert proc.returncode == 1
    assert elapsed < 20, f"the other ranks were not stopped promptly ({elapsed:.1f} s)"
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "tilescale-run: rank 1 failed: ValueError: boom from rank one "
        "(stopped ranks [0, 2]; --verbose shows the traceback)"
    ]


def test_verbose_shows_the_failing_ranks_traceback(tmp_path, clean_env):
    proc, elapsed = run_launcher(tmp_path, FAIL_RANK_ONE, "-n", "3", "--grace", "2", "--verbose")
    assert proc.returncode == 1
    assert elapsed < 20, f"the other ranks were not stopped promptly ({elapsed:.1f} s)"
    assert "[rank 1] Traceback (most recent call last):" in proc.stdout
    assert "rank 1 failed (exit code 1); stopped ranks [0, 2]" in proc.stderr
    assert "[rank 1] ValueError: boom from rank one" in proc.stderr


def test_ranks_raising_the_same_error_make_one_line(tmp_path, clean_env):
    """The quick start without a GPU: every rank raises the same error; the launcher says it
    once, naming the ranks (it printed 77 lines of tracebacks for 2 ranks before, issue 46)."""
    proc, _ = run_launcher(
        tmp_path,
        """
        import os, time
        if os.environ["RANK"] != "0":
            time.sleep(0.3)  # rank 0 fails first
        raise ValueError("no CUDA device is visible\\nsecond line")
        """,
        "-n", "2", "--grace", "5",
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tilescale-run: rank") and "failed: ValueError: no CUDA device is visible second line" in lines[0]


def test_ranks_raising_different_errors_make_one_line_each(tmp_path, clean_env):
    proc, _ = run_launcher(
        tmp_path,
        """
        import os, time
        rank = int(os.environ["RANK"])
        time.sleep(0.3 * rank)
        raise KeyError(rank % 2)
        """,
        "-n", "3", "--grace", "5",
    )
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("tilescale-run: rank 0") and "failed: KeyError: 0 (" in lines[0], proc.stderr
    assert all("failed: KeyError: " in line for line in lines) and len(lines) <= 2, proc.stderr


def test_rank_ignoring_sigterm_is_killed(tmp_path, clean_env):
    proc, elapsed = run_launcher(
        tmp_path,
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["RANK"] == "0":
            time.sleep(0.3)
            sys.exit(3)
        time.sleep(120)
        """,
        "-n", "2", "--grace", "1",
    )
    assert proc.returncode == 3
    assert elapsed < 20


def test_overall_timeout_dumps_stacks_and_exits_124(tmp_path, clean_env):
    proc, elapsed = run_launcher(
        tmp_path,
        """
        import time
        def waiting_for_peers():
            time.sleep(120)
        waiting_for_peers()
        """,
        "-n", "2", "--timeout", "2", "--grace", "1",
    )
    assert proc.returncode == 124
    assert elapsed < 20
    assert "timed out after 2 s; ranks [0, 1]" in proc.stderr
    assert "waiting_for_peers" in proc.stdout  # faulthandler's stack dump, prefixed by rank


def test_module_mode_and_argument_parsing(tmp_path, clean_env):
    (tmp_path / "tsjob_mod.py").write_text("import os, sys\nprint('mod', os.environ['RANK'], sys.argv[1:])\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tilescale_host.launcher", "-n", "2", "-m", "tsjob_mod", "a", "--b"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0] mod 0 ['a', '--b']", "[rank 1] mod 1 ['a', '--b']"]
    args = parse_args(["--nproc_per_node", "4", "--timeout", "9", "s.py", "--timeout", "1"])
    assert (args.nranks, args.timeout, args.target, args.args) == (4, 9.0, "s.py", ["--timeout", "1"])


def test_rank_env_keeps_base_and_sets_defaults():
    env = build_rank_env(1, 2, 4000, base={"MASTER_ADDR": "10.1.1.1", "KEEP": "yes"})
    assert env["MASTER_ADDR"] == "10.1.1.1" and env["KEEP"] == "yes"
    assert env["TILESCALE_MASTER_PORT"] == env["MASTER_PORT"] == "4000"
    assert "TILESCALE_SHARE_GPUS" not in env


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("tilescale-run") or str((__import__("pathlib").Path(sys.executable).parent / "tilescale-run"))
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "--share-gpus" in proc.stdout


@pytest.mark.parametrize("argv", [["-n", "0", "x.py"]])
def test_bad_rank_count(tmp_path, argv):
    proc = subprocess.run([sys.executable, "-m", "tilescale_host.launcher", *argv], capture_output=True, text=True)
    assert proc.returncode != 0 and "at least 1" in proc.stderr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_port_in_use_is_one_line_before_any_rank_starts(tmp_path, clean_env, monkeypatch, how):
    """A rendezvous port another process holds: one line naming the port and what to do, exit 2,
    no rank started (each rank used to fail with its own socket traceback, issue 46)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        marker = tmp_path / "started"
        args = ("--master-port", str(port)) if how == "flag" else ()
        if how == "env":
            monkeypatch.setenv("MASTER_PORT", str(port))
        proc, _ = run_launcher(tmp_path, f"open({str(marker)!r}, 'w').close()", "-n", "2", *args)
    assert proc.returncode == 2, proc.stderr
    name = "master_port" if how == "flag" else "MASTER_PORT"
    assert proc.stderr.splitlines() == [
        f"tilescale-run: error: {name}={port} is in use on this machine (another job, or one still shutting "
        "down): pick another port, or leave it unset for a free one"], proc.stderr
    assert not marker.exists()
