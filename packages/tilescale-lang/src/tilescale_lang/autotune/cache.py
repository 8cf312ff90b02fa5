"""The autotuner's disk cache: one JSON file per tuned kernel name, entries by key, written
under a file lock by the root rank only.

Where: ``<cache_dir>/tilescale-autotune/<name>.json`` with ``cache_dir`` TileLang's cache
directory (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``) unless given; the name is
kept to ``[A-Za-z0-9._-]`` (other characters become ``_``). Writes hold
:func:`tilescale_lang.compile_lock.compile_lock` on
``<cache_dir>/tilescale-locks-<uid>/tilescale-autotune.lock`` (the compile lock's private
per-user directory and checks), read the file again under the lock, add or replace the one
entry, and replace the file atomically (a temporary file in the same directory, flushed and
``fsync``-ed, then ``os.replace``): a reader sees the old file or the new one, never a torn
one, and two writers of the same key leave one entry (the later one's). Reads take no lock.

The file (``"version": 1``)::

    {
      "format": "tilescale-autotune",
      "version": 1,
      "entries": {
        "<key hash: 32 hex digits of SHA-256 over the key's canonical JSON>": {
          "key": {"name": "gemm", "gpu": "NVIDIA H200", "arch": "sm_90", "toolkit": "12.8",
                  "tilelang": "0.1.15", "tilescale_lang": "0.1.0", "dtype": "bfloat16",
                  "shapes": {"m": 4096, "n": 3584, "k": 8192}, "world_size": 2,
                  "space": "<SearchSpace.fingerprint()>", "extra": {}},
          "config": {"block_m": 128, "block_n": 256, ...},   # the winner
          "time_ms": 0.412,                                   # its time (the policy's)
          "policy": "root",                                   # or "slowest"
          "timings": [{"config": {...}, "time_ms": 0.412}, ...],   # every timed candidate
          "skipped": [{"config": {...}, "stage": "compile", "error": "..."}, ...],
          "created": "2025-06-01T12:00:00Z"                   # UTC, when it was written
        }
      }
    }

An entry is used only when its ``key`` equals the key asked for and its ``config`` is a
candidate of the space (so an edited or planted file can at worst pick another valid
candidate, and only one that already passed the space's filter). A file that is not this
format is ignored with a warning on read and replaced on the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import compile_lock
from .space import SearchSpace, canonical_json, json_tree

__all__ = ["FORMAT", "FORMAT_VERSION", "DIRECTORY_NAME", "LOCK_NAME", "TuneCache", "current_environment",
           "key_hash", "make_key"]

#: ``"format"`` of every cache file.
FORMAT = "tilescale-autotune"
#: ``"version"`` of the file layout documented above.
FORMAT_VERSION = 1
#: Directory of the cache files inside the cache directory.
DIRECTORY_NAME = "tilescale-autotune"
#: The lock's file name, in the compile lock's per-user directory.
LOCK_NAME = "tilescale-autotune.lock"
#: The hardware and software fields of a key (:func:`current_environment`).
ENVIRONMENT_FIELDS = ("gpu", "arch", "toolkit", "tilelang", "tilescale_lang")


def current_environment(device: Any = None) -> dict:
    """The hardware and software part of a cache key, for this process's ``device`` (default:
    the current CUDA device): ``gpu`` (its name), ``arch`` (``"sm_90"``), ``toolkit`` (the CUDA
    toolkit TileLang compiles with, ``"12.8"``), ``tilelang`` and ``tilescale_lang`` (the
    versions). Without a GPU or a toolkit those fields are ``"none"``."""
    import tilelang
    import torch

    import tilescale_lang

    from ..toolkit import find_toolkit

    gpu = arch = "none"
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
        gpu = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"sm_{major}{minor}"
    kit = find_toolkit()
    return {"gpu": gpu, "arch": arch, "toolkit": "none" if kit is None else "%d.%d" % kit.version,
            "tilelang": str(getattr(tilelang, "__version__", "unknown")),
            "tilescale_lang": tilescale_lang.__version__}


def make_key(name: str, space: SearchSpace, dtype: Any, shapes: Any, world_size: int,
             environment: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict:
    """The cache key (a JSON-ready dict) of tuning ``name`` over ``space``.

    Args:
        name: the tuned kernel's name (also the cache file's).
        space: its search space (the key holds its fingerprint).
        dtype: a ``torch.dtype`` or a str (stored as ``"bfloat16"``, without ``torch.``).
        shapes: the problem's sizes: a mapping (``{"m": 4096, ...}``) or a sequence of ints /
            shapes; JSON-able after tuples become lists.
        world_size: ranks in the group (a positive int).
        environment: :func:`current_environment`'s fields (all of :data:`ENVIRONMENT_FIELDS`).
        extra: anything else the result depends on (JSON-able), or None.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space must be a SearchSpace, got {type(space).__name__}")
    if not isinstance(environment, Mapping) or set(ENVIRONMENT_FIELDS) - set(environment):
        raise ValueError(f"environment must be a mapping with the fields {ENVIRONMENT_FIELDS}, got {environment!r}")
    if dtype is None:
        raise ValueError("dtype must be given (a torch.dtype or its name): the winner depends on it")
    key = {f: str(environment[f]) for f in ENVIRONMENT_FIELDS}
    key.update(name=name, dtype=str(dtype).removeprefix("torch."), shapes=json_tree("shapes", shapes),
               world_size=world_size, space=space.fingerprint(), extra=json_tree("extra", extra or {}))
    return key


