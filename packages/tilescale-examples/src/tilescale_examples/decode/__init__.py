"""The decode path: collectives fused with their neighbours, for the small messages of
tensor-parallel decoding (few tokens, thousands of calls a second), where launches and flag
rounds cost more than the bytes. :class:`AllReduceResidualRMSNorm`
(:mod:`.allreduce_norm`, its kernel in :mod:`.norm_kernel`): all-reduce + residual add +
RMSNorm (+ FP8 quantisation) in one kernel; :class:`GemmAllReduce` (:mod:`.gemm_allreduce`,
its kernel in :mod:`.gemm_ar_kernel`): GEMM + all-reduce, the reduction of each tile starting
as soon as the GEMM has it."""

from tilescale_core.interface import lazy_getattr

__all__ = ["AllReduceResidualRMSNorm", "GemmAllReduce"]
__getattr__ = lazy_getattr(globals(), {"AllReduceResidualRMSNorm": "allreduce_norm", "GemmAllReduce": "gemm_allreduce"})
