"""Rank bodies of the GPU tests (imported by name in spawned ranks)."""

from __future__ import annotations

import os
import time


def _setup(rank):
    import torch

    os.environ.pop("TILESCALE_USE_VMM", None)
    os.environ.pop("TILESCALE_CHECK_ALLOC", None)
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    return device


def peer_views(rank, world_size, use_vmm, numel):
    """Poison, barrier, fresh random data, barrier, check every peer view against gathered data."""
    import torch
    import torch.distributed as dist

    import tilelang

    device = _setup(rank)
    a = tilelang.get_allocator(
        size=32 << 20, local_rank=rank, num_local_ranks=world_size, group=dist.group.WORLD, use_vmm=use_vmm
    )
    table = a.table.tolist()
    assert table[:2] == [rank, world_size] and table[2 + rank] == a.base_ptr
    floats = tilelang.tensor((numel,), "float32", allocator=a, return_peers=True)
    ints = tilelang.tensor((7, 9), torch.int64, allocator=a, return_peers=True)
    for views in (floats, ints):
        assert len(views) == world_size
        for r, v in enumerate(views):
            assert v.device == torch.device("cuda", device), f"peer view {r} is on {v.device}"
            assert v.data_ptr() - a.peer_base_ptrs[r] == views[rank].data_ptr() - a.base_ptr
    floats[rank].fill_(float("nan"))
    ints[rank].fill_(-1)
    torch.cuda.synchronize()
    dist.barrier()
    gen = torch.Generator(device="cuda").manual_seed(time.time_ns() % (1 << 31) + 7919 * rank)
    floats[rank].copy_(torch.rand(numel, generator=gen, device="cuda"))
    ints[rank].copy_(torch.randint(0, 1 << 40, (7, 9), generator=gen, device="cuda"))
    torch.cuda.synchronize()
    expected = [None] * world_size
    dist.all_gather_object(expected, (floats[rank].cpu(), ints[rank].cpu()))
    dist.barrier()
    for r in range(world_size):
        assert not torch.isnan(floats[r]).any(), f"rank {rank} sees poison in rank {r}'s tensor"
        assert torch.equal(floats[r].cpu(), expected[r][0]), f"rank {rank}: rank {r}'s float view differs"
        assert torch.equal(ints[r].cpu(), expected[r][1]), f"rank {rank}: rank {r}'s int view differs"
    # every rank has finished reading before anyone writes into a peer's tensor
    dist.barrier()
    # write into a peer's memory through its view, and let the peer check it
    peer = (rank + 1) % world_size
    floats[peer][rank] = 1000.0 + rank
    torch.cuda.synchronize()
    dist.barrier()
    writer = (rank - 1) % world_size
    assert float(floats[rank][writer].item()) == 1000.0 + writer
    dist.barrier()
    path = a.path
    a.close()
    return path


def open_close_cycles(rank, world_size, use_vmm, cycles):
    """Open/close ``cycles`` heaps; return device free memory (bytes) before and after on rank 0."""
    import torch
    import torch.distributed as dist

    import tilelang
    from tilescale_core import _driver

    device = _setup(rank)

    def cycle():
        a = tilelang.get_allocator(
            size=64 << 20, local_rank=rank, num_local_ranks=world_size, group=dist.group.WORLD, use_vmm=use_vmm
        )
        views = tilelang.tensor((1 << 16,), "float32", allocator=a, return_peers=True)
        views[rank].fill_(rank)
        torch.cuda.synchronize()
        a.close()
        return a.path

    cycle()  # warm-up: contexts, peer mappings of the driver
    torch.cuda.synchronize()
    dist.barrier()
    before = _driver.mem_get_info(device)[0]
    dist.barrier()
    for _ in range(cycles):
        path = cycle()
    torch.cuda.synchronize()
    dist.barrier()
    after = _driver.mem_get_info(device)[0]
    dist.barrier()  # no rank tears its context down while another one measures
    return {"path": path, "before": before, "after": after}


def _failing_real_backend(path, where, fail):
    """The real heap backend of ``path`` (``ipc`` or ``vmm-fd``), with the driver call that
    exports this rank's allocation (``where="export"``) or maps a peer's (``"map"``) made to
    fail when ``fail``; the allocation itself is real, so the failure paths must free it.
    Wraps the module functions the backend calls, in this rank's process only."""
    from tilescale_core import _backends, _ipc, _vmm

    module, export, map_peer = (_ipc, "get_handle", "open_handle") if path == "ipc" else (_vmm, "export_fd", "import_fd")

    def failing(fn, step):
        def call(*args, **kwargs):
            if fail and where == step:
                raise OSError(f"injected {step} failure")
            return fn(*args, **kwargs)
        return call

    setattr(module, export, failing(getattr(module, export), "export"))
    setattr(module, map_peer, failing(getattr(module, map_peer), "map"))
    return _backends.make_backend(path)


def failed_setup_cycles(rank, world_size, path, where, cycles):
    """``cycles`` heap set-ups on real GPU memory in which rank 1's export or peer mapping
    fails: every rank must raise SetupError each time, and rank 0's free device memory and
    every rank's open descriptors (memfds, sockets) must come back."""
    import torch
    import torch.distributed as dist

    from core_rank_bodies import open_fds
    from tilescale_core import _driver
    from tilescale_core._comm import SetupError
    from tilescale_core.allocator import BaseAllocator

    device = _setup(rank)
    backend = _failing_real_backend(path, where, rank == 1)

    def cycle():
        try:
            BaseAllocator(64 << 20, device=torch.device("cuda", device), is_distributed=True, local_rank=rank,
                          num_local_ranks=world_size, group=dist.group.WORLD, backend=backend)
        except SetupError as err:
            return err.phase, sorted(err.failures)
        return None, []

    cycle()  # warm-up: contexts and the driver's peer bookkeeping
    torch.cuda.synchronize()
    dist.barrier()
    fds, before = open_fds(), _driver.mem_get_info(device)[0]
    dist.barrier()
    outcomes = [cycle() for _ in range(cycles)]
    torch.cuda.synchronize()
    dist.barrier()
    after, fds_after = _driver.mem_get_info(device)[0], open_fds()
    dist.barrier()
    return {"outcomes": sorted(set((p, tuple(f)) for p, f in outcomes), key=str), "before": before,
            "after": after, "fd_leaks": sorted(fds_after - fds)}
