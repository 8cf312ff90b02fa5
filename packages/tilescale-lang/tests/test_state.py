"""tilescale-lang's process-wide state is one object whose size does not grow with use (CPU).

10,000 module loads (stock kernels' modules, which no TileScale kernel claims) and 10,000
``kernel.initialize`` calls on one kernel, on each execution backend's copy path, with the
CUDA calls replaced by host-side fakes, leave every container where it was.
"""

from __future__ import annotations

import tracemalloc
import types

import pytest
import torch
from lang_helpers import FakeAllocator

from tilescale_lang import _extension, metadata, pipeline_hooks, remote_tma
from tilescale_lang.state import STATE, LangState

ROUNDS = 10_000


def test_one_state_object():
    assert isinstance(STATE, LangState)
    assert _extension.STOCK is STATE.stock and pipeline_hooks.STOCK is STATE.stock
    assert remote_tma._heaps is STATE.heaps
    assert metadata._local is STATE.launching
    # the wrappers installed at import found their stock callables there
    assert {"copy", "tma_copy", "atomic_add"} <= set(STATE.stock)
    assert STATE.hooks.get("module_init") is True


def _fake_driver():
    return types.SimpleNamespace(
        CUmodule=lambda handle: handle,
        CUstream=lambda stream: stream,
        cuModuleGetGlobal=lambda module, symbol: (0, 0x7000_0000 + module, 8 * metadata.MAX_TABLE_ENTRIES),
        cuLibraryGetGlobal=lambda lib, symbol: (0, 0x7100_0000, 8 * metadata.MAX_TABLE_ENTRIES),
        cuMemcpyHtoDAsync=lambda dst, src, nbytes, stream: (0,),
    )


class _Setter:
    restype = argtypes = None

    def __call__(self, buf, n, stream):
        return 0


class _Kernel:
    adapter = None
    torch_function = None

    def __init__(self, backend):
        self.execution_backend = backend
        if backend == "nvrtc":
            self.adapter = types.SimpleNamespace(lib_generator=types.SimpleNamespace(culib="culib"))
        elif backend == "cython":
            self.adapter = types.SimpleNamespace(lib=types.SimpleNamespace(tilescale_set_meta_data=_Setter()))


class _Heap(FakeAllocator):
    size = 1 << 20
    closed = False


def _grown_bytes(fn) -> int:
    fn()  # warm up: first-call caches
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        fn()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))


def test_module_loads_keep_the_state_flat():
    sizes = STATE.sizes()
    unclaimed = STATE.unclaimed_modules

    def load():
        for i in range(ROUNDS):
            metadata.on_module_load(0x5000 + i)

    grown = _grown_bytes(load)
    assert STATE.sizes() == sizes
    assert STATE.unclaimed_modules == unclaimed + 2 * ROUNDS
    assert grown < 64 * 1024, f"{2 * ROUNDS} stock module loads grew memory by {grown} bytes"


@pytest.mark.parametrize("backend", ["tvm_ffi", "nvrtc", "cython"])
def test_initialize_calls_keep_the_state_flat(backend, monkeypatch):
    monkeypatch.setattr(metadata, "_driver", _fake_driver)
    kernel = _Kernel(backend)
    if backend == "tvm_ffi":
        metadata._state(kernel)["modules"] = [0x10, 0x20]  # two loaded modules (e.g. two devices)
    allocator = _Heap(torch.tensor([1, 2, 0x1000_0000, 0x2000_0000], dtype=torch.uint64))
    sizes = STATE.sizes()

    def initialize():
        for _ in range(ROUNDS):
            metadata.initialize(kernel, allocator=allocator, stream=0)
            remote_tma.register_heap(allocator, metadata.table_from_allocator(allocator))

    grown = _grown_bytes(initialize)
    st = kernel._tilescale_state
    assert len(st["keep"]) == {"tvm_ffi": 2, "nvrtc": 1, "cython": 1}[backend]
    assert STATE.sizes()["heaps"] <= sizes["heaps"] + 1
    assert STATE.sizes()["stock"] == sizes["stock"] and STATE.sizes()["hooks"] == sizes["hooks"]
    assert grown < 64 * 1024, f"{2 * ROUNDS} initialize calls ({backend}) grew memory by {grown} bytes"
    STATE.heaps[:] = [h for h in STATE.heaps if h.allocator() is not allocator]
