"""GEMMs overlapped with communication: :class:`AllGatherGEMM` (all-gather of A, then A @ B) and
:class:`GemmReduceScatter` (A @ B, then reduce-scatter), their GEMM kernel (:mod:`.gemm`) and the
stream-ordered pieces of their plans (:mod:`.stream_ops`)."""

from tilescale_core.interface import lazy_getattr

__all__ = ["AllGatherGEMM", "GemmReduceScatter"]
__getattr__ = lazy_getattr(globals(), {"AllGatherGEMM": "ag_gemm", "GemmReduceScatter": "gemm_rs"})
