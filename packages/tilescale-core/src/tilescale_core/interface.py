"""What the other TileScale wheels use from tilescale-core: a small, versioned interface.

tilescale-host and tilescale-lang import only these names (never core's private modules), so
any tilescale-core 0.1.x serves them. :data:`TABLE_VERSION` numbers the layout of the
allocator's metadata table that compiled kernels receive; tilescale-lang checks it when it
is imported and refuses, with a clear error, a core that speaks another layout.
"""

from __future__ import annotations

from ._extension import add_facade_dir
from ._lazy import lazy_getattr

__all__ = ["TABLE_VERSION", "TABLE_LAYOUT", "add_facade_dir", "lazy_getattr"]

#: Version of the metadata table layout (:data:`TABLE_LAYOUT`). A change of layout bumps it.
TABLE_VERSION = 1
#: The table, CPU ``torch.uint64``: ``[local_rank, num_ranks, base_0, ..., base_{n-1}]``
#: (``base_r``: the address of rank ``r``'s heap base in this process).
TABLE_LAYOUT = ("local_rank", "num_ranks", "base_0 .. base_{num_ranks-1}")
