"""``torch.ops.tilescale.*`` (tilescale_examples.torch_ops) on the CPU: registration, the
handle registry and its errors, fake (meta) shapes, and ``torch.compile(fullgraph=True)``
tracing, with stand-ins that subclass the real collectives and compute what ``world_size``
ranks holding the same input would get."""

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import examples_helpers  # noqa: F401  (CUDA_HOME before TileLang is imported)
import tilescale_examples
from tilescale_examples import torch_ops
from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
from tilescale_examples.collectives.allgather import AllGather
from tilescale_examples.collectives.allreduce import AllReduce
from tilescale_examples.collectives.alltoall import AllToAll
from tilescale_examples.overlap.gemm_rs import GemmReduceScatter
from tilescale_examples.moe.dispatcher import DispatchHandle, MoEDispatcher, torch_combine_reference, torch_dispatch_reference
from tilescale_examples.collectives.reducescatter import ReduceScatter
from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm
from tilescale_examples.decode.gemm_allreduce import GemmAllReduce
from tilescale_examples.decode.reference import scales_shape, torch_reference as norm_reference
from tilescale_examples.sequence.flash_decode import SPFlashDecode, torch_reference as decode_reference
from tilescale_examples.sequence.sp_attention import SPAllGatherAttention, torch_reference as sp_reference
from tilescale_examples.sequence.ulysses import UlyssesAllToAll, output_shape, torch_reference as ulysses_reference
from tilescale_examples.tutorials.tma_allreduce import TmaAllReduce
from tilescale_examples.torch_ops import handle_of, lookup, register, unregister

pytestmark = pytest.mark.skipif(not torch_ops.AVAILABLE, reason="torch has no torch.library.custom_op")

OPS = torch.ops.tilescale
W = 2  # the stand-ins' world size


# ------------------------------------------------------------------------------ stand-ins
class _Collective:
    """Shared by the stand-ins: no heap, no kernel; ``calls`` records every call (with a
    global order number in ``ORDER``); a call writes ``_stand_in_result(input)`` to ``out`` (default:
    the op's ``output``)."""

    ORDER = []

    def _init(self, dtype=torch.float32, world_size=W):
        self.dtype, self.world_size, self.rank = dtype, world_size, 0
        self.device = torch.device("cpu")
        self._closed = False
        self.kernel = object()
        self.calls = 0

    def _record(self):
        self.calls += 1
        _Collective.ORDER.append(self)

    def __call__(self, input, *, out=None):
        self._record()
        out = self.output if out is None else out
        out.copy_(self._stand_in_result(input))
        return out

    def close(self):
        self._closed = True
        self.kernel = None

    @property
    def closed(self):
        return self._closed


class _Sharded(_Collective):
    """Shared by the stand-ins whose input is ``(world_size, *shard_shape)``."""

    def __init__(self, shard_shape, dtype=torch.float32, world_size=W):
        self._init(dtype, world_size)
        self.shard_shape = tuple(shard_shape)
        self.shape = (world_size, *self.shard_shape)


class StandInAllReduce(_Collective, AllReduce):
    def __init__(self, shape, dtype=torch.float32, world_size=W):
        self._init(dtype, world_size)
        self.shape = self.shard_shape = tuple(shape)
        self.output = torch.zeros(self.shape, dtype=dtype)

    def _stand_in_result(self, input):
        return input * self.world_size


class StandInTmaAllReduce(_Collective, TmaAllReduce):
    """A subclass whose call takes no ``out=``: the op copies the result out of its buffer."""

    def __init__(self, shape, world_size=W):
        self._init(torch.float32, world_size)
        self.shape = self.shard_shape = tuple(shape)
        self.output = torch.zeros(self.shape)

    def __call__(self, x):
        self._record()
        self.output.copy_(x * self.world_size)
        return self.output


class StandInReduceScatter(_Sharded, ReduceScatter):
    def _stand_in_result(self, input):
        return input[self.rank] * self.world_size


class StandInAllGather(_Collective, AllGather):
    def __init__(self, shard_shape, dtype=torch.float32, world_size=W):
        self._init(dtype, world_size)
        self.shape = self.shard_shape = tuple(shard_shape)
        self.output = torch.zeros((world_size, *self.shard_shape), dtype=dtype)

    def _stand_in_result(self, input):
        return input.expand(self.world_size, *self.shard_shape)


