"""GemmAllReduce on the CPU: the torch reference against a float64 computation of the documented
rounding (partials rounded to the dtype, rank-order float32 sum rounded once), the comparison's
bound, the tile choice and the size table, argument errors before any kernel, the host side of
a call on a CPU stand-in allocator (a fake kernel), the heap, the generated CUDA (epilogue
store, release, the flag wait on same-index blocks, the rank-order sum, in that order; the
split-``k`` kernel's group round and split-then-rank sum) and nvcc's register budget at
sm_90a. The GPU runs are in ``test_gemm_allreduce_gpu.py``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from examples_helpers import (CpuAllocator, LaunchRecorder, call_rejected, kernel_body, lower_with, needs_nvcc, nvcc_resources,
                              rejects_before_allocating)

from tilescale_examples import ClosedError, GemmAllReduce
from tilescale_examples.decode.gemm_allreduce import (compare, default_split_k, default_tiles, partial_magnitudes,
                                                      reduction_for, resolve_split_k, torch_reference)
from tilescale_examples.decode.gemm_ar_kernel import (PASS_CONFIGS, build_gemm_ar_kernel, check_split_k, padded_rows,
                                                      reads_table, tile_count)
from tilescale_examples.decode.gemm_ar_split import split_flag_words
from tilescale_examples.decode.gemm_ar_two_shot import shard_vectors
from tilescale_examples.overlap.gemm import GemmTiles

BF16, F16 = torch.bfloat16, torch.float16


def int_inputs(world, m=5, k=64, n=128, dtype=BF16, seed=0):
    """Small integers: every float32 and float64 product and sum is exact, so the only
    roundings are the documented ones."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(-15, 16, (m, k), generator=g).to(dtype), torch.randint(-15, 16, (k, n), generator=g).to(dtype))
            for _ in range(world)]


def normal_inputs(world, m=3, k=256, n=512, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)) for _ in range(world)]


# ------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_reference_is_the_documented_rounding_exactly(dtype, world):
    ins = int_inputs(world, dtype=dtype, seed=world)
    got = torch_reference(ins, world - 1)
    partials = [(a.double() @ b.double()).to(dtype) for a, b in ins]  # each rank's GEMM rounded to the dtype
    want = sum(p.double() for p in partials).to(dtype)  # exact sum (float32 is exact here), rounded once
    assert got.dtype == dtype and got.shape == (5, 128) and torch.equal(got, want)
    assert torch.equal(GemmAllReduce.torch_reference(ins, 0), got)  # every rank: the same bits
    if dtype == BF16 and world > 1:  # the partials' rounding is visible: bfloat16 holds integers only to 256
        assert not torch.equal(got, sum(a.double() @ b.double() for a, b in ins).to(dtype))


