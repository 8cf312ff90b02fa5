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
