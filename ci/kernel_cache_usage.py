"""Which entries of a carried TileLang kernel cache a run used, and pruning the others.

The cache carried to the device machines (``.tlcache.tar.xz``, see ``ci/device-check.sh``)
only grows: a kernel whose source changed gets a new entry and the old one stays, while a
device call carries at most 64 MiB. This tool finds the entries a run read, by their files'
access times:

``python3 ci/kernel_cache_usage.py stamp CACHE``
    before the run: every file's access time set just before its modification time, so the
    first read of it afterwards records the time of the read (Linux's default ``relatime``
    mount option updates an access time that is not later than the modification time).
``python3 ci/kernel_cache_usage.py used CACHE SINCE``
    after the run: the kernel entries (directories holding ``executable.so``, paths relative
    to ``CACHE``) read or written at or after ``SINCE`` (seconds since the epoch), one a line;
    a first line ``# ...`` says when this filesystem records no reads (``noatime``), and the
    list then holds the written entries only.
``python3 ci/kernel_cache_usage.py prune CACHE USED.txt [USED.txt ...] [--dry-run]``
    removes every kernel entry none of the lists names; prints what it removed and what is
    left. (TileScale's launch metadata, ``tilescale-launch/*.json``, a few KiB in all, stays.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pack_kernel_cache import KERNEL_MARK, _size  # the same entries that script packs (ci/ is on sys.path)


def kernel_entries(cache: Path) -> list:
    """The kernel entries of ``cache`` (directories holding ``executable.so``), sorted."""
    return sorted(mark.parent for mark in cache.rglob(KERNEL_MARK))


def stamp(cache: Path) -> int:
    """Set the access time of every file of ``cache`` 1 s before its modification time;
    returns the number of files."""
    count = 0
    for path in cache.rglob("*"):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            os.utime(path, ns=(st.st_mtime_ns - 10**9, st.st_mtime_ns))
            count += 1
    return count


def records_reads(directory: Path) -> bool:
    """Whether reading a file in ``directory`` updates its access time after :func:`stamp`
    (false on a ``noatime`` mount)."""
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        probe = Path(tmp) / "probe"
        probe.write_bytes(b"x")
        stamp(Path(tmp))
        before = probe.stat().st_atime_ns
        probe.read_bytes()
        return probe.stat().st_atime_ns > before


def used_entries(cache: Path, since: float) -> list:
    """The kernel entries of ``cache`` with a file read or written at or after ``since``,
    as paths relative to ``cache``."""
    since_ns = int(since * 10**9)
    used = []
    for entry in kernel_entries(cache):
        stats = (f.stat() for f in entry.iterdir() if f.is_file())
        if any(max(st.st_atime_ns, st.st_mtime_ns) >= since_ns for st in stats):
            used.append(entry.relative_to(cache).as_posix())
    return used


def read_lists(paths) -> set:
    """The entries named by the ``used`` lists ``paths`` (comment lines left out)."""
    names = set()
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                names.add(line)
    return names


def prune(cache: Path, keep: set, dry_run: bool = False) -> tuple:
    """Remove the kernel entries of ``cache`` not in ``keep`` (relative paths); returns
    ``(removed, kept, bytes removed)``."""
    removed, kept, freed = 0, 0, 0
    for entry in kernel_entries(cache):
        if entry.relative_to(cache).as_posix() in keep:
            kept += 1
            continue
        removed += 1
        freed += _size(entry)
        if not dry_run:
            shutil.rmtree(entry)
    return removed, kept, freed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stamp", help="mark every file unread").add_argument("cache", type=Path)
    u = sub.add_parser("used", help="list the entries read or written since a time")
    u.add_argument("cache", type=Path)
    u.add_argument("since", type=float, help="seconds since the epoch")
    r = sub.add_parser("prune", help="remove the entries no list names")
    r.add_argument("cache", type=Path)
    r.add_argument("lists", nargs="+", help="files of entries to keep (the output of `used`)")
    r.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    args = p.parse_args(argv)
    if not args.cache.is_dir():
        print(f"kernel cache: {args.cache} is not a directory", file=sys.stderr)
        return 2
    if args.command == "stamp":
        print(f"kernel cache: {stamp(args.cache)} files marked unread")
    elif args.command == "used":
        if not records_reads(args.cache):
            print("# this filesystem records no reads (noatime): only the entries written are listed")
        for name in used_entries(args.cache, args.since):
            print(name)
    else:
        keep = read_lists(args.lists)
        if not keep:
            print("kernel cache: the lists name no entry; nothing removed", file=sys.stderr)
            return 2
        removed, kept, freed = prune(args.cache, keep, args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        print(f"kernel cache: {verb} {removed} entries ({freed / 2**20:.1f} MiB), {kept} kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