class StandInAllToAll(_Sharded, AllToAll):
    def _stand_in_result(self, input):
        return input[self.rank].expand(self.world_size, *self.shard_shape)


class StandInUlysses(_Collective, UlyssesAllToAll):
    """What ``world_size`` ranks holding the same input would each get (rank 0's view)."""

    def __init__(self, shape, direction="seq_to_head", dtype=torch.float32, world_size=W):
        self._init(dtype, world_size)
        self.shape, self.direction = tuple(shape), direction
        self.output_shape = output_shape(self.shape, world_size, direction)
        self.output = torch.zeros(self.output_shape, dtype=dtype)

    def _stand_in_result(self, input):
        return ulysses_reference([input] * self.world_size, self.rank, self.direction)


class _Attention(_Collective):
    """Shared by the attention stand-ins: ``world_size`` ranks holding this rank's shard each
    (rank 0's view); a call writes the module's float32 reference into ``out`` and ``lse``."""

    def __init__(self, q_shape, kv_shape, out_shape, lse_shape, dtype=torch.float32, world_size=W):
        self._init(dtype, world_size)
        self.q_shape, self.kv_shape = tuple(q_shape), tuple(kv_shape)
        self.output, self.lse = torch.zeros(out_shape, dtype=dtype), torch.zeros(lse_shape)

    def __call__(self, q, k, v, *, out=None, lse=None):
        self._record()
        o, l = self._reference(q, k, v)
        (self.output if out is None else out).copy_(o)
        (self.lse if lse is None else lse).copy_(l)
        return out, lse


class StandInSPAttention(_Attention, SPAllGatherAttention):
    def _reference(self, q, k, v):
        return sp_reference([(q, k, v)] * self.world_size, 0, True)


class StandInFlashDecode(_Attention, SPFlashDecode):
    def _reference(self, q, k, v, cache_seqlens=None):
        shard = (q, k, v) if cache_seqlens is None else (q, k, v, cache_seqlens)
        return decode_reference([shard] * self.world_size, 0)

    def __call__(self, q, k, v, *, cache_seqlens=None, out=None, lse=None):
        self._record()
        o, l = self._reference(q, k, v, cache_seqlens)
        out.copy_(o)
        lse.copy_(l)
        return out, lse


class _Gemm(_Collective):
    """Shared by the GEMM stand-ins: the GEMM's sizes; a call writes ``_stand_in_result(a, b)`` to ``out``."""

    def __init__(self, m_local, k, n, dtype=torch.float32, world_size=W):
        self._init(dtype, world_size)
        self.m_local, self.k, self.n = m_local, k, n

    def __call__(self, a, b, *, out=None):
        self._record()
        out.copy_(self._stand_in_result(a, b))
        return out


class StandInAllGatherGEMM(_Gemm, AllGatherGEMM):
    def _stand_in_result(self, a, b):
        return a.repeat(self.world_size, 1) @ b


class StandInGemmReduceScatter(_Gemm, GemmReduceScatter):
    def _stand_in_result(self, a, b):
        m = self.m_local
        return (a @ b)[self.rank * m:(self.rank + 1) * m] * self.world_size


class StandInGemmAllReduce(_Gemm, GemmAllReduce):
    def __init__(self, m, k, n, dtype=torch.float32, world_size=W):
        super().__init__(m, k, n, dtype, world_size)
        self.m = m

    def _stand_in_result(self, a, b):
        return (a @ b) * self.world_size


class StandInNorm(_Collective, AllReduceResidualRMSNorm):
    """``world_size`` ranks holding the same ``x``, ``residual`` and ``weight`` (rank 0's
    view): the module's float32 reference written into the outputs."""

    def __init__(self, shape, fp8=None, dtype=torch.bfloat16, world_size=W):
        self._init(dtype, world_size)
        self.shape, self.fp8, self.eps = tuple(shape), fp8, 1e-6
        self.output = torch.zeros(self.shape, dtype=torch.float8_e4m3fn if fp8 else dtype)
        self.residual_output = torch.zeros(self.shape, dtype=dtype)
        self.scales = None if fp8 is None else torch.zeros(scales_shape(*self.shape, fp8))

    def _reference(self, x, residual, weight):
        return norm_reference([(x, residual, weight)] * self.world_size, 0, eps=self.eps, fp8=self.fp8)

    def __call__(self, x, residual, weight, *, out=None, residual_out=None, scales_out=None):
        self._record()
        got = self._reference(x, residual, weight)
        outs = (out, scales_out, residual_out) if self.fp8 else (out, residual_out)
        for dst, value in zip(outs, got):
            dst.copy_(value)
        return outs


