"""tilescale-run under faults: a killed launcher, forwarded signals, a failed rank's children,
bad ports and grace values (real subprocesses, CPU only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(120)

# Each rank writes its pid (and its child's) to <dir>/pid.<rank>, then waits.
RANK_BODY = """
import os, signal, subprocess, sys, time
out = sys.argv[1]
child = None
if os.environ.get("SPAWN_CHILD"):
    child = subprocess.Popen(["sleep", "300"])  # inherits the output pipe
def on_signal(signum, frame):
    print(f"rank {os.environ['RANK']} got {signal.Signals(signum).name}", flush=True)
    sys.exit(0)
for sig in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, on_signal)
with open(os.path.join(out, f"pid.{os.environ['RANK']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid if child else 0}")
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    time.sleep(0.5)
    raise SystemExit(7)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _start(tmp_path, n=2, extra_env=None, args=()):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(RANK_BODY))
    env = dict(os.environ, **(extra_env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tilescale_host.launcher", "-n", str(n), *args, str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = [tmp_path / f"pid.{r}" for r in range(n)]
        if all(f.exists() and f.read_text(encoding="utf-8").strip() for f in files):
            return proc, [tuple(int(x) for x in f.read_text(encoding="utf-8").split()) for f in files]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"ranks did not start: {proc.communicate()}")


def _wait_dead(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return time.monotonic()
        time.sleep(0.05)
    return None


def test_ranks_die_when_the_launcher_is_sigkilled(tmp_path, clean_env):
    proc, pids = _start(tmp_path)
    start = time.monotonic()
    proc.kill()  # SIGKILL: the launcher cannot forward anything
    proc.wait()
    ended = _wait_dead([p for p, _ in pids], 10)
    for p, _ in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    assert ended is not None, "ranks outlived the SIGKILLed launcher"
    assert ended - start < 5


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_every_rank(tmp_path, clean_env, sig):
    proc, pids = _start(tmp_path)
    start = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    name = signal.Signals(sig).name
    for r in range(2):
        assert f"[rank {r}] rank {r} got {name}" in out, out
    assert f"got {name}; forwarding it to every rank" in err
    assert _wait_dead([p for p, _ in pids], 5) is not None


def test_a_failed_ranks_children_are_stopped_and_do_not_delay_the_exit(tmp_path, clean_env):
    proc, pids = _start(tmp_path, extra_env={"SPAWN_CHILD": "1", "FAIL_RANK": "1"}, args=("--grace", "2"))
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 7, err[-2000:]
    assert "rank 1 failed (exit code 7)" in err
    children = [c for _, c in pids]
    assert _wait_dead(children, 5) is not None, "a rank's child process outlived the run"
    assert elapsed < 4.5, f"the launcher took {elapsed:.1f} s to exit"


@pytest.mark.parametrize(
    "env, args, message",
    [
        ({"MASTER_PORT": "abc"}, (), "MASTER_PORT='abc' is not an integer port"),
        ({"TILESCALE_MASTER_PORT": "70000"}, (), "TILESCALE_MASTER_PORT='70000' is not a TCP port"),
        ({}, ("--master-port", "0"), "--master-port=0 is not a TCP port"),
        ({}, ("--grace", "-1"), "--grace must be a non-negative, finite number"),
        ({}, ("--grace", "nan"), "--grace must be a non-negative, finite number"),
    ],
)
def test_bad_ports_and_grace_are_one_line_errors(tmp_path, clean_env, env, args, message):
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    full_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "TILESCALE_MASTER_PORT")}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "tilescale_host.launcher", "-n", "2", *args, str(script)],
        capture_output=True, text=True, env=full_env, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "ran" not in proc.stdout
