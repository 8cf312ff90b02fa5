"""``tilelang.distributed.utils``: upstream TileScale's module path for its host helpers.

``from tilelang.distributed.utils import CUDA_CHECK, has_fullmesh_nvlink, init_distributed``
works as in upstream TileScale.  Every name is one of TileScale's own functions (from the
tilescale-host wheel; see :mod:`tilescale_host.compat` for the four written for upstream's
names); none of them is a copy.  Upstream's CUDA-IPC helpers (``create_tensor``,
``get_local_ipc_handle``, ``create_dist_tensor``) are not here: TileScale's symmetric heap
(``tilelang.get_allocator``, ``tilelang.tensor(..., allocator=...)``) replaces them.
"""

from tilescale_host.bench import perf_fn
from tilescale_host.compat import CUDA_CHECK, create_mapped_tensor, dtype_map, init_distributed
from tilescale_host.dist_init import init_dist
from tilescale_host.signals import set_signal, wait_eq
from tilescale_host.topology import (
    NvidiaSmiUtil,
    cuda_stream_max_priority,
    has_fullmesh_nvlink,
    has_fullmesh_nvlink_pynvml,
    supports_p2p_native_atomic,
)
from tilescale_host.utils import dist_print

__all__ = [
    "CUDA_CHECK",
    "NvidiaSmiUtil",
    "create_mapped_tensor",
    "cuda_stream_max_priority",
    "dist_print",
    "dtype_map",
    "has_fullmesh_nvlink",
    "has_fullmesh_nvlink_pynvml",
    "init_dist",
    "init_distributed",
    "perf_fn",
    "set_signal",
    "supports_p2p_native_atomic",
    "wait_eq",
]
