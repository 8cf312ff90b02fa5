"""TileScale host: process-group setup, a multi-rank launcher and pytest plugin, stream
signals, topology probes, benchmarking and small helpers from Triton-distributed.

Importing this package is cheap (standard library only); the public names load their
modules, and with them torch and cuda-python, on first use.  The same names are reachable
as ``tilelang.distributed.host`` (and ``tilelang.distributed``) once the wheel is installed.

Modules: :mod:`~tilescale_host.dist_init` (``init_dist``), :mod:`~tilescale_host.launcher`
(``tilescale-run``), :mod:`~tilescale_host.pytest_plugin` and :mod:`~tilescale_host.testing`
(multi-rank tests), :mod:`~tilescale_host.signals`, :mod:`~tilescale_host.bench`,
:mod:`~tilescale_host.topology`, :mod:`~tilescale_host.utils`, :mod:`~tilescale_host.doctor`,
:mod:`~tilescale_host.cuda` (checked CUDA driver queries), :mod:`~tilescale_host.compat`
(upstream TileScale's helper names).
"""

from __future__ import annotations

from tilescale_core.interface import lazy_exports

__version__ = "0.1.0"

__getattr__, __all__ = lazy_exports(globals(), {
    "dist_init": ("init_dist",),
    "compat": ("init_distributed", "CUDA_CHECK", "create_mapped_tensor", "dtype_map"),
    "signals": ("set_signal", "synchronize_streams", "stream_wait_eq", "wait_eq"),
    "stream_barrier": ("barrier_all_on_stream", "close_stream_barriers"),
    "bench": ("do_bench", "perf_fn", "perf_rounds"),
    "topology": ("NvidiaSmiUtil", "cuda_stream_max_priority", "has_fullmesh_nvlink", "has_fullmesh_nvlink_pynvml",
                 "supports_p2p_native_atomic"),
    "utils": ("dist_print", "get_bool_env", "get_current_gpu_clock_rate_in_khz", "get_device_max_shared_memory_size",
              "get_int_env", "get_max_gpu_clock_rate_in_khz", "get_numa_node", "has_tma", "init_seed", "rand_tensor"),
})
