"""compile_once: a host-wide file lock, not a collective (CPU tests, real processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import os
import time

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
    events = [line.split() for line in log.read_text().splitlines()]
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
        out = compile_fn("f", compile_once=True, compile_group=dist.group.WORLD)
    dist.barrier()
    return out


def test_a_kernel_only_one_rank_compiles_does_not_hang(tmp_path, monkeypatch):
    """With a barrier inside compile_once this pairs rank 0's barrier with the peers' and hangs."""
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
    assert path.read_text() == ""  # the holder's pid is cleared on release
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(PermissionError, match="is a symlink; refusing to follow it"):
        with compile_lock.compile_lock(path):
            pass
    assert victim.read_text() == "precious"


def test_lock_directory_that_is_a_symlink_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = compile_lock.lock_path(tmp_path / "cache")
    path.parent.parent.mkdir(parents=True)
    path.parent.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="not a plain directory"):
        with compile_lock.compile_lock(path):
            pass
