"""``pynvshmem`` over TileScale's heap (CPU): the top-level shim and its deference to a real
pynvshmem, initialisation over a process group, the heap (a host-memory backend here), the
default heap it sets, argument checks and the clear errors of what it does not provide."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tilescale_host import pynvshmem as P

SRC = os.path.dirname(os.path.dirname(P.__file__))


@pytest.fixture
def group(tmp_path, monkeypatch):
    """A one-rank gloo world group, and a pynvshmem whose heap lives in host memory."""
    import torch.distributed as dist
    from tilescale_core.allocator import BaseAllocator
    from tilescale_core.testing import HostBackend

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv(P.SIZE_ENV, "1M")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)

    def host_heap(group, rank, size):
        return BaseAllocator(P.heap_bytes(), device="cpu", is_distributed=True, local_rank=rank,
                             num_local_ranks=size, group=group, backend=HostBackend())

    monkeypatch.setattr(P, "_new_heap", host_heap)
    try:
        yield dist.group.WORLD
    finally:
        P.nvshmem_finalize()
        dist.destroy_process_group()


def test_top_level_module_is_tilescales():
    import pynvshmem

    assert pynvshmem.nvshmem_create_tensor is P.nvshmem_create_tensor
    assert pynvshmem.init_nvshmem_by_uniqueid is P.init_nvshmem_by_uniqueid
    assert set(P.__all__) <= set(dir(pynvshmem))


def _import_in_subprocess(tmp_path, path_entries):
    code = "import pynvshmem; print(getattr(pynvshmem, 'MARK', 'tilescale'), pynvshmem.__name__)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path_entries))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()


@pytest.mark.parametrize("real_first", [True, False])
def test_a_real_pynvshmem_wins_wherever_it_is_on_the_path(tmp_path, real_first):
    real = tmp_path / "real"
    (real / "pynvshmem").mkdir(parents=True)
    (real / "pynvshmem" / "__init__.py").write_text("MARK = 'real'\n")
    entries = [str(real), SRC] if real_first else [SRC, str(real)]
    assert _import_in_subprocess(tmp_path, entries) == ["real", "pynvshmem"]


def test_without_a_real_one_the_shim_is_tilescales(tmp_path):
    assert _import_in_subprocess(tmp_path, [SRC]) == ["tilescale", "pynvshmem"]


@pytest.mark.parametrize("value, expected", [("", P.DEFAULT_HEAP_BYTES), ("4096", 4096), ("512M", 512 << 20),
                                             ("4G", 4 << 30), ("2g", 2 << 30), ("1KiB", 1024), (" 3T ", 3 << 40)])
def test_heap_bytes(value, expected):
    assert P.heap_bytes({P.SIZE_ENV: value}) == expected


@pytest.mark.parametrize("value", ["x", "0", "-4", "1.5G", "4Q"])
def test_heap_bytes_rejects(value):
    with pytest.raises(ValueError, match=P.SIZE_ENV):
        P.heap_bytes({P.SIZE_ENV: value})


def test_uninitialised_calls_say_how_to_initialise():
    for call in (P.nvshmem_my_pe, P.nvshmem_n_pes, lambda: P.nvshmem_create_tensor([4], torch.float32),
                 P.nvshmem_barrier_all):
        with pytest.raises(RuntimeError, match="init_nvshmem_by_uniqueid"):
            call()


def test_init_without_torch_distributed():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        P.init_nvshmem_by_uniqueid(object())


def test_init_and_queries(group):
    P.init_nvshmem_by_uniqueid(group)
    P.init_nvshmem_by_uniqueid(group)  # again: nothing
    assert (P.nvshmem_my_pe(), P.nvshmem_n_pes()) == (0, 1)
    assert P.nvshmem_team_my_pe(P.Team.NODE) == 0 and P.nvshmem_team_n_pes(P.Team.WORLD) == 1
    assert P.nvshmem_team_n_pes(P.Team.SAME_MYPE_NODE) == 1
    with pytest.raises(ValueError, match="team"):
        P.nvshmem_team_n_pes(P.Team.GPU_LEADERS)
    with pytest.raises(ValueError, match="team"):
        P.nvshmem_team_my_pe("node")
    import torch.distributed as dist

    with pytest.raises(RuntimeError, match="another process group"):
        P.init_nvshmem_by_uniqueid(dist.new_group([0]))


def test_init_argument_checks(group):
    with pytest.raises(TypeError, match="group"):
        P.init_nvshmem_by_uniqueid(None)
    with pytest.raises(ValueError, match="rank=1"):
        P.nvshmemx_init_attr_with_uniqueid(1, 2, P.nvshmemx_get_uniqueid())
    with pytest.raises(ValueError, match="unique_id"):
        P.nvshmemx_init_attr_with_uniqueid(0, 1, "id")
    assert len(P.nvshmemx_get_uniqueid()) == 128
    P.nvshmemx_init_attr_with_uniqueid(0, 1, P.nvshmemx_get_uniqueid())
    assert P.nvshmem_n_pes() == 1


def test_multi_node_group_fails_with_one_line(group, monkeypatch):
    monkeypatch.setattr("torch.distributed.get_world_size", lambda g=None: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="spans one node only") as info:
        P.init_nvshmem_by_uniqueid(group)
    assert "\n" not in str(info.value)


def test_tensors_come_from_one_heap_that_becomes_the_default(group):
    from tilescale_core.interface import default_allocator

    P.init_nvshmem_by_uniqueid(group)
    assert default_allocator() is None  # no heap before the first allocation
    a = P.nvshmem_create_tensor([4, 8], torch.float16)
    heap = P.heap()
    assert default_allocator() is heap
    assert a.shape == (4, 8) and a.dtype == torch.float16
    assert a.data_ptr() == heap.base_ptr
    b = P.nvshmem_create_tensor((3,), torch.uint64)
    assert b.data_ptr() == heap.base_ptr + 256  # the heap's 256-byte alignment
    views = P.nvshmem_create_tensor_list_intra_node([2], torch.int32)
    assert len(views) == 1 and views[0].shape == (2,)
    ptr = P.nvshmem_malloc(100)
    assert P.nvshmem_ptr(ptr, 0) == ptr and P.nvshmem_ptr(1, 0) == 0
    with pytest.raises(ValueError, match="peer"):
        P.nvshmem_ptr(ptr, 1)
    P.nvshmem_free(ptr)
    P.nvshmem_finalize()
    assert default_allocator() is None and heap.closed


@pytest.mark.parametrize("shape, exc", [([0, 4], ValueError), ([-1], ValueError), (["a"], TypeError), (None, TypeError),
                                        ([2.5, 4], TypeError)])
def test_create_tensor_rejects_shapes(group, shape, exc):
    P.init_nvshmem_by_uniqueid(group)
    with pytest.raises(exc, match="shape"):
        P.nvshmem_create_tensor(shape, torch.float32)


def test_heap_exhaustion_names_the_fix(group):
    from tilescale_core.allocator import HeapExhaustedError

    P.init_nvshmem_by_uniqueid(group)
    with pytest.raises(HeapExhaustedError):
        P.nvshmem_create_tensor([1 << 20], torch.float32)  # 4 MiB in a 1 MiB heap


def test_malloc_checks_size(group):
    P.init_nvshmem_by_uniqueid(group)
    with pytest.raises((TypeError, ValueError), match="size"):
        P.nvshmem_malloc(0)


def test_enums_and_names_not_provided():
    import importlib.util

    import tilelang.language as T

    if importlib.util.find_spec("tilescale_lang") is not None:
        assert P.CmpType is T.CmpType and P.Amo is T.Amo
    else:  # tilescale-host installed without tilescale-lang: the enums say where they come from
        for name in ("CmpType", "Amo"):
            with pytest.raises(AttributeError, match=f"pynvshmem.{name} comes from tilescale-lang"):
                getattr(P, name)
    assert int(P.Team.NODE) == 2
    for name in ("nvshmem_putmem", "nvshmemx_putmem_signal_on_stream", "nvshmem_int_p", "write64_on_stream"):
        with pytest.raises(AttributeError, match="not provided by TileScale's pynvshmem"):
            getattr(P, name)
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        P.bogus  # noqa: B018


def test_cumodule_hooks_are_no_ops():
    assert P.nvshmemx_cumodule_init(1234) is None and P.nvshmemx_cumodule_finalize(1234) is None


def test_stream_argument_of_the_stream_barrier(group, monkeypatch):
    seen = []
    monkeypatch.setattr("tilescale_host.stream_barrier.barrier_all_on_stream", lambda s, group: seen.append((s, group)))
    P.init_nvshmem_by_uniqueid(group)
    sentinel = object()
    P.nvshmemx_barrier_all_on_stream(sentinel)
    assert seen == [(sentinel, group)]


def test_upstream_init_distributed_initialises_it(monkeypatch):
    """``tilelang.distributed.init_distributed`` finds this pynvshmem and calls its
    ``init_nvshmem_by_uniqueid(group)`` (compat)."""
    from tilescale_host import compat

    calls = []
    monkeypatch.setattr("tilescale_host.dist_init.init_dist", lambda lr, ws: (0, 1, "group"))
    import pynvshmem

    monkeypatch.setattr(pynvshmem, "init_nvshmem_by_uniqueid", calls.append)
    for var, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    assert compat.init_distributed() == (1, 0, 0)
    assert calls == ["group"]


SCRIPT = textwrap.dedent("""
    import pynvshmem
    print(pynvshmem.nvshmem_my_pe.__module__)
""")


def test_shim_script_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert res.stdout.strip() == "tilescale_host.pynvshmem", res.stderr[-2000:]
