"""The collectives: all-gather, all-to-all, reduce-scatter and all-reduce over the symmetric
heap, with their two engines (:mod:`.put_exchange` for the put-based ops, :mod:`.reduce_engine`
for the reductions)."""

from tilescale_core.interface import lazy_getattr

__all__ = ["AllGather", "AllToAll", "ReduceScatter", "AllReduce"]
__getattr__ = lazy_getattr(globals(), {"AllGather": "allgather", "AllToAll": "alltoall",
                                       "ReduceScatter": "reducescatter", "AllReduce": "allreduce"})
