"""Host sections of ``python -m tilescale_core.doctor``: topology and a 2-rank group check.

Registered in the entry-point group ``tilescale.doctor_sections`` (tilescale-core's doctor
lists what is installed and imports nothing of this wheel by name); the core doctor prints each
``(title, lines)`` pair after its own sections.  Nothing here raises: a failed probe becomes a line saying why.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["sections"]


def _probe(label: str, fn: Callable[[], object]) -> str:
    """``"label: value"``, or ``"label: unavailable (reason)"`` when ``fn`` raises."""
    try:
        value = fn()
    except Exception as exc:
        return f"{label}: unavailable ({type(exc).__name__}: {exc})"
    if isinstance(value, bool):
        value = "yes" if value else "no"
    return f"{label}: {value}"


def _numa_lines(count: int) -> list[str]:
    from .topology import NvidiaSmiUtil

    return [_probe(f"GPU {i} NUMA node", lambda i=i: NvidiaSmiUtil.get_gpu_numa_node(i)) for i in range(count)]


def topology_lines() -> list[str]:
    """Visible GPUs, NVLink full mesh, NUMA node per GPU, P2P native atomics (0<->1)."""
    from . import _cuda
    from .topology import has_fullmesh_nvlink, supports_p2p_native_atomic

    count = _cuda.device_count()
    lines = [
        f"visible CUDA devices: {count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
        ("NVLink full mesh: n/a: no GPU" if count == 0 else
         _probe("NVLink full mesh", has_fullmesh_nvlink) + (" (trivially: one GPU)" if count == 1 else "")),
        *_numa_lines(count),
    ]
    if count >= 2:
        lines.append(_probe("P2P native atomics between devices 0 and 1", supports_p2p_native_atomic))
    else:
        lines.append("P2P native atomics between devices 0 and 1: not applicable (needs 2 GPUs)")
    lines.append(_probe("TILESCALE_SHARE_GPUS (several ranks per GPU)", _share_mode))
    return lines


def _share_mode() -> str:
    """``on``/``off`` as init_dist reads TILESCALE_SHARE_GPUS (a bad value raises, naming it)."""
    from tilescale_core.env import flag

    value = os.environ.get("TILESCALE_SHARE_GPUS")
    on = flag("TILESCALE_SHARE_GPUS", False)
    return f"{'on' if on else 'off'} ({'unset' if value is None else repr(value)})"


def _all_reduce_rank(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def process_group_lines(timeout: float = 60.0) -> list[str]:
    """Spawn 2 ranks, join a gloo group, all_reduce; report the result and the time taken."""
    try:
        from tilescale_core.multiprocess import run_ranks

        start = time.monotonic()
        sums = run_ranks(_all_reduce_rank, 2, backend="gloo", timeout=timeout)
        took = time.monotonic() - start
    except Exception as exc:
        return [f"2-rank gloo process group: FAILED ({type(exc).__name__}: {exc})"]
    ok = sums == [3.0, 3.0]
    verdict = "ok" if ok else f"WRONG all_reduce results {sums} (expected [3.0, 3.0])"
    return [f"2-rank gloo process group (spawn, TCP rendezvous, all_reduce): {verdict} in {took:.1f} s"]


def sections() -> list[tuple[str, list[str]]]:
    """The host sections of the doctor report: ``[(title, lines), ...]``; never raises."""
    return [
        ("Topology", _safe(topology_lines)),
        ("Process group", _safe(process_group_lines)),
    ]


def _safe(fn: Callable[[], list[str]]) -> list[str]:
    try:
        return fn()
    except Exception as exc:
        return [f"check failed: {type(exc).__name__}: {exc}"]


#: Position among the doctor's extension sections (lower first).
sections.order = 10