def test_reference_rounds_partials_then_the_rank_order_sum_once():
    one = torch.ones(1, 1, dtype=F16)

    def rank(value):
        return one, torch.full((1, 8), value, dtype=F16)

    # partial 2049 rounds to 2048 (float16), + 1 = 2049, rounded once: 2048 (ties to even); float32 partials: 2050
    assert torch.equal(torch_reference([rank(2049.0), rank(1.0)], 0), torch.full((1, 8), 2048.0, dtype=F16))
    # 2048 + 1 + 1 in float32, rounded once: 2050 (rounding after every add would give 2048)
    assert torch.equal(torch_reference([rank(2048.0), rank(1.0), rank(1.0)], 2), torch.full((1, 8), 2050.0, dtype=F16))
    with pytest.raises(ValueError, match=r"one \(a, b\) pair per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        torch_reference([rank(1.0)] * 2, 2)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_compare_bounds_the_kernel_against_float64(dtype):
    ins = normal_inputs(4, dtype=dtype)
    ref = torch_reference(ins, 0)
    exact = sum(a.double() @ b.double() for a, b in ins)
    u = 2.0**-8 if dtype == BF16 else 2.0**-11
    # the reference is within one rounding of each partial and one of the sum of the float64 result
    mags = partial_magnitudes(ins).double()
    assert ((ref.double() - exact).abs() <= u * (exact.abs() + mags) + 1e-4 * exact.abs().max()).all()
    assert compare(ref, ins) == []
    bad = ref.clone()
    bad[0, :3] = bad[0, :3] * 1.5 + 1
    bad[2, 7] = float("nan")
    assert compare(bad, ins, "x") == [compare(bad, ins, "x")[0]] and "x out: 4 elements outside" in compare(bad, ins, "x")[0]


def test_default_tiles_and_the_size_table():
    # one wave of the widest tiles: 64 x 128 to m = 128, then 128 x 128 while it fits the grid, then 128 x 256
    assert default_tiles(1, 8192, 132) == GemmTiles(64, 128, 64, 4, 128)  # 64 tiles
    assert default_tiles(128, 8192, 132) == GemmTiles(64, 128, 64, 4, 128)  # 2 x 64 tiles
    assert default_tiles(256, 8192, 132) == GemmTiles(128, 128, 64, 4, 256)  # 2 x 64 tiles
    assert default_tiles(512, 8192, 132) == GemmTiles(128, 256, 64, 4, 256)  # 4 x 32 tiles
    assert default_tiles(2048, 8192, 132) == GemmTiles(128, 256, 64, 4, 256)  # no tile fills one wave: the fewest
    assert default_tiles(1, 8192, 16) == GemmTiles(64, 256, 64, 4, 128)
    assert default_tiles(1, 192, 132).block_n == 64  # the one that divides n
    assert default_tiles(100, 1024, 132, block_n=128, threads=256).block_n == 128
    assert padded_rows(1, 64) == 64 and padded_rows(200, 128) == 256 and tile_count(200, 1024, GemmTiles(128, 256)) == 8
    assert reduction_for(2**30, 8) == "one_shot" and reduction_for(64, 1) == "one_shot"
    with pytest.raises(ValueError, match="nbytes"):
        reduction_for(0, 2)


def test_split_k_choice_and_checks():
    tiles = default_tiles(1, 8192, 132)  # 64 x 128: 64 tiles of a decode row
    assert default_split_k(1, 8192, 8192, 8, tiles, 132) == 2  # 128 units in one wave; 4 would be 256
    assert default_split_k(1, 8192, 4096, 8, tiles, 132) == 4  # 32 tiles
    assert default_split_k(1, 8192, 4096, 16, tiles, 132) == 4  # any world size: one rounded tile per rank read
    assert default_split_k(1, 512, 1024, 2, tiles, 132) == 2  # k / 4 = 128: shorter than the 4-stage pipeline
    assert default_split_k(1, 256, 1024, 2, tiles, 132) == 1
    assert default_split_k(256, 8192, 8192, 8, default_tiles(256, 8192, 132), 132) == 1  # 128 tiles fill the grid
    assert default_split_k(1, 8192, 8192, 8, tiles, 64) == 1  # the grid cap: the tiles alone fill it
    assert resolve_split_k("auto", 1, 8192, 8192, 2, tiles, 132) == 2
    assert resolve_split_k(4, 1, 8192, 8192, 2, tiles, 132) == 4
    for split, match in ((0, "split_k must be an int >= 1"), (2.0, "split_k must be an int"), (True, "split_k must be"),
                         (3, r"k \(8192\) must be a multiple of split_k \* block_k \(192\)"),
                         (256, r"k \(8192\) must be a multiple of split_k \* block_k \(16384\)")):
        with pytest.raises(ValueError, match=match):
            check_split_k(split, 8192, 8, tiles)
    assert check_split_k(8, 8192, 8, tiles) == 8 and check_split_k(64, 8192, 32, tiles) == 64  # no world limit
    with pytest.raises(ValueError, match="split_k=4 exceeds max_blocks=2"):
        resolve_split_k(4, 1, 8192, 8192, 2, tiles, 2)


# ------------------------------------------------------------------------------ host side on the CPU
class FakeKernel(LaunchRecorder):
    """Stands in for the GPU launch (recording each call's arguments in ``calls``): stages the
    rounded ``a @ b`` into the call's buffer (``e % 2``, ``e`` from the device counters; with
    ``k`` split, the exact product as split 0's partial and the rounded one, as float32, in the
    call's buffer after the ``split_k`` partials) and writes the reference of ``world_size``
    ranks that all hold this rank's inputs."""

    def __init__(self, op):
        super().__init__([])
        self.op, self.calls = op, self.launched

    def __call__(self, *args):
        super().__call__(*args)
        a, b, stage, out, _, state = args[:6]
        op, epoch = self.op, int(args[5][0]) + 1
        state += 1
        exact = a.float() @ b.float()
        if op.split_k == 1:
            stage[(epoch % 2) * op.mp:][:op.m].copy_(exact.to(stage.dtype))
        else:
            stage[:op.m].copy_(exact)
            stage[(op.split_k + epoch % 2) * op.mp:][:op.m].copy_(exact.to(op.dtype).float())
        out.copy_(op.torch_reference([(a, b)] * op.world_size, op.rank))


def make(m=3, k=256, n=512, dtype=BF16, num_ranks=2, **kwargs):
    op = GemmAllReduce(CpuAllocator(num_ranks=num_ranks), m, k, n, dtype, **kwargs)
    op.kernel = FakeKernel(op)
    return op


def test_buffers_arguments_and_call_numbers(compiles):
    op = make(max_blocks=4, block_n=64)
    assert compiles == ["gemm_allreduce"] and (op.mp, op.tile_count, op.blocks, op.iters) == (64, 8, 4, 2)
    assert op.tiles == GemmTiles(64, 64, 64, 4, 128)
    assert op.allocator.allocations == [((128, 512), BF16), ((2 * 4 * 4,), torch.uint64)]
    assert not op.flags.ne(0).any() and not op.state.ne(0).any()
    a, b = normal_inputs(1)[0]
    out = op(a, b)
    (args,) = op.kernel.calls
    assert [t.data_ptr() for t in args[:2]] == [a.data_ptr(), b.data_ptr()]
    assert args[2] is op.stage_buffer and args[3] is op.output and args[4] is op.flags and args[5] is op.state
    assert args[6:] == (4, 2)  # blocks, iters: no call number from the host
    assert out is op.output and torch.equal(out, torch_reference([(a, b)] * 2, 0))
    assert torch.equal(op.stages[1][:3], (a.float() @ b.float()).to(BF16))  # call 1: buffer 1
    mine = torch.empty(3, 512, dtype=BF16)
    assert op(a, b, out=mine) is mine and op.kernel.calls[-1][3] is mine and torch.equal(mine, out)
    assert op.state.tolist() == [2] * 4 and op.epoch == 2
    flat = torch.empty(3 * 512 + 1, dtype=BF16)
    odd = flat[1:].view(3, 512)  # 2-byte aligned: the kernel writes op.output, the call copies
    assert op(a, b, out=odd) is odd and op.kernel.calls[-1][3] is op.output and torch.equal(odd, out)
    au = torch.empty(3 * 256 + 1, dtype=BF16)[1:].view(3, 256)
    au.copy_(a)
    assert torch.equal(op(au, b), out) and op.kernel.calls[-1][0].data_ptr() % 16 == 0  # TMA: an aligned copy


def test_split_k_buffers_grid_and_calls(compiles):
    op = make(m=3, k=1024, n=512, max_blocks=7, block_n=64, split_k=2)  # 8 tiles x 2 splits on 6 blocks
    assert compiles == ["gemm_allreduce_split"] and (op.split_k, op.tile_count, op.blocks, op.iters) == (2, 8, 6, 3)
    # flags: a row per rank of the 8 tiles' ready flags and this rank's 8 counters
    assert op.allocator.allocations == [((2 * 2 * 64, 512), torch.float32), ((2 * 2 * 8 * 4,), torch.uint64)]
    assert [s.shape for s in op.stages] == [(128, 512)] * 2 and op.stages[0].dtype == torch.float32
    a, b = normal_inputs(1, m=3, k=1024)[0]
    out = op(a, b)
    args = op.kernel.calls[-1]
    assert args[2] is op.stage_buffer and args[6:] == (6, 3) and torch.equal(out, torch_reference([(a, b)] * 2, 0))
    assert torch.equal(op.stages[0][:3], a.float() @ b.float())  # split 0's partial
    assert torch.equal(op.stages[1][64:67], (a.float() @ b.float()).to(BF16).float())  # call 1: its buffer 1
    assert "split_k=2" in repr(op)
    auto = make(m=1, k=8192, n=8192, max_blocks=132)  # the default: split_k="auto"
    assert (auto.split_k, auto.tile_count, auto.blocks, auto.iters) == (2, 64, 128, 1)
    assert make(m=1, k=8192, n=8192, max_blocks=132, split_k=1).split_k == 1
    assert make(m=256, k=8192, n=8192, max_blocks=132).split_k == 1  # 128 tiles: one wave already



def test_one_rank_builds_the_kernels_that_exchange_nothing(compiles):
    """World 1: the one-rank kernels (gemm_ar_solo, gemm_ar_split's), the op's buffers and call
    unchanged; the split kernel's flags: a row of 8 tile flags and 8 counters (8 tiles on 6
    blocks)."""
    op = make(num_ranks=1, max_blocks=4, block_n=64)
    assert compiles == ["gemm_allreduce_solo"] and op.allocator.allocations[-1] == ((4 * 4,), torch.uint64)
    a, b = normal_inputs(1)[0]
    assert torch.equal(op(a, b), torch_reference([(a, b)], 0)) and op.kernel.calls[-1][6:] == (4, 2)
    split = make(m=3, k=1024, n=512, num_ranks=1, max_blocks=7, block_n=64, split_k=2)
    assert compiles[-1] == "gemm_allreduce_solo_split" and (split.tile_count, split.blocks, split.iters) == (8, 6, 3)
    assert split.allocator.allocations == [((2 * 2 * 64, 512), torch.float32), ((2 * 8 * 4,), torch.uint64)]
    assert split_flag_words(1, 8) == 64 and split_flag_words(4, 8) == 256  # a row of flags and counters per rank
    assert make(m=1, k=8192, n=8192, num_ranks=1, max_blocks=132).split_k == 2  # "auto" as on several ranks
    # the unsplit one-rank kernel has no TileScale intrinsic: no rank table to bind before it runs
    assert not reads_table(1, 1) and reads_table(1, 2) and reads_table(2, 1)


def test_reduction_choice_and_checks(compiles, monkeypatch):
    """``reduction``: "auto" through the size table (one-shot while it is empty; two-shot from a
    set entry, never on one rank), "two_shot" keeps k whole (an explicit split is refused), one
    rank runs its own kernels whatever is asked, a bad value is refused before any build."""
    from tilescale_examples.decode import gemm_allreduce as mod

    op = make(num_ranks=2, reduction="two_shot", m=1, k=8192, n=8192, max_blocks=132)
    assert compiles == ["gemm_allreduce_two_shot"] and (op.reduction, op.split_k, op.blocks) == ("two_shot", 1, 64)
    assert "reduction='two_shot'" in repr(op) and op.allocator.allocations[0] == ((2 * 64, 8192), BF16)
    assert make(num_ranks=2).reduction == "one_shot" and compiles[-1] == "gemm_allreduce"
    solo = make(num_ranks=1, reduction="two_shot")
    assert solo.reduction == "one_shot" and compiles[-1] == "gemm_allreduce_solo"
    monkeypatch.setitem(mod.TWO_SHOT_FROM_BYTES, 2, 4096)
    assert make(m=4, num_ranks=2).reduction == "two_shot" and make(m=3, num_ranks=2).reduction == "one_shot"
    assert mod.reduction_for(4096, 2) == "two_shot" and mod.reduction_for(1 << 30, 1) == "one_shot"
    assert mod.resolve_reduction("auto", 4096, 2) == "two_shot" and mod.resolve_reduction("one_shot", 4096, 2) == "one_shot"
    built = len(compiles)
    for kwargs, match in ((dict(reduction="three_shot"), "reduction must be 'auto' or one of"),
                          (dict(reduction=None), "reduction must be"),
                          (dict(reduction="two_shot", split_k=2, k=1024), "split_k=2: reduction='two_shot' keeps")):
        with pytest.raises(ValueError, match=match):
            make(num_ranks=2, **kwargs)
    assert len(compiles) == built
    with pytest.raises(ValueError, match="keeps every tile's k whole"):
        build_gemm_ar_kernel(4, 512, 512, 2, "bfloat16", GemmTiles(64, 64, 64, 4, 128), 2, "two_shot")
    with pytest.raises(ValueError, match="reduction must be one of"):
        build_gemm_ar_kernel(4, 512, 512, 2, "bfloat16", GemmTiles(64, 64, 64, 4, 128), 1, "auto")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_two_shot_shards_cover_every_tile_once(world):
    """Every real vector of a tile is reduced by exactly one rank, for every row count."""
    for rows in range(1, 129):
        for block_n, vector in ((64, 8), (128, 8), (256, 8), (128, 4)):
            shards = [shard_vectors(rows, block_n, vector, world, r) for r in range(world)]
            assert sorted(v for sh in shards for v in sh) == list(range(rows * (block_n // vector)))

A, B = (3, 256), (256, 512)


@pytest.mark.parametrize("call,exc,match", [
    (lambda op: op(torch.zeros(2, 256, dtype=BF16), torch.zeros(B, dtype=BF16)), ValueError,
     r"a has shape \(2, 256\), expected \(m, k\) = \(3, 256\)"),
    (lambda op: op(torch.zeros(A, dtype=BF16), torch.zeros(B)), TypeError,
     "b has dtype torch.float32, this GemmAllReduce was built for torch.bfloat16"),
    (lambda op: op(torch.zeros(256, 3, dtype=BF16).t(), torch.zeros(B, dtype=BF16)), ValueError, "a must be contiguous"),
    (lambda op: op(torch.zeros(A, dtype=BF16), [0.0]), TypeError, "b must be a torch.Tensor"),
    (lambda op: op(torch.zeros(A, dtype=BF16), torch.zeros(B, dtype=BF16), out=torch.zeros(3, 511, dtype=BF16)),
     ValueError, r"out has shape \(3, 511\), expected \(m, n\) = \(3, 512\)"),
    (lambda op: op(torch.zeros(A, dtype=BF16), torch.zeros(B, dtype=BF16), out=op.stages[1][:3]), ValueError,
     "out overlaps this GemmAllReduce's symmetric buffers"),
])
def test_call_rejects_bad_arguments_before_any_launch(call, exc, match, compiles):
    call_rejected(make(), call, exc, match)


def test_out_may_not_overlap_the_inputs(compiles):
    op = make()
    big = torch.zeros(256 * 512, dtype=BF16)
    call_rejected(op, lambda o: o(torch.zeros(A, dtype=BF16), big.view(B), out=big[:1536].view(3, 512)), ValueError,
                  "out overlaps b")


test_constructor_rejects_before_allocating = rejects_before_allocating(
    GemmAllReduce, dict(m=3, k=256, n=512, dtype=BF16), [
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
    (dict(m=0), ValueError, "m must be"),
    (dict(k=2.0), ValueError, "k must be"),
    (dict(k=100), ValueError, "k=100 is not a multiple of block_k=64"),
    (dict(n=100), ValueError, "n=100 is not a multiple of block_n=64"),
    (dict(n=512, block_n=4), ValueError, "block_n=4 must be a multiple of 8"),
    (dict(m=2**20, k=4096, n=4096), ValueError, "exceeds the kernel's int32 indexing"),
    (dict(dtype=torch.float32), TypeError, "dtype must be one of"),
    (dict(world_size=3), ValueError, r"world_size=3 but the allocator spans 2 rank\(s\)"),
    (dict(threads=100), ValueError, "threads must be a multiple of 128"),
    (dict(threads=128, num_ranks=256), ValueError, r"threads \(128\) must be >= world_size \(256\)"),
    (dict(max_blocks=0), ValueError, "max_blocks must be None or a positive int"),
    (dict(block_m=64, block_n=64, block_k=128, num_stages=8), ValueError,
     r"need 262144 bytes of shared memory per block, more than 232448: lower num_stages or block_k"),
    (dict(target=3), TypeError, "target"),
    (dict(split_k=0), ValueError, "split_k must be an int >= 1"),
    (dict(split_k="two"), ValueError, "split_k must be an int >= 1"),
    (dict(split_k=8), ValueError, r"k \(256\) must be a multiple of split_k \* block_k \(512\)"),
    (dict(split_k=2, max_blocks=1), ValueError, "split_k=2 exceeds max_blocks=1"),
    (dict(m=2**16, k=4096, n=4096, block_m=128, split_k=8), ValueError, "split_k=8: the staging buffers"),
    (dict(m=200, k=128, n=1024, block_n=256), None, None),
    (dict(k=1024, split_k=4), None, None),
])


def test_close_and_closed_allocator(compiles):
    op = make()
    assert "GemmAllReduce(m=3, k=256, n=512, dtype=torch.bfloat16, world_size=2, tiles=64x128x64" in repr(op)
    a, b = normal_inputs(1)[0]
    op.close()
    op.close()
    assert op.closed and op.kernel is None and op.stage_buffer is None and "closed" in repr(op)
    with pytest.raises(ClosedError, match="this GemmAllReduce is closed"):
        op(a, b)
    other = make()
    other.allocator.closed = True
    with pytest.raises(ClosedError, match="the allocator of this GemmAllReduce is closed"):
        other(a, b)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_heap_bytes_is_what_the_constructor_allocates(world, compiles):
    from tilescale_examples.base import RecordingAllocator

    for (m, k, n), kwargs in (((1, 8192, 8192), {}), ((512, 8192, 8192), dict(max_blocks=132)),
                              ((7, 128, 1024), dict(max_blocks=4, block_n=128)),
                              ((1, 8192, 8192), dict(split_k="auto")),
                              ((5, 1024, 2048), dict(split_k=4, max_blocks=10))):
        alloc = CpuAllocator(num_ranks=world)
        GemmAllReduce(alloc, m, k, n, BF16, **kwargs)
        assert GemmAllReduce.heap_bytes(m, k, n, BF16, world_size=world, device="cpu", **kwargs) == alloc.heap_bytes
    # unsplit: 64 blocks, one per 64 x 128 tile; by default (k split in 2): 128 blocks, float32 partials
    assert GemmAllReduce.heap_bytes(1, 8192, 8192, F16, world_size=2, device="cpu",
                                    split_k=1) == 2 * 64 * 8192 * 2 + 2 * 64 * 4 * 8
    assert GemmAllReduce.heap_bytes(1, 8192, 8192, F16, world_size=2, device="cpu") == 2 * 2 * 64 * 8192 * 4 + 2 * 128 * 4 * 8
    built = len(compiles)
    GemmAllReduce(RecordingAllocator(2), 3, 256, 512, BF16)
    assert len(compiles) == built  # a dry run compiles nothing


# ------------------------------------------------------------------------------ codegen
def source(m, k, n, world, dtype="bfloat16", tiles=None):
    return kernel_body(lower_with(build_gemm_ar_kernel(m, k, n, world, dtype, tiles), PASS_CONFIGS))


NOTIFY = "tilescale::notify<false>("
WAIT = "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>("


def assert_protocol_order(body: str, stage_store: str, out_store: str) -> None:
    """In ``body``: the GEMM, the epilogue's ``stage_store``, a barrier of the compute warps, the
    release, the acquire wait, a barrier, the peers' loads, the ``out_store``, then the call
    count; one flag round a tile, no fence."""
    gemm = body.index("tl::wgmma_ss<")
    stage = body.index(stage_store)
    sync = [m.start() for m in re.finditer(r"tl::__sync_thread_partial\(\d+, 128\);", body)]
    ready, wait = body.index(NOTIFY), body.index(WAIT)
    loads = [m.start() for m in re.finditer(r"tilescale::remap_ptr\(Stage, (\d)\)", body)]
    out = body.index(out_store)
    write = body.index("State[((int)blockIdx.x)] = epoch")
    assert "fence_sys" not in body and "fence_proxy" not in body and body.count(NOTIFY) == 1 and body.count(WAIT) == 1
    assert gemm < stage < sync[0] < ready < wait < sync[1] < loads[0] < out < write and len(sync) == 2


def test_protocol_order_on_one_decode_row():
    """m = 1, 4 ranks: per tile, the GEMM, the epilogue's store into this rank's staging buffer,
    a barrier of the compute warps, the release to every rank, the acquire wait on the same
    block index, a barrier, the peers' rows 0..3 in order, the rank-order sum, the store to Out;
    the call count after the loop."""
    body = source(1, 512, 1024, 4, "bfloat16", GemmTiles(64, 64, 64, 4, 128))
    assert_protocol_order(body, "*(uint1*)(Stage + ", "*(uint4*)(Out + ")
    assert re.findall(r"remap_ptr\(Stage, (\d)\)", body) == ["0", "1", "2", "3"]
    assert "lo = (((int)(epoch & (int64_t)1)) * 64);" in body  # call e's buffer: e % 2, 64 padded rows
    assert "((epoch * ((int64_t)iters)) + ((int64_t)i))" in body  # the flag value: e * iters + tile
    # ready[me, b] on peer tx and ready[tx, b] here: same block index, FLAG_STRIDE (4) words apart
    assert "(&(Flags[(((((int64_t)me) * ((int64_t)blocks)) * (int64_t)4) + (((int64_t)((int)blockIdx.x)) * (int64_t)4))]))" in body
    assert "(((int64_t)((int)threadIdx.x)) - (int64_t)128) * ((int64_t)blocks)) * (int64_t)4)" in body
    # the tile's 64 x 8 vectors in 2 steps of 128 threads x 2 (unrolled), the real rows only
    assert "for (int j = 0; j < 2; ++j)" in body and "if (((int)threadIdx.x) < 132)" in body  # flags: 4 ranks


def test_rank_order_sum_and_rounding_once():
    body = source(200, 256, 512, 4, "float16", GemmTiles(128, 128, 64, 3, 256))
    adds = re.findall(r"(__\d+)\.x = \((__\d+)\.x\+(__\d+)\.x\);", body)
    # ((v0 + v1) + v2) + v3: each add's left operand is the previous sum, converted once at the end
    assert len(adds) >= 3 and all(adds[i + 1][1] == adds[i][0] for i in range(2))
    assert "__float22half2_rn" in body and "half_t vals[" in body
    assert "lo = (((int)(epoch & (int64_t)1)) * 256);" in body  # 200 rows padded to 256


def test_builder_rejects_bad_arguments():
    for kwargs, match in ((dict(dtype="float32"), "dtype must be one of"), (dict(world_size=0), "world_size must be"),
                          (dict(world_size=129), "world_size must be"), (dict(k=100), "multiple of block_k"),
                          (dict(n=100), "multiple of block_k"), (dict(m=0), "m must be")):
        args = dict(m=4, k=256, n=512, world_size=2, dtype="bfloat16", tiles=GemmTiles(64, 64, 64, 4, 128))
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            build_gemm_ar_kernel(**args)


@needs_nvcc
def test_nvcc_register_budget(tmp_path):
    """sm_90a cubin of the largest default tiles (m = 512: 128 x 128, 256 compute threads plus
    TileLang's producer warpgroup), 8 ranks: the registers fit one block per SM, no spills."""
    tiles = default_tiles(512, 8192, 132)
    registers, spills = nvcc_resources(lower_with(build_gemm_ar_kernel(512, 8192, 8192, 8, "bfloat16", tiles),
                                                  PASS_CONFIGS), tmp_path)
    assert registers * (tiles.threads + 128) <= 65536 and spills == 0, (registers, spills)


def split_source(m, k, n, world, split, dtype="bfloat16", tiles=None):
    return kernel_body(lower_with(build_gemm_ar_kernel(m, k, n, world, dtype, tiles, split_k=split), PASS_CONFIGS))


def test_split_k_protocol_order_on_one_decode_row():
    """m = 1, 2 ranks, k split in 2: per unit, the GEMM over this block's half of k (the TMA
    coordinates: k0 = (block % 2) * 4096), the real row of the float32 partial into its split,
    a barrier, one thread's acq_rel add on this rank's counter of the tile, a barrier; then
    only the tile's last unit: the two partials added in split order, rounded to bfloat16 and
    kept as float32 in the call's buffer (rows 128 + e % 2 * 64), the release round on the
    tile's flag (one notify and one wait per rank), both ranks' rounded tiles added in rank
    order and rounded once, the store; the call count after the loop."""
    body = split_source(1, 8192, 8192, 2, 2, tiles=default_tiles(1, 8192, 132))
    assert "gemm_allreduce_split_kernel(" in body
    assert "(((((int)blockIdx.x) & 1) * 4096) + (kk * 64))" in body  # k0 of this unit's split
    gemm, partial = body.index("tl::wgmma_ss<"), body.index("*(float2*)(Stage + ")
    atomic = body.index("AtomicAddRet((&(Flags[")
    last = body.index("& (uint64_t)1) == (uint64_t)1)")
    rounded = body.index("__bfloat1622float2", last)  # the rank's product rounded, back to float32
    ready, wait = body.index(NOTIFY), body.index(WAIT)
    loads = [m.start() for m in re.finditer(r"tilescale::remap_ptr\(Stage, (\d)\)", body)]
    out = body.index("*(uint2*)(Out + ")
    assert gemm < partial < atomic < last < rounded < ready < wait < loads[0] < out
    assert body.index("State[((int)blockIdx.x)] = epoch") > out
    assert ", 1, 4);" in body[atomic:atomic + 400] and "fence_sys" not in body
    # counter of tile t on this rank: row me (2 x 64 tiles x 4 words), after the 64 ready flags
    assert "(int64_t)4)) + (int64_t)256)])), 1, 4);" in body[atomic:atomic + 400]
    assert "lo = ((((int)(epoch & (int64_t)1)) * 64) + 128);" in body  # after the S * mp partial rows
    assert re.findall(r"remap_ptr\(Stage, (\d)\)", body) == ["0", "1"]  # one rounded tile per rank
    assert body.count(NOTIFY) == 1 and body.count(WAIT) == 1 and "if (((int)threadIdx.x) < 130)" in body
    # ready[me, t] on every rank, then ready[p, t] here: rows of 2 x 64 flags, 4 words apart
    assert "tilescale::notify<false>((&(Flags[((((int64_t)me) * (int64_t)512) + " in body
    assert "* (int64_t)512) + " in body[wait:wait + 300]
    # the last unit's sum: split 0 + split 1 (rows 64 apart), rounded; then rank 0 + rank 1, rounded once
    assert re.search(r"__3\.x = \(v_\.x\+v__1\.x\);.*__float22bfloat162_rn", body[last:ready], re.S)
    assert re.search(r"__5\.x = \(v__2\.x\+v__3\.x\);.*__float22bfloat162_rn", body[loads[0]:out], re.S)


@needs_nvcc
def test_nvcc_register_budget_of_the_split_kernel(tmp_path):
    """The most partials a thread adds (8 ranks x 4 splits) at the decode tiles: no spills,
    one block per SM."""
    tiles = default_tiles(1, 4096, 132)
    registers, spills = nvcc_resources(lower_with(build_gemm_ar_kernel(1, 8192, 4096, 8, "bfloat16", tiles, split_k=4),
                                                  PASS_CONFIGS), tmp_path)
    assert registers * (tiles.threads + 128) <= 65536 and spills == 0, (registers, spills)



def test_one_rank_kernel_stores_the_rounded_tile_and_waits_for_nothing():
    """World 1, unsplit: per tile the GEMM, then its real row rounded to bfloat16 straight into
    Out; no staging, no flag, no wait, no peer address; the call count after the loop."""
    body = source(1, 512, 1024, 1, "bfloat16", GemmTiles(64, 64, 64, 4, 128))
    gemm, out = body.index("tl::wgmma_ss<"), body.index("*(uint1*)(Out + ")
    assert gemm < out < body.index("State[((int)blockIdx.x)] = epoch")
    assert "< 65)" in body and "__float22bfloat162_rn" in body  # the real row, rounded once
    for absent in ("Stage +", "Flags[", "notify", "wait_until", "remap_ptr", "Atomic", "fence_sys", "fence_gpu"):
        assert absent not in body, absent


@pytest.mark.parametrize("split", [2, 4])
def test_one_rank_split_kernel_lets_the_last_unit_of_a_tile_add_the_partials(split):
    """World 1, k split in S: the unit's float32 partial (real row) into its split of Stage, a
    barrier, one thread's acq_rel atomic add on the tile's counter (gpu scope: no system
    release, no wait), a barrier; the unit that saw count % S == S - 1 adds the S partials in
    split order (float32) and rounds once into Out."""
    body = split_source(1, 8192, 4096, 1, split, tiles=default_tiles(1, 4096, 132))
    store = body.index("*(float2*)(Stage + ")
    sync = [m.start() for m in re.finditer(r"tl::__sync_thread_partial\(\d+, 128\);", body)]
    atomic = body.index("AtomicAddRet((&(Flags[")
    last = body.index(f"& (uint64_t){split - 1}) == (uint64_t){split - 1})")
    out = body.index("*(uint2*)(Out + ")
    assert store < sync[0] < atomic < sync[1] < last < out < body.index("State[((int)blockIdx.x)] = epoch")
    assert ", 1, 4);" in body[atomic:atomic + 300]  # add 1, memory order 4: acq_rel
    assert "if (((int)threadIdx.x) == 128)" in body[sync[0]:atomic]  # one thread (the first compute thread)
    for absent in ("notify", "wait_until", "remap_ptr", "fence_sys"):
        assert absent not in body, absent
    adds = re.findall(r"(__\d+)\.x = \((v_\w*|__\d+)\.x\+(v_\w*|__\d+)\.x\);", body[last:out])
    assert len(adds) == split - 1  # S partials, S - 1 float32 adds, left to right
    assert all(adds[i + 1][1] == adds[i][0] for i in range(split - 2))


@needs_nvcc
@pytest.mark.parametrize("m,split", [(512, 1), (1, 4)])
def test_nvcc_one_rank_kernels(tmp_path, m, split):
    """The one-rank kernels compile for sm_90a at the largest default tiles (m = 512) and the
    most splits, one block per SM, no spills."""
    tiles = default_tiles(m, 8192, 132)
    registers, spills = nvcc_resources(lower_with(build_gemm_ar_kernel(m, 8192, 8192, 1, "bfloat16", tiles,
                                                                       split_k=split), PASS_CONFIGS), tmp_path)
    assert registers * (tiles.threads + 128) <= 65536 and spills == 0, (registers, spills)


def test_two_shot_protocol_order():
    """m = 3, 4 ranks, two-shot: per tile the GEMM, the rounded partial into this rank's rows
    0 .. mp of Stage, the release round (value 2v), this rank's shard read from ranks 0..3 in
    order, the rank-order sum rounded once, the result stored into ranks 0..3's rows mp .. 2mp,
    the second round (2v + 1), then the reduced tile's real rows copied locally into Out."""
    body = kernel_body(lower_with(build_gemm_ar_kernel(3, 512, 1024, 4, "bfloat16", GemmTiles(64, 64, 64, 4, 128),
                                                       reduction="two_shot"), PASS_CONFIGS))
    assert "gemm_allreduce_two_shot_kernel(" in body
    gemm, partial = body.index("tl::wgmma_ss<"), body.index("*(uint1*)(Stage + ")
    notify = [m.start() for m in re.finditer(re.escape(NOTIFY), body)]
    wait = [m.start() for m in re.finditer(re.escape(WAIT), body)]
    loads = [m.start() for m in re.finditer(r"remap_ptr\(Stage, \d\);\n\s+bfloat16_t broadcast", body)]
    rounding = body.index("__float22bfloat162_rn", loads[-1])
    stores = [m.start() for m in re.finditer(r"tilescale::store_vec16\(", body)]
    out = body.index("*(uint4*)(Out + ")
    assert gemm < partial < notify[0] < wait[0] < loads[0] < rounding < stores[0] < notify[1] < wait[1] < out
    assert len(notify) == len(wait) == 2 and len(loads) == 4 and len(stores) == 4
    assert re.findall(r"remap_ptr\(Stage, (\d)\)", body) == ["0", "1", "2", "3"] * 2  # loads, then pushes
    assert "epoch_1 = (((epoch * ((int64_t)iters)) * (int64_t)2) + (((int64_t)i) * (int64_t)2));" in body
    assert "* (int64_t)2)) + (int64_t)1);" in body[notify[0]:notify[1]]  # the second round: 2v + 1
    assert "(int64_t)49152)" in body[stores[0]:out]  # rows mp .. 2mp (64 x 1024, less the thread offset)
    assert "Stage + " in body[out:body.index(";", out)] and "remap_ptr" not in body[out:body.index(";", out)]
    assert "fence_sys" not in body  # the notify is the release


@needs_nvcc
def test_nvcc_register_budget_of_the_two_shot_kernel(tmp_path):
    """The largest default tiles (m = 512) at 8 ranks: one block per SM, no spills."""
    tiles = default_tiles(512, 8192, 132)
    registers, spills = nvcc_resources(lower_with(build_gemm_ar_kernel(512, 8192, 8192, 8, "bfloat16", tiles,
                                                                       reduction="two_shot"), PASS_CONFIGS), tmp_path)
    assert registers * (tiles.threads + 128) <= 65536 and spills == 0, (registers, spills)

# ------------------------------------------------------------------------------ the benchmark
def test_benchmark_without_gpu_bad_arguments_and_goals(monkeypatch, capsys):
    from examples_helpers import exits_naming, output_without_gpu

    from tilescale_examples.benchmarks import BENCHMARKS, gemm_allreduce

    assert "gemm_allreduce" in BENCHMARKS
    assert output_without_gpu(gemm_allreduce.main, [], monkeypatch, capsys) == (
        "gemm_allreduce benchmark: no CUDA GPU visible, nothing to measure\n")
    exits_naming(gemm_allreduce.main, ["--ranks", "0"], "--ranks must be in [1, 64]", capsys)
    exits_naming(gemm_allreduce.main, ["--k", "100"], "--k, --n positive multiples of 64", capsys)
    exits_naming(gemm_allreduce.main, ["--tiles", "64x64"], "--tiles must be BMxBNxBK[:STAGES[:THREADS]]", capsys)
    exits_naming(gemm_allreduce.main, ["--tiles", "64x64x64:a"], "--tiles must hold ints only", capsys)
    exits_naming(gemm_allreduce.main, ["--split-k", "0"], "--split-k values must be ints >= 1 or auto", capsys)
    assert [gemm_allreduce.parse_split_k(t) for t in ("1", "auto", "4")] == [1, "auto", 4]
    assert gemm_allreduce.split_variants([1, "auto"], 1, 8192, 8192, 2, 132, {}) == [1, 2]
    assert gemm_allreduce.split_variants([1, "auto"], 256, 8192, 8192, 2, 132, {}) == [1]  # auto is 1 there
    exits_naming(gemm_allreduce.main, ["--reduction", "three_shot"], "--reduction", capsys)
    assert gemm_allreduce.split_variants([1, "auto", 4], 1, 8192, 8192, 2, 132, {}, "two_shot") == [1]  # k whole
    assert gemm_allreduce.reduction_variants(["auto", "one_shot", "two_shot"], 1, 8192, 2, "bfloat16") == [
        "one_shot", "two_shot"]  # auto is one-shot while the size table is empty
    assert gemm_allreduce.reduction_variants(["one_shot", "two_shot"], 1, 8192, 1, "bfloat16") == ["one_shot"]
    assert gemm_allreduce.tiles_label(default_tiles(1, 8192, 132), 2) == "64x128x64:4:128 split 2"
    assert gemm_allreduce.parse_tiles("64x128x64") == {"block_m": 64, "block_n": 128, "block_k": 64}
    assert gemm_allreduce.parse_tiles("128x128x64:4:256") == {"block_m": 128, "block_n": 128, "block_k": 64,
                                                              "num_stages": 4, "threads": 256}
    assert gemm_allreduce.tiles_label(default_tiles(1, 8192, 132)) == "64x128x64:4:128"
    rows = {1: [[1, 1, 30.0, 33.0, 29.0, 0.909, 1.034, "64x64x64:4:128", "ok"]],
            4: [[4, 8, 40.0, 50.0, 30.0, 0.8, 1.333, "64x64x64:4:128", "ok"]]}
    assert gemm_allreduce.goal_lines(rows) == ["worst fused/(matmul + all-reduce): 0.909 (goal <= 0.85)",
                                               "worst fused/matmul at 1 rank: 1.034 (goal <= 1.05)"]
    assert gemm_allreduce.goal_lines({})[0].endswith("not measured")
    tiled = {1: [[1, 1, 60.0, 53.0, 47.0, 1.132, 1.277, "64x64x64:4:128", "ok"],
                 [1, 1, 56.0, 53.0, 47.0, 1.057, 1.191, "64x128x64:4:128", "ok"]]}
    assert gemm_allreduce.goal_lines(tiled) == [
        "worst fused/(matmul + all-reduce) (the fastest of 2 tile programs per shape): 1.057 (goal <= 0.85)",
        "worst fused/matmul at 1 rank (the fastest of 2 tile programs per shape): 1.191 (goal <= 1.05)"]


def test_benchmark_presets_the_peers_flags_and_keeps_each_ranks_own_waits_real():
    """The emulated ranks' flags: every peer's row preset (its waits pass), the rank's own row
    (set by its own blocks: the split-k group round waits on it) cleared."""
    from tilescale_examples.benchmarks.gemm_allreduce import preset_peer_flags
    from tilescale_examples.collectives.reduce_engine import FLAG_STRIDE
    from tilescale_examples.testing.emulated import PRESET, EmulatedPeers

    world, blocks = 3, 5
    peers = EmulatedPeers(world, 4096, "cpu")
    ops = [SimpleNamespace(rank=r, world_size=world,
                           flags=peers.rank(r)._allocate_tensor((world * blocks * FLAG_STRIDE,), torch.uint64))
           for r in range(world)]
    for op in ops:
        op.flags.view(torch.int64).fill_(7)
    preset_peer_flags(ops)
    for op in ops:
        rows = op.flags.view(torch.int64).view(world, blocks * FLAG_STRIDE)
        for p in range(world):
            assert rows[p].tolist() == [0 if p == op.rank else PRESET] * (blocks * FLAG_STRIDE), (op.rank, p)
    peers.close()


@pytest.mark.parametrize("m, n, world", [(1, 8192, 2), (7, 512, 4), (128, 8192, 8), (512, 4096, 1)])
def test_precompile_jobs_are_the_kernels_the_op_builds(compiles, monkeypatch, m, n, world):
    from tilescale_examples.decode import gemm_allreduce as mod

    built = []

    def recording(*args):
        built.append(args)
        return build_gemm_ar_kernel(*args)

    monkeypatch.setattr(mod, "build_gemm_ar_kernel", recording)
    make(m=m, k=256, n=n, num_ranks=world, max_blocks=132)
    [(builder, args, configs)] = mod.gemm_allreduce_jobs([m], 256, n, "bfloat16", [world], 132)
    assert builder == "tilescale_examples.decode.gemm_ar_kernel:build_gemm_ar_kernel" and configs == PASS_CONFIGS
    assert built == [args]
    assert len(mod.gemm_allreduce_jobs([1, 2, 4], 256, 512, "float16", [1, 2], 132)) == 6
    # tile keywords (the benchmark's --tiles) reach the jobs as they reach the op
    [(_, tiled, _)] = mod.gemm_allreduce_jobs([m], 256, n, "bfloat16", [world], 132, block_n=64, num_stages=5)
    assert (tiled[5].block_n, tiled[5].num_stages) == (64, 5)
    built.clear()
    make(m=m, k=1024, n=n, num_ranks=world, max_blocks=132, split_k="auto")
    assert [args for _, args, _ in mod.gemm_allreduce_jobs([m], 1024, n, "bfloat16", [world], 132, "auto")] == built
    built.clear()
    make(m=m, k=256, n=n, num_ranks=world, max_blocks=132, reduction="two_shot")
    jobs = mod.gemm_allreduce_jobs([m], 256, n, "bfloat16", [world], 132, reduction="two_shot")
    if world == 1:  # one rank: its own kernel (whatever is asked), the one built above
        assert built in ([], [args]) and [job for _, job, _ in jobs] == [args]
    else:
        assert [job for _, job, _ in jobs] == built and built[0][6:] == (1, "two_shot")
