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
