"""``tilelang.distributed.host``: TileScale's host utilities (from the tilescale-host wheel).

``from tilelang.distributed.host import init_dist`` is the documented spelling (docs/host.md); every name
here is re-exported by ``tilelang.distributed`` too.  See :mod:`tilescale_host`.
"""

import tilescale_host as _host

#: tilescale_host's public names (its one list), loaded now.
__all__ = [name for name in _host.__all__ if name != "__version__"]
globals().update({name: getattr(_host, name) for name in __all__})
