"""Rank bodies for the multi-process tests (imported by name in spawned ranks; imports are lazy)."""

from __future__ import annotations

import os
import time


def _allocator(rank, world_size, size=1 << 16, backend=None, **kw):
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    backend = backend or HostBackend()
    a = BaseAllocator(size, device="cpu", local_rank=rank, num_local_ranks=world_size, backend=backend, **kw)
    return a, backend


def heap_roundtrip(rank, world_size, n):
    """Poison, barrier, fill with fresh random data, barrier, check every peer view."""
    import torch
    import torch.distributed as dist

    import tilescale_core

    a, backend = _allocator(rank, world_size)
    table = a.table.tolist()
    assert table[:2] == [rank, world_size] and table[2 + rank] == a.base_ptr and len(table) == 2 + world_size
    first = tilescale_core.tensor((n,), "float32", allocator=a, return_peers=True)
    second = tilescale_core.tensor((3, 5), torch.int64, allocator=a, return_peers=True)
    offsets = (first[rank].data_ptr() - a.base_ptr, second[rank].data_ptr() - a.base_ptr)
    for views in (first, second):
        assert len(views) == world_size and views[rank].device.type == "cpu"
        for r, v in enumerate(views):
            assert v.data_ptr() - a.peer_base_ptrs[r] == views[rank].data_ptr() - a.base_ptr
    first[rank].fill_(float("nan"))
    second[rank].fill_(-1)
    dist.barrier()
    gen = torch.Generator().manual_seed(1000 + rank * 7 + int(time.time()))
    mine = torch.rand(n, generator=gen)
    first[rank].copy_(mine)
    second[rank].copy_(torch.randint(0, 1 << 40, (3, 5), generator=gen))
    expected = [None] * world_size
    dist.all_gather_object(expected, (mine, second[rank].clone()))
    dist.barrier()
    for r in range(world_size):
        assert torch.equal(first[r], expected[r][0]), f"rank {rank}: peer {r}'s float view differs"
        assert torch.equal(second[r], expected[r][1]), f"rank {rank}: peer {r}'s int view differs"
    dist.barrier()
    a.close()
    assert backend.mappings == {}, "close() left mappings behind"
    return {"table": table, "offsets": offsets}


def mismatch_at_close(rank, world_size, order_swap):
    from tilescale_core.allocator import AllocationMismatchError

    a, backend = _allocator(rank, world_size)
    sizes = [64, 128, 32]
    if rank == 1:
        sizes = [128, 64, 32] if order_swap else [64, 256, 32]
    for s in sizes:
        a.allocate(s)
    try:
        a.close()
    except AllocationMismatchError as err:
        return {"message": str(err), "ranks": err.ranks, "index": err.index, "leaks": len(backend.mappings)}
    return None


def mismatch_check_mode(rank, world_size, use_env):
    from tilescale_core.allocator import AllocationMismatchError

    if use_env:
        os.environ["TILESCALE_CHECK_ALLOC"] = "1"
        a, _ = _allocator(rank, world_size)
    else:
        a, _ = _allocator(rank, world_size, check_alloc=True)
    a.allocate(64)
    try:
        a.allocate(100 if rank == world_size - 1 else 96)
    except AllocationMismatchError as err:
        outcome = {"message": str(err), "ranks": err.ranks, "index": err.index, "used": a.used}
    else:
        outcome = None
    a.allocate(8)  # the failed allocation left no trace: sequences agree again
    a.close()
    return outcome


def _failing_backend(fail_rank, where):
    from tilescale_core.testing import HostBackend

    class Failing(HostBackend):
        def allocate(self, size, device):
            if where == "allocate" and rank_box[0] == fail_rank:
                raise OSError("injected allocate failure")
            return super().allocate(size, device)

        def import_fd(self, fd, size, device):
            if where == "import" and rank_box[0] == fail_rank:
                raise OSError("injected import failure")
            return super().import_fd(fd, size, device)

        def export_fd(self, ptr):
            if where == "export" and rank_box[0] == fail_rank:
                raise OSError("injected export failure")
            return super().export_fd(ptr)

    rank_box = [None]
    return Failing(), rank_box


def setup_failure(rank, world_size, fail_rank, where):
    from tilescale_core._comm import SetupError

    backend, box = _failing_backend(fail_rank, where)
    box[0] = rank
    fds_before = open_fds()
    try:
        _allocator(rank, world_size, backend=backend)
    except SetupError as err:
        return {"phase": err.phase, "failed": sorted(err.failures), "message": str(err), "leaks": len(backend.mappings),
                "fd_leaks": sorted(open_fds() - fds_before)}
    return None


