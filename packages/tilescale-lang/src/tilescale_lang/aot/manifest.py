"""``manifest.json`` of an AOT bundle: its key, its entries, and the checks a loader makes.

The key (``manifest["key"]``) holds what the compile cache keys a kernel on:

==================  =====================================================  ===========================
field               value                                                  a loader with another one
==================  =====================================================  ===========================
``format_version``  :data:`FORMAT_VERSION` of the writer                   refuses
``archs``           the GPU architectures the cubins are for (``sm_90a``)  refuses a GPU not among them
``toolkit``         ``"major.minor"`` of the CUDA toolkit that compiled    refuses a driver older than
                                                                           it; ``toolkit=`` demands it
``tilescale_lang``  ``tilescale_lang.__version__`` (headers, table reads)  refuses
``table_version``   ``tilescale_core.table.TABLE_VERSION``                 refuses
``tilelang``        ``tilelang.__version__`` (the lowering)                logs it (JIT fallback only)
``header_abi``      :func:`tilescale_lang.headers.abi_hash`                records it
==================  =====================================================  ===========================

A refusal is a :class:`BundleMismatchError` naming the field, the bundle's value and the
expected one.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "BundleFormatError", "BundleMismatchError", "arch_matches",
           "check_key", "current_key", "read_manifest"]

#: The ``format`` field of every manifest.
FORMAT = "tilescale-aot-bundle"
#: Version of the bundle layout and of the manifest's fields; a loader reads only its own
#: (2: launches may take ``tensormap`` arguments, TMA descriptors the loader encodes).
FORMAT_VERSION = 2
#: File name of the manifest inside a bundle directory.
MANIFEST = "manifest.json"

log = logging.getLogger("tilescale_lang.aot")


class BundleMismatchError(ValueError):
    """The bundle was built for something else than what loads it.

    Attributes:
        field: the manifest key field (``"arch"``, ``"toolkit"``, ``"format_version"``,
            ``"tilescale_lang"``, ``"table_version"``).
        bundle_value: the bundle's value.
        expected: the loader's value.
    """

    def __init__(self, field: str, bundle_value: Any, expected: Any, hint: str = ""):
        self.field, self.bundle_value, self.expected = field, bundle_value, expected
        text = f"AOT bundle mismatch on {field!r}: the bundle has {bundle_value!r}, this machine expects {expected!r}"
        super().__init__(text + (f"; {hint}" if hint else ""))

    def __reduce__(self):
        return type(self), (self.field, self.bundle_value, self.expected)


class BundleFormatError(ValueError):
    """``manifest.json`` is missing, not JSON, or lacks a field (named in the message)."""


def current_key(archs: list[str], toolkit: tuple[int, int]) -> dict[str, Any]:
    """The manifest key of a bundle built now for ``archs`` with a ``toolkit`` ``(major, minor)``."""
    import tilelang
    from tilescale_core import table

    import tilescale_lang

    from .. import headers

    return {
        "format_version": FORMAT_VERSION,
        "archs": list(archs),
        "toolkit": f"{toolkit[0]}.{toolkit[1]}",
        "tilescale_lang": tilescale_lang.__version__,
        "tilelang": str(tilelang.__version__),
        "table_version": table.TABLE_VERSION,
        "header_abi": headers.abi_hash(),
    }


_KEY_FIELDS = {"format_version": int, "archs": list, "toolkit": str, "tilescale_lang": str, "tilelang": str,
               "table_version": int}
_ENTRY_FIELDS = {"name": str, "id": str, "entry": str, "args": dict, "bound": dict, "params": list,
                 "dynamic_vars": list, "table": dict, "archs": dict}


def _require(obj: dict, fields: dict[str, type], where: str) -> None:
    for name, kind in fields.items():
        if not isinstance(obj.get(name), kind):
            raise BundleFormatError(f"{where}.{name} is missing or not a {kind.__name__} "
                                    f"(got {type(obj.get(name)).__name__})")


def read_manifest(bundle_dir: str | Path) -> dict[str, Any]:
    """Read and structurally validate ``bundle_dir/manifest.json`` (format name, version first,
    then the key and every entry's fields).

    Raises:
        BundleFormatError: no manifest, not JSON, or a field missing (named).
        BundleMismatchError: another ``format`` or ``format_version`` than this loader's.
    """
    from .spec import read_json

    path = Path(bundle_dir) / MANIFEST
    manifest = read_json(path, "AOT bundle manifest", BundleFormatError, BundleFormatError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleMismatchError("format", got, FORMAT)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleMismatchError("format_version", version, FORMAT_VERSION,
                                  "rebuild the bundle with this tilescale-lang (python -m tilescale_lang.aot build)")
    if not isinstance(manifest.get("key"), dict) or not isinstance(manifest.get("kernels"), list):
        raise BundleFormatError(f"{path}: 'key' must be an object and 'kernels' a list")
    _require(manifest["key"], _KEY_FIELDS, "key")
    for i, entry in enumerate(manifest["kernels"]):
        if not isinstance(entry, dict):
            raise BundleFormatError(f"{path}: kernels[{i}] is not an object")
        _require(entry, _ENTRY_FIELDS, f"kernels[{i}]")
        for arch, per_arch in entry["archs"].items():
            _require(per_arch, {"cubin": str, "source": str, "sha256": str, "launches": list},
                     f"kernels[{i}].archs.{arch}")
    return manifest


def _cc(arch: str) -> str:
    m = re.fullmatch(r"sm_(\d{2,3})a?", arch)
    if not m:
        raise ValueError(f"arch must look like 'sm_90a' or 'sm_90', got {arch!r}")
    return m.group(1)


def arch_matches(bundle_arch: str, arch: str) -> bool:
    """Whether a cubin for ``bundle_arch`` runs on a GPU of ``arch`` (the same compute
    capability; ``sm_90a`` and ``sm_90`` both name a 9.0 GPU)."""
    return _cc(bundle_arch) == _cc(arch)


def _version(text: str) -> tuple[int, int]:
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def check_key(manifest: dict[str, Any], *, arch: str | None = None, toolkit: str | None = None,
              driver_version: int | None = None) -> None:
    """Refuse a bundle this machine must not run (see the module doc's table).

    Args:
        manifest: from :func:`read_manifest`.
        arch: this GPU's architecture (``"sm_90a"``); None skips the check (no GPU known).
        toolkit: ``"major.minor"`` the bundle must have been built with; None: no demand.
        driver_version: the CUDA driver's version (``12080`` for 12.8); when given, a bundle
            built with a newer toolkit is refused (its cubins need that driver).

    Raises:
        BundleMismatchError: naming the field and both values.
    """
    import tilelang
    from tilescale_core import table

    import tilescale_lang

    key = manifest["key"]
    if key["tilescale_lang"] != tilescale_lang.__version__:
        raise BundleMismatchError("tilescale_lang", key["tilescale_lang"], tilescale_lang.__version__,
                                  "rebuild the bundle with the installed tilescale-lang")
    if key["table_version"] != table.TABLE_VERSION:
        raise BundleMismatchError("table_version", key["table_version"], table.TABLE_VERSION)
    if arch is not None and not any(arch_matches(a, arch) for a in key["archs"]):
        raise BundleMismatchError("arch", key["archs"], arch, "build the bundle for this GPU's architecture")
    if toolkit is not None and _version(key["toolkit"]) != _version(toolkit):
        raise BundleMismatchError("toolkit", key["toolkit"], str(toolkit))
    if driver_version is not None:
        have = (driver_version // 1000, driver_version % 1000 // 10)
        if _version(key["toolkit"]) > have:
            raise BundleMismatchError("toolkit", key["toolkit"], f"{have[0]}.{have[1]}",
                                      "the CUDA driver is older than the toolkit that built the cubins")
    if key["tilelang"] != str(tilelang.__version__):
        log.info("AOT bundle built with tilelang %s, running %s (used only for JIT fallback)",
                 key["tilelang"], tilelang.__version__)
