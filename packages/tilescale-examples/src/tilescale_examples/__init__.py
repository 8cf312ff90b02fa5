"""TileScale's collective library for TileLang users.

The product classes are importable from here (loaded on first use)::

    from tilescale_examples import AllReduce, AllGather, AllGatherGEMM

They share one call contract (docs/architecture.md, "Call contract"); every call of a closed
one raises :class:`ClosedError` (a ``RuntimeError``), also exported here.

Layout: :mod:`tilescale_examples.collectives` (AllGather, AllToAll, ReduceScatter, AllReduce), :mod:`tilescale_examples.overlap`
(AllGatherGEMM, GemmReduceScatter), :mod:`tilescale_examples.moe` (MoEDispatcher, MoELowLatency),
:mod:`tilescale_examples.decode` (AllReduceResidualRMSNorm, GemmAllReduce), :mod:`tilescale_examples.sequence`
(UlyssesAllToAll), :mod:`tilescale_examples.tutorials`,
:mod:`tilescale_examples.testing` (emulated peers, precompile), :mod:`tilescale_examples.benchmarks`, :mod:`tilescale_examples.demo`, and
:mod:`tilescale_examples.torch_ops` (``torch.ops.tilescale.*``, registered when this package is imported).
"""

from tilescale_core.interface import lazy_getattr

__version__ = "0.1.0"

__all__ = ["AllGather", "AllToAll", "ReduceScatter", "AllReduce", "AllGatherGEMM", "GemmReduceScatter", "MoEDispatcher",
           "AllReduceResidualRMSNorm", "ClosedError", "MoELowLatency", "GemmAllReduce", "UlyssesAllToAll",
           "SPFlashDecode", "SPAllGatherAttention"]
__getattr__ = lazy_getattr(globals(), {"ClosedError": "base",
    "AllGather": "collectives.allgather", "AllToAll": "collectives.alltoall",
    "ReduceScatter": "collectives.reducescatter", "AllReduce": "collectives.allreduce",
    "AllGatherGEMM": "overlap.ag_gemm", "GemmReduceScatter": "overlap.gemm_rs", "MoEDispatcher": "moe.dispatcher",
    "AllReduceResidualRMSNorm": "decode.allreduce_norm", "MoELowLatency": "moe.low_latency",
    "GemmAllReduce": "decode.gemm_allreduce", "UlyssesAllToAll": "sequence.ulysses",
    "SPFlashDecode": "sequence.flash_decode", "SPAllGatherAttention": "sequence.sp_attention",
})

try:  # registers torch.ops.tilescale.* (a no-op where torch has no torch.library.custom_op)
    from tilescale_examples import torch_ops  # noqa: E402,F401
except ImportError:  # pragma: no cover - torch missing: the collectives need it anyway
    torch_ops = None
