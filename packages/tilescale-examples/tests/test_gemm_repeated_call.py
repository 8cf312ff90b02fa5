"""The overlapped GEMMs' repeated call at one rank (their GEMM alone: ``_gemm_alone``), on the
CPU with a stand-in GEMM: two full calls on the same ``a`` keep the launch, the next launches
through the op's launcher and freezes it with nothing moving (its TMA descriptors describe
``a``, ``b`` and the output where they are), the later ones launch the frozen launch alone;
anything laid out otherwise, ``out=``, a capture and ``close()`` take the full call's path.
The frozen launch's bits on a GPU: test_overlap_gpu."""

from __future__ import annotations

import pytest
import torch
from examples_helpers import gemm_fused_on_one_rank

from tilescale_examples import AllGatherGEMM, ClosedError, GemmReduceScatter


class GemmStandIn:
    """Stands for the compiled GEMM: ``C = A @ B`` in float32, rounded; records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b, c):
        self.calls.append((a, b, c))
        c.copy_((a.float() @ b.float()).to(c.dtype))


class _Stream:
    """Stands in for the current CUDA stream on the CPU (the full call orders itself on it)."""

    cuda_stream = 0

    def wait_event(self, event):
        pass


@pytest.fixture
def streams(monkeypatch):
    """The current stream and its events as CPU stand-ins."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: type("E", (), {"record": lambda self, s: None})())


def _op(cls, compiles):
    op = gemm_fused_on_one_rank(cls, torch.float16, compiles)
    op.kernel = GemmStandIn()
    if cls is AllGatherGEMM:
        op.own_kernel = op.kernel
    return op


@pytest.mark.parametrize("cls", [AllGatherGEMM, GemmReduceScatter])
def test_repeated_gemm_calls_launch_a_frozen_launch_with_nothing_moving(cls, compiles, fused_available, streams, monkeypatch):
    from tilescale_lang import lean

    op = _op(cls, compiles)
    made, launched = [], []

    class Frozen:  # stands for a FrozenLaunch of the stand-in: its parameters launched again
        capturing = False

        def __init__(self, kernel, args, moving):
            assert list(moving) == []  # the descriptors' buffers stay where they were
            self.kernel, self.args = kernel, args

        def __call__(self, *addresses):
            assert addresses == ()
            if Frozen.capturing:
                return False
            launched.append(self.args)
            self.kernel(*self.args)
            return True

    monkeypatch.setattr(lean, "freeze", lambda kernel, args, moving: made.append(args) or Frozen(kernel, args, moving))
    a, b = torch.randn(256, 128).half(), torch.randn(128, 256).half()

    def check():
        assert torch.equal(op.output, (a.float() @ b.float()).half())

    op(a, b), op(a, b)  # two full calls on the same a: kept
    assert len(op.kernel.calls) == 2 and op._kept_launch is not None and not made
    assert op(a, b) is op.output and len(made) == 1 and not launched  # the launcher, then frozen
    assert made[0][0].data_ptr() == a.data_ptr() and made[0][2] is op.output
    for i in range(3):
        a.copy_(torch.randn(256, 128).half())
        op.output.fill_(float("nan"))
        assert op(a, b) is op.output and len(launched) == i + 1 and op.epoch == 4 + i
        check()
    calls = len(op.kernel.calls)
    a2 = torch.randn(256, 128).half()
    assert op(a2, b) is op.output and len(op.kernel.calls) == calls + 1 and len(launched) == 3  # moved: full call
    assert op._kept_launch is None
    a = a2
    check()
    out = torch.empty(256, 256).half()
    op(a, b), op(a, b)  # kept again (the second: through the launcher, frozen anew)
    assert len(made) == 2 and op._kept_launch is not None
    assert op(a, b, out=out) is out and op._kept_launch is None and torch.equal(out, op.output)  # out=: full call
    op(a, b), op(a, b), op(a, b), op(a, b)
    assert len(made) == 3 and len(launched) == 4
    Frozen.capturing = True  # a capture: the frozen launch launches nothing, the full call runs and is counted
    calls, epoch = len(op.kernel.calls), op.epoch
    op.output.fill_(float("nan"))
    assert op(a, b) is op.output and len(op.kernel.calls) == calls + 1 and op.epoch == epoch + 1
    check()
    Frozen.capturing = False
    op.close()
    with pytest.raises(ClosedError, match=f"{cls.__name__} is closed"):
        op(a, b)


@pytest.mark.parametrize("cls", [AllGatherGEMM, GemmReduceScatter])
def test_a_repeated_gemm_call_checks_what_its_layout_does_not_hold(cls, compiles, fused_available, streams):
    """A call laid out otherwise (another dtype, shape, a transposed view at the same address)
    takes the full call, whose checks name the argument; nothing launched."""
    op = _op(cls, compiles)
    a, b = torch.randn(256, 128).half(), torch.randn(128, 256).half()
    op(a, b), op(a, b), op(a, b)
    calls = len(op.kernel.calls)
    with pytest.raises(TypeError, match="a has dtype torch.bfloat16"):
        op(a.view(torch.bfloat16), b)
    with pytest.raises(ValueError, match="b .*contiguous"):
        op(a, b.view(256, 128).t())  # b's address, shape and dtype; other strides
    assert len(op.kernel.calls) == calls
