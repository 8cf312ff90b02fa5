"""Attach TileScale to the stock ``tilelang`` package when, and only when, it is imported.

This top-level module (shipped in the ``tilescale-core`` wheel beside ``tilescale_core.pth``,
re-exported as ``tilescale_core._bootstrap``) is imported at interpreter start by the
``.pth`` line, so it must stay cheap: one module, outside the package so that
``tilescale_core/__init__`` is not imported too: standard library only, no CUDA, no torch,
no tilelang.  It installs one :class:`importlib.abc.MetaPathFinder` that recognises the
top-level ``tilelang`` import, lets the normal finders locate the stock package, and wraps
its loader so that right after stock ``tilelang/__init__.py`` has run, every TileScale
extension registered under the entry-point group :data:`ENTRY_POINT_GROUP` is called with
the ``tilelang`` module.  Stock files are never touched: removing the tilescale wheels
removes the ``.pth`` file and with it every trace of the hook.

Extensions are plain callables ``extend(tilelang_module) -> None``; they are called in the
order they declare (an ``order`` attribute on the callable, lower first: tilescale-core 0,
tilescale-host 10, tilescale-lang 20; :data:`DEFAULT_ORDER` when absent; ties by entry-point
name), never by the accident of their names' spelling.  One that fails to load or raises is
reported with a :class:`RuntimeWarning` and skipped, so a broken extension never breaks stock
tilelang.  The same ordering serves every TileScale entry-point group
(:func:`load_ordered`), the doctor's sections among them.

Setting the environment variable ``TILESCALE_DISABLE_HOOK`` to ``1`` (or ``true``, ``yes``,
``on``: the spellings of :mod:`tilescale_core.env`) before the interpreter starts leaves
``tilelang`` exactly stock (useful to bisect a problem); the ``.pth`` line checks those
spellings before importing anything, and otherwise calls :func:`startup`, which reads the
variable again: an off spelling or none installs the hook, and a value that is neither
prints one line to stderr and installs the hook (a typo must not break every start-up).

Start-up cost: this module and ``tilescale_core/__init__`` import nothing beyond ``os`` and
``sys`` (already loaded by ``site``): the finder and loader are plain classes (the
``importlib.abc`` bases would pull in ``typing`` and ``importlib.resources``, ~20 ms), and
``warnings`` / ``importlib.metadata`` are imported only when ``tilelang`` is.
"""

import os
import sys

#: Entry-point group under which packages register ``extend(tilelang_module)`` callables.
ENTRY_POINT_GROUP = "tilescale.tilelang_extensions"
#: Order of an extension whose callable declares none (after every TileScale wheel's).
DEFAULT_ORDER = 100
#: Environment variable that, when on (``1``/``true``/``yes``/``on``), keeps the hook from
#: being installed.
DISABLE_ENV = "TILESCALE_DISABLE_HOOK"
_TARGET = "tilelang"
_warned = False
_MARKER = "__tilescale_extensions__"


class _ExtendingLoader:
    """Delegates to the stock loader, then runs the TileScale extensions."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        extend(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_data, ...
        return getattr(self._inner, name)


class TilelangFinder:
    """Meta-path finder that wraps the loader of the top-level ``tilelang`` package."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, TilelangFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and not isinstance(spec.loader, _ExtendingLoader):
            spec.loader = _ExtendingLoader(spec.loader)
        return spec


def extension_entry_points():
    """Return the registered extension entry points, sorted by name."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def load_ordered(eps, on_error):
    """Load entry points ``eps`` and return ``[(ep, loaded object)]`` in their declared order.

    The order is the loaded object's ``order`` attribute (lower first, :data:`DEFAULT_ORDER`
    when absent), then the entry-point name.  ``on_error(ep, exc)`` is called for an entry
    point that fails to load, which is left out.
    """
    loaded = []
    for ep in eps:
        try:
            obj = ep.load()
        except Exception as exc:
            on_error(ep, exc)
            continue
        loaded.append((ep, obj))
    loaded.sort(key=lambda pair: (getattr(pair[1], "order", DEFAULT_ORDER), pair[0].name))
    return loaded


def _warn_skipped(ep, exc):
    import warnings

    warnings.warn(
        f"TileScale extension {ep.name!r} ({ep.value}) failed and was skipped: "
        f"{type(exc).__name__}: {exc}. Stock tilelang remains usable.",
        RuntimeWarning,
        stacklevel=3,
    )


def extend(tilelang_module):
    """Run every registered extension on ``tilelang_module`` once, in their declared order
    (see :func:`load_ordered`); return the names applied.

    Calling it again on the same module is a no-op that returns the same names.
    """
    applied = getattr(tilelang_module, _MARKER, None)
    if applied is not None:
        return list(applied)
    applied = []
    setattr(tilelang_module, _MARKER, applied)
    for ep, fn in load_ordered(extension_entry_points(), _warn_skipped):
        try:
            fn(tilelang_module)
        except Exception as exc:  # a broken extension must not break stock tilelang
            _warn_skipped(ep, exc)
            continue
        applied.append(ep.name)
    return list(applied)


def parse_disable(value):
    """``TILESCALE_DISABLE_HOOK``'s text (None when unset) as a bool, read as every TileScale
    switch is (:func:`tilescale_core.env.parse_flag`; unset or blank: False).

    Unset or blank, the answer needs no import: that is the start-up path, which must import
    nothing. Any other value imports :mod:`tilescale_core.env` (standard library only), so
    that its spellings and its error are the only ones.

    Raises:
        ValueError: neither an on nor an off spelling, naming the variable and the value.
    """
    if value is None or not value.strip():
        return False
    from tilescale_core.env import parse_flag

    return parse_flag(DISABLE_ENV, value)


def startup():
    """Called by ``tilescale_core.pth`` at interpreter start: :func:`install` unless
    ``TILESCALE_DISABLE_HOOK`` is on.  Never raises for the variable: a value that is not a
    boolean is reported on one line of stderr and the hook is installed (the default)."""
    global _warned
    try:
        return install()
    except ValueError as exc:
        if not _warned:  # site.py may process the .pth file twice
            _warned = True
            sys.stderr.write(f"[tilescale] {exc}; the TileScale hook stays installed\n")
        return _install()


def install():
    """Install the finder (idempotent). Return True when the hook is active, False when
    ``TILESCALE_DISABLE_HOOK`` is on.

    If ``tilelang`` was imported before the hook was installed, the extensions are applied
    to it right away.

    Raises:
        ValueError: ``TILESCALE_DISABLE_HOOK`` is neither an on nor an off spelling.
    """
    if parse_disable(os.environ.get(DISABLE_ENV)):
        return False
    return _install()


def _install():
    if not any(isinstance(f, TilelangFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TilelangFinder())
    module = sys.modules.get(_TARGET)
    if module is not None:
        extend(module)
    return True
