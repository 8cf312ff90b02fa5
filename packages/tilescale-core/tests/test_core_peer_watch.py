"""PeerWatch: when one rank is SIGKILLed, every other rank stops within a second, naming it
(real processes over gloo, CPU only)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from tilescale_core.multiprocess import find_free_port
from tilescale_core.peer_watch import EXIT_PEER_DIED, process_alive

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch.distributed as dist
    from tilescale_core.peer_watch import PeerWatch
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    watch = PeerWatch()
    print("watching", flush=True)
    if rank == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # stuck, as if waiting on the dead rank
    print("NOT STOPPED", flush=True)
    """
)


def test_survivors_stop_naming_the_killed_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port, world = find_free_port(), 3
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "watching"
        start = time.monotonic()
        outs = [p.communicate(timeout=30) for p in procs]
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[2].returncode == -9
    for r in (0, 1):
        assert procs[r].returncode == EXIT_PEER_DIED, outs[r]
        assert f"[tilescale] rank {r}: peer rank 2 (pid {procs[2].pid}) died" in outs[r][1]
        assert "NOT STOPPED" not in outs[r][0]
    assert elapsed < 5.0, f"survivors took {elapsed:.1f} s to stop"


def test_process_alive():
    assert process_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not process_alive(p.pid)


GATED = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch.distributed as dist
    from tilescale_core.peer_watch import PeerWatch
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    print("ready", flush=True)
    sys.stdin.readline()  # the attacker plants its directory meanwhile
    watch = PeerWatch()
    print("watching", flush=True)
    if rank == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    """
)


def _rank_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(extra)
    return env


def test_another_users_planted_directory_and_symlinks_are_not_followed(tmp_path, other_user):
    """Another user plants ``/tmp/tilescale-peer-watch-<uid>-<pid of rank 0>`` (mode 0777) with
    symlinks named like the ranks' notes pointing at a 0600 file of the ranks' user; when a rank
    dies, the survivors still stop naming it, and the file is untouched."""
    uid, gid = other_user
    secret = tmp_path / "secret"
    secret.write_text("SECRET")
    secret.chmod(0o600)
    script = tmp_path / "job.py"
    script.write_text(GATED)
    port, world = find_free_port(), 3
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port)], env=_rank_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    planted = os.path.join(tempfile.gettempdir(), f"tilescale-peer-watch-{os.getuid()}-{procs[0].pid}")
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        links = " && ".join(f"ln -s {secret} {planted}/rank{r}.{p.pid}" for r, p in enumerate(procs))
        subprocess.run(["sh", "-c", f"mkdir -m 777 {planted} && {links}"], user=uid, group=gid, extra_groups=[],
                       check=True, timeout=30)
        assert os.stat(planted).st_uid == uid
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        subprocess.run(["rm", "-rf", planted], check=False)
    assert secret.read_text(encoding="utf-8") == "SECRET", "a rank followed another user's symlink and overwrote the file"
    for r in (0, 1):
        assert procs[r].returncode == EXIT_PEER_DIED, outs[r]
        assert f"[tilescale] rank {r}: peer rank 2 (pid {procs[2].pid}) died" in outs[r][1]


NORMAL = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    from tilescale_core.peer_watch import PeerWatch
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    watch = PeerWatch()
    base = os.environ["XDG_RUNTIME_DIR"]
    print(sorted((n, oct(os.lstat(os.path.join(base, n)).st_mode & 0o777)) for n in os.listdir(base)), flush=True)
    dist.barrier()
    watch.stop()
    dist.barrier()
    print(os.listdir(base), flush=True)
    dist.destroy_process_group()
    """
)


def test_notes_directory_is_private_under_the_runtime_dir_and_removed_at_stop(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    script = tmp_path / "job.py"
    script.write_text(NORMAL)
    port, world = find_free_port(), 2
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port)],
                         env=_rank_env(XDG_RUNTIME_DIR=str(runtime)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        during, after = out.splitlines()
        entries = eval(during)
        assert len(entries) == 1, entries
        name, mode = entries[0]
        assert name.startswith(f"tilescale-peer-watch-{os.getuid()}-") and mode == "0o700"
        assert after == "[]", "the notes directory was left behind"


def _private_dir_api():
    from tilescale_core import peer_watch

    return peer_watch.check_private_dir, peer_watch.runtime_dir


def test_private_dir_refuses_other_owner_open_mode_and_symlink(tmp_path, other_user):
    check_private_dir, _ = _private_dir_api()
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    check_private_dir(str(good))
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, *other_user)
    with pytest.raises(PermissionError, match=rf"{theirs}.*owned by uid {other_user[0]}"):
        check_private_dir(str(theirs))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(PermissionError, match=r"mode 0o777"):
        check_private_dir(str(open_dir))
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(PermissionError, match=r"symbolic link"):
        check_private_dir(str(link))


def test_runtime_dir_is_used_only_when_private(tmp_path, monkeypatch):
    _, runtime_dir = _private_dir_api()
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(private))
    assert runtime_dir() == str(private)
    private.chmod(0o777)
    assert runtime_dir() == tempfile.gettempdir()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir() == tempfile.gettempdir()
