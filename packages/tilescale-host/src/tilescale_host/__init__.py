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

from tilescale_core.interface import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "init_dist": "dist_init",
    "init_distributed": "compat",
    "CUDA_CHECK": "compat",
    "create_mapped_tensor": "compat",
    "dtype_map": "compat",
    "set_signal": "signals",
    "synchronize_streams": "signals",
    "stream_wait_eq": "signals",
    "wait_eq": "signals",
    "barrier_all_on_stream": "stream_barrier",
    "close_stream_barriers": "stream_barrier",
    "do_bench": "bench",
    "perf_fn": "bench",
    "perf_rounds": "bench",
    "NvidiaSmiUtil": "topology",
    "cuda_stream_max_priority": "topology",
    "has_fullmesh_nvlink": "topology",
    "has_fullmesh_nvlink_pynvml": "topology",
    "supports_p2p_native_atomic": "topology",
    "dist_print": "utils",
    "get_bool_env": "utils",
    "get_current_gpu_clock_rate_in_khz": "utils",
    "get_device_max_shared_memory_size": "utils",
    "get_int_env": "utils",
    "get_max_gpu_clock_rate_in_khz": "utils",
    "get_numa_node": "utils",
    "has_tma": "utils",
    "init_seed": "utils",
    "rand_tensor": "utils",
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__ = lazy_getattr(globals(), _LAZY)