def open_fds() -> set:
    """This process's open descriptors that point at memfds or sockets (``/proc/self/fd``)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, already closed
            continue
        if target.startswith(("/memfd:", "socket:")):
            found.add((int(name), target))
    return found


def fd_exchange(rank, world_size):
    import torch.distributed as dist

    from tilescale_core._comm import Comm
    from tilescale_core._fd_exchange import exchange_fds

    fd = os.memfd_create("fd-exchange-test")
    os.write(fd, f"hello from rank {rank}".encode())
    fds = exchange_fds(Comm(dist.group.WORLD, rank, world_size), fd, timeout=20)
    seen = {}
    for r, peer_fd in enumerate(fds):
        if r == rank:
            assert peer_fd is None
            continue
        seen[r] = os.pread(peer_fd, 64, 0).decode()
        os.close(peer_fd)
    os.close(fd)
    return seen


class FakeMulticast:
    """Records multicast driver calls; mapping returns host memory so views can be checked."""

    def __init__(self, rank):
        self.rank = rank
        self.calls = []
        from tilescale_core.testing import HostBackend

        self.host = HostBackend()

    def install(self):
        from tilescale_core import _driver_multicast as mc

        for name in mc.__all__:
            setattr(mc, name, getattr(self, name))

    def aligned_size(self, size, n):
        self.calls.append(("aligned_size", size, n))
        return (size + 8191) // 8192 * 8192

    def create(self, size, n):
        self.calls.append(("create", size, n))
        return 77

    def export_handle(self, handle):
        self.calls.append(("export_handle", handle))
        return b"H" * 64

    def import_handle(self, data):
        self.calls.append(("import_handle", data))
        return 88

    def add_device(self, handle, dev):
        self.calls.append(("add_device", handle, dev))

    def bind_mem(self, handle, ptr, size):
        self.calls.append(("bind_mem", handle, size))

    def map(self, handle, size, devices):
        self.calls.append(("map", handle, size, list(devices)))
        self.mc_ptr = self.host.allocate(size, None)
        return self.mc_ptr

    def unmap(self, ptr, size):
        self.calls.append(("unmap", ptr == self.mc_ptr, size))
        self.host.free(ptr)

    def unbind(self, handle, dev, size):
        self.calls.append(("unbind", handle, size))

    def release_handle(self, handle):
        self.calls.append(("release_handle", handle))


def multicast_mocked(rank, world_size):
    import torch

    from tilescale_core import probes
    from tilescale_core.probes import Probe
    from tilescale_core.testing import HostBackend

    os.environ["TILESCALE_USE_VMM"] = "1"
    probes.probe_vmm_fabric = lambda: Probe(True, "faked")
    probes.probe_multicast = lambda: Probe(True, "faked")
    fake = FakeMulticast(rank)
    fake.install()
    backend = HostBackend()
    a, _ = _allocator(rank, world_size, backend=backend, mcast_size=10000)
    assert a.path == "vmm-fabric"
    mc_view, local_view = a._allocate_mcast_tensor((16,), "float32")
    second_mc, second_local = a._allocate_mcast_tensor((4,), torch.int32)
    info = {
        "mc_offset": mc_view.data_ptr() - fake.mc_ptr,
        "local_is_physical": local_view.data_ptr() in backend.mappings,
        "second_offsets": (second_mc.data_ptr() - fake.mc_ptr, second_local.data_ptr() - local_view.data_ptr()),
        "heap_used": a.used,
    }
    a.close()
    info["calls"] = fake.calls
    info["leaks"] = len(backend.mappings) + len(fake.host.mappings)
    return info


def fail_with_message(rank, world_size):
    if rank == 2:
        raise ValueError(f"deliberate failure on rank {rank}")
    time.sleep(30)
    return rank


def stuck_rank(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def bad_arguments(rank, world_size, case):
    """case "invalid": rank 1 passes size=0; case "disagree": rank 2 asks for a bigger heap."""
    size = 1 << 16
    if case == "invalid" and rank == 1:
        size = 0
    if case == "disagree" and rank == 2:
        size = 1 << 17
    try:
        _allocator(rank, world_size, size=size)
    except Exception as err:
        return type(err).__name__, str(err)
    return None


def group_backend(rank, world_size):
    """The backend run_ranks gave this rank's process group."""
    import torch.distributed as dist

    return dist.get_backend()


def close_with_absent_peer(rank, world_size, timeout):
    """Rank 1 never calls close(): rank 0's close(timeout=...) must fail in time and still
    release its mappings and descriptors."""
    a, backend = _allocator(rank, world_size)
    fds = open_fds()
    if rank == 1:
        time.sleep(timeout + 6)
        return None
    start = time.monotonic()
    try:
        a.close(timeout=timeout)
    except TimeoutError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start, "mappings": len(backend.mappings),
                "closed": a.closed, "fds_closed": sorted(fds - open_fds())}
    return {"error": None}


def start_a_process(rank, world_size):
    """A rank body may start processes of its own (the harness's ranks are not daemons)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_put_pid, args=(q,))
    p.start()
    child = q.get(timeout=60)
    p.join(timeout=30)
    return {"child": child, "exitcode": p.exitcode, "me": os.getpid()}


def _put_pid(q):
    q.put(os.getpid())


def dies_in_a_collective(rank, world_size, how):
    """The last rank dies (``how``: "exit3" ``os._exit(3)``, "kill" SIGKILL) between two
    barriers; the others then fail in the second barrier, because of it."""
    import signal

    import torch.distributed as dist

    dist.barrier()
    if rank == world_size - 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()
    return "survived"


def unpicklable_result(rank, world_size):
    import threading

    return threading.Lock() if rank == 1 else rank


def aborts_at_exit(rank, world_size):
    """Rank 1 returns, then aborts during interpreter shutdown (as std::terminate would)."""
    import atexit
    import os

    if rank == 1:
        atexit.register(os.abort)
    return rank
