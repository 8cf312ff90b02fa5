"""The stream-K GEMM (:mod:`tilescale_examples.overlap.stream_k`).

CPU: the schedule walked whole for many shapes (every ``k`` step of every tile computed once,
balanced shares, at most two partial segments per block in their own slots, every tile's
contributors and their slots; the blocks running together close along ``k``); the kernel's
tables holding that plan; the fix-up simulated in numpy from the tables with random arrival
orders (bit-identical whatever block arrives last); the generated CUDA (one pipelined loop, the
device-scope acquire-release counter, the named barrier of the compute threads, the counter
reset); an nvcc compile (no spills); argument errors before any kernel.

GPU (``gpu``): against the float32 reference with fresh random data and poisoned outputs, at
shapes with stream-K tiles only, data-parallel and stream-K tiles, whole waves only, tiny
grids where a tile has three contributors, more blocks than steps, more blocks than SMs (not all
resident at once: nothing waits for a block); bit-identical repeated
calls; 200 back-to-back calls on fresh inputs with the counters back at zero; a side stream;
CUDA-graph replays with fresh inputs; a straggler kernel holding SMs while the GEMM runs.
"""

import itertools
import random

import numpy as np
import pytest
import torch
from examples_helpers import assert_gemm_graph_replays, kernel_body, lower_source, needs_nvcc, nvcc_resources

from tilescale_examples.overlap.gemm import GemmTiles, count_outside
from tilescale_examples.overlap.stream_k import (STREAM_K_TILES, StreamKGemm, StreamKPlan, build_stream_k_gemm,
                                                 default_blocks, schedule_tables, workspace_shapes)

#: (row_blocks, col_blocks, iters, blocks) walked by the schedule tests: fewer tiles than
#: blocks, whole waves, waves plus a remainder, more blocks than steps, one step per tile.
PLANS = [(8, 14, 128, 132), (32, 14, 128, 132), (8, 28, 128, 132), (32, 112, 128, 132), (12, 11, 16, 132),
         (2, 2, 4, 7), (1, 1, 1, 5), (3, 5, 7, 4), (1, 1, 3, 2), (5, 1, 9, 3), (4, 4, 2, 64), (7, 3, 1, 4),
         (1, 2, 128, 132), (33, 4, 5, 132)]


def _walk(plan: StreamKPlan) -> dict:
    """``{(tile, step): block}`` of every step every block computes (data-parallel tiles as
    output tiles ``0 .. dp_tiles - 1``, stream-K tiles after them); fails on a step computed
    twice."""
    done = {}
    for b in range(plan.blocks):
        for i in range(plan.dp_waves):
            for step in range(plan.iters):
                key = (i * plan.blocks + b, step)
                assert key not in done
                done[key] = b
        for seg in plan.segments(b):
            for step in range(seg.lo, seg.hi):
                key = (plan.dp_tiles + seg.tile, step)
                assert key not in done
                done[key] = b
    return done


@pytest.mark.parametrize("shape", PLANS, ids=str)
def test_every_step_of_every_tile_is_computed_once(shape):
    plan = StreamKPlan(*shape)
    assert set(_walk(plan)) == set(itertools.product(range(plan.tiles), range(plan.iters)))
    assert plan.dp_tiles % plan.blocks == 0 and 0 <= plan.sk_tiles < 2 * plan.blocks
    if plan.tiles % plan.blocks == 0:
        assert plan.sk_tiles == 0


@pytest.mark.parametrize("shape", PLANS, ids=str)
def test_blocks_get_equal_shares_and_at_most_two_partials_in_their_slots(shape):
    plan = StreamKPlan(*shape)
    q, r = plan.share
    for b in range(plan.blocks):
        start, end = plan.sk_range(b)
        assert end - start == q + (b < r) and start == sum(q + (c < r) for c in range(b))
        segs = plan.segments(b)
        assert len(segs) == plan.segment_count(b)
        partial = [s for s in segs if s.slot is not None]
        assert all(s.slot is None for s in segs[1:-1])  # the middle segments are whole tiles
        assert len(partial) <= 2 and len({s.slot for s in partial}) == len(partial)
        assert {s.slot for s in partial} <= {2 * b, 2 * b + 1}
        for s in segs:
            assert 0 <= s.lo < s.hi <= plan.iters and s.tile < plan.sk_tiles


