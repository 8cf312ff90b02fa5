"""The tilescale-core extension of stock tilelang (entry point ``core``).

Adds ``tilelang.get_allocator``, ``tilelang.tensor`` and the ``tilelang.distributed``
package.  ``tilelang.distributed`` lives in ``_facade/`` beside this file: the directory is
appended to ``tilelang.__path__`` so that the package's own import system finds it, and
other TileScale wheels append their own ``_facade`` directories for their sub-modules
(for example ``tilelang.distributed.host``).

:func:`after_import` lets a wheel add names to a stock sub-module that ``import tilelang``
does not import itself (tilescale-host: ``tilelang.testing.requires_distributed``) when, and
only when, the program imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

FACADE_DIR = Path(__file__).with_name("_facade")


def add_facade_dir(tilelang_module, facade_dir: Path) -> None:
    """Append ``facade_dir`` to ``tilelang.__path__`` (once)."""
    entry = str(facade_dir)
    if entry not in tilelang_module.__path__:
        tilelang_module.__path__.append(entry)


#: Callbacks waiting for a module to be imported, by full module name (:func:`after_import`).
_PENDING: dict[str, list[Callable]] = {}


def _call(name: str, callback: Callable, module) -> None:
    """``callback(module)``; one that raises is reported with a RuntimeWarning and skipped, so
    it never breaks the import of stock ``name``."""
    try:
        callback(module)
    except Exception as exc:
        import warnings

        warnings.warn(f"TileScale's addition to {name} ({getattr(callback, '__qualname__', callback)}) "
                      f"failed and was skipped: {type(exc).__name__}: {exc}. Stock {name} remains usable.",
                      RuntimeWarning, stacklevel=3)


def _run_callbacks(name: str, module) -> None:
    """Call, and forget, the callbacks registered for ``name`` with the imported module."""
    for callback in _PENDING.pop(name, []):
        _call(name, callback, module)


class _AfterImportLoader:
    """Delegates to the module's own loader, then runs its :func:`after_import` callbacks."""

    def __init__(self, inner, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _run_callbacks(self._name, module)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_data, ...
        return getattr(self._inner, name)


class _AfterImportFinder:
    """Meta-path finder that answers only for module names with pending callbacks: it lets
    the other finders locate the module and wraps the loader they return."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _AfterImportFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and not isinstance(spec.loader, _AfterImportLoader):
            spec.loader = _AfterImportLoader(spec.loader, fullname)
        return spec


def after_import(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once module ``name`` (a stock ``tilelang`` sub-module that
    ``import tilelang`` does not import itself, e.g. ``"tilelang.testing"``) is imported:
    right away when it already is, else right after its own code has run.

    This is how a wheel adds a name to a stock module without importing that module early
    (``tilelang.testing`` imports pytest).  The module's files are not touched; a callback
    that raises is reported with a RuntimeWarning and skipped.
    """
    module = sys.modules.get(name)
    if module is not None:
        _call(name, callback, module)
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())


def extend(tilelang_module) -> None:
    """Attach the core names to ``tilelang``; cheap, imports nothing heavy."""
    import tilescale_core

    add_facade_dir(tilelang_module, FACADE_DIR)
    for name in ("get_allocator", "tensor"):
        if not hasattr(tilelang_module, name):
            setattr(tilelang_module, name, getattr(tilescale_core, name))


#: Position among the TileScale extensions (lower runs first; see ``tilescale_core._bootstrap``).
extend.order = 0
