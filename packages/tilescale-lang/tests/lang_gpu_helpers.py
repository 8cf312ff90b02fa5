"""What the multi-rank GPU test bodies share: the rank's device and heap, a collective sync,
and a check recorder (errors are collected, not raised, so every rank reports them all).

A module of its own, importable by spawned rank processes (no pytest import)."""

from __future__ import annotations

import os


#: A TileLang cache directory the GPU tests use instead of one per pytest session (kept across
#: sessions: ``ci/device-check.sh`` points it at the repository's ``.tlcache``).
KEPT_CACHE_ENV = "TILESCALE_TEST_KERNEL_CACHE"


def session_cache(tmp_path_factory, name: str) -> str:
    """The GPU tests' TileLang cache ``name``: ``$TILESCALE_TEST_KERNEL_CACHE`` when set, else a
    new directory of this pytest session."""
    return os.environ.get(KEPT_CACHE_ENV) or str(tmp_path_factory.mktemp(name))


def open_rank(rank: int, world: int, cache_dir: str, heap_bytes: int = 2**26):
    """Point TileLang's cache at ``cache_dir``, select the rank's device (cuda:0 when ranks
    share one GPU) and make a distributed heap; returns ``(allocator, sync)`` where ``sync()``
    is a device sync followed by a barrier of the world group."""
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    alloc = tilelang.get_allocator(size=heap_bytes, device=dev, is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=dist.group.WORLD)

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    return alloc, sync


class Checks:
    """``check(cond, what)`` records a failed check's description; ``report`` holds
    ``{"errors": [...], "checks": n}``."""

    def __init__(self):
        self.report: dict = {"errors": [], "checks": 0}

    def __call__(self, cond, what: str) -> None:
        self.report["checks"] += 1
        if not cond:
            self.report["errors"].append(what)
