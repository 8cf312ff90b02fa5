"""tilescale-lang's check, at import, that the tilescale-core it finds speaks its table layout.

Compiled kernels read the allocator's metadata table (``[local_rank, num_ranks, base_0,
...]``, see :mod:`tilescale_lang.metadata`); tilescale-core builds it and numbers its layout
``tilescale_core.table.TABLE_VERSION`` (re-exported by ``tilescale_core.interface``). A core without that number (too old) or with
another one would make kernels read wrong addresses, so tilescale-lang refuses to load with an
``ImportError`` that names both versions and the fix.
"""

from __future__ import annotations

import importlib
import importlib.metadata

__all__ = ["TABLE_VERSION", "check_core"]

#: The metadata table layout this tilescale-lang compiles kernels for.
TABLE_VERSION = 1
_FIX = "install matching wheels: pip install 'tilescale-core>=0.1,<0.2' 'tilescale-lang>=0.1,<0.2'"


def _core_version() -> str:
    try:
        return importlib.metadata.version("tilescale-core")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_core(interface_module: str = "tilescale_core.interface") -> None:
    """Raise ``ImportError`` unless ``interface_module`` (tilescale-core's interface) exists and
    its ``TABLE_VERSION`` equals :data:`TABLE_VERSION`."""
    from tilescale_lang import __version__

    try:
        interface = importlib.import_module(interface_module)
    except ImportError as exc:
        raise ImportError(
            f"tilescale-lang {__version__} needs tilescale-core's metadata table version {TABLE_VERSION}, "
            f"but the installed tilescale-core ({_core_version()}) has no {interface_module} "
            f"({exc}); {_FIX}"
        ) from exc
    found = getattr(interface, "TABLE_VERSION", None)
    if found != TABLE_VERSION:
        raise ImportError(
            f"tilescale-lang {__version__} compiles kernels for metadata table version {TABLE_VERSION}, "
            f"but the installed tilescale-core ({_core_version()}) speaks version {found}; {_FIX}"
        )
