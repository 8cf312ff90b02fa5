"""compile_once: a host-wide file lock, not a collective (CPU tests, real processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import os
import time
from pathlib import Path

import pytest

from tilescale_lang import compile_lock


def test_lock_path_follows_tilelang_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "c"))
    per_user = f"tilescale-locks-{os.getuid()}"
    assert compile_lock.lock_path() == tmp_path / "c" / per_user / compile_lock.LOCK_NAME
    assert compile_lock.lock_path(tmp_path) == tmp_path / per_user / compile_lock.LOCK_NAME


def test_processes_take_turns(tmp_path):
    """Three processes compiling at once never overlap inside the lock."""
    log = tmp_path / "log"
    script = textwrap.dedent(f"""
        import os, time
        from tilescale_lang.compile_lock import compile_once
        def build():
            with open({str(log)!r}, "a") as f:
                f.write(f"start {{time.monotonic()}}\\n")
            time.sleep(0.3)
            with open({str(log)!r}, "a") as f:
                f.write(f"end {{time.monotonic()}}\\n")
            return 7
        assert compile_once(build, cache_dir={str(tmp_path)!r}, timeout=60) == 7
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    events = [line.split() for line in log.read_text(encoding="utf-8").splitlines()]
    assert [kind for kind, _ in events] == ["start", "end"] * 3  # strictly alternating: no overlap


def test_waiting_past_the_deadline_names_the_holder(tmp_path):
    path = tmp_path / compile_lock.LOCK_NAME
    with compile_lock.compile_lock(path):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"waited 0.3 s for the TileScale compile lock .* \(held by pid {os.getpid()}\)"):
            with compile_lock.compile_lock(path, timeout=0.3):
                pass
        assert time.monotonic() - t0 < 5
    with compile_lock.compile_lock(path, timeout=1):  # released: free again
        pass
    with pytest.raises(ValueError, match="timeout"):
        with compile_lock.compile_lock(path, timeout=0):
            pass


def _only_rank0_compiles(rank, world_size, cache_dir):
    import torch.distributed as dist

    import tilelang  # noqa: F401  (wraps tilelang.compile)
    from tilescale_lang import codegen

    compile_fn = codegen.wrap_compile(lambda *a, **k: f"kernel on {rank}")
    out = None
    if rank == 0:  # a kernel only rank 0 launches: the peers never call compile
        out = compile_fn("f", compile_once=True)  # no compile_group: the lock alone, no collective
    dist.barrier()
    return out


def test_a_kernel_only_one_rank_compiles_does_not_hang(tmp_path, monkeypatch):
    """compile_once without a compile_group is the host-wide lock, not a collective: with a
    barrier inside it, rank 0's barrier would pair with the peers' and hang.  (With a
    compile_group it is the collective form, test_compile_root.py.)"""
    from tilescale_core.multiprocess import run_ranks

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    out = run_ranks(_only_rank0_compiles, 2, args=(str(tmp_path),), backend="gloo", timeout=60,
                    env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert out == ["kernel on 0", None]


def test_lock_is_private_and_never_follows_a_symlink(tmp_path):
    import stat

    path = compile_lock.lock_path(tmp_path)
    with compile_lock.compile_lock(path):
        pass
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert path.read_text(encoding="utf-8") == ""  # the holder's pid is cleared on release
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(PermissionError, match="is a symlink; refusing to follow it"):
        with compile_lock.compile_lock(path):
            pass
    assert victim.read_text(encoding="utf-8") == "precious"


def test_lock_directory_that_is_a_symlink_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = compile_lock.lock_path(tmp_path / "cache")
    path.parent.parent.mkdir(parents=True)
    path.parent.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="not a plain directory"):
        with compile_lock.compile_lock(path):
            pass