class StandInMoE(_Collective, MoEDispatcher):
    """One rank: dispatch and combine from the module's torch references, results in
    internal buffers (as the real dispatcher's are)."""

    def __init__(self, num_experts=4, hidden=8, topk=2, max_tokens=6, dtype=torch.float32):
        self._init(dtype, 1)
        self.num_experts, self.hidden, self.topk, self.max_tokens = num_experts, hidden, topk, max_tokens
        self.index_dtype = torch.int64
        self.experts_per_rank = num_experts
        self.capacity = max_tokens * topk
        self.epoch = 0
        self.recv_x = torch.zeros((self.capacity, hidden), dtype=dtype)
        self.output = torch.zeros((max_tokens, hidden), dtype=dtype)

    def dispatch(self, x, topk_idx, topk_weights, *, validate=None):
        self._record()
        rows, counts, _ = torch_dispatch_reference([x], [topk_idx], self.num_experts, 0)
        self.recv_x[: rows.shape[0]] = rows
        counts = counts.to(torch.int32)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
        self.epoch += 1
        self._routing = (topk_idx.clone(), topk_weights.clone())
        T = x.shape[0]
        handle = DispatchHandle(self, self.epoch, T, counts, offsets,
                                torch.zeros((T, self.topk), dtype=torch.int32),
                                torch.zeros((T, self.topk), dtype=torch.int32))
        return self.recv_x, counts, handle

    def combine(self, y, handle):
        self._record()
        if handle.dispatcher is not self:
            raise TypeError("handle must be a DispatchHandle returned by this MoEDispatcher's dispatch()")
        if handle.epoch != self.epoch:
            raise RuntimeError(f"handle is from dispatch call {handle.epoch}, but dispatch call {self.epoch} "
                               "has overwritten its routing")
        idx, w = self._routing
        out = self.output[: handle.num_tokens]
        out.copy_(torch_combine_reference([y], [idx], [w], self.num_experts, 0).to(self.dtype))
        return out


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    _Collective.ORDER.clear()
    yield
    torch._dynamo.reset()


def _routing(T=5, topk=2, num_experts=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(T)])
    idx[0, 1] = -1  # an unused slot
    w = torch.rand((T, topk), generator=g)
    return idx, w


# ------------------------------------------------------------------------------ registration
def test_every_op_is_registered_with_its_schema():
    assert tilescale_examples.torch_ops is torch_ops
    assert set(torch_ops.SCHEMAS) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_matmul",
                                      "matmul_reduce_scatter", "moe_dispatch", "moe_combine", "ulysses_all_to_all",
                                      "sp_attention", "sp_flash_decode", "matmul_all_reduce",
                                      "all_reduce_residual_rms_norm", "all_reduce_residual_rms_norm_fp8"}
    for name, schema in torch_ops.SCHEMAS.items():
        op = getattr(OPS, name)
        assert str(op.default._schema) == f"tilescale::{name}{schema}"
        assert torch_ops.OPS[name] is not None
        assert torch_ops.SIDE_EFFECTS[name] in ("ordered", "kept", "none")
    if hasattr(torch_ops.OPS["all_reduce"], "register_effect"):
        assert set(torch_ops.SIDE_EFFECTS.values()) == {"ordered"}


def test_register_is_idempotent_and_handles_are_unique():
    a, b = StandInAllReduce((4,)), StandInAllGather((4,))
    ha = register(a)
    assert isinstance(ha, int) and ha > 0
    assert register(a) == ha == handle_of(a) == a._op_handle
    hb = handle_of(b)
    assert hb != ha and hb > 0
    assert lookup(ha, "all_reduce") is a and lookup(hb, "all_gather") is b
    assert torch_ops.registered()[ha] == "AllReduce"


