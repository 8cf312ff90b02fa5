"""The two TileLang kernels behind :class:`tilescale_examples.moe.dispatcher.MoEDispatcher`.

* :func:`build_dispatch_kernel` (:mod:`.dispatch`): plan and data movement in one launch
  (``blocks`` blocks of 1024 threads, at most one per SM), on one of two paths chosen on the
  device by the batch: the small batch (at most one entry per thread, :mod:`.dispatch_small`)
  or the large batch (:mod:`.dispatch_large`); both end in the same closing round.
* :func:`build_combine_kernel` (:mod:`.combine`, same grid): with several ranks, pushes each
  received row back to its source rank, signals the other ranks and waits for them; then sums
  each token's ``K`` rows with their weights in float32, in slot order.

The constants and the macros both share are in :mod:`._common`. The notation, the receive
layout, each kernel step by step, the counter words ``Ctr`` and the call numbers ``State``, and
why nothing deadlocks: ``docs/moe.md``. This module keeps the public names in one place.
"""

# CHUNK, PUT_UNROLL and RANK_BITS stay importable from here, as before the split (not in __all__)
from tilescale_examples.moe._common import (CHUNK, DISPATCH_PHASES, MAX_EXPERTS, MAX_PARTS,  # noqa: F401
                                            PASS_CONFIGS, PLAN_THREADS, PLAN_WARPS, PUT_UNROLL, RANK_BITS)
from tilescale_examples.moe.combine import build_combine_kernel
from tilescale_examples.moe.dispatch import build_dispatch_kernel

__all__ = ["PLAN_THREADS", "PLAN_WARPS", "PASS_CONFIGS", "MAX_EXPERTS", "MAX_PARTS", "DISPATCH_PHASES",
           "build_dispatch_kernel", "build_combine_kernel"]
