"""Where the TileScale CUDA headers live, and the flags that tie a kernel to them.

The device code of every intrinsic lives in ``include/tilescale/*.cuh`` inside this wheel.
Kernels that use an intrinsic are compiled with :func:`compile_flags`: the include path, a
hash of the headers (``-DTILESCALE_ABI=<sha>``) and, when enabled, the wait timeout
(``-DTILESCALE_WAIT_TIMEOUT_MS=<ms>``).  TileLang's kernel cache hashes the compile flags, so
a kernel built against other headers or another timeout is never returned from the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

#: Directory to pass as ``-I`` (it contains ``tilescale/tilescale.cuh``).
INCLUDE_DIR = Path(__file__).with_name("include")
#: The one header the generated kernels include.
MAIN_HEADER = "tilescale/tilescale.cuh"
#: Environment variable holding the wait timeout in milliseconds (read at compile time).
WAIT_TIMEOUT_ENV = "TILESCALE_WAIT_TIMEOUT_MS"
#: Environment variable that compiles the device debug checks in (on/off; read at compile time).
DEBUG_ENV = "TILESCALE_DEBUG"


def include_dir() -> str:
    """Absolute path of the header include directory."""
    return str(INCLUDE_DIR)


def header_files(root: str | os.PathLike | None = None) -> list[Path]:
    """All ``*.cuh`` headers under ``root/tilescale`` (default: the shipped ones), sorted."""
    base = Path(root) if root is not None else INCLUDE_DIR
    return sorted((base / "tilescale").glob("*.cuh"))


def abi_hash(root: str | os.PathLike | None = None) -> str:
    """A 16-hex-digit SHA-256 over the names and contents of the headers under ``root``."""
    h = hashlib.sha256()
    for path in header_files(root):
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


_ABI_CACHE: dict[str, str] = {}


def _cached_abi() -> str:
    key = str(INCLUDE_DIR)
    if key not in _ABI_CACHE:
        _ABI_CACHE[key] = abi_hash()
    return _ABI_CACHE[key]


#: Largest wait timeout (ms): the device prints it as a 32-bit int and counts it in
#: nanoseconds in 64 bits; 2**31 - 1 ms is about 24.8 days.
MAX_WAIT_TIMEOUT_MS = (1 << 31) - 1


def wait_timeout_ms() -> int:
    """The wait timeout (ms) from ``TILESCALE_WAIT_TIMEOUT_MS``; 0 when unset (no timeout).

    Raises:
        ValueError: the variable is not an integer in ``0..MAX_WAIT_TIMEOUT_MS`` (a larger one
            would wrap: 18446744073710 ms became 0.448 ms), naming the variable.
    """
    raw = os.environ.get(WAIT_TIMEOUT_ENV, "").strip()
    if not raw:
        return 0
    what = f"{WAIT_TIMEOUT_ENV} must be an integer number of milliseconds in 0..{MAX_WAIT_TIMEOUT_MS} (0: no timeout)"
    if not re.fullmatch(r"[+-]?[0-9]+", raw):
        raise ValueError(f"{what}, got {raw!r}")
    value = int(raw)
    if not 0 <= value <= MAX_WAIT_TIMEOUT_MS:
        raise ValueError(f"{what}, got {raw!r}")
    return value


#: Environment variable (on/off, read at compile time): on compiles the run-time PE range check in.
CHECK_PE_ENV = "TILESCALE_CHECK_PE"


def _on_off(name: str) -> bool:
    """The compile-time switch ``name`` (:func:`tilescale_core.env.flag`: ``1/true/yes/on``
    on, ``0/false/no/off``, empty or unset off).

    Raises:
        ValueError: any other value, naming the variable.
    """
    from tilescale_core.env import flag

    return flag(name, False)


def check_pe_enabled() -> bool:
    """Whether the run-time PE range check is compiled in: ``TILESCALE_CHECK_PE`` on, or
    ``TILESCALE_DEBUG`` on (which turns on every device debug check).

    Raises:
        ValueError: either variable is not a boolean spelling.
    """
    return _on_off(CHECK_PE_ENV) or debug_enabled()


def compile_flags() -> list[str]:
    """The flags every kernel that uses a TileScale intrinsic is compiled with."""
    flags = [f"-I{include_dir()}", f"-DTILESCALE_ABI={_cached_abi()}"]
    timeout = wait_timeout_ms()
    if timeout:
        flags.append(f"-DTILESCALE_WAIT_TIMEOUT_MS={timeout}")
    if check_pe_enabled():
        flags.append("-DTILESCALE_CHECK_PE=1")
    if debug_enabled():
        flags.append("-DTILESCALE_DEBUG=1")
    return flags


def debug_enabled() -> bool:
    """Whether ``TILESCALE_DEBUG`` asks for the device debug checks (on/off as for
    :func:`check_pe_enabled`).

    Raises:
        ValueError: not a boolean spelling.
    """
    return _on_off(DEBUG_ENV)
