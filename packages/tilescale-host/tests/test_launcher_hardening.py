"""tilescale-run and the rank entry point under bad input and badly timed signals (issue 39):
``--timeout nan``, signals during start-up and during the grace period, an inherited ignored
SIGHUP (nohup), output without newlines, more ranks than file descriptors, bad
TILESCALE_PARENT_PID / MASTER_ADDR. Real subprocesses, CPU only."""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tilescale_host import launcher

pytestmark = pytest.mark.timeout(120)

LAUNCHER = [sys.executable, "-m", "tilescale_host.launcher"]


def _script(tmp_path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "TILESCALE_MASTER_PORT", "MASTER_ADDR")}
    env.update(extra)
    return env


def _wait_for_files(paths, proc, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(os.path.exists(p) for p in paths):
            return
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"ranks did not start: {proc.communicate()}")


# --------------------------------------------------------------------------- --timeout


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_timeout_must_be_positive_and_finite(tmp_path, clean_env, value):
    script = _script(tmp_path, "print('ran')\n")
    proc = subprocess.run([*LAUNCHER, "-n", "1", "--timeout", value, script], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--timeout must be a positive, finite number of seconds" in proc.stderr and "ran" not in proc.stdout
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        launcher.launch([script], 1, timeout=float(value))


# --------------------------------------------------------------------------- signals

TRAP_BODY = """
import os, signal, sys, time
out = sys.argv[1]
def on_signal(signum, frame):
    time.sleep(float(os.environ.get("EXIT_DELAY", "0")))
    print(f"rank {os.environ['RANK']} got {signal.Signals(signum).name}, exiting", flush=True)
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, on_signal)
open(os.path.join(out, f"up.{os.environ['RANK']}"), "w").close()
time.sleep(float(os.environ.get("RUN_FOR", "60")))
print(f"rank {os.environ['RANK']} done", flush=True)
"""


def test_a_signal_during_rank_start_up_exits_128_plus_signal(tmp_path, clean_env, monkeypatch, capsys):
    """SIGTERM arrives after the first rank started and before the second: no traceback, exit
    143, the started rank gets SIGTERM and its grace, the second rank is never started."""
    script = _script(tmp_path, TRAP_BODY)
    real_popen = subprocess.Popen
    started = []

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        _wait_for_files([tmp_path / "up.0"], proc)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler runs before the next rank starts
        return proc

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    saved = {s: signal.getsignal(s) for s in launcher.FORWARDED_SIGNALS}
    try:
        status = launcher.main(["-n", "2", "--grace", "5", script, str(tmp_path)])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    out, err = capsys.readouterr()
    assert status == 128 + signal.SIGTERM, err
    assert len(started) == 1 and started[0].returncode == 0  # it exited by itself within its grace
    assert "[rank 0] rank 0 got SIGTERM, exiting" in out
    assert "got SIGTERM" in err and "Traceback" not in err


def test_a_second_ctrl_c_during_the_grace_period(tmp_path, clean_env):
    """The ranks take 2 s to exit after SIGINT; a second SIGINT 0.5 s later must not cut
    their grace short nor end the launcher with a traceback: exit status 130."""
    script = _script(tmp_path, TRAP_BODY)
    proc = subprocess.Popen([*LAUNCHER, "-n", "2", "--grace", "10", script, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(EXIT_DELAY="2"))
    _wait_for_files([tmp_path / "up.0", tmp_path / "up.1"], proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err, err
    for r in range(2):
        assert f"[rank {r}] rank {r} got SIGINT, exiting" in out, out


def test_an_ignored_sighup_stays_ignored(tmp_path, clean_env):
    """Under nohup (SIGHUP ignored when the launcher starts) a hang-up does not stop the run."""
    script = _script(tmp_path, TRAP_BODY)
    proc = subprocess.Popen([*LAUNCHER, "-n", "2", script, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(RUN_FOR="2"),
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    _wait_for_files([tmp_path / "up.0", tmp_path / "up.1"], proc)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "[rank 0] rank 0 done" in out and "[rank 1] rank 1 done" in out


# --------------------------------------------------------------------------- output


def test_a_partial_line_is_shown_before_its_newline(tmp_path, clean_env):
    """A progress bar (text without a newline) is forwarded as it comes, prefixed."""
    script = _script(tmp_path, """
        import sys, time
        sys.stdout.write("progress 50%")
        sys.stdout.flush()
        time.sleep(60)
        """)
    proc = subprocess.Popen([*LAUNCHER, "-n", "1", "--grace", "1", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    seen = b""
    deadline = time.monotonic() + 20
    try:
        while b"[rank 0] progress 50%" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                seen += os.read(proc.stdout.fileno(), 4096)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert b"[rank 0] progress 50%" in seen, seen


def test_lines_written_in_pieces_stay_whole(tmp_path, clean_env):
    """``print(a, b)`` writes its line in pieces (the ranks run unbuffered): forwarding partial
    text must not split ordinary lines between ranks."""
    script = _script(tmp_path, """
        import os
        for i in range(200):
            print("rank", os.environ["RANK"], "line", i)
        """)
    proc = subprocess.run([*LAUNCHER, "-n", "3", script], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 600
    assert all(line == f"[rank {line[6]}] rank {line[6]} line {line.rsplit(' ', 1)[1]}" for line in lines), lines


def test_output_without_newlines_does_not_grow_the_launcher(tmp_path, clean_env):
    """200 MB without a newline: the launcher's peak memory stays far below the output size
    (the old line reader held the whole 'line', several times over)."""
    script = _script(tmp_path, """
        import sys
        chunk = b"x" * (1 << 20)
        for _ in range(200):
            sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        """)
    measure = (
        "import resource, subprocess, sys\n"
        f"rc = subprocess.run({[*LAUNCHER, '-n', '1', script]!r}, stdout=subprocess.DEVNULL).returncode\n"
        "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    proc = subprocess.run([sys.executable, "-c", measure], capture_output=True, text=True, env=_env(), timeout=100)
    rc, peak_kib = map(int, proc.stdout.split())
    assert rc == 0, proc.stderr
    assert peak_kib < 64 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB for 200 MiB of output"


def test_long_lines_are_forwarded_in_bounded_chunks_and_tail_lines_are_capped(tmp_path, clean_env):
    script = _script(tmp_path, """
        import sys
        sys.stdout.write("y" * (3 << 20) + "\\nlast line\\n")
        raise SystemExit(5)
        """)
    proc = subprocess.run([*LAUNCHER, "-n", "1", script], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 5
    assert proc.stdout.count("y") == 3 << 20 and "[rank 0] last line" in proc.stdout
    assert len(proc.stderr) < 64 * 1024 and "[rank 0] last line" in proc.stderr  # the failure summary


# --------------------------------------------------------------------------- -n and file descriptors


def test_more_ranks_than_file_descriptors_is_a_clear_error(tmp_path, clean_env):
    """``ulimit -n 48`` and ``-n 60``: one line naming -n and the limit, nothing started
    (was a raw OSError from the 40-somethingth Popen); ``-n 10`` still runs."""
    script = _script(tmp_path, "import time\ntime.sleep(2)\nprint('ran')\n")

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.run([*LAUNCHER, "-n", "60", script], capture_output=True, text=True, env=_env(),
                          preexec_fn=low_limit, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "-n 60" in proc.stderr and "ulimit -n" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "ran" not in proc.stdout
    proc = subprocess.run([*LAUNCHER, "-n", "10", script], capture_output=True, text=True, env=_env(),
                          preexec_fn=low_limit, timeout=60)
    assert proc.returncode == 0 and proc.stdout.count("] ran") == 10, proc.stderr


# --------------------------------------------------------------------------- variables


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1_000"])
def test_a_bad_parent_pid_is_a_one_line_error(tmp_path, clean_env, value):
    script = _script(tmp_path, "print('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "tilescale_host._rank_main", script], capture_output=True, text=True,
                          env=_env(TILESCALE_PARENT_PID=value), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"TILESCALE_PARENT_PID={value!r} is not a process id" in proc.stderr and "Traceback" not in proc.stderr
    assert "ran" not in proc.stdout


@pytest.mark.parametrize("value", [" ", "host name", "a\tb"])
def test_a_blank_master_addr_is_refused_up_front(tmp_path, clean_env, value):
    script = _script(tmp_path, "print('ran')\n")
    proc = subprocess.run([*LAUNCHER, "-n", "2", script], capture_output=True, text=True,
                          env=_env(MASTER_ADDR=value), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"MASTER_ADDR={value!r} is not a host name or address" in proc.stderr and "Traceback" not in proc.stderr
    assert "ran" not in proc.stdout


def test_every_rank_of_one_launch_shares_a_job_id(tmp_path, clean_env):
    script = _script(tmp_path, """
        from tilescale_host.dist_init import job_id
        print("job", job_id())
        """)
    runs = [subprocess.run([*LAUNCHER, "-n", "2", script], capture_output=True, text=True,
                           env=_env(TILESCALE_JOB_ID="outer"), timeout=60) for _ in range(2)]
    ids = [sorted(line.split(" job ", 1)[1] for line in r.stdout.splitlines()) for r in runs]
    assert all(len(set(i)) == 1 and i[0] != "outer" for i in ids), ids  # one id per launch, not the inherited one
    assert ids[0][0] != ids[1][0]
