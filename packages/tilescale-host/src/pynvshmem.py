"""``import pynvshmem`` for upstream TileScale's NVSHMEM examples, without NVSHMEM.

A thin shim shipped by tilescale-host: it is :mod:`tilescale_host.pynvshmem` (the functions
over TileScale's symmetric heap) unless a real ``pynvshmem`` -- upstream TileScale's NVSHMEM
bindings, a package directory ``pynvshmem/`` -- is installed.  A real one never loses:

* in the same ``site-packages`` Python's path finder takes the package directory before this
  module file;
* anywhere else on ``sys.path`` (earlier or later), this shim finds it and imports it in its
  own place, so ``import pynvshmem`` gives the real bindings.

TileScale's functions stay importable as ``tilescale_host.pynvshmem`` either way.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _real_pynvshmem():
    """The spec of another ``pynvshmem`` on ``sys.path`` (not this file), or None."""
    here = os.path.abspath(__file__)
    spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(here)])
    if spec is None or spec.origin is None or os.path.abspath(spec.origin) == here:
        return None
    return spec


_spec = _real_pynvshmem()
if _spec is not None:  # a real pynvshmem: it takes this module's place in sys.modules
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
else:
    from tilescale_host import pynvshmem as _impl
    from tilescale_host.pynvshmem import *  # noqa: F401,F403
    from tilescale_host.pynvshmem import __all__  # noqa: F401

    def __getattr__(name):
        """``CmpType`` / ``Amo`` and the clear errors of names TileScale does not provide."""
        return _impl.__getattr__(name)
