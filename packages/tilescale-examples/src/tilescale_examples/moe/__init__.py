"""Mixture-of-experts token dispatch and combine: :class:`MoEDispatcher` (:mod:`.dispatcher`),
its torch references (:mod:`.reference`) and its kernels (:mod:`.kernels`; the protocol is in
``docs/moe.md``); the low-latency mode for decode, :class:`MoELowLatency` (:mod:`.low_latency`,
its references in :mod:`.ll_reference`, its kernels in :mod:`.ll_dispatch` and :mod:`.ll_combine`).

``tilescale_examples.moe`` was a module in 0.1.0; its public names are still importable from here."""

from tilescale_examples.moe.dispatcher import *  # noqa: F401,F403
from tilescale_examples.moe.dispatcher import __all__ as _dispatcher_all
from tilescale_examples.moe.low_latency import LowLatencyHandle, MoELowLatency  # noqa: F401

__all__ = [*_dispatcher_all, "MoELowLatency", "LowLatencyHandle"]
