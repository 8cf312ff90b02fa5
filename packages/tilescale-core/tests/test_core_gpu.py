"""GPU tests (one H200 is enough: several ranks share it over gloo). Run with ``-m gpu``."""

from __future__ import annotations

import pytest
import torch

import core_gpu_bodies as bodies
from tilescale_core.multiprocess import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

MiB = 1 << 20
#: Device memory that may legitimately move during 100 cycles (driver bookkeeping), bytes.
LEAK_TOLERANCE = 8 * MiB


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("TILESCALE_USE_VMM", raising=False)
    monkeypatch.delenv("TILESCALE_CHECK_ALLOC", raising=False)


@pytest.mark.parametrize("use_vmm,expected", [(False, "ipc"), (True, ("vmm-fd", "vmm-fabric")), (None, ("ipc", "vmm-fabric"))])
def test_one_rank_heap(no_env, use_vmm, expected):
    import tilelang
    from tilescale_core import tensor_from_ptr

    a = tilelang.get_allocator(size=16 * MiB, use_vmm=use_vmm)
    with a:
        assert a.path in expected
        assert a.table.tolist() == [0, 1, a.base_ptr] and a.device == torch.device("cuda", torch.cuda.current_device())
        x = tilelang.tensor((1024, 3), "float16", allocator=a)
        y = tilelang.tensor((5,), torch.int32, allocator=a)
        assert x.data_ptr() == a.base_ptr and y.data_ptr() == a.base_ptr + 6144
        data = torch.randn(1024, 3, device="cuda", dtype=torch.float16)
        x.copy_(data)
        alias = tensor_from_ptr(a.base_ptr, (1024, 3), "half", torch.cuda.current_device())
        assert torch.equal(alias, data)
        y.copy_(torch.arange(5, device="cuda", dtype=torch.int32))
        assert y.sum().item() == 10
    assert a.closed


def test_non_distributed_local_heap(no_env):
    import tilelang

    with tilelang.get_allocator(size=4 * MiB, is_distributed=False) as a:
        assert a.path == "local"
        t = tilelang.tensor((256,), "float32", allocator=a)
        t.fill_(3.0)
        assert t.sum().item() == 768.0


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_vmm,path", [(False, "ipc"), (True, "vmm-fd")])
def test_ranks_share_gpu_peer_views(no_env, world_size, use_vmm, path):
    if use_vmm:
        from tilescale_core.probes import probe_vmm_fabric, probe_vmm_fd

        if probe_vmm_fabric():
            path = "vmm-fabric"
        elif not probe_vmm_fd():
            pytest.skip(f"VMM fd handles unavailable: {probe_vmm_fd().reason}")
    paths = run_ranks(bodies.peer_views, world_size, args=(use_vmm, 1 << 20), timeout=120)
    assert paths == [path] * world_size


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("use_vmm", [False, True])
def test_open_close_cycles_return_memory(no_env, world_size, use_vmm):
    results = run_ranks(bodies.open_close_cycles, world_size, args=(use_vmm, 100), timeout=240)
    r0 = results[0]
    drift = r0["before"] - r0["after"]
    print(f"path={r0['path']} ranks={world_size}: free before {r0['before']} after {r0['after']} drift {drift} B")
    assert abs(drift) <= LEAK_TOLERANCE, f"{drift / MiB:.1f} MiB not returned after 100 cycles on {r0['path']}"


@pytest.mark.parametrize("path", ["ipc", "vmm-fd"])
@pytest.mark.parametrize("where", ["export", "map"])
def test_failed_setup_returns_device_memory_and_descriptors(no_env, path, where):
    """Rank 1 of 3 fails its export (or its peer mapping) 30 times on real GPU memory:
    every rank raises SetupError naming rank 1 each time, and device memory and descriptors
    come back."""
    if path == "vmm-fd":
        from tilescale_core.probes import probe_vmm_fd

        if not probe_vmm_fd():
            pytest.skip(f"VMM fd handles unavailable: {probe_vmm_fd().reason}")
    results = run_ranks(bodies.failed_setup_cycles, 3, args=(path, where, 30), timeout=240)
    for rank, r in enumerate(results):
        assert len(r["outcomes"]) == 1, f"rank {rank}: outcomes differ between cycles: {r['outcomes']}"
        phase, failed = r["outcomes"][0]
        assert phase is not None, f"rank {rank}: set-up did not fail"
        assert where in phase or (where == "map" and ("open" in phase or "map" in phase)), phase
        assert list(failed) == [1], f"rank {rank}: failures {failed}"
        assert r["fd_leaks"] == [], f"rank {rank} leaked descriptors: {r['fd_leaks']}"
    drift = results[0]["before"] - results[0]["after"]
    print(f"{path} {where}: 30 failed set-ups, free device memory drift {drift} B")
    assert abs(drift) <= LEAK_TOLERANCE, f"{drift / MiB:.1f} MiB not returned after 30 failed set-ups on {path}"