def test_register_refuses_other_objects_and_closed_instances():
    with pytest.raises(TypeError, match="not a TileScale collective"):
        register(object())
    c = StandInAllReduce((4,))
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        register(c)


# ------------------------------------------------------------------------------ handle errors
def test_unknown_handle_raises_value_error_naming_it():
    with pytest.raises(ValueError, match=r"handle 987654321 is not a registered TileScale collective.*AllReduce"):
        OPS.all_reduce(torch.ones(4), 987654321)
    with pytest.raises(ValueError, match="unknown operator kind"):
        lookup(1, "broadcast")


def test_wrong_kind_raises_value_error_naming_both_classes():
    ag = StandInAllGather((4,))
    h = handle_of(ag)
    with pytest.raises(ValueError, match=rf"all_reduce: handle {h} names an AllGather, but all_reduce takes the "
                                         "handle of an AllReduce or TmaAllReduce"):
        OPS.all_reduce(torch.ones(4), h)
    with pytest.raises(ValueError, match=rf"handle {h} names an AllGather, but moe_combine takes the handle of "
                                         "a MoEDispatcher"):
        lookup(h, "moe_combine")
    assert lookup(h, "all_gather") is ag


def test_closed_unregistered_and_collected_instances_raise_runtime_error():
    ar = StandInAllReduce((4,))
    h = handle_of(ar)
    ar.close()
    with pytest.raises(RuntimeError, match=rf"handle {h} names a closed AllReduce"):
        OPS.all_reduce(torch.ones(4), h)

    ar2 = StandInAllReduce((4,))
    h2 = handle_of(ar2)
    assert unregister(ar2) and not unregister(ar2)
    assert not hasattr(ar2, "_op_handle")
    with pytest.raises(RuntimeError, match=rf"handle {h2} named an AllReduce that has been unregistered"):
        OPS.all_reduce(torch.ones(4), h2)
    assert handle_of(ar2) != h2  # registering again gives a new handle

    ar3 = StandInAllReduce((4,))
    h3 = handle_of(ar3)
    del ar3
    gc.collect()
    with pytest.raises(RuntimeError, match=rf"handle {h3} named an AllReduce that has been garbage-collected"):
        lookup(h3, "all_reduce")
    assert h3 not in torch_ops.registered()


def test_handle_must_be_an_int():
    with pytest.raises(TypeError, match="handle must be an int"):
        lookup(True, "all_reduce")
    with pytest.raises(TypeError, match="handle must be an int"):
        lookup("1", "all_reduce")


def test_shape_and_dtype_mismatch_names_the_argument():
    h = handle_of(keep := StandInReduceScatter((3,)))
    with pytest.raises(ValueError, match=r"reduce_scatter: x is \(3,\) torch.float32, but handle .* \(2, 3\)"):
        OPS.reduce_scatter(torch.ones(3), h)
    g = handle_of(keep2 := StandInAllGatherGEMM(2, 3, 4))
    with pytest.raises(ValueError, match=r"all_gather_matmul: b is \(4, 4\).*\(k, n\) = \(3, 4\)"):
        OPS.all_gather_matmul(torch.ones(2, 3), torch.ones(4, 4), g)
    with pytest.raises(ValueError, match="float64"):
        OPS.all_gather_matmul(torch.ones(2, 3, dtype=torch.float64), torch.ones(3, 4), g)
    del keep, keep2


# ------------------------------------------------------------------------------ eager results
def _dense_instances():
    return dict(ar=StandInAllReduce((3, 4)), tma=StandInTmaAllReduce((3, 4)), rs=StandInReduceScatter((3, 4)),
                ag=StandInAllGather((3, 4)), a2a=StandInAllToAll((3, 4)), agmm=StandInAllGatherGEMM(2, 3, 5),
                mmrs=StandInGemmReduceScatter(2, 3, 5))


def _dense_calls(x, xs, a, a_full, b, h):
    """Every dense op once: ``x`` (3, 4), ``xs`` (W, 3, 4), ``a`` (2, 3), ``a_full`` (W*2, 3), ``b`` (3, 5)."""
    return (OPS.all_reduce(x, h["ar"]), OPS.all_reduce(x, h["tma"]), OPS.reduce_scatter(xs, h["rs"]),
            OPS.all_gather(x, h["ag"]), OPS.all_to_all(xs, h["a2a"]), OPS.all_gather_matmul(a, b, h["agmm"]),
            OPS.matmul_reduce_scatter(a_full, b, h["mmrs"]))