@pytest.mark.parametrize("shape", PLANS, ids=str)
def test_contributors_and_their_slots_are_the_blocks_that_computed_the_tile(shape):
    plan = StreamKPlan(*shape)
    touched = {}  # stream-K tile -> [(block, lo, slot)]
    for b in range(plan.blocks):
        for seg in plan.segments(b):
            touched.setdefault(seg.tile, []).append((b, seg.lo, seg.slot))
    for tile in range(plan.sk_tiles):
        first, count = plan.contributors(tile)
        blocks = [b for b, _, _ in touched[tile]]
        assert blocks == list(range(first, first + count))
        assert [lo for _, lo, _ in touched[tile]] == sorted(lo for _, lo, _ in touched[tile])  # k order
        if count > 1:
            assert [plan.contributor_slot(tile, b) for b in blocks] == [slot for _, _, slot in touched[tile]]
        else:
            assert touched[tile][0][2] is None  # one contributor: a whole tile, stored directly
    for x in range(plan.sk_tiles * plan.iters):
        start, end = plan.sk_range(plan.owner(x))
        assert start <= x < end


@pytest.mark.parametrize("shape", [(8, 14, 128, 132), (10, 12, 128, 132), (6, 20, 64, 132)], ids=str)
def test_blocks_running_together_stay_close_along_k(shape):
    """In the kernel's order (last segment first) every block's ``k`` step at time ``tau`` (in
    steps since the stream-K phase began) is within ``iters - q`` of ``tau``: the blocks share
    the ``k`` slabs of ``A`` and ``B`` in L2. In range order they would be scattered."""
    plan = StreamKPlan(*shape)
    q, _ = plan.share
    assert q < plan.iters

    def positions(segments):
        return [k for seg in segments for k in range(seg.lo, seg.hi)]

    ordered = [positions(plan.order(b)) for b in range(plan.blocks)]
    spread = max(abs(k - tau) for pos in ordered for tau, k in enumerate(pos))
    assert spread <= plan.iters - q
    ranged = [positions(plan.segments(b)) for b in range(plan.blocks)]
    assert max(abs(k - tau) for pos in ranged for tau, k in enumerate(pos)) > plan.iters // 2
    for b in range(plan.blocks):
        los = [seg.lo for seg in plan.order(b)]
        assert los == sorted(los) and (len(los) < 2 or los[0] == 0)


@pytest.mark.parametrize("shape", PLANS, ids=str)
def test_the_kernel_s_tables_hold_the_plan(shape):
    plan = StreamKPlan(*shape)
    units, fix = schedule_tables(plan)
    assert tuple(units.shape) == workspace_shapes(GemmTiles(), plan)["units"]
    assert tuple(fix.shape) == workspace_shapes(GemmTiles(), plan)["fix"]
    for b in range(plan.blocks):
        n = int(units[b, 0, 0])
        rows = [tuple(r) for r in units[b, 1:1 + n].tolist()]
        dp = [(i * plan.blocks + b, 0, plan.iters, -1) for i in range(plan.dp_waves)]
        sk = [(plan.dp_tiles + g.tile, g.lo, g.hi, -1 if g.slot is None else g.slot) for g in plan.order(b)]
        assert rows == dp + sk
    for tile in range(plan.sk_tiles):
        first, count = plan.contributors(tile)
        assert fix[tile, 0] == count
        assert fix[tile, 1:1 + count].tolist() == [plan.contributor_slot(tile, c) for c in range(first, first + count)]


