"""Lazy package attributes (PEP 562), so importing a TileScale package stays cheap.

Imported at interpreter start (through ``tilescale_core/__init__``), so it imports nothing.
"""


def lazy_getattr(package_globals, names):
    """Return a module ``__getattr__`` that imports ``names[attr]`` (a sub-module) on first use.

    Args:
        package_globals: the package's ``globals()``; a loaded value is cached there.
        names: public attribute name -> sub-module name relative to the package.
    """
    package = package_globals["__name__"]

    def __getattr__(name):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        package_globals[name] = value
        return value

    return __getattr__


def lazy_exports(package_globals, modules):
    """``(__getattr__, __all__)`` of a package whose public names live in its sub-modules,
    each loaded on first use (:func:`lazy_getattr`).

    Args:
        package_globals: the package's ``globals()``.
        modules: sub-module name (relative to the package) -> the public names it provides.

    ``__all__`` lists the names sorted, then ``__version__`` when the package defines one.
    """
    names = {name: module for module, provided in modules.items() for name in provided}
    public = sorted(names) + (["__version__"] if "__version__" in package_globals else [])
    return lazy_getattr(package_globals, names), public