def _dense_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 4, generator=g), torch.randn(W, 3, 4, generator=g), torch.randn(2, 3, generator=g),
            torch.randn(W * 2, 3, generator=g), torch.randn(3, 5, generator=g))


def test_eager_results_are_fresh_and_correct():
    inst = _dense_instances()
    h = {k: handle_of(v) for k, v in inst.items()}
    x, xs, a, a_full, b = _dense_inputs()
    got = _dense_calls(x, xs, a, a_full, b, h)
    want = (x * W, x * W, xs[0] * W, x.expand(W, 3, 4), xs[0].expand(W, 3, 4), a.repeat(W, 1) @ b,
            (a_full @ b)[:2] * W)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_)
    internal = {inst["ar"].output.data_ptr(), inst["tma"].out.data_ptr(), inst["ag"].output.data_ptr()}
    inputs = {t.data_ptr() for t in (x, xs, a, a_full, b)}
    for t in got:
        assert t.data_ptr() not in internal | inputs and t._base is None
    assert all(i.calls == 1 for i in inst.values())


# ------------------------------------------------------------------------------ fake shapes
def test_fake_impls_give_shapes_and_dtypes():
    inst = _dense_instances()
    inst["ar16"] = StandInAllReduce((7,), dtype=torch.bfloat16)
    h = {k: handle_of(v) for k, v in inst.items()}
    moe = StandInMoE()
    hm = handle_of(moe)
    real = _dense_inputs()
    idx, w = _routing()
    with FakeTensorMode() as mode:
        x, xs, a, a_full, b = (mode.from_tensor(t) for t in real)
        got = _dense_calls(x, xs, a, a_full, b, h)
        shapes = [(tuple(t.shape), t.dtype) for t in got]
        y16 = OPS.all_reduce(mode.from_tensor(torch.ones(7, dtype=torch.bfloat16)), h["ar16"])
        tokens = mode.from_tensor(torch.ones(5, 8))
        recv_x, counts, offsets = OPS.moe_dispatch(tokens, mode.from_tensor(idx), mode.from_tensor(w), hm)
        out = OPS.moe_combine(recv_x, mode.from_tensor(idx), hm)
        with pytest.raises(ValueError, match=r"all_gather: x is \(4,\)"):
            OPS.all_gather(mode.from_tensor(torch.ones(4)), h["ag"])
    f32 = torch.float32
    assert shapes == [((3, 4), f32), ((3, 4), f32), ((3, 4), f32), ((W, 3, 4), f32), ((W, 3, 4), f32),
                      ((W * 2, 5), f32), ((2, 5), f32)]
    assert (tuple(y16.shape), y16.dtype) == ((7,), torch.bfloat16)
    assert (tuple(recv_x.shape), recv_x.dtype) == ((moe.capacity, 8), f32)
    assert (tuple(counts.shape), counts.dtype) == ((4,), torch.int32)
    assert (tuple(offsets.shape), offsets.dtype) == ((5,), torch.int32)
    assert (tuple(out.shape), out.dtype) == ((5, 8), f32)
    assert all(i.calls == 0 for i in inst.values()) and moe.calls == 0  # fake impls never run the collective


# ------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(backend):
    inst = _dense_instances()
    h = {k: handle_of(v) for k, v in inst.items()}

    def step(x, xs, a, a_full, b):
        outs = _dense_calls(x.relu(), xs + 1, a, a_full, b * 2, h)
        return [o * 3 for o in outs]

    args = _dense_inputs()
    want = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for _ in range(2):
        got = compiled(*args)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_)
    assert torch._dynamo.explain(step)(*args).graph_break_count == 0


def test_compiled_calls_are_neither_dropped_nor_reordered():
    if torch_ops.SIDE_EFFECTS["all_reduce"] == "none":
        pytest.skip("this torch offers no way to mark the ops as side-effecting")
    first, second, third = StandInAllReduce((4,)), StandInAllReduce((4,)), StandInAllReduce((4,))
    h1, h2, h3 = handle_of(first), handle_of(second), handle_of(third)

    def step(x):
        OPS.all_reduce(x, h1)  # result unused: a collective still has to run on every rank
        y = OPS.all_reduce(x + 1, h2)
        OPS.all_reduce(x * 2, h3)
        return y

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(torch.ones(4)), torch.full((4,), 2.0 * W))
    assert (first.calls, second.calls, third.calls) == (1, 1, 1)
    if torch_ops.SIDE_EFFECTS["all_reduce"] == "ordered":
        assert _Collective.ORDER == [first, second, third]


