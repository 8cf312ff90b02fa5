"""``ci/kernel_cache_usage.py``: the entries of a carried kernel cache a run read (access
times after ``stamp``), and pruning the rest."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
import kernel_cache_usage as U  # noqa: E402

KERNELS = "0.1.15/linux-x86_64/kernels"


def _entry(cache: Path, name: str, mtime: float = 1000.0) -> Path:
    entry = cache / KERNELS / name
    entry.mkdir(parents=True)
    for file in (U.KERNEL_MARK, "device_kernel.cu"):
        (entry / file).write_bytes(b"x" * 100)
        os.utime(entry / file, (mtime, mtime))
    return entry


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / ".tlcache"
    for name in ("read", "unread", "also_unread"):
        _entry(root, name)
    (root / "tilescale-launch").mkdir()
    (root / "tilescale-launch" / "k.json").write_text("{}", encoding="utf-8")
    return root


def test_used_lists_the_entries_read_or_written_after_the_stamp(cache):
    if not U.records_reads(cache):
        pytest.skip("this filesystem records no reads (noatime)")
    assert U.stamp(cache) == 7
    since = time.time() - 1  # access times may be coarser than the clock
    (cache / KERNELS / "read" / U.KERNEL_MARK).read_bytes()
    new = _entry(cache, "written", mtime=time.time())
    assert new.is_dir()
    assert U.used_entries(cache, since) == [f"{KERNELS}/read", f"{KERNELS}/written"]


def test_prune_keeps_the_listed_entries_and_the_launch_metadata(cache, tmp_path, capsys):
    listed = tmp_path / "used.txt"
    listed.write_text(f"# a comment\n{KERNELS}/read\n\n", encoding="utf-8")
    assert U.main(["prune", str(cache), str(listed), "--dry-run"]) == 0
    assert "would remove 2 entries (0.0 MiB), 1 kept" in capsys.readouterr().out
    assert len(U.kernel_entries(cache)) == 3
    assert U.main(["prune", str(cache), str(listed)]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert [e.name for e in U.kernel_entries(cache)] == ["read"]
    assert (cache / "tilescale-launch" / "k.json").is_file()


def test_prune_refuses_lists_that_name_nothing(cache, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("# this filesystem records no reads\n", encoding="utf-8")
    assert U.main(["prune", str(cache), str(empty)]) == 2
    assert "name no entry" in capsys.readouterr().err
    assert len(U.kernel_entries(cache)) == 3


def test_used_says_when_reads_are_not_recorded(cache, capsys, monkeypatch):
    monkeypatch.setattr(U, "records_reads", lambda directory: False)
    assert U.main(["used", str(cache), "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# this filesystem records no reads") and len(out) == 4
    assert U.main(["stamp", str(cache / "missing")]) == 2
