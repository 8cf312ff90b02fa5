"""Build an AOT bundle: lower every declared kernel variant, compile a cubin per arch, write
the sources, cubins and ``manifest.json``.

Bundle layout (``FORMAT_VERSION`` 1)::

    DIR/
      manifest.json                     key, entries, launch metadata (tilescale_lang.aot.manifest)
      kernels/<id>/<arch>.cu            the CUDA source nvcc compiled (TileScale include applied)
      kernels/<id>/<arch>.cubin         the cubin for that arch

``<id>`` is ``<kernel name>_<12 hex digits of the canonical arguments>``
(:func:`tilescale_lang.aot.spec.variant_id`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from . import launch_info, manifest as manifest_mod, spec as spec_mod

__all__ = ["build", "compile_variant"]

log = logging.getLogger("tilescale_lang.aot")


def _toolkit():
    from .. import toolkit

    found = toolkit.find_toolkit()
    if found is None:
        raise RuntimeError("building an AOT bundle needs a CUDA toolkit: set CUDA_HOME (no toolkit found)")
    return found


def _table_info(func: Any, helpers: set[str]) -> dict[str, Any]:
    """What a loader must bind: the ``meta_data`` table, when the kernel reads it."""
    from tilescale_core import table

    from .. import metadata

    readers = metadata.table_readers(func) if helpers else []
    return {"needed": bool(readers), "readers": readers, "has_symbol": bool(helpers),
            "symbol": metadata.SYMBOL.decode(), "entries": table.MAX_TABLE_ENTRIES,
            "layout": list(table.TABLE_LAYOUT), "version": table.TABLE_VERSION}


def _flags(options: dict[str, Any], kernel: spec_mod.KernelSpec) -> list[str]:
    from tilelang.transform import PassConfigKey

    flags: list[str] = []
    for source in (options.get("pass_configs", {}).get(PassConfigKey.TL_DEVICE_COMPILE_FLAGS),
                   options.get("compile_flags"), list(kernel.compile_flags)):
        if source:
            flags += [source] if isinstance(source, str) else list(source)
    return flags


def compile_variant(kernel: spec_mod.KernelSpec, obj: Any, args: dict[str, Any], out_dir: Path,
                    toolkit: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """Lower and compile one variant of ``kernel`` (factory ``obj`` called with ``args``) for
    each of its archs into ``out_dir/kernels/<id>/``; return its manifest entry.

    Raises:
        tilescale_lang.toolkit.ToolkitFeatureError: the kernel needs a newer toolkit.
        UnsupportedKernelError: a launch the bundle cannot describe.
        RuntimeError: nvcc failed (its log in the message).
    """
    from .. import codegen
    from .. import headers
    from .. import toolkit as toolkit_mod

    func, options = spec_mod.prim_func_of(obj, args, kernel.entry)
    helpers = codegen.tilescale_helpers(func)
    toolkit_mod.check_features(helpers, toolkit)
    pass_configs = {**options.get("pass_configs", {}), **kernel.pass_configs}
    flags = _flags({**options, "pass_configs": pass_configs}, kernel)
    vid = spec_mod.variant_id(kernel.name, args)
    rel = Path("kernels") / vid
    (out_dir / rel).mkdir(parents=True, exist_ok=True)
    entry: dict[str, Any] = {"name": kernel.name, "id": vid, "entry": kernel.entry, "args": args,
                             "defaults": defaults, "bound": {**defaults, **args}, "helpers": sorted(helpers),
                             "table": _table_info(func, helpers),
                             "compile_flags": headers.compile_flags() + flags, "archs": {}}
    for arch in kernel.archs:
        start = time.perf_counter()
        artifact = launch_info.lower(func, arch, pass_configs)
        info = launch_info.describe(func, artifact, tensormaps=True)  # TMA descriptors: encoded per call
        with tempfile.TemporaryDirectory(prefix="tilescale-aot-") as work:
            cubin, _, _ = toolkit.compile(artifact.kernel_source, work, "cubin", arch, flags)
            data = cubin.read_bytes()
        (out_dir / rel / f"{arch}.cu").write_text(artifact.kernel_source, encoding="utf-8")
        (out_dir / rel / f"{arch}.cubin").write_bytes(data)
        entry["params"], entry["dynamic_vars"] = info["params"], info["dynamic_vars"]
        entry["archs"][arch] = {"source": (rel / f"{arch}.cu").as_posix(), "cubin": (rel / f"{arch}.cubin").as_posix(),
                                "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                                "launches": info["launches"]}
        log.info("aot: %s %s for %s: %d bytes in %.1f s", vid, spec_mod.canonical(args), arch, len(data),
                 time.perf_counter() - start)
    return entry


def _prepare(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        if not (out_dir / manifest_mod.MANIFEST).is_file():
            raise FileExistsError(f"out_dir {str(out_dir)!r} is not empty and holds no bundle; pick an empty or new "
                                  "directory")
        (out_dir / manifest_mod.MANIFEST).unlink()
        shutil.rmtree(out_dir / "kernels", ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def build(spec: str | os.PathLike | dict[str, Any], out_dir: str | os.PathLike, *,
          archs: list[str] | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Build the AOT bundle that ``spec`` declares into ``out_dir``.

    Args:
        spec: a JSON spec file or its dict (:mod:`tilescale_lang.aot.spec`).
        out_dir: the bundle directory: new, empty, or an earlier bundle (replaced).
        archs: overrides every kernel's target architectures (``["sm_90a"]``).
        progress: called with one line per compiled variant (e.g. ``print``); default: the
            ``tilescale_lang.aot`` logger.

    Returns:
        the path of the written ``manifest.json``.

    Raises:
        RuntimeError: no CUDA toolkit, or nvcc failed.
        ValueError / TypeError: a malformed spec, naming the key.
        ImportError / AttributeError: an entry that does not import, naming it.
    """
    parsed = spec_mod.load_spec(spec)
    if archs is not None:
        archs = list(spec_mod.check_archs(archs, "archs"))
    toolkit = _toolkit()
    out = Path(out_dir)
    _prepare(out)
    entries, all_archs = [], []
    for kernel in parsed.kernels:
        if archs is not None:
            kernel = spec_mod.KernelSpec(kernel.name, kernel.entry, kernel.variants, tuple(archs),
                                         kernel.pass_configs, kernel.compile_flags)
        obj = spec_mod.resolve_entry(kernel.entry, parsed.base)
        defaults = spec_mod.signature_defaults(obj)
        for args in kernel.variants:
            start = time.perf_counter()
            entries.append(compile_variant(kernel, obj, args, out, toolkit, defaults))
            line = f"aot build: {entries[-1]['id']} {spec_mod.canonical(args)} ({time.perf_counter() - start:.1f} s)"
            (progress or log.info)(line)
        all_archs += [a for a in kernel.archs if a not in all_archs]
    manifest = {"format": manifest_mod.FORMAT, "format_version": manifest_mod.FORMAT_VERSION, "name": parsed.name,
                "key": manifest_mod.current_key(all_archs, toolkit.version), "kernels": entries}
    path = out / manifest_mod.MANIFEST
    path.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path
