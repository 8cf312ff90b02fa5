"""``tilelang.distributed.host``: TileScale's host utilities (from the tilescale-host wheel).

``from tilelang.distributed.host import init_dist`` is the documented spelling (docs/host.md); every name
here is re-exported by ``tilelang.distributed`` too.  See :mod:`tilescale_host`.
"""

from tilescale_host.bench import do_bench, perf_fn, perf_rounds
from tilescale_host.compat import CUDA_CHECK, create_mapped_tensor, dtype_map, init_distributed
from tilescale_host.dist_init import init_dist
from tilescale_host.signals import set_signal, stream_wait_eq, synchronize_streams, wait_eq
from tilescale_host.stream_barrier import barrier_all_on_stream, close_stream_barriers
from tilescale_host.topology import (
    NvidiaSmiUtil,
    cuda_stream_max_priority,
    has_fullmesh_nvlink,
    has_fullmesh_nvlink_pynvml,
    supports_p2p_native_atomic,
)
from tilescale_host.utils import (
    dist_print,
    get_bool_env,
    get_current_gpu_clock_rate_in_khz,
    get_device_max_shared_memory_size,
    get_int_env,
    get_max_gpu_clock_rate_in_khz,
    get_numa_node,
    has_tma,
    init_seed,
    rand_tensor,
)

__all__ = [
    "CUDA_CHECK",
    "NvidiaSmiUtil",
    "barrier_all_on_stream",
    "close_stream_barriers",
    "create_mapped_tensor",
    "cuda_stream_max_priority",
    "dist_print",
    "do_bench",
    "dtype_map",
    "get_bool_env",
    "get_current_gpu_clock_rate_in_khz",
    "get_device_max_shared_memory_size",
    "get_int_env",
    "get_max_gpu_clock_rate_in_khz",
    "get_numa_node",
    "has_fullmesh_nvlink",
    "has_fullmesh_nvlink_pynvml",
    "has_tma",
    "init_dist",
    "init_distributed",
    "init_seed",
    "perf_fn",
    "perf_rounds",
    "rand_tensor",
    "set_signal",
    "stream_wait_eq",
    "synchronize_streams",
    "supports_p2p_native_atomic",
    "wait_eq",
]