def test_new_handle_retraces_with_the_new_instance():
    two, four = StandInAllReduce((4,), world_size=2), StandInAllReduce((4,), world_size=4)
    h2, h4 = handle_of(two), handle_of(four)

    def step(x, h):
        return OPS.all_reduce(x, h)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.ones(4)
    for h, n in ((h2, 2), (h4, 4), (h2, 2), (h4, 4)):
        torch.testing.assert_close(compiled(x, h), x * n)


def test_compiled_call_with_closed_instance_raises_when_traced():
    ar = StandInAllReduce((4,))
    h = handle_of(ar)
    ar.close()
    with pytest.raises(Exception, match=rf"handle {h} names a closed AllReduce"):
        torch.compile(lambda x: OPS.all_reduce(x, h), fullgraph=True, backend="aot_eager")(torch.ones(4))


# ------------------------------------------------------------------------------ MoE
def test_moe_dispatch_and_combine_eager():
    moe = StandInMoE()
    h = handle_of(moe)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    idx, w = _routing()
    with pytest.raises(RuntimeError, match=rf"handle {h} \(MoEDispatcher\) has no moe_dispatch"):
        OPS.moe_combine(torch.zeros(moe.capacity, 8), idx, h)
    recv_x, counts, offsets = OPS.moe_dispatch(x, idx, w, h)
    rows, want_counts, _ = torch_dispatch_reference([x], [idx], 4, 0)
    R = rows.shape[0]
    assert recv_x.shape == (moe.capacity, 8) and recv_x.data_ptr() != moe.recv_x.data_ptr()
    torch.testing.assert_close(recv_x[:R], rows)
    assert counts.tolist() == want_counts.tolist() and counts.dtype == torch.int32
    assert offsets.tolist() == [0] + want_counts.cumsum(0).tolist() and offsets.dtype == torch.int32
    y = recv_x * 2
    out = OPS.moe_combine(y, idx, h)
    assert out.shape == (5, 8) and out.data_ptr() != moe.output.data_ptr()
    torch.testing.assert_close(out, torch_combine_reference([y], [idx], [w], 4, 0).float())
    with pytest.raises(ValueError, match=r"topk_idx has 4 tokens, but the latest moe_dispatch .* sent 5"):
        OPS.moe_combine(y, idx[:4], h)
    moe.dispatch(x, idx, w)  # through the class API: the op's routing is stale now
    with pytest.raises(RuntimeError, match="overwritten"):
        OPS.moe_combine(y, idx, h)
    with pytest.raises(ValueError, match="more than the max_tokens=6"):
        OPS.moe_dispatch(torch.ones(7, 8), torch.zeros(7, 2, dtype=torch.int64), torch.ones(7, 2), h)


def test_moe_compile_fullgraph_matches_eager():
    moe = StandInMoE()
    h = handle_of(moe)
    expert_scale = torch.linspace(0.5, 2.0, 8)

    def layer(x, idx, w):
        recv_x, counts, offsets = OPS.moe_dispatch(x, idx, w, h)
        y = recv_x * expert_scale  # the experts
        return OPS.moe_combine(y, idx, h), counts, offsets

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    idx, w = _routing(seed=4)
    want = layer(x, idx, w)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, idx, w)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_)
    assert moe.calls == 4  # dispatch + combine, eagerly and compiled