# --------------------------------------------------------------------- issue 39: what the lock trusts
def _other_user() -> tuple[int, int]:
    """(uid, gid) of a second user, for files and processes that are not this user's; skips
    where that is impossible (only root can make them)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second user id (chown, setuid)")
    import pwd

    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _kernel_holders(path) -> list[int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return compile_lock._lock_holders(fd) or []
    finally:
        os.close(fd)


def test_lock_directory_open_to_other_users_is_refused(tmp_path):
    """A 0777 lock directory lets another user plant (and hold) the lock file: refused."""
    path = compile_lock.lock_path(tmp_path)
    path.parent.mkdir(parents=True)
    os.chmod(path.parent, 0o777)
    with pytest.raises(PermissionError, match=r"compile lock directory .* has mode 0777.*must be 0700"):
        with compile_lock.compile_lock(path, timeout=1):
            pass
    assert not path.exists()


def test_lock_file_of_another_user_is_refused(tmp_path):
    """A lock file another user owns (planted while the directory was open) is refused, not
    waited on."""
    uid, gid = _other_user()
    path = compile_lock.lock_path(tmp_path)
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text("")
    os.chmod(path, 0o600)
    os.chown(path, uid, gid)
    with pytest.raises(PermissionError, match=rf"compile lock {path} belongs to uid {uid}, not to this user"):
        with compile_lock.compile_lock(path, timeout=1):
            pass


def test_lock_held_by_another_user_fails_at_once_instead_of_stalling(tmp_path):
    """Another user creates the lock in a shared directory and holds it: the compile is refused
    at once, naming the owner, instead of waiting out the deadline (a stall of every compile)."""
    import shutil
    import tempfile

    uid, gid = _other_user()
    flock_tool = shutil.which("flock")
    if flock_tool is None:
        pytest.skip("needs util-linux flock(1) to hold a lock as the second user")
    shared = Path(tempfile.mkdtemp(prefix="tilescale-lock-test-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)  # like /tmp: everyone may create files
        path = shared / compile_lock.LOCK_NAME
        holder = subprocess.Popen([flock_tool, "-x", str(path), "sleep", "60"], user=uid, group=gid,
                                  extra_groups=[], umask=0o077)
        try:
            deadline = time.monotonic() + 20
            while not (path.exists() and _kernel_holders(path)):
                assert time.monotonic() < deadline and holder.poll() is None, "the second user never took the lock"
                time.sleep(0.05)
            t0 = time.monotonic()
            with pytest.raises(PermissionError, match=rf"belongs to uid {uid}"):
                with compile_lock.compile_lock(path, timeout=5):
                    pass
            assert time.monotonic() - t0 < 2
        finally:
            holder.kill()
            holder.wait()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_lock_file_open_to_other_users_is_refused(tmp_path):
    path = tmp_path / compile_lock.LOCK_NAME
    path.write_text("")
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match=r"has mode 0644.*must be 0600"):
        with compile_lock.compile_lock(path, timeout=1):
            pass


@pytest.mark.parametrize("text", ["1", "9" * 60, "\u0661\u0662", "pid 1 (root)"])
def test_holder_named_in_a_timeout_cannot_be_spoofed(tmp_path, text):
    """The pid text in the lock file is only the holder's say-so: a timeout names the holder
    the kernel records, whatever the file says (a huge number used to crash os.kill, Arabic
    digits passed str.isdigit)."""
    path = tmp_path / compile_lock.LOCK_NAME
    with compile_lock.compile_lock(path):
        path.write_text(text, encoding="utf-8")  # CI may run under an ASCII locale
        with pytest.raises(TimeoutError, match=rf"held by pid {os.getpid()}\)$"):
            with compile_lock.compile_lock(path, timeout=0.2):
                pass


def test_holder_from_the_file_is_checked_where_the_kernel_table_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_lock, "_lock_holders", lambda fd: None)  # no /proc/locks
    path = tmp_path / compile_lock.LOCK_NAME
    with compile_lock.compile_lock(path):
        for text, named in (("9" * 60, "unknown (no valid pid recorded)"), ("\u0661", "unknown (no valid pid recorded)"),
                            (str(os.getpid()), f"pid {os.getpid()} (as recorded in the lock file)")):
            path.write_text(text, encoding="utf-8")  # CI may run under an ASCII locale
            with pytest.raises(TimeoutError) as err:
                with compile_lock.compile_lock(path, timeout=0.1):
                    pass
            assert str(err.value).endswith(f"(held by {named})"), str(err.value)


def test_empty_cache_dir_is_refused_and_relative_ones_are_made_absolute(monkeypatch, tmp_path):
    """TILELANG_CACHE_DIR="" put the lock in each process's working directory."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", "")
    with pytest.raises(ValueError, match=r"TILELANG_CACHE_DIR is empty"):
        compile_lock.lock_path()
    monkeypatch.setenv("TILELANG_CACHE_DIR", "  ")
    with pytest.raises(ValueError, match=r"TILELANG_CACHE_DIR is empty"):
        compile_lock.lock_path()
    with pytest.raises(ValueError, match=r"cache_dir is empty"):
        compile_lock.lock_path("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TILELANG_CACHE_DIR", "rel")
    path = compile_lock.lock_path()
    assert path.is_absolute() and path == tmp_path / "rel" / f"tilescale-locks-{os.getuid()}" / compile_lock.LOCK_NAME