def _simulate(plan: StreamKPlan, a: np.ndarray, b: np.ndarray, bm: int, bn: int, bk: int, order) -> np.ndarray:
    """The kernel's arithmetic in numpy, read from its tables (:func:`schedule_tables`): float32
    partials, the last arrival adds them in ``k`` order; blocks' units finishing in ``order``
    (a permutation of ``(block, unit)``)."""
    units, fix = (t.numpy() for t in schedule_tables(plan))
    c = np.full((a.shape[0], b.shape[1]), np.nan, dtype=np.float32)
    work = np.full((2 * plan.blocks, bm, bn), np.nan, dtype=np.float32)
    counts = [0] * max(plan.sk_tiles, 1)
    for blk, u in order:
        t, lo, hi, slot = units[blk, 1 + u]
        row, col = plan.tile_position(t)
        p = (a[row * bm:(row + 1) * bm, lo * bk:hi * bk] @ b[lo * bk:hi * bk, col * bn:(col + 1) * bn]).astype(np.float32)
        if slot < 0:
            c[row * bm:(row + 1) * bm, col * bn:(col + 1) * bn] = p
            continue
        work[slot] = p
        s = t - plan.dp_tiles
        counts[s] += 1
        if counts[s] == fix[s, 0]:
            counts[s] = 0
            acc = np.zeros((bm, bn), dtype=np.float32)
            for j in range(fix[s, 0]):
                acc += work[fix[s, 1 + j]]
            c[row * bm:(row + 1) * bm, col * bn:(col + 1) * bn] = acc
    assert not any(counts)  # back to zero for the next call
    return c


