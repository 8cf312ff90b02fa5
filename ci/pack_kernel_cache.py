"""Pack the TileLang kernels a GPU call compiled, to carry them to the next machine.

``python3 ci/pack_kernel_cache.py CACHE_DIR SINCE OUT.tar [--max-mib 15]``: every kernel entry
of TileLang's cache ``CACHE_DIR`` (a directory holding ``executable.so``, under
``<version>/<platform>/kernels/``) written at or after ``SINCE`` (seconds since the epoch),
newest first while the archive stays under ``--max-mib`` MiB (a file the device tool returns
may hold 16 MiB), plus TileScale's launch metadata (``tilescale-launch/*.json``) of that time,
into the tar ``OUT`` with paths relative to ``CACHE_DIR``. Unpacked into a ``.tlcache`` that is
carried to the next machine (``tar -C .tlcache -xf OUT.tar``), they load there without a
compile: TileLang's cache key holds the kernel source, target, pass configuration, compile
flags and TileLang's version and library hash, and of the machine that compiled only its CPU architecture.
Prints one line saying what it packed and what it left out; no archive when nothing is new.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

KERNEL_MARK = "executable.so"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def new_entries(cache: Path, since: float) -> list:
    """``(mtime, path, bytes)`` of the kernel entries and launch-metadata files of ``cache``
    written at or after ``since``, newest first."""
    found = []
    for mark in cache.rglob(KERNEL_MARK):
        entry = mark.parent
        mtime = max(f.stat().st_mtime for f in entry.iterdir())
        if mtime >= since:
            found.append((mtime, entry, _size(entry)))
    for meta in cache.glob("tilescale-launch/*.json"):
        stat = meta.stat()
        if stat.st_mtime >= since:
            found.append((stat.st_mtime, meta, stat.st_size))
    return sorted(found, key=lambda e: (-e[0], str(e[1])))


def pack(cache: Path, since: float, out: Path, max_bytes: int) -> tuple:
    """Write the newest :func:`new_entries` that fit ``max_bytes`` into ``out``; returns
    ``(packed, left_out, bytes)`` (counts of entries and the packed size)."""
    chosen, total, left = [], 0, 0
    for _, path, size in new_entries(cache, since):
        if total + size > max_bytes:
            left += 1
            continue
        chosen.append(path)
        total += size
    if chosen:
        with tarfile.open(out, "w") as tar:
            for path in chosen:
                tar.add(path, arcname=str(path.relative_to(cache)))
    return len(chosen), left, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path, help="TileLang's cache directory")
    p.add_argument("since", type=float, help="seconds since the epoch: entries written from then on")
    p.add_argument("out", type=Path, help="the tar to write")
    p.add_argument("--max-mib", type=float, default=15.0, help="largest archive, MiB")
    args = p.parse_args(argv)
    if not args.cache.is_dir():
        print(f"kernel cache: {args.cache} is not a directory, nothing packed")
        return 0
    packed, left, total = pack(args.cache, args.since, args.out, int(args.max_mib * 2**20))
    where = f"in {args.out}" if packed else "(no archive)"
    print(f"kernel cache: {packed} new entries packed ({total / 2**20:.1f} MiB) {where}; {left} left out "
          f"(over {args.max_mib:g} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
