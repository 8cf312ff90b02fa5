"""Launch records: a kernel's prepared launches made from C in one call (the lean launcher's driver path).

A :class:`~tilescale_lang.lean.LeanLaunch` knows everything about its launches but the stream
and the changing arguments' values, which it writes into the packed parameters itself. Calling
the driver's ``cuLaunchKernel`` through ctypes converts eleven Python arguments per launch;
here each launch is a :class:`LaunchRecord` (a C struct: the driver entry point, the function,
grid and block, dynamic shared memory and the parameter array) and a small C helper,
:data:`SOURCE`, launches an array of them on a stream in one ctypes call of four arguments::

    records = make_records(3)                   # LaunchRecord * 3, filled by the caller
    run = helper()                              # None where no C compiler is found
    failed = ctypes.c_int(-1)
    err = run(ctypes.addressof(records), 3, stream, ctypes.byref(failed))  # 0, or the CUresult of launch failed.value

The helper is compiled once per machine with the C compiler (``$CC``, default ``cc``; the one
TileLang's toolchain needs anyway) into TileLang's cache directory
(``<cache>/tilescale-launch/launch_records-<hash>.so``, the hash of the source, the compiler,
the OS and the architecture), loaded with ctypes and kept for the process. Without a compiler
or a cache directory :func:`helper` returns None (logged once) and the lean launcher calls the
driver through ctypes as before: the same launches.

A launch made again and again with nothing but the stream changing (a
:class:`~tilescale_lang.lean.FrozenLaunch`) keeps its arguments in a :class:`LaunchCall` and
launches through :func:`call_helper`'s ``ts_launch_call_run(&call)``: one argument, already a
C object, so the ctypes call converts nothing; given the driver's ``cuStreamIsCapturing``, it
launches nothing on a stream that is capturing a CUDA graph and returns :data:`CAPTURING`::

    call = LaunchCall(records=ctypes.addressof(records), n=3, is_capturing=query_address)
    call.stream = stream
    err = call_helper()(ctypes.byref(call))     # 0, CAPTURING, or the CUresult of launch call.failed
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["LaunchRecord", "LaunchCall", "SOURCE", "CAPTURING", "helper", "call_helper", "make_records",
           "library_path"]

log = logging.getLogger("tilescale_lang.launch_records")

#: The C helper: ``ts_launch_records`` launches ``n`` records on ``stream``; returns 0, or the
#: first failing launch's CUresult with its index in ``*failed``. ``launch`` is ``cuLaunchKernel``
#: (11 arguments) or, for a cooperative record, ``cuLaunchCooperativeKernel`` (10).
#: ``ts_launch_call_run`` does the same from a :class:`LaunchCall`, first asking
#: ``is_capturing`` (``cuStreamIsCapturing``) where given.
SOURCE = r"""
typedef int (*ts_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
typedef int (*ts_cooperative_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 void *, void **);
typedef struct {
  void *launch;
  void *function;
  unsigned dims[6];
  unsigned shared_bytes;
  int cooperative;
  void **params;
} ts_launch_record;

int ts_launch_records(const ts_launch_record *records, int n, void *stream, int *failed) {
  for (int i = 0; i < n; ++i) {
    const ts_launch_record *r = records + i;
    int err = r->cooperative
        ? ((ts_cooperative_fn)r->launch)(r->function, r->dims[0], r->dims[1], r->dims[2], r->dims[3], r->dims[4],
                                         r->dims[5], r->shared_bytes, stream, r->params)
        : ((ts_launch_fn)r->launch)(r->function, r->dims[0], r->dims[1], r->dims[2], r->dims[3], r->dims[4],
                                    r->dims[5], r->shared_bytes, stream, r->params, (void **)0);
    if (err) {
      *failed = i;
      return err;
    }
  }
  return 0;
}

typedef int (*ts_is_capturing_fn)(void *, int *);
typedef struct {
  const ts_launch_record *records;
  int n;
  int failed;
  void *stream;
  void *is_capturing;
} ts_launch_call;

int ts_launch_call_run(ts_launch_call *call) {
  if (call->is_capturing) {
    int status = 0;
    if (((ts_is_capturing_fn)call->is_capturing)(call->stream, &status) || status)
      return -1;
  }
  return ts_launch_records(call->records, call->n, call->stream, &call->failed);
}
"""

#: What ``ts_launch_call_run`` returns, with nothing launched, when its call's stream is
#: capturing a CUDA graph (or the driver cannot say that it is not).
CAPTURING = -1


class LaunchRecord(ctypes.Structure):
    """One prepared launch, as the C helper reads it (a C struct, in this field order).

    Attributes:
        launch: address of the driver entry point (``cuLaunchKernel``, or
            ``cuLaunchCooperativeKernel`` when ``cooperative``).
        function: the ``CUfunction`` handle.
        dims: grid x, y, z then block x, y, z.
        shared_bytes: dynamic shared memory, in bytes.
        cooperative: nonzero for a cooperative launch.
        params: address of the ``void*`` array of the kernel's packed parameters.
    """

    _fields_ = [("launch", ctypes.c_void_p), ("function", ctypes.c_void_p), ("dims", ctypes.c_uint * 6),
                ("shared_bytes", ctypes.c_uint), ("cooperative", ctypes.c_int), ("params", ctypes.c_void_p)]


class LaunchCall(ctypes.Structure):
    """The arguments of one ``ts_launch_call_run`` (a C struct, in this field order).

    Attributes:
        records: address of the :class:`LaunchRecord` array.
        n: how many records to launch.
        failed: set by the helper to the index of the launch that failed.
        stream: the ``CUstream`` handle to launch on (0: the legacy default stream).
        is_capturing: address of the driver's ``cuStreamIsCapturing``, or None: launch into
            a capture like any launch.
    """

    _fields_ = [("records", ctypes.c_void_p), ("n", ctypes.c_int), ("failed", ctypes.c_int),
                ("stream", ctypes.c_void_p), ("is_capturing", ctypes.c_void_p)]


def make_records(n: int) -> ctypes.Array:
    """A zeroed array of ``n`` :class:`LaunchRecord` (``n >= 1``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    return (LaunchRecord * n)()


def library_path(cache_dir: Optional[str] = None, compiler: Optional[str] = None) -> Optional[Path]:
    """Where the compiled helper lives: ``<cache>/tilescale-launch/launch_records-<hash>.so``,
    the hash of the source, the compiler (``compiler`` default ``$CC``, else ``cc``), the OS and
    the machine architecture (``cache_dir`` default TileLang's cache directory,
    ``$TILELANG_CACHE_DIR`` or its default; None when none is named)."""
    cache = cache_dir if cache_dir is not None else _tilelang_cache_dir()
    if not str(cache).strip():
        return None
    compiler = compiler or _compiler()
    key = hashlib.sha256(f"{SOURCE}\0{compiler}\0{sys.platform}\0{platform.machine()}".encode()).hexdigest()[:16]
    return Path(cache) / "tilescale-launch" / f"launch_records-{key}.so"


def _tilelang_cache_dir() -> str:
    """TileLang's cache directory (``$TILELANG_CACHE_DIR``, else TileLang's default), or ""
    when TileLang names none."""
    from tilelang.env import env

    return str(env.TILELANG_CACHE_DIR or "")


def _compiler() -> str:
    """The C compiler: ``$CC``, else ``cc``."""
    return os.environ.get("CC", "cc")


def _compile(path: Path, compiler: str) -> None:
    """Compile :data:`SOURCE` into the shared library ``path`` (whole files only: written
    beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source = Path(tmp) / "launch_records.c"
        source.write_text(SOURCE, encoding="utf-8")
        out = Path(tmp) / path.name
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, path)


def _load(path: Path) -> tuple:
    """``ts_launch_records`` and ``ts_launch_call_run`` of the library at ``path``, with their C
    argument types (the second's argument left unconverted: a ``byref`` of a
    :class:`LaunchCall` is passed as it is)."""
    library = ctypes.CDLL(str(path))
    run = library.ts_launch_records
    run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    run.restype = ctypes.c_int
    call = library.ts_launch_call_run
    call.restype = ctypes.c_int
    return run, call


_helper: Any = None  # the loaded functions (ts_launch_records, ts_launch_call_run), False once they could not be made


def helper() -> Optional[Callable[..., int]]:
    """The C helper ``ts_launch_records(records, n, stream, failed) -> CUresult`` (compiled
    into :func:`library_path` and loaded at the first call, see the module docstring), or None
    where it cannot be made (no cache directory, no C compiler, a failed compile: logged
    once). Decided once per process."""
    global _helper
    if _helper is None:
        compiler = _compiler()
        path = library_path(compiler=compiler)
        try:
            if path is None:
                raise OSError("no cache directory (TILELANG_CACHE_DIR)")
            if not path.exists():
                _compile(path, compiler)
            _helper = _load(path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.info("launch records: no C helper (%s%s); launching through ctypes", exc,
                     f": {detail.decode(errors='replace')[:300]}" if detail else "")
            _helper = False
    return _helper[0] if _helper else None


def call_helper() -> Optional[Callable[..., int]]:
    """The C helper ``ts_launch_call_run(&call) -> CUresult or CAPTURING`` (see the module
    docstring; pass ``ctypes.byref`` of a :class:`LaunchCall`), made and loaded as
    :func:`helper`'s, or None where that cannot be made."""
    helper()
    return _helper[1] if _helper else None