@pytest.mark.parametrize("shape", [(2, 2, 4, 7), (3, 5, 7, 4), (5, 1, 9, 3), (4, 3, 6, 5), (7, 3, 2, 4)], ids=str)
def test_the_fix_up_is_exact_and_independent_of_the_arrival_order(shape):
    bm, bn, bk = 4, 8, 2
    plan = StreamKPlan(*shape)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((plan.row_blocks * bm, plan.iters * bk)).astype(np.float32)
    b = rng.standard_normal((plan.iters * bk, plan.col_blocks * bn)).astype(np.float32)
    units = [(blk, u) for blk in range(plan.blocks) for u in range(int(schedule_tables(plan)[0][blk, 0, 0]))]
    results = []
    for seed in range(4):
        order = list(units)
        random.Random(seed).shuffle(order)
        results.append(_simulate(plan, a, b, bm, bn, bk, order))
    assert not np.isnan(results[0]).any()
    np.testing.assert_allclose(results[0], a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    assert all(np.array_equal(results[0], r) for r in results[1:])  # the same bits


def test_bad_plans_and_shapes_are_named():
    with pytest.raises(ValueError, match="blocks must be a positive int"):
        StreamKPlan(1, 1, 1, 0)
    with pytest.raises(ValueError, match="iters must be a positive int"):
        StreamKPlan(1, 1, True, 2)
    with pytest.raises(ValueError, match="n=300 is not a multiple of block_n=256"):
        build_stream_k_gemm(128, 300, 64)
    with pytest.raises(ValueError, match="blocks must be a positive int"):
        build_stream_k_gemm(128, 256, 64, blocks=0)


def test_default_blocks_are_the_sms_with_at_least_four_steps_each():
    assert default_blocks(1024, 3584, 8192, STREAM_K_TILES, 132) == 132
    assert default_blocks(256, 512, 256, STREAM_K_TILES, 132) == 4  # 16 steps
    assert default_blocks(128, 256, 64, STREAM_K_TILES, 132) == 1


def test_workspace_is_two_slots_per_block_and_a_counter_per_stream_k_tile():
    plan = StreamKPlan(8, 14, 128, 132)
    assert workspace_shapes(GemmTiles(), plan) == {"work": (2 * 132 * 128, 256), "counts": (112,),
                                                   "units": (132, 1 + 2, 4), "fix": (112, 1 + 3)}
    whole = StreamKPlan(12, 11, 16, 132)
    assert whole.sk_tiles == 0 and workspace_shapes(GemmTiles(), whole)["counts"] == (1,)


# ------------------------------------------------------------------------------ generated code
def test_generated_cuda_has_one_pipeline_an_acq_rel_counter_and_a_compute_barrier():
    src = kernel_body(lower_source(build_stream_k_gemm(4096, 3584, 8192, "bfloat16", STREAM_K_TILES)))
    assert src.count("tl::tma_load(A_desc") == 1 and "wgmma" in src  # one pipelined loop, TMA + WGMMA
    atomic = src[src.index("AtomicAddRet("):]
    assert atomic[:atomic.index(";")].endswith(", 1, 4)")  # fetch_add(1), memory_order_acq_rel (4)
    assert "cuda::thread_scope_device" not in src  # (the scope is in TileLang's header: device)
    assert "tl::__sync_thread_partial(" in src  # the fix-up's barrier: the compute threads only
    assert src.count("__syncthreads()") <= 2  # setup and the start of each unit, as every TileLang GEMM
    assert "Counts[" in src and "] = 0;" in src[src.index("AtomicAddRet("):]  # the last arrival resets


def test_the_reduction_adds_the_contributors_in_a_loop_over_their_slots():
    src = kernel_body(lower_source(build_stream_k_gemm(1024, 3584, 8192, "bfloat16", STREAM_K_TILES)))
    loop = src[src.index("AtomicAddRet("):]
    assert "for (int j = 0; j <" in loop and "Work + " in loop[loop.index("for (int j = 0; j <"):]


@needs_nvcc
def test_kernel_compiles_without_spills(tmp_path):
    for m, n, k, blocks in ((4096, 3584, 8192, 132), (256, 512, 256, 7)):
        src = lower_source(build_stream_k_gemm(m, n, k, "bfloat16", STREAM_K_TILES, blocks))
        regs, spills = nvcc_resources(src, tmp_path)
        assert spills == 0 and regs <= 168, (m, n, k, regs, spills)  # 384 threads: 65536 / 384 registers


# ------------------------------------------------------------------------------ the op's checks
@pytest.fixture
def cpu_op(monkeypatch):
    """A StreamKGemm on the CPU with its compile recorded (the kernel records its calls)."""
    calls = []

    class Kernel:
        def __call__(self, *args):
            calls.append(args)

    monkeypatch.setattr("tilescale_examples.base.compile_once", lambda func, *a, **k: Kernel())
    op = StreamKGemm(256, 512, 128, torch.bfloat16, blocks=3, device="cpu")
    return op, calls


def test_constructor_names_bad_arguments():
    with pytest.raises(ValueError, match="k=100 is not a multiple of block_k=64"):
        StreamKGemm(128, 256, 100, device="cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        StreamKGemm(128, 256, 64, torch.float32, device="cpu")
    with pytest.raises(TypeError, match="tiles must be a GemmTiles"):
        StreamKGemm(128, 256, 64, tiles=(128, 256, 64), device="cpu")
    with pytest.raises(ValueError, match="blocks must be a positive int"):
        StreamKGemm(128, 256, 64, blocks=-1, device="cpu")


def test_a_call_checks_its_tensors_before_the_kernel(cpu_op):
    op, calls = cpu_op
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.zeros(128, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a"):
        op(a[:128], b)
    with pytest.raises(TypeError, match="b has dtype torch.float16"):
        op(a, b.half())
    with pytest.raises(ValueError, match="out"):
        op(a, b, out=torch.zeros(256, 256, dtype=torch.bfloat16))
    both = torch.zeros(256 * 128 + 256 * 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out overlaps a"):
        op(both[:256 * 128].view(256, 128), b, out=both[:256 * 512].view(256, 512))
    assert calls == []
    assert op(a, b) is op.output
    assert [tuple(t.shape) for t in calls[0]] == [tuple(a.shape), tuple(b.shape), (256, 512), (2 * 3 * 128, 256), (4,),
                                                  (3, 1 + 2, 4), (4, 1 + 2)]
    assert calls[0][4].dtype == torch.int32 and not calls[0][4].any()  # the counters start at zero
    assert "sk_tiles=4" in repr(op) and op.flops() == 2.0 * 256 * 512 * 128


# ------------------------------------------------------------------------------ GPU
#: (m, n, k, dtype, tiles, blocks) of the GPU cases; blocks None: the SM count.
GPU_CASES = [(1024, 3584, 8192, torch.bfloat16, None, None),  # stream-K tiles only (112 < 132)
             (4096, 3584, 1024, torch.bfloat16, None, None),  # data-parallel + stream-K tiles
             (1536, 2816, 512, torch.float16, None, 132),  # whole waves only (132 tiles)
             (256, 512, 256, torch.bfloat16, None, 7),  # three contributors to a tile
             (128, 256, 64, torch.bfloat16, None, 5),  # more blocks than steps
             (384, 1024, 640, torch.float16, GemmTiles(128, 128, 64, 3, 256), 10),
             (512, 1024, 2048, torch.bfloat16, None, 300)]  # more blocks than SMs: 1-2 steps each, ~20 per tile


#: (m, n, k, blocks) of the back-to-back test (8 tiles over 11 blocks: every tile fixed up).
BACK_TO_BACK = (512, 1024, 1024, 11)


@pytest.fixture(scope="module")
def compiled():
    """Every kernel of the GPU tests compiled first, in parallel worker processes (the ops'
    compiles are then cache hits)."""
    from tilescale_examples._contract import sm_count_of
    from tilescale_examples.overlap.gemm import DTYPES
    from tilescale_examples.testing.precompile import precompile

    jobs = []
    for m, n, k, dtype, tiles, blocks in GPU_CASES + [BACK_TO_BACK[:3] + (torch.bfloat16, None, BACK_TO_BACK[3])]:
        tiles = tiles or STREAM_K_TILES
        blocks = default_blocks(m, n, k, tiles, sm_count_of(None)) if blocks is None else blocks
        jobs.append(("tilescale_examples.overlap.stream_k:build_stream_k_gemm", (m, n, k, DTYPES[dtype], tiles, blocks),
                     None))
    precompile(jobs)


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn((m, k), generator=g, device="cuda").to(dtype),
            torch.randn((k, n), generator=g, device="cuda").to(dtype))


def _check(out, a, b, what):
    ref = a.float() @ b.float()
    bad, worst = count_outside(out, ref, out.dtype)
    assert bad == 0, f"{what}: {bad} elements outside the bound (worst {worst:.2f}x)"


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c[:4]))
def test_gpu_stream_k_matches_the_reference_and_repeats_bit_for_bit(case):
    m, n, k, dtype, tiles, blocks = case
    op = StreamKGemm(m, n, k, dtype, tiles=tiles, blocks=blocks)
    for seed in range(3):
        a, b = _inputs(m, n, k, dtype, seed)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        op(a, b, out=out)
        _check(out, a, b, f"seed {seed}")
        op.output.fill_(float("nan"))
        assert torch.equal(op(a, b), out)  # the same bits, whichever block arrived last
    torch.cuda.synchronize()
    assert not op.counts.any()


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
def test_gpu_back_to_back_calls_side_stream_graphs_and_a_straggler():
    (m, n, k, blocks), dtype = BACK_TO_BACK, torch.bfloat16
    op = StreamKGemm(m, n, k, dtype, blocks=blocks)
    inputs = [_inputs(m, n, k, dtype, 100 + i) for i in range(4)]
    outs = [torch.full((m, n), float("nan"), dtype=dtype, device="cuda") for _ in range(200)]
    for i, out in enumerate(outs):  # 200 calls without host synchronisation
        op(*inputs[i % 4], out=out)
    torch.cuda.synchronize()
    for i in (0, 1, 2, 3, 101, 199):
        _check(outs[i], *inputs[i % 4], f"back-to-back call {i}")
    assert all(torch.equal(outs[i], outs[i % 4]) for i in range(4, 200))
    assert not op.counts.any()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000)  # a straggler on the side stream first
        got = op(*inputs[0])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, outs[0])

    assert_gemm_graph_replays(lambda a, b, out: op(a, b, out=out), inputs, outs[:4])
    out = torch.empty((m, n), dtype=dtype, device="cuda")

    hold = torch.cuda.Stream()  # a kernel holding SMs while the GEMM runs: nothing waits on a block
    with torch.cuda.stream(hold):
        for _ in range(8):
            torch.cuda._sleep(1_000_000)
    out.fill_(float("nan"))
    op(*inputs[2], out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, outs[2]) and not op.counts.any()
