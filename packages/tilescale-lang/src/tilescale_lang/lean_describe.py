"""The lean launcher's kernel descriptions (:func:`describe_kernel`): a compiled TileLang
kernel's parameters and launches in the shape of an AOT bundle entry
(:mod:`tilescale_lang.aot.launch_info`), lowered again from its PrimFunc (no nvcc) and kept
in TileLang's cache directory, and why the lean launcher cannot launch a kernel itself, where
it cannot (:mod:`tilescale_lang.lean` launches from them)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from .aot import launch_info

__all__ = ["describe_kernel", "FORMAT", "KNOWN_ATTRS", "KNOWN_LAUNCH_TAGS"]

log = logging.getLogger("tilescale_lang.lean")
#: Version of the launch metadata kept in TileLang's cache directory (2: TMA descriptors
#: described, where version 1 refused them).
FORMAT = 2

#: Device-function attributes whose meaning the lean launcher reproduces (or that do not
#: affect a launch); a kernel with any other attribute launches through TileLang.
KNOWN_ATTRS = frozenset({
    "target", "tirx.noalias", "tl.non_restrict_params", "tirx.is_global_func", "calling_conv",
    "tirx.kernel_launch_params", "global_symbol", "thread_extent", "dyn_shared_memory_buf",
    "use_cooperative_groups", "cluster_dims", "tl.readonly_param_indices", "tl.smem_alignment_map",
})
#: Launch parameter tags of ``tirx.kernel_launch_params`` the lean launcher understands.
KNOWN_LAUNCH_TAGS = frozenset({"blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y",
                               "threadIdx.z", "tirx.use_dyn_shared_memory"})


def _unsupported(device_mod: Any) -> str | None:
    """Why the lean launcher cannot launch ``device_mod``'s kernels itself, or None."""
    for gvar, fn in device_mod.functions.items():
        attrs = fn.attrs if fn.attrs is not None else {}
        unknown = sorted(str(k) for k in attrs.keys() if str(k) not in KNOWN_ATTRS)
        if unknown:
            return f"kernel {gvar.name_hint!r} has launch attributes {unknown} the lean launcher does not make"
        tags = sorted(str(t) for t in (attrs["tirx.kernel_launch_params"] if "tirx.kernel_launch_params" in attrs
                                       else []) if str(t) not in KNOWN_LAUNCH_TAGS)
        if tags:
            return f"kernel {gvar.name_hint!r} has launch parameters {tags} the lean launcher does not make"
    return None


def _arch(kernel: Any) -> str:
    target = getattr(kernel, "target", None)
    attrs = getattr(target, "attrs", None)
    if attrs is not None and "arch" in attrs:
        return str(attrs["arch"])
    if isinstance(target, dict) and "arch" in target:
        return str(target["arch"])
    raise ValueError(f"kernel target {target!r} names no CUDA arch (compile with target={{'kind': 'cuda', "
                     "'arch': 'sm_90a'}} or 'auto' on a GPU)")


def _disk_path(func: Any, arch: str, pass_configs: dict[str, Any]) -> Path | None:
    """Where the launch metadata of ``func`` lowered for ``arch`` is kept between processes:
    ``$TILELANG_CACHE_DIR/tilescale-launch/<key>.json``, the key hashing the PrimFunc's
    structure, the arch, the pass configs and the TileLang and tilescale-lang versions;
    None when TileLang names no cache directory."""
    import tilelang
    from tilelang import tvm
    from tilelang.env import env

    from . import __version__

    cache = str(env.TILELANG_CACHE_DIR or "").strip()
    if not cache:
        return None
    text = json.dumps([FORMAT, tvm.ir.structural_hash(func), arch, sorted((str(k), repr(v)) for k, v in
                       pass_configs.items()), tilelang.__version__, __version__])
    return Path(cache) / "tilescale-launch" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def _read(path: Path | None) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("format") == FORMAT else None


def _write(path: Path | None, info: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info), encoding="utf-8")
        os.replace(tmp, path)  # whole files only, whichever process writes last
    except OSError as exc:  # a read-only cache: lowered again next time
        log.debug("lean: cannot keep launch metadata in %s: %s", path, exc)


def describe_kernel(kernel: Any) -> dict[str, Any]:
    """The launch metadata of a compiled TileLang ``kernel``, in the shape of an AOT bundle
    entry (:mod:`tilescale_lang.aot.launch_info`): ``id``, ``params``, ``dynamic_vars``,
    ``launches`` and ``unsupported`` (why the lean launcher cannot launch it itself, or None).

    The kernel keeps only compiled modules, so its PrimFunc is lowered again (no nvcc) for
    its arch and pass configs: once per kernel and process (kept on the kernel), and once
    per machine (kept in TileLang's cache directory: lowering a large kernel takes seconds).

    Raises:
        launch_info.UnsupportedKernelError: a device kernel takes an argument the metadata
            cannot describe (a TMA descriptor built on the host at each call).
    """
    state = getattr(kernel, "__dict__", {})
    info = state.get("_tilescale_launch_info")
    if info is None:
        func, arch = kernel.prim_func, _arch(kernel)
        pass_configs = dict(getattr(kernel, "pass_configs", None) or {})
        path = _disk_path(func, arch, pass_configs)
        info = _read(path)
        if info is None:
            info = {"format": FORMAT, "id": launch_info.symbol_of(func)}
            artifact = launch_info.lower(func, arch, pass_configs)
            try:
                info.update(launch_info.describe(func, artifact, tensormaps=True),
                            unsupported=_unsupported(artifact.device_mod))
            except launch_info.UnsupportedKernelError as exc:
                info["error"] = str(exc)
            _write(path, info)
        state["_tilescale_launch_info"] = info
    if "error" in info:
        raise launch_info.UnsupportedKernelError(info["error"])
    return info