# ------------------------------------------------------------------------------ ulysses_all_to_all
@pytest.mark.parametrize("direction, shape", [("seq_to_head", (2, 3, 4, 5)), ("head_to_seq", (2, 6, 2, 5))])
def test_ulysses_all_to_all_eager_fake_and_compiled(direction, shape):
    op = StandInUlysses(shape, direction)
    h = handle_of(op)
    x = torch.randn(shape)
    want = ulysses_reference([x] * W, 0, direction)
    got = OPS.ulysses_all_to_all(x, h)
    torch.testing.assert_close(got, want)
    assert got.data_ptr() not in (op.output.data_ptr(), x.data_ptr()) and tuple(got.shape) == op.output_shape
    with FakeTensorMode() as mode:
        fake = OPS.ulysses_all_to_all(mode.from_tensor(x), h)
        assert (tuple(fake.shape), fake.dtype) == (op.output_shape, torch.float32)
    compiled = torch.compile(lambda t: OPS.ulysses_all_to_all(t * 2, h), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), ulysses_reference([x * 2] * W, 0, direction))
    with pytest.raises(ValueError, match=r"shape = \(batch, positions, heads, head_dim\)"):
        OPS.ulysses_all_to_all(torch.randn(2, 3, 4), h)
    other = StandInAllToAll((3, 4))
    with pytest.raises(ValueError, match="UlyssesAllToAll"):
        OPS.ulysses_all_to_all(x, handle_of(other))


# ------------------------------------------------------------------------------ sp_attention, sp_flash_decode
@pytest.mark.parametrize("kind, make, shapes", [
    ("sp_attention", lambda: StandInSPAttention((1, 8, 4, 16), (1, 8, 2, 16), (1, 8, 4, 16), (1, 4, 8)),
     ((1, 8, 4, 16), (1, 8, 2, 16))),
    ("sp_flash_decode", lambda: StandInFlashDecode((2, 4, 16), (2, 8, 2, 16), (2, 4, 16), (2, 4)),
     ((2, 4, 16), (2, 8, 2, 16))),
])
def test_attention_ops_eager_fake_and_compiled(kind, make, shapes):
    op = make()
    h = handle_of(op)
    fn = getattr(OPS, kind)
    q, k, v = torch.randn(shapes[0]), torch.randn(shapes[1]), torch.randn(shapes[1])
    want = op._reference(q, k, v)
    got = fn(q, k, v, h)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got[0].data_ptr() not in (op.output.data_ptr(), q.data_ptr()) and got[1].data_ptr() != op.lse.data_ptr()
    with FakeTensorMode() as mode:
        fake_o, fake_lse = fn(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), h)
        assert tuple(fake_o.shape) == tuple(op.output.shape) and fake_lse.dtype == torch.float32
        assert tuple(fake_lse.shape) == tuple(op.lse.shape)
    compiled = torch.compile(lambda a, b, c: fn(a * 2, b, c, h), fullgraph=True, backend="aot_eager")
    for g, w in zip(compiled(q, k, v), op._reference(q * 2, k, v)):
        torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match=rf"torch.ops.tilescale.{kind}: k is \(1, 2\) torch.float32"):
        fn(q, torch.randn(1, 2), v, h)
    other = StandInAllToAll((3, 4))
    with pytest.raises(ValueError, match=f"names an AllToAll, but {kind} takes the handle of a "
                                         f"{'SPAllGatherAttention' if kind == 'sp_attention' else 'SPFlashDecode'}"):
        fn(q, k, v, handle_of(other))


def test_sp_flash_decode_takes_cache_lengths():
    op = StandInFlashDecode((2, 4, 16), (2, 8, 2, 16), (2, 4, 16), (2, 4))
    h = handle_of(op)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    lens = torch.tensor([3, 8], dtype=torch.int32)
    got = OPS.sp_flash_decode(q, k, v, h, lens)
    for g, w in zip(got, op._reference(q, k, v, lens)):
        torch.testing.assert_close(g, w)
    assert not torch.allclose(got[0], op._reference(q, k, v)[0])  # the lengths count
    compiled = torch.compile(lambda a, n: OPS.sp_flash_decode(a, k, v, h, n), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, lens)[1], op._reference(q, k, v, lens)[1])
    with pytest.raises(ValueError, match=r"cache_seqlens is \(2,\) torch.int64"):
        OPS.sp_flash_decode(q, k, v, h, lens.long())


