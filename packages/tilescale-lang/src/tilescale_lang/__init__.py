"""TileScale lang: kernel-side communication intrinsics for stock TileLang.

Installed, it extends ``tilelang`` at import time (through tilescale-core's hook):
``T.get_rank``, ``T.put_warp`` / ``T.get_warp`` / ``T.put_block`` / ``T.get_block``,
``T.copy(..., src_pe=, dst_pe=)``, ``T.ld`` / ``T.st`` / ``T.atom_add``, fences,
``T.wait_*``, GPU and cross-rank barriers, ``T.notify``, and
``JITKernel.initialize(allocator=..., stream=None)``.  Device code ships as CUDA headers in
``tilescale_lang/include/tilescale``; see :mod:`tilescale_lang.headers`.
"""

__version__ = "0.1.0"
