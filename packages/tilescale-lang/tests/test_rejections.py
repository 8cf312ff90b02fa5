"""Invalid combinations fail while tracing with a Python error naming the argument, and
kernel.initialize validates its arguments before touching CUDA."""

from __future__ import annotations

import pytest
import tilelang.language as T
from lang_helpers import FakeAllocator

from tilescale_lang import metadata


def trace(body):
    """Trace a small kernel whose body calls ``body(A, F, G, S, r)``."""

    @T.prim_func
    def k(A: T.Tensor((256,), "float32"), F: T.Tensor((8,), "uint32"), G: T.Tensor((8,), "uint64"), X: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=32) as _:
            s = T.alloc_shared((64,), "float32")
            f = T.alloc_shared((4,), "uint32")
            r = T.alloc_local((1,), "uint64")
            body(A, F, G, s, f, r, X)

    return k


CASES = [
    # ld: semantics PTX lacks
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], sem="release"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], sem="acq_rel"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], sem="bogus"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], scope="cluster"), ValueError, "scope"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], sem="acquire", nc=True), ValueError, "nc"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], sem="volatile", na=True), ValueError, "na"),
    (lambda A, F, G, s, f, r, X: T.ld(f[0], r[0], nc=True), ValueError, "src"),
    (lambda A, F, G, s, f, r, X: T.ld(f[0], r[0], src_pe=1), ValueError, "src"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], 3), TypeError, "value"),
    (lambda A, F, G, s, f, r, X: T.ld(F[0], r[0], nc=r[0]), TypeError, "nc"),
    # st
    (lambda A, F, G, s, f, r, X: T.st(F[0], 1, sem="acquire"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.st(F[0], 1, sem="acq_rel"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.st(F[0], 1, sem="volatile", na=True), ValueError, "na"),
    (lambda A, F, G, s, f, r, X: T.st(f[0], 1, dst_pe=0), ValueError, "dst"),
    (lambda A, F, G, s, f, r, X: T.st(F[0], 1.5), TypeError, "value"),
    # atom_add
    (lambda A, F, G, s, f, r, X: T.atom_add(F[0], 1, scope="cta"), ValueError, "scope"),
    (lambda A, F, G, s, f, r, X: T.atom_add(F[0], 1, sem="weak"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.atom_add(F[0], 1, sem="volatile"), ValueError, "sem"),
    (lambda A, F, G, s, f, r, X: T.atom_add(G[0], 1), TypeError, "target"),
    (lambda A, F, G, s, f, r, X: T.atom_add(X[0], 1), TypeError, "target"),
    # waits
    (lambda A, F, G, s, f, r, X: T.wait_eq(F[0], 1, scope="cta"), ValueError, "scope"),
    (lambda A, F, G, s, f, r, X: T.wait_eq(F[0], 1, semantics="relaxed"), ValueError, "semantics"),
    (lambda A, F, G, s, f, r, X: T.wait_ge(F[0], 1, peer=1.5), TypeError, "peer"),
    (lambda A, F, G, s, f, r, X: T.wait_ge(F[0], 1, peer=X[0]), TypeError, "peer"),
    (lambda A, F, G, s, f, r, X: T.wait_ge(F[0], 1, peer=r), TypeError, "peer"),
    (lambda A, F, G, s, f, r, X: T.wait_ge(F[0], 1, peer=-2), ValueError, "peer"),
    (lambda A, F, G, s, f, r, X: T.wait_ge(f[0], 1, peer=1), ValueError, "value"),
    (lambda A, F, G, s, f, r, X: T.wait_eq(F[0], 1.5), TypeError, "expected"),
    (lambda A, F, G, s, f, r, X: T.wait_eq(3, 1), TypeError, "value"),
    # peer copies
    (lambda A, F, G, s, f, r, X: T.put_warp(A, s, 16, dst_pe=1), ValueError, "dst"),
    (lambda A, F, G, s, f, r, X: T.get_block(s, A, 16, src_pe=0), ValueError, "src"),
    (lambda A, F, G, s, f, r, X: T.put_warp(A, X, 16, unroll_factor=r[0]), TypeError, "unroll_factor"),
    (lambda A, F, G, s, f, r, X: T.put_warp(A, X, 16, unroll_factor=0), ValueError, "unroll_factor"),
    (lambda A, F, G, s, f, r, X: T.put_warp(A, X, 16, enable_aggressive_vectorize=r[0] > 0), TypeError, "enable_aggressive_vectorize"),
    (lambda A, F, G, s, f, r, X: T.put_warp(A, X, X[0]), TypeError, "size"),
    (lambda A, F, G, s, f, r, X: T.put_warp(A, X, -4), ValueError, "size"),
    (lambda A, F, G, s, f, r, X: T.put_warp(A, X, 4, dst_pe=True), TypeError, "dst_pe"),
    (lambda A, F, G, s, f, r, X: T.put_block(A, G, 4), TypeError, "element sizes"),
    (lambda A, F, G, s, f, r, X: T.put_block(5, A, 4), TypeError, "src"),
    (lambda A, F, G, s, f, r, X: T.copy(A[0:64], X[0:64], src_pe=0, dst_pe=1), ValueError, "src_pe and dst_pe"),
    (lambda A, F, G, s, f, r, X: T.copy(s, A[0:64], src_pe=0), ValueError, "src"),
    (lambda A, F, G, s, f, r, X: T.copy(A[0:64], s, dst_pe=r[0]), ValueError, "dst"),
    (lambda A, F, G, s, f, r, X: T.tma_copy(A[0:64], s, src_pe=8), ValueError, "PEs 0..7"),
    # barriers
    (lambda A, F, G, s, f, r, X: T.barrier_blocks(G), TypeError, "barrier"),
    (lambda A, F, G, s, f, r, X: T.barrier_blocks(f), ValueError, "barrier"),
    (lambda A, F, G, s, f, r, X: T.init_barrier_gpu(f, 4), ValueError, "barrier"),
    (lambda A, F, G, s, f, r, X: T.notify(G[0], 1, sig_op="add"), TypeError, "sig_op"),
    (lambda A, F, G, s, f, r, X: T.notify(F[0], 1, sig_op="xor"), ValueError, "sig_op"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rejected_while_tracing(case):
    body, exc, word = CASES[case]
    with pytest.raises(exc, match=word):
        trace(body)


def test_local_pe_spellings_accepted():
    # None, -1 and a run-time expression of any width/signedness are all fine
    trace(lambda A, F, G, s, f, r, X: T.put_warp(A, X, 4, dst_pe=None))
    trace(lambda A, F, G, s, f, r, X: T.put_warp(A, X, 4, dst_pe=-1))
    trace(lambda A, F, G, s, f, r, X: T.put_warp(A, X, 4, dst_pe=(r[0] ^ 1)))
    trace(lambda A, F, G, s, f, r, X: T.wait_eq(F[0], 1, peer=T.Cast("int16", r[0])))
    trace(lambda A, F, G, s, f, r, X: T.wait_eq(F[0], 1, peer=T.Cast("uint8", r[0])))


# ------------------------------------------------------------------------------ initialize
class _Kernel:
    execution_backend = "tvm_ffi"
    adapter = None
    torch_function = None


def test_initialize_argument_errors():
    import torch

    k = _Kernel()
    good = FakeAllocator(torch.tensor([0, 1, 0x7F0000000000], dtype=torch.uint64))
    with pytest.raises(TypeError, match="allocator"):
        metadata.initialize(k)
    with pytest.raises(TypeError, match="allocator"):
        metadata.initialize(k, allocator=object())
    with pytest.raises(TypeError, match="stream"):
        metadata.initialize(k, allocator=good, stream="0")
    with pytest.raises(TypeError, match="stream"):
        metadata.initialize(k, allocator=good, stream=1.0)
    with pytest.raises(TypeError, match="stream"):
        metadata.initialize(k, allocator=good, stream=True)
    with pytest.raises(ValueError, match="stream"):
        metadata.initialize(k, allocator=good, stream=-1)
    big = torch.zeros(1025, dtype=torch.uint64)
    big[1] = 1023
    with pytest.raises(ValueError, match="1024"):
        metadata.initialize(k, allocator=FakeAllocator(big))
    with pytest.raises(ValueError, match="inconsistent"):
        metadata.initialize(k, allocator=FakeAllocator(torch.tensor([0, 2, 5], dtype=torch.uint64)))
    with pytest.raises(ValueError, match="inconsistent"):
        metadata.initialize(k, allocator=FakeAllocator(torch.tensor([3, 1, 5], dtype=torch.uint64)))
    with pytest.raises(TypeError, match="uint64"):
        metadata.initialize(k, allocator=FakeAllocator(torch.zeros(3, dtype=torch.float32)))
    with pytest.raises(ValueError, match="at least"):
        metadata.initialize(k, allocator=FakeAllocator([0]))


def test_initialize_before_load_is_pending():
    """Before the module is loaded (no GPU here) the table waits for the first launch."""
    import torch

    k = _Kernel()
    calls = []
    # what TVM does: the module is loaded (and the hook called) inside the first launch
    k.torch_function = _launch_reporting(lambda *a: calls.append(a) or "ran", 0xABC)
    table = torch.tensor([1, 2, 0xFFFF_FFFF_FFFF_FFF0, 0x10], dtype=torch.uint64)
    assert metadata.initialize(k, allocator=FakeAllocator(table), stream=7) is k
    st = k._tilescale_state
    assert st["pending"] == ([1, 2, 0xFFFF_FFFF_FFFF_FFF0, 0x10], 7)
    assert st["capturing"] and k.torch_function is not None
    # the first launch runs under the capture wrapper; the hook attributes the module to k
    applied = []
    orig_apply = metadata.apply_to_module
    metadata.apply_to_module = lambda m, v, s, keep: applied.append((m, v, s))
    try:
        assert k.torch_function(1) == "ran"
    finally:
        metadata.apply_to_module = orig_apply
    assert applied == [(0xABC, [1, 2, 0xFFFF_FFFF_FFFF_FFF0, 0x10], 7)]
    assert st["modules"] == [0xABC] and not st["capturing"]
    assert "first_launch" not in k.torch_function.__qualname__  # back to the plain launch


def _launch_reporting(fn, module):
    def launch(*args):
        metadata.on_module_load(module)
        return fn(*args)

    return launch


def test_module_handles_and_other_backends():
    import ctypes

    assert metadata._handle_to_int(5) == 5
    assert metadata._handle_to_int(ctypes.c_void_p(77)) == 77
    k = _Kernel()
    k.execution_backend = "torch"
    with pytest.raises(NotImplementedError, match="tvm_ffi"):
        metadata.initialize(k, allocator=FakeAllocator([0, 1, 0]))
    k.execution_backend = "cython"

    class _Adapter:
        lib = object()

    k.adapter = _Adapter()
    with pytest.raises(NotImplementedError, match="cython"):
        metadata.initialize(k, allocator=FakeAllocator([0, 1, 0]))
