"""GemmAllReduce's repeated call on the CPU (a fake kernel, a stand-in frozen launch): two full
calls on the same ``a`` keep the launch, the next launches through the op's launcher and freezes
it with nothing moving (its TMA descriptors describe ``a``, ``b`` and the output where they
are), the later ones launch the frozen launch alone, each a new call (the kernel counts the
calls on the device); ``a`` or ``b`` elsewhere, ``out=``, an unaligned input, a capture and
``close()`` take the full call's path. The frozen launch's bits on a GPU: the back-to-back part
of ``test_gemm_allreduce_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from tilescale_examples import ClosedError
from tilescale_examples.decode.gemm_allreduce import torch_reference

from test_gemm_allreduce import BF16, make, normal_inputs


class Frozen:
    """Stands for a :class:`~tilescale_lang.lean.FrozenLaunch` of the fake kernel: launches its
    parameters again (``False``, launching nothing, while "capturing")."""

    capturing = False
    made: list = []
    launched: list = []

    def __init__(self, kernel, args, moving):
        assert list(moving) == []  # the descriptors' buffers stay where they were
        self.kernel, self.args = kernel, args
        Frozen.made.append(args)

    def __call__(self, *addresses):
        assert addresses == ()
        if Frozen.capturing:
            return False
        Frozen.launched.append(self.args)
        self.kernel(*self.args)
        return True


@pytest.fixture
def frozen(monkeypatch):
    from tilescale_lang import lean

    Frozen.capturing, Frozen.made, Frozen.launched = False, [], []
    monkeypatch.setattr(lean, "freeze", Frozen)
    return Frozen


@pytest.mark.parametrize("world, split_k", [(1, 1), (2, 1), (2, 2), (4, "auto")])
def test_repeated_calls_launch_a_frozen_launch_with_nothing_moving(world, split_k, frozen, compiles):
    op = make(num_ranks=world, split_k=split_k)
    (a, b), = normal_inputs(1)

    def check(result, epoch):
        assert result is op.output and op.epoch == epoch
        assert op.state.tolist() == [epoch] * op.blocks  # the device counted every call
        assert torch.equal(result, torch_reference([(a, b)] * world, 0))

    check(op(a, b), 1)
    check(op(a, b), 2)  # two full calls on the same a: kept
    assert op._kept_launch is not None and not frozen.made and len(op.kernel.calls) == 2
    check(op(a, b), 3)  # through the launcher, then frozen
    assert len(frozen.made) == 1 and not frozen.launched and len(op.kernel.calls) == 3
    assert [t.data_ptr() for t in frozen.made[0][:2]] == [a.data_ptr(), b.data_ptr()] and frozen.made[0][3] is op.output
    for i in range(3):  # new values in the same buffers: the frozen launch alone
        a.copy_(normal_inputs(1, seed=10 + i)[0][0])
        op.output.fill_(float("nan"))
        check(op(a, b), 4 + i)
        assert len(frozen.launched) == i + 1
    a2 = a.clone()
    check(op(a2, b), 7)  # a elsewhere: the full call, which forgets the kept launch
    assert op._kept_launch is None and len(frozen.launched) == 3
    a = a2
    out = torch.empty_like(op.output)
    op(a, b), op(a, b)  # kept again
    assert op._kept_launch is not None
    assert op(a, b, out=out) is out and op._kept_launch is None  # out=: the full call, nothing kept
    assert torch.equal(out, torch_reference([(a, b)] * world, 0))
    op(a, b), op(a, b), op(a, b)  # kept and frozen anew
    frozen.capturing = True  # a capture: the frozen launch launches nothing, the full call runs and counts
    calls, epoch = len(op.kernel.calls), op.epoch
    check(op(a, b), epoch + 1)
    assert len(op.kernel.calls) == calls + 1
    frozen.capturing = False
    op.close()
    with pytest.raises(ClosedError, match="GemmAllReduce is closed"):
        op(a, b)


def test_an_unaligned_input_is_never_kept(frozen, compiles):
    """An input whose base is not 16-byte aligned is copied for the call (TMA): a kept launch
    would read the copy of an earlier call, so none is kept."""
    op = make(num_ranks=2)
    (a, b), = normal_inputs(1)
    store = torch.empty(a.numel() + 1, dtype=BF16)
    shifted = store[1:].view(a.shape)  # 2 bytes past an aligned base
    shifted.copy_(a)
    for _ in range(4):
        assert torch.equal(op(shifted, b), torch_reference([(a, b)] * 2, 0))
        assert op._kept_launch is None
    assert op.kernel.calls[-1][0].data_ptr() != shifted.data_ptr() and not frozen.made


def test_a_repeated_call_checks_what_its_layout_does_not_hold(frozen, compiles):
    """A call laid out otherwise (another dtype, a transposed view at the same address) takes
    the full call, whose checks name the argument; nothing launched."""
    op = make(num_ranks=2)
    (a, b), = normal_inputs(1)
    op(a, b), op(a, b), op(a, b)
    calls = len(op.kernel.calls)
    with pytest.raises(TypeError, match="a has dtype torch.float16"):
        op(a.view(torch.float16), b)
    with pytest.raises(ValueError, match="b"):
        op(a, b.view(b.shape[1], b.shape[0]).t())  # b's address, shape and dtype; other strides
    assert len(op.kernel.calls) == calls


@pytest.mark.parametrize("world, split_k, reduction", [(1, 1, "one_shot"), (1, 2, "one_shot"), (2, 1, "one_shot"),
                                                       (2, 2, "one_shot"), (4, 1, "two_shot")])
def test_every_kernel_can_be_frozen(world, split_k, reduction):
    """Every GemmAllReduce kernel is one the lean launcher launches itself (lowered on the
    CPU): its TMA descriptors described for encoding once, no unknown launch attribute, no
    cluster; so a repeated call gets its frozen launch (the GPU test requires it)."""
    from tilescale_lang.aot import launch_info
    from tilescale_lang.lean_describe import _unsupported

    from tilescale_examples.decode.gemm_ar_kernel import PASS_CONFIGS, build_gemm_ar_kernel, kernel_args

    func = build_gemm_ar_kernel(*kernel_args(16, 1024, 1024, world, "bfloat16", None, split_k, reduction))
    artifact = launch_info.lower(func, "sm_90a", PASS_CONFIGS)
    info = launch_info.describe(func, artifact, tensormaps=True)
    assert _unsupported(artifact.device_mod) is None
    assert len(info["launches"]) == 1 and info["launches"][0]["cluster"] is None
    described = [arg["param"] for arg in info["launches"][0]["args"] if arg["kind"] == "tensormap"]
    assert described == ["A", "B"]  # the descriptors over a and b: the frozen launch keeps them where they were
