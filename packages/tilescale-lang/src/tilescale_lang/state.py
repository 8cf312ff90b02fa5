"""Everything tilescale-lang keeps between calls, in one object: :data:`STATE`.

Lifetime: one :class:`LangState` per process, created when this module is first imported
(tilescale-core's hook imports it, through :mod:`tilescale_lang._extension`, while
``import tilelang`` runs) and alive as long as the ``tilelang`` module it extends.  Nothing in
it grows with the number of kernels compiled, modules loaded or ``kernel.initialize`` calls:

* :attr:`LangState.stock`: the stock TileLang callables that TileScale wrappers replaced
  (``T.copy``, ``T.atomic_add``, pipeline passes ...), by name; one entry per wrapper.
* :attr:`LangState.hooks`: which process-wide hooks are installed (the
  ``runtime.nvshmem.cumodule_init`` module hook, the CUDA post-processing callback and the
  callback it chains), one entry per hook.
* :attr:`LangState.launching`: per thread, the kernel whose first launch is running (the
  module hook attributes the module TVM loads to it).
* :attr:`LangState.heaps`: the symmetric heaps ``kernel.initialize`` registered for remote
  TMA (one per live allocator; closed or collected ones are dropped on every registration).
* :attr:`LangState.unclaimed_modules`: a count of modules loaded while no TileScale kernel
  was launching (stock kernels); a count, not a list.

State of one kernel (its loaded modules, the pending table, the launch guard) lives on the
kernel itself (``kernel._tilescale_state``, see :mod:`tilescale_lang.metadata`) and dies
with it.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["LangState", "STATE"]


class LangState:
    """tilescale-lang's process-wide state (see the module docstring for each field)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stock: dict[str, Any] = {}
        self.hooks: dict[str, Any] = {}
        self.launching = threading.local()
        self.heaps: list[Any] = []
        self.unclaimed_modules = 0

    def sizes(self) -> dict[str, int]:
        """Number of entries held by each growing container (tests check they stay flat)."""
        return {"stock": len(self.stock), "hooks": len(self.hooks), "heaps": len(self.heaps)}


#: The process's one :class:`LangState`.
STATE = LangState()