# ------------------------------------------------------------------------------ matmul_all_reduce
def test_matmul_all_reduce_eager_fake_and_compiled():
    op = StandInGemmAllReduce(3, 4, 5)
    h = handle_of(op)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    got = OPS.matmul_all_reduce(a, b, h)
    torch.testing.assert_close(got, (a @ b) * W)
    assert got.data_ptr() not in (a.data_ptr(), b.data_ptr()) and op.calls == 1
    with FakeTensorMode() as mode:
        fake = OPS.matmul_all_reduce(mode.from_tensor(a), mode.from_tensor(b), h)
        assert (tuple(fake.shape), fake.dtype) == ((3, 5), torch.float32)
    assert op.calls == 1  # the fake never runs the op
    compiled = torch.compile(lambda x, w: OPS.matmul_all_reduce(x.relu(), w, h) + 1, fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(a, b), (a.relu() @ b) * W + 1)
    with pytest.raises(ValueError, match=r"matmul_all_reduce: a is \(2, 4\) torch.float32, .*a = \(m, k\) = \(3, 4\)"):
        OPS.matmul_all_reduce(a[:2], b, h)
    with pytest.raises(ValueError, match=r"names an AllReduce, but matmul_all_reduce takes the handle of a "
                                         r"GemmAllReduce"):
        OPS.matmul_all_reduce(a, b, handle_of(keep := StandInAllReduce((4,))))
    del keep


# ------------------------------------------------------------------------------ all_reduce_residual_rms_norm
def _norm_inputs(shape=(3, 256), seed=6):
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2))
    return x, residual, (torch.rand(shape[1], generator=g) + 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("fp8", [None, "per_token", "per_block"])
def test_fused_norm_ops_eager_fake_and_compiled(fp8):
    op = StandInNorm((3, 256), fp8)
    h = handle_of(op)
    kind = "all_reduce_residual_rms_norm" + ("_fp8" if fp8 else "")
    fn = getattr(OPS, kind)
    x, residual, weight = _norm_inputs()
    want = op._reference(x, residual, weight)
    got = fn(x, residual, weight, h)
    assert len(got) == len(want) == (3 if fp8 else 2)
    for g_, w_ in zip(got, want):
        assert (g_.shape, g_.dtype) == (w_.shape, w_.dtype)
        torch.testing.assert_close(g_.float(), w_.float())
    own = {t.data_ptr() for t in (op.output, op.residual_output, x, residual, weight)}
    assert not own & {t.data_ptr() for t in got} and op.calls == 1  # fresh results, the instance's left alone
    with FakeTensorMode() as mode:
        fakes = fn(*(mode.from_tensor(t) for t in (x, residual, weight)), h)
        assert [(tuple(t.shape), t.dtype) for t in fakes] == [(tuple(t.shape), t.dtype) for t in want]
    assert op.calls == 1

    def block(x, residual, weight):
        *y, h_out = fn(x * 2, residual, weight, h)
        return (*y, h_out + 1)

    *y_want, h_want = op._reference(x * 2, residual, weight)
    for g_, w_ in zip(torch.compile(block, fullgraph=True, backend="aot_eager")(x, residual, weight),
                      (*y_want, h_want + 1)):
        torch.testing.assert_close(g_.float(), w_.float())


def test_fused_norm_ops_refuse_the_other_mode_and_bad_shapes():
    plain, quantised = StandInNorm((3, 256)), StandInNorm((3, 256), "per_token")
    hp, hq = handle_of(plain), handle_of(quantised)
    x, residual, weight = _norm_inputs()
    with pytest.raises(ValueError, match=rf"handle {hp} names an AllReduceResidualRMSNorm built without fp8: call "
                                         "torch.ops.tilescale.all_reduce_residual_rms_norm$"):
        OPS.all_reduce_residual_rms_norm_fp8(x, residual, weight, hp)
    with pytest.raises(ValueError, match=rf"handle {hq} names an AllReduceResidualRMSNorm built with "
                                         "fp8='per_token': call torch.ops.tilescale.all_reduce_residual_rms_norm_fp8"):
        OPS.all_reduce_residual_rms_norm(x, residual, weight, hq)
    with pytest.raises(ValueError, match=r"residual is \(2, 256\) torch.bfloat16, .*residual = \(tokens, hidden\) ="):
        OPS.all_reduce_residual_rms_norm(x, residual[:2], weight, hp)
    with pytest.raises(ValueError, match=r"weight is \(256,\) torch.float32, .*weight = \(hidden,\) = \(256,\)"):
        OPS.all_reduce_residual_rms_norm(x, residual, weight.float(), hp)
    assert plain.calls == quantised.calls == 0
