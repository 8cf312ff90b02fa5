"""Mixture-of-experts token dispatch and combine: :class:`MoEDispatcher` (:mod:`.dispatcher`),
its torch references (:mod:`.reference`) and its kernels (:mod:`.kernels`; the protocol is in
``docs/moe.md``).

``tilescale_examples.moe`` was a module in 0.1.0; its public names are still importable from here."""

from tilescale_examples.moe.dispatcher import *  # noqa: F401,F403
from tilescale_examples.moe.dispatcher import __all__  # noqa: F401
