"""The bump allocator in one process, over the host-memory backend: layout, alignment, errors, close."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import tilescale_core
from tilescale_core.allocator import (
    DEFAULT_ALIGNMENT,
    AllocationLog,
    AllocationMismatchError,
    BaseAllocator,
    HeapExhaustedError,
    get_allocator,
)
from tilescale_core.testing import HostBackend


def make(size=1 << 16, **kw):
    backend = kw.pop("backend", None) or HostBackend()
    return BaseAllocator(size, device="cpu", backend=backend, **kw), backend


def test_get_allocator_signature_matches_spec():
    import inspect

    params = inspect.signature(get_allocator).parameters
    spec = {
        "size": 2**30, "device": "cuda", "is_distributed": True, "local_rank": 0,
        "num_local_ranks": 1, "group": None, "use_vmm": None, "mcast_size": None,
    }
    assert list(params)[: len(spec)] == list(spec)
    assert {k: params[k].default for k in spec} == spec
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in list(params)[len(spec):])


def test_table_layout_single_rank(clean_env):
    a, _ = make()
    with a:
        assert a.table.dtype == torch.uint64 and a.table.device.type == "cpu"
        assert a.table.tolist() == [0, 1, a.base_ptr]
        assert a.peer_base_ptrs == [a.base_ptr]
        assert a.local_rank == 0 and a.num_ranks == 1 and a.device == torch.device("cpu")
        assert a.size == 1 << 16 and a.used == 0 and not a.closed
        assert a.path in ("ipc", "local")


def test_alignment_and_offsets(clean_env):
    a, _ = make()
    with a:
        assert a.allocate(1) == 0
        assert a.allocate(1) == DEFAULT_ALIGNMENT
        assert a.allocate(10, alignment=1024) == 1024
        assert a.used == 1034
        assert a.allocate(8, alignment=8) == 1040
        assert a.allocate(300) == 1280
        assert a.used == 1580


@pytest.mark.parametrize("alignment", [0, -256, 3, 100, 1.0])
def test_bad_alignment(clean_env, alignment):
    a, _ = make()
    with a, pytest.raises(ValueError, match="alignment"):
        a.allocate(16, alignment=alignment)


@pytest.mark.parametrize("nbytes", [0, -1, 2.5, True])
def test_bad_allocation_sizes(clean_env, nbytes):
    a, _ = make()
    with a, pytest.raises(ValueError, match="nbytes"):
        a.allocate(nbytes)


def test_tensors_are_zero_copy_views_at_offsets(clean_env):
    a, _ = make()
    with a:
        x = a._allocate_tensor((4, 4), "float32")
        y = tilescale_core.tensor((3,), torch.int64, allocator=a)
        assert x.data_ptr() == a.base_ptr and y.data_ptr() == a.base_ptr + 256
        x.fill_(1.5)
        from tilescale_core.tensors import view_at

        alias = view_at(a.base_ptr, (16,), torch.float32, a.device)
        assert torch.all(alias == 1.5)
        peers = tilescale_core.tensor((2,), "bool", allocator=a, return_peers=True)
        assert isinstance(peers, list) and len(peers) == 1 and peers[0].data_ptr() == a.base_ptr + 512
        empty = tilescale_core.tensor((0, 3), "float16", allocator=a)
        assert empty.shape == (0, 3)


def test_exhausted_heap_message(clean_env):
    a, _ = make(size=1000)
    with a:
        a.allocate(600)
        with pytest.raises(HeapExhaustedError) as info:
            a.allocate(500)
        err = info.value
        assert (err.requested, err.used, err.capacity) == (500, 600, 1000)
        text = str(err)
        assert "500 bytes" in text and "600 of 1000 bytes used" in text
        assert isinstance(err, MemoryError)
        assert a.used == 600  # the failed allocation left no trace
        assert a.allocate(400, alignment=8) == 600  # exactly fits: 600 + 400 = 1000
        with pytest.raises(HeapExhaustedError):
            a.allocate(1, alignment=8)


@pytest.mark.parametrize("size", [0, -5, 1.5, None, True])
def test_bad_heap_size(clean_env, size):
    with pytest.raises(ValueError, match="size"):
        make(size=size)


def test_close_is_idempotent_and_releases(clean_env):
    a, backend = make()
    a.allocate(64)
    assert len(backend.mappings) == 1
    a.close()
    assert a.closed and backend.mappings == {}
    a.close()
    a.close()


def test_allocation_after_close(clean_env):
    a, _ = make()
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.allocate(8)
    with pytest.raises(RuntimeError, match="closed"):
        tilescale_core.tensor((2,), "float32", allocator=a)
    with pytest.raises(RuntimeError, match="closed"):
        a._allocate_mcast_tensor((2,), "float32")


def test_context_manager(clean_env):
    a, backend = make()
    with a as entered:
        assert entered is a
    assert a.closed and backend.mappings == {}


def test_tensor_from_another_device(clean_env):
    a, _ = make()
    with a:
        with pytest.raises(ValueError, match="heap is on cpu"):
            tilescale_core.tensor((2,), "float32", device="meta", allocator=a)
        ok = tilescale_core.tensor((2,), "float32", device="cpu", allocator=a)
        assert ok.device.type == "cpu"


def test_unknown_dtype_with_allocator_allocates_nothing(clean_env):
    a, _ = make()
    with a:
        with pytest.raises(ValueError, match="unknown dtype"):
            tilescale_core.tensor((2,), "float8", allocator=a)
        assert a.used == 0


def test_mcast_without_multicast(clean_env):
    with pytest.raises(ValueError, match="VMM allocator with fabric"):
        make(mcast_size=4096)
    with pytest.raises(ValueError, match="distributed"):
        make(mcast_size=4096, is_distributed=False)
    a, _ = make()
    with a, pytest.raises(RuntimeError, match="no multicast region"):
        a._allocate_mcast_tensor((2,), "float32")


def test_forced_vmm_without_support_raises(clean_env):
    clean_env.setenv("TILESCALE_USE_VMM", "1")
    from tilescale_core.allocator import VmmUnavailableError

    with pytest.raises(VmmUnavailableError, match="no fallback"):
        make()
    clean_env.setenv("TILESCALE_USE_VMM", "0")
    a, _ = make(use_vmm=True)  # the environment wins over the argument
    a.close()


def test_non_distributed_rank_arguments(clean_env):
    with pytest.raises(ValueError, match="single-rank"):
        make(is_distributed=False, num_local_ranks=2)
    with pytest.raises(ValueError, match="local_rank"):
        make(local_rank=1, num_local_ranks=1)
    with pytest.raises(ValueError, match="process group"):
        make(local_rank=0, num_local_ranks=2)
    a, _ = make(is_distributed=False)
    assert a.path == "local"
    a.close()


def test_real_backend_without_gpu_is_a_clear_error(clean_env):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU error")
    with pytest.raises(RuntimeError, match="CUDA is unavailable"):
        get_allocator(size=1 << 20)


def test_cpu_device_with_cuda_backend_rejected(clean_env):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA to get past the availability check")
    with pytest.raises(ValueError, match="CUDA device"):
        get_allocator(size=1 << 20, device="cpu")


def test_gc_without_close_warns(clean_env):
    a, _ = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del a
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)


def test_allocation_log_digest_and_difference():
    x, y = AllocationLog(), AllocationLog()
    for rec in [("heap", 8, 256), ("heap", 16, 256)]:
        x.append(rec)
        y.append(rec)
    assert x.digest == y.digest
    y.append(("heap", 4, 256))
    x.append(("heap", 4, 512))
    assert x.digest != y.digest
    assert AllocationLog.first_difference([x.records, y.records]) == (2, {0: ("heap", 4, 512), 1: ("heap", 4, 256)})
    assert AllocationLog.first_difference([x.records[:2], y.records]) == (2, {0: None, 1: ("heap", 4, 256)})
    # order matters for the digest
    p, q = AllocationLog(), AllocationLog()
    p.append(("heap", 1, 256)); p.append(("heap", 2, 256))
    q.append(("heap", 2, 256)); q.append(("heap", 1, 256))
    assert p.digest != q.digest


def test_mismatch_error_names_ranks():
    err = AllocationMismatchError(3, {0: ("heap", 8, 256), 1: ("heap", 8, 256), 2: ("heap", 16, 256)}, "at close()")
    assert err.ranks == [2] and err.index == 3
    assert "allocation #3" in str(err) and "rank 2 allocated 16 bytes" in str(err)


def test_public_tensor_is_the_heap_allocation(clean_env):
    a, _ = make()
    with a:
        x = a.tensor((4, 4), "float32")
        y = tilescale_core.tensor((3,), torch.int32, allocator=a)
        views = a.tensor(5, torch.float16, return_peers=True)
        assert x.shape == (4, 4) and x.dtype == torch.float32 and x.data_ptr() == a.base_ptr
        assert y.data_ptr() == a.base_ptr + DEFAULT_ALIGNMENT
        assert len(views) == 1 and views[0].shape == (5,) and views[0].data_ptr() == a.base_ptr + 2 * DEFAULT_ALIGNMENT
        x.fill_(3.0)
        assert torch.equal(a._heap_view(0)[:64].view(torch.float32), torch.full((16,), 3.0))


def test_public_multicast_tensor_says_how_to_get_multicast(clean_env):
    a, _ = make()
    with a, pytest.raises(RuntimeError, match=r"no multicast region \(path '(ipc|local)'\): pass mcast_size .* fabric handles"):
        a.multicast_tensor((2,), "float32")
    with pytest.raises(RuntimeError, match="closed"):
        a.multicast_tensor((2,), "float32")


@pytest.mark.parametrize("text,want", [("1", True), ("true", True), ("Yes", True), ("on", True),
                                       ("0", False), ("false", False), ("off", False), ("", False)])
def test_check_alloc_env_reads_every_boolean_spelling(clean_env, text, want):
    clean_env.setenv("TILESCALE_CHECK_ALLOC", text)
    a, _ = make()
    with a:
        assert a._check is want


def test_check_alloc_env_rejects_an_unreadable_value(clean_env):
    clean_env.setenv("TILESCALE_CHECK_ALLOC", "maybe")
    with pytest.raises(ValueError, match=r"TILESCALE_CHECK_ALLOC='maybe' is not a boolean"):
        make()
