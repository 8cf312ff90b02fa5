"""The CUDA-graph rules of the collectives checked on the CPU (the GPU runs are in
``test_graphs.py``): call numbers and buffer choice on the device, what refuses capture, the
warm-up rule, and how a kernel's table is bound when graphs capture it."""

from __future__ import annotations

import pytest
import torch
from examples_helpers import CpuAllocator


class _FakeKernel:
    """Stands in for a compiled reduction kernel on the CPU: records its arguments."""

    def __init__(self):
        self.calls = []

    def initialize(self, allocator=None, stream=None):
        return self

    def __call__(self, *args):
        self.calls.append(args)


def _cpu_allreduce(monkeypatch, algorithm="one_shot"):
    from examples_helpers import record_compiles

    from tilescale_examples.collectives.allreduce import AllReduce

    record_compiles(monkeypatch)
    ar = AllReduce(CpuAllocator(2, 0), (64,), torch.float16, algorithm=algorithm)
    ar.kernel = _FakeKernel()
    return ar


def test_the_kernels_take_their_call_number_from_the_device(monkeypatch):
    """No kernel argument carries a call number: the reduction kernel gets the per-block
    counters (``state``) and its buffer choice is made on the device."""
    ar = _cpu_allreduce(monkeypatch)
    x = torch.zeros(64, dtype=torch.float16)
    ar(x)
    ar(x)
    first, second = ar.kernel.calls
    assert first[4] is ar.state and second[4] is ar.state  # the counters, not a number
    assert first[1] is ar.stage_buffer and second[1] is ar.stage_buffer  # both buffers, always
    assert ar.state.shape == (ar.plan.blocks,) and ar.state.dtype == torch.int64
    assert ar.stage_buffer.shape[0] == 2 * ar.plan.stage_rows


def test_zero_copy_input_is_refused_once_captured(monkeypatch):
    ar = _cpu_allreduce(monkeypatch)
    staged = ar.input
    ar._captured = True  # as a call under capture leaves it
    with pytest.raises(RuntimeError, match="captured in a CUDA graph.*pass a tensor of your own"):
        ar.input
    with pytest.raises(RuntimeError, match="own staging buffers.*captured in a CUDA graph"):
        ar(staged)
    ar(torch.zeros(64, dtype=torch.float16))  # an ordinary input still works
    two = _cpu_allreduce(monkeypatch, "two_shot")
    two._captured = True
    assert two.input.data_ptr() == two.stage_buffer.data_ptr()  # one buffer: always known


def test_tma_allreduce_refuses_capture(monkeypatch):
    from tilescale_examples.tutorials.tma_allreduce import TmaAllReduce

    ar = object.__new__(TmaAllReduce)
    ar._closed, ar.allocator, ar.shape = False, CpuAllocator(2, 0), (64, 128)
    ar.dtype, ar.device = torch.float32, torch.device("cpu")
    monkeypatch.setattr(TmaAllReduce, "_capturing", lambda self: True)
    with pytest.raises(RuntimeError, match="TmaAllReduce cannot be captured in a CUDA graph"):
        ar(torch.zeros((64, 128)))


def test_capture_of_a_kernel_never_launched_asks_for_a_warm_up(monkeypatch):
    from tilescale_lang import metadata

    ar = _cpu_allreduce(monkeypatch)
    monkeypatch.setattr(type(ar), "_capturing", lambda self: True)
    monkeypatch.setattr(metadata, "loaded", lambda kernel: False)
    with pytest.raises(RuntimeError, match="never run.*outside the CUDA graph capture first"):
        ar(torch.zeros(64, dtype=torch.float16))


