"""The build spec of an AOT bundle: which kernels, with which arguments, for which GPUs.

A spec is a JSON file (or the same structure as a Python ``dict``)::

    {
      "name": "serving",                        # optional, default: the file's stem
      "archs": ["sm_90a"],                      # optional, default ["sm_90a"]
      "kernels": [
        {
          "name": "ring_put",                   # optional, default: the function's name
          "entry": "tilescale_examples.tutorials.ring_put:build_ring_put",
          "args": [{"n": 4096}],                # keyword arguments, one dict per variant
          "product": {"n": [1024, 4096], "dtype": ["float32", "float16"]},
          "archs": ["sm_90a"],                  # optional, overrides the spec's
          "pass_configs": {},                   # optional, TileLang pass configs
          "compile_flags": []                   # optional, extra nvcc flags
        }
      ]
    }

``entry`` is ``module:attribute`` (the attribute may be dotted) naming a ``@tilelang.jit``
function, a function returning a ``T.prim_func``, or a ``T.prim_func`` itself. Its argument
space is the union of ``args`` (a list of keyword-argument dicts) and the cartesian product of
``product`` (a dict of lists); with neither, the one variant ``{}``. JSON lists become tuples
when they are passed to the factory (shapes are usually tuples).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_ARCHS", "KernelSpec", "Spec", "canonical", "check_archs", "load_spec", "prim_func_of",
           "read_json", "resolve_entry", "signature_defaults", "variant_id"]

#: Target architectures when a spec names none.
DEFAULT_ARCHS = ("sm_90a",)
_ARCH = re.compile(r"sm_\d{2,3}a?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KERNEL_KEYS = {"name", "entry", "args", "product", "archs", "pass_configs", "compile_flags"}


@dataclass(frozen=True)
class KernelSpec:
    """One declared kernel: ``name`` (a C identifier), ``entry`` (``module:attr``), its
    ``variants`` (keyword-argument dicts, JSON values), ``archs`` (``sm_XY[a]``), TileLang
    ``pass_configs`` and extra ``compile_flags``."""

    name: str
    entry: str
    variants: list[dict[str, Any]]
    archs: tuple[str, ...]
    pass_configs: dict[str, Any] = field(default_factory=dict)
    compile_flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the bundle ``name``, its ``kernels`` and the directory ``base`` that
    holds the spec file (put on ``sys.path`` while the entries are imported; None for a dict)."""

    name: str
    kernels: list[KernelSpec]
    base: str | None = None


def canonical(args: dict[str, Any]) -> str:
    """The canonical JSON text of keyword arguments (sorted keys, tuples as lists): the key
    that identifies a variant in a bundle."""
    return json.dumps(_jsonable(args, "args"), sort_keys=True, separators=(",", ":"))


def variant_id(name: str, args: dict[str, Any]) -> str:
    """``<name>_<12 hex digits>``: a C-identifier-safe id of kernel ``name`` with ``args``."""
    digest = hashlib.sha256(canonical(args).encode()).hexdigest()[:12]
    return f"{name}_{digest}"


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where}: {value!r} ({type(value).__name__}) is not a JSON value (str, int, float, bool, "
                    "None, list, dict)")


def _as_call_value(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_as_call_value(v) for v in value)
    return value


def check_archs(archs: Any, where: str) -> tuple[str, ...]:
    """``archs`` as a tuple without repeats; raises ValueError naming ``where`` unless it is a
    non-empty list of ``sm_XY`` / ``sm_XYa`` strings."""
    if isinstance(archs, str) or not isinstance(archs, (list, tuple)) or not archs:
        raise ValueError(f"{where}: archs must be a non-empty list such as ['sm_90a'], got {archs!r}")
    for arch in archs:
        if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
            raise ValueError(f"{where}: arch must look like 'sm_90a' or 'sm_80', got {arch!r}")
    return tuple(dict.fromkeys(archs))


def _variants(kernel: dict[str, Any], where: str) -> list[dict[str, Any]]:
    explicit = kernel.get("args", [])
    if not isinstance(explicit, list) or not all(isinstance(a, dict) for a in explicit):
        raise TypeError(f"{where}.args must be a list of keyword-argument dicts, got {explicit!r}")
    product = kernel.get("product", {})
    if not isinstance(product, dict) or not all(isinstance(v, list) and v for v in product.values()):
        raise TypeError(f"{where}.product must be a dict of non-empty lists, got {product!r}")
    found = [dict(a) for a in explicit]
    keys = list(product)
    found += [dict(zip(keys, combo)) for combo in itertools.product(*(product[k] for k in keys))] if keys else []
    if not found:
        found = [{}]
    unique: dict[str, dict[str, Any]] = {}
    for args in found:
        unique.setdefault(canonical(args), _jsonable(args, f"{where}.args"))
    return list(unique.values())


