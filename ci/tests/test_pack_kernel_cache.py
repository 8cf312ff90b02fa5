"""``ci/pack_kernel_cache.py``: what a GPU call hands back of the kernels it compiled (the
new entries only, newest first within the size cap, paths relative to the cache)."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
import pack_kernel_cache as P  # noqa: E402


def _entry(cache: Path, name: str, nbytes: int, mtime: float) -> Path:
    entry = cache / "0.1.15" / "linux-x86_64" / "kernels" / name
    entry.mkdir(parents=True)
    for file, size in ((P.KERNEL_MARK, nbytes), ("manifest.json", 10)):
        (entry / file).write_bytes(b"x" * size)
        os.utime(entry / file, (mtime, mtime))
    return entry


def test_packs_new_entries_newest_first_within_the_cap(tmp_path, capsys):
    cache = tmp_path / "cache"
    _entry(cache, "old", 100, 1000.0)
    _entry(cache, "new1", 400, 2001.0)
    _entry(cache, "new2", 400, 2002.0)
    _entry(cache, "new3", 400, 2003.0)
    (cache / "tilescale-launch").mkdir()
    meta = cache / "tilescale-launch" / "k.json"
    meta.write_text("{}", encoding="utf-8")
    os.utime(meta, (2004.0, 2004.0))
    out = tmp_path / "new.tar"
    packed, left, total = P.pack(cache, 2000.0, out, max_bytes=900)
    assert (packed, left, total) == (3, 1, 2 + 2 * 410)  # the metadata, new3, new2; new1 does not fit
    with tarfile.open(out) as tar:
        names = sorted(tar.getnames())
    assert "tilescale-launch/k.json" in names
    assert "0.1.15/linux-x86_64/kernels/new3/executable.so" in names
    assert not any("new1" in n or "old" in n for n in names)
    assert P.main([str(cache), "3000", str(tmp_path / "none.tar")]) == 0
    assert "0 new entries packed (0.0 MiB) (no archive)" in capsys.readouterr().out
    assert not (tmp_path / "none.tar").exists()
    assert P.main([str(tmp_path / "missing"), "0", str(out)]) == 0
    assert "is not a directory" in capsys.readouterr().out