def test_a_kernel_captured_unshared_is_pinned_and_others_get_a_copy(monkeypatch):
    """A graph captured without a table copy binds one allocator's table for good: an
    instance on another allocator compiles its own copy of the kernel (another symbol)."""
    from examples_helpers import record_compiles

    from tilescale_examples.collectives.allreduce import AllReduce

    built = record_compiles(monkeypatch)
    a0, a1 = CpuAllocator(2, 0), CpuAllocator(2, 0)
    first = AllReduce(a0, (64,), torch.float16, algorithm="one_shot")
    monkeypatch.setattr(AllReduce, "_capturing", lambda self: True)
    first.bind_table()  # as the launch under capture does: one user, so pinned
    monkeypatch.setattr(AllReduce, "_capturing", lambda self: False)
    second = AllReduce(a1, (64,), torch.float16, algorithm="one_shot")
    assert second.kernel is not first.kernel
    assert built[-1] == "allreduce_one_shot_copy1"
    third = AllReduce(a0, (128,), torch.float16, algorithm="one_shot")
    assert third.kernel is first.kernel  # the pinned allocator keeps sharing it


def test_a_shared_kernel_binds_from_the_device_under_capture(monkeypatch):
    from examples_helpers import record_compiles
    from tilescale_lang import metadata

    from tilescale_examples.collectives.allreduce import AllReduce

    record_compiles(monkeypatch)
    ar0 = AllReduce(CpuAllocator(2, 0), (64,), torch.float16, algorithm="one_shot")
    ar1 = AllReduce(CpuAllocator(2, 1), (64,), torch.float16, algorithm="one_shot")
    assert ar0.kernel is ar1.kernel
    ar1._device_table()  # on a GPU, the first eager bind makes it (a host copy cannot be captured)
    copies = []
    monkeypatch.setattr(metadata, "bind_from_device", lambda kernel, table, stream: copies.append(table))
    monkeypatch.setattr(AllReduce, "_capturing", lambda self: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    ar1.bind_table()
    assert len(copies) == 1 and copies[0].tolist()[:2] == [1, 2]  # rank 1's table
    monkeypatch.setattr(AllReduce, "_capturing", lambda self: False)
    inits = []
    monkeypatch.setattr(type(ar0.kernel), "initialize", lambda self, allocator=None, stream=None: inits.append(allocator))
    ar1.bind_table()
    ar1.bind_table()
    assert inits == [ar1.allocator, ar1.allocator]  # after a captured copy, every eager launch rebinds


def test_an_eager_rebind_of_a_loaded_kernel_copies_from_the_device(monkeypatch):
    """On a CUDA device, a kernel shared by two allocators rebinds eagerly from the instance's
    device copy of its table once its module is loaded (a copy from pageable host memory may
    wait for the stream); before that (the first launch loads the module) through
    ``kernel.initialize``."""
    from examples_helpers import record_compiles
    from tilescale_lang import metadata

    from tilescale_examples.collectives.allreduce import AllReduce

    record_compiles(monkeypatch)
    ar0 = AllReduce(CpuAllocator(2, 0), (64,), torch.float16, algorithm="one_shot")
    ar1 = AllReduce(CpuAllocator(2, 1), (64,), torch.float16, algorithm="one_shot")
    kernel = ar0.kernel
    assert kernel is ar1.kernel
    for ar in (ar0, ar1):
        ar._device_table()  # the CPU tensor stands for the device copy
        ar.device = torch.device("cuda", 0)
    kernel.execution_backend = "tvm_ffi"
    copies, inits = [], []
    monkeypatch.setattr(AllReduce, "_capturing", lambda self: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})())
    monkeypatch.setattr(metadata, "bind_from_device", lambda k, table, stream: copies.append((table, stream)))
    monkeypatch.setattr(type(kernel), "initialize", lambda self, allocator=None, stream=None: inits.append(allocator))
    monkeypatch.setattr(metadata, "loaded", lambda k: False)
    ar0.bind_table()  # ar1 was bound last (its constructor)
    assert inits == [ar0.allocator] and copies == []
    monkeypatch.setattr(metadata, "loaded", lambda k: True)
    ar1.bind_table()
    ar1.bind_table()  # bound already: nothing
    ar0.bind_table()
    assert inits == [ar0.allocator]
    assert [(t.tolist()[:2], stream) for t, stream in copies] == [([1, 2], 7), ([0, 2], 7)]