def _kernel(raw: Any, index: int, archs: tuple[str, ...]) -> KernelSpec:
    where = f"kernels[{index}]"
    if not isinstance(raw, dict):
        raise TypeError(f"{where} must be a dict with an 'entry', got {raw!r}")
    unknown = set(raw) - _KERNEL_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_KERNEL_KEYS)}")
    entry = raw.get("entry")
    if not isinstance(entry, str) or entry.count(":") != 1 or not all(entry.split(":")):
        raise ValueError(f"{where}.entry must be 'module:function', got {entry!r}")
    name = raw.get("name", entry.split(":")[1].split(".")[-1])
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be an identifier ([A-Za-z_][A-Za-z0-9_]*), got {name!r}")
    pass_configs = raw.get("pass_configs", {})
    flags = raw.get("compile_flags", [])
    if not isinstance(pass_configs, dict):
        raise TypeError(f"{where}.pass_configs must be a dict, got {pass_configs!r}")
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise TypeError(f"{where}.compile_flags must be a list of strings, got {flags!r}")
    kernel_archs = check_archs(raw["archs"], f"{where}.archs") if "archs" in raw else archs
    return KernelSpec(name, entry, _variants(raw, where), kernel_archs, dict(pass_configs), tuple(flags))


def read_json(path: Path, what: str, missing: type[Exception], invalid: type[Exception]) -> Any:
    """The JSON content of file ``path``; ``missing`` / ``invalid`` (exception types) are raised
    when it does not exist or is not JSON, with ``what`` and the path in the message."""
    if not path.is_file():
        raise missing(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise invalid(f"{what} {str(path)!r} is not valid JSON: {exc}") from exc


def load_spec(spec: str | os.PathLike | dict[str, Any]) -> Spec:
    """Parse ``spec``: a path to a JSON spec file, or its content as a dict (see the module doc).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError / TypeError: a malformed spec, naming the key (``kernels[1].entry``).
    """
    base = None
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        raw = read_json(path, "spec file", FileNotFoundError, ValueError)
        base, default_name = str(path.resolve().parent), path.stem
    elif isinstance(spec, dict):
        raw, default_name = spec, "bundle"
    else:
        raise TypeError(f"spec must be a path to a JSON file or a dict, got {type(spec).__name__}")
    if not isinstance(raw, dict) or not isinstance(raw.get("kernels"), list) or not raw["kernels"]:
        raise ValueError("spec must be an object with a non-empty 'kernels' list")
    unknown = set(raw) - {"name", "archs", "kernels"}
    if unknown:
        raise ValueError(f"spec: unknown key(s) {sorted(unknown)}; known: ['archs', 'kernels', 'name']")
    archs = check_archs(raw.get("archs", list(DEFAULT_ARCHS)), "spec.archs")
    kernels = [_kernel(k, i, archs) for i, k in enumerate(raw["kernels"])]
    names = [k.name for k in kernels]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"spec: kernel names must be unique, {dup} repeat (set 'name' on each)")
    name = raw.get("name", re.sub(r"\W", "_", default_name))
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"spec.name must be an identifier, got {name!r}")
    return Spec(name, kernels, base)


def resolve_entry(entry: str, base: str | None = None) -> Any:
    """Import ``module:attr.path`` and return the object (``base`` is tried on ``sys.path``).

    Raises:
        ImportError: the module cannot be imported, naming the entry.
        AttributeError: the attribute does not exist, naming the entry.
    """
    import sys

    module_name, _, attr = entry.partition(":")
    added = base is not None and base not in sys.path
    if added:
        sys.path.insert(0, base)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"entry {entry!r}: cannot import module {module_name!r}: {exc}") from exc
    finally:
        if added:
            sys.path.remove(base)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"entry {entry!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _factory(obj: Any) -> Any:
    """The plain Python function behind ``obj`` (a JITImpl's ``func``, else ``obj``)."""
    inner = getattr(obj, "func", None)
    return getattr(inner, "orig_func", None) or getattr(inner, "func", None) or inner or obj


def signature_defaults(obj: Any) -> dict[str, Any]:
    """The JSON-able keyword defaults of the factory ``obj`` (``{}`` when it has none)."""
    try:
        params = inspect.signature(_factory(obj)).parameters.values()
    except (TypeError, ValueError):
        return {}
    out = {}
    for p in params:
        if p.default is not inspect.Parameter.empty:
            try:
                out[p.name] = _jsonable(p.default, p.name)
            except TypeError:
                continue
    return out


def prim_func_of(obj: Any, args: dict[str, Any], entry: str = "entry") -> tuple[Any, dict[str, Any]]:
    """The ``T.prim_func`` of factory ``obj`` for keyword ``args``, and the compile options it
    carries (``pass_configs``, ``compile_flags`` of a ``@tilelang.jit`` function).

    Raises:
        TypeError: ``obj`` gives no PrimFunc for these arguments, naming ``entry``.
    """
    from tvm.tirx import PrimFunc

    call_args = {k: _as_call_value(v) for k, v in args.items()}
    options: dict[str, Any] = {}
    if isinstance(obj, PrimFunc):
        if call_args:
            raise TypeError(f"entry {entry!r} is a T.prim_func and takes no arguments, got {sorted(args)}")
        return obj, options
    if hasattr(obj, "get_tir"):  # a @tilelang.jit function (tilelang.jit.JITImpl)
        func = obj.get_tir(**call_args)
        options = {"pass_configs": dict(obj.pass_configs or {}), "compile_flags": obj.compile_flags}
    elif callable(obj):
        func = obj(**call_args)
    else:
        raise TypeError(f"entry {entry!r} is a {type(obj).__name__}, not a @tilelang.jit function, a function "
                        "returning a T.prim_func, or a T.prim_func")
    if not isinstance(func, PrimFunc):
        raise TypeError(f"entry {entry!r} with {canonical(args)} returned {type(func).__name__}, not a T.prim_func")
    return func, options