def key_hash(key: Mapping[str, Any]) -> str:
    """32 hex digits of SHA-256 over the key's canonical JSON: the entry's name in the file."""
    return hashlib.sha256(canonical_json(dict(key)).encode()).hexdigest()[:32]


def _file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"


class TuneCache:
    """The autotune cache files under ``cache_dir`` (see the module docstring for the layout).

    Args:
        cache_dir: the cache directory (default: TileLang's ``TILELANG_CACHE_DIR``); the files
            go to its ``tilescale-autotune`` folder, the lock to its ``tilescale-locks-<uid>``.
        timeout: seconds a write waits for the lock.

    Raises:
        ValueError: ``cache_dir`` (or ``TILELANG_CACHE_DIR``) is empty.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, *,
                 timeout: float = compile_lock.DEFAULT_TIMEOUT_S):
        lock = compile_lock.lock_path(cache_dir)  # validates the directory; the compile lock's folder
        self.directory = lock.parent.parent / DIRECTORY_NAME
        self.lock_path = lock.with_name(LOCK_NAME)
        self.timeout = timeout

    def path(self, name: str) -> Path:
        """The file holding ``name``'s entries."""
        return self.directory / f"{_file_stem(name)}.json"

    def entries(self, name: str) -> dict:
        """All entries of ``name``'s file (``{key hash: entry}``); ``{}`` when the file is
        missing, and with a warning when it is not this format."""
        path = self.path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            warnings.warn(f"autotune cache {path} is not JSON ({exc}); ignoring it", RuntimeWarning, stacklevel=2)
            return {}
        if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == FORMAT_VERSION
                and isinstance(data.get("entries"), dict)):
            warnings.warn(f"autotune cache {path} is not a {FORMAT} version {FORMAT_VERSION} file; ignoring it",
                          RuntimeWarning, stacklevel=2)
            return {}
        return data["entries"]

    def load(self, key: Mapping[str, Any]) -> dict | None:
        """The entry stored for ``key``, or None (no file, no entry, or an entry whose recorded
        key differs: a hash collision or an edited file)."""
        entry = self.entries(key["name"]).get(key_hash(key))
        if not isinstance(entry, dict) or entry.get("key") != dict(key) or not isinstance(entry.get("config"), dict):
            return None
        return entry

    def store(self, key: Mapping[str, Any], entry: Mapping[str, Any]) -> Path:
        """Write ``entry`` (its ``key`` set to ``key``, ``created`` to now) under the lock,
        replacing any entry of the same key; returns the file's path."""
        record = dict(entry, key=dict(key), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        canonical_json(record)  # refuse what would not round-trip, before taking the lock
        path = self.path(key["name"])
        with compile_lock.compile_lock(self.lock_path, self.timeout):
            entries = self.entries(key["name"])
            entries[key_hash(key)] = record
            self._replace(path, {"format": FORMAT, "version": FORMAT_VERSION, "entries": entries})
        return path

    @staticmethod
    def _replace(path: Path, data: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True, allow_nan=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
