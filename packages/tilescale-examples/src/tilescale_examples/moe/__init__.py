"""Mixture-of-experts token dispatch and combine: :class:`MoEDispatcher` (:mod:`.dispatcher`)
and its kernels (:mod:`.kernels`).

``tilescale_examples.moe`` was a module in 0.1.0; its public names are still importable from here."""

from tilescale_examples.moe.dispatcher import *  # noqa: F401,F403
from tilescale_examples.moe.dispatcher import __all__  # noqa: F401
