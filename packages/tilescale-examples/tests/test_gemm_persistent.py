"""The persistent GEMM (:mod:`tilescale_examples.overlap.gemm_persistent`).

CPU: the tile order visits every tile once, panel by panel, and the tiles running at once are
consecutive; the async pipeline's protocol with the ring running on across a block's tiles
(the running step number's stages and parities) under random interleavings; the generated CUDA
(each block's tile loop around the producer's and the compute warpgroups' step loops, parities
from the running step, the store inside the compute branch; the TMA-store epilogue's tile of its
own beside the stages); nvcc without spills; argument errors.

GPU (``gpu``): against the float32 reference with fresh random data and poisoned outputs, at
the benchmark's shapes and at small ones (blocks with several tiles and a step count that is
not a multiple of the stages, so the ring's stages shift from tile to tile; one ``k`` step;
one compute warpgroup; float16; a rasterized order), bit-identical to the one-block-per-tile
async GEMM, with the direct and the TMA-store epilogue; 200 back-to-back calls; CUDA-graph
replays; two instances at once on two streams.
"""

import random
import re
from dataclasses import replace

import pytest
import torch
from examples_helpers import (assert_gemm_back_to_back, assert_gemm_graph_replays, assert_gemm_matches, assert_gemm_two_streams,
                             in_order, kernel_body, lower_source, needs_nvcc, nvcc_resources)

from pipeline_model import simulate

from tilescale_examples.overlap.gemm import DTYPES, STORES, GemmTiles, build_gemm_kernel, default_swizzle
from tilescale_examples.overlap.gemm_persistent import build_persistent_gemm, persistent_blocks, tile_order

#: The benchmark's default tiles.
TILES = GemmTiles(num_stages=4)


@pytest.mark.parametrize("rows,cols,panel", [(8, 14, 0), (32, 14, 0), (8, 112, 8), (32, 112, 8), (7, 5, 3), (1, 9, 8),
                                             (5, 1, 2), (10, 3, 4)])
def test_tile_order_visits_every_tile_once_panel_by_panel(rows, cols, panel):
    order = [tile_order(t, rows, cols, panel) for t in range(rows * cols)]
    assert sorted(order) == [(r, c) for r in range(rows) for c in range(cols)]
    if not panel:
        assert order == [(r, c) for r in range(rows) for c in range(cols)]  # the grid's own order
        return
    for t, (r, c) in enumerate(order):
        first = t // (panel * cols) * panel
        assert first <= r < first + panel  # within its panel of rows
    # Within a panel: column by column, rows fastest.
    height = min(panel, rows)
    assert order[:height] == [(r, 0) for r in range(height)]
    if cols > 1:
        assert order[height] == (0, 1)


def test_blocks_are_one_per_sm_and_no_more_than_tiles():
    assert persistent_blocks(4096, 3584, TILES, 132) == 132
    assert persistent_blocks(1024, 3584, TILES, 132) == 112  # 8 x 14 tiles
    assert persistent_blocks(128, 256, TILES, 132) == 1


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("tile_steps", [[1, 1, 1, 1, 1], [3, 3, 3], [5, 5], [2, 7, 1, 4]])
def test_the_ring_runs_on_across_tiles_without_a_stale_read_or_deadlock(stages, tile_steps):
    rng = random.Random(stages * 100 + len(tile_steps))
    for _ in range(100):
        assert simulate(stages, tile_steps, rng) == list(range(sum(tile_steps)))


def test_each_block_loops_over_its_tiles_with_the_running_step():
    src = kernel_body(lower_source(build_persistent_gemm(4096, 28672, 8192, "bfloat16", replace(TILES, swizzle=8))))
    assert "__launch_bounds__(384, 1)" in src and "warpgroup_reg_dealloc<40>" in src
    producer, consumer = src.split("warpgroup_reg_alloc<232>")
    # 896 tiles over 132 blocks: block b runs (1027 - b) // 132 + ... tiles; the parities run on.
    assert "for (int i = 0; i < ((3715 - ((int)blockIdx.x)) / 132); ++i)" in producer
    assert "empty[(kk & 3)].wait(((((i * 32) + (kk >> 2)) & 1) ^ 1))" in producer
    assert "min(8, " in producer  # the last panel's rows
    assert "for (int i_2 = 0; i_2 < ((3715 - ((int)blockIdx.x)) / 132); ++i_2)" in consumer
    loop = consumer[consumer.index("for (int kk_1"):]
    order = [loop.index(s) for s in ("full[(kk_1 & 3)].wait((((i_2 * 32) + (kk_1 >> 2)) & 1))", "wgmma_ss",
                                     "wait_wgmma<1>", "wait_wgmma<0>", "empty[3].arrive()", "__float22bfloat162_rn")]
    assert order == sorted(order) and "__syncthreads" not in consumer
    assert "wait_wgmma<0>();\n      tl::warpgroup_fence_operand(reinterpret_cast<float*>(C_f + 0), 128);" in consumer


def test_a_step_count_off_the_ring_shifts_the_stages_from_tile_to_tile():
    src = kernel_body(lower_source(build_persistent_gemm(512, 1024, 192, "bfloat16", GemmTiles(128, 128, 64, 4, 256), 3)))
    producer, consumer = src.split("warpgroup_reg_alloc<232>")
    # 4 stages, 3 steps a tile: the running step i * 3 + kk picks the stage and the parity.
    assert "empty[(((i * 3) + kk) & 3)].wait((((((i * 3) + kk) >> 2) & 1) ^ 1))" in producer
    assert "full[(((i_2 * 3) + kk_1) & 3)].wait(((((i_2 * 3) + kk_1) >> 2) & 1))" in consumer
    assert "empty[((((i_2 * 3) + kk_1) + 3) & 3)].arrive()" in consumer  # the previous step's stage
    assert "empty[(((i_2 * 3) + 2) & 3)].arrive()" in consumer  # the tile's last


def test_the_tma_store_epilogue_has_a_tile_of_its_own():
    src = kernel_body(lower_source(build_persistent_gemm(4096, 3584, 8192, "bfloat16", GemmTiles(num_stages=3),
                                                         store="tma")))
    assert "gemm_persistent_tma_store_kernel" in src
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    assert offsets == {"B_s": "0", "C_s": "98304", "A_s": "163840"}  # never over a stage the producer may be loading
    _, consumer = src.split("warpgroup_reg_alloc<232>")
    loop = consumer[consumer.index("for (int i_2"):]
    assert in_order(loop, "wait_wgmma<0>", "__sync_thread_partial(3, 256)", "ptx_stmatrix_m8n8_x4",
                     "__sync_thread_partial(3, 256)", "tma_store(C_desc", "tma_store_wait<0")
    with pytest.raises(ValueError, match="num_stages=4 does not fit beside the TMA-store epilogue"):
        build_persistent_gemm(4096, 3584, 8192, "bfloat16", GemmTiles(num_stages=4), store="tma")


@needs_nvcc
def test_kernel_compiles_without_spills(tmp_path):
    for func in (build_persistent_gemm(4096, 28672, 8192, "bfloat16", GemmTiles(num_stages=4, swizzle=8)),
                 build_persistent_gemm(4096, 3584, 8192, "bfloat16", GemmTiles(128, 224, 64, 4, 256)),
                 build_persistent_gemm(512, 1024, 192, "float16", GemmTiles(64, 128, 64, 3, 128), 3),
                 build_persistent_gemm(4096, 3584, 8192, "bfloat16", GemmTiles(num_stages=3), store="tma")):
        regs, spills = nvcc_resources(lower_source(func), tmp_path)
        assert spills == 0, (regs, spills)


@pytest.mark.parametrize("call,match", [
    (lambda: build_persistent_gemm(100, 512, 128), "m=100 is not a multiple of block_m=128"),
    (lambda: build_persistent_gemm(256, 300, 128), "n=300 is not a multiple of block_n=256"),
    (lambda: build_persistent_gemm(256, 512, 128, blocks=0), "blocks must be a positive int, got 0"),
    (lambda: build_persistent_gemm(256, 512, 128, blocks=True), "blocks must be a positive int"),
    (lambda: build_persistent_gemm(256, 512, 128, tiles=GemmTiles(num_stages=1)),
     "num_stages must be >= 2 for the async pipeline")])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------ GPU
#: (m, n, k, dtype, tiles, blocks) of the GPU cases (tiles None: the benchmark's, rasterized as
#: the ops do; blocks None: one per SM).
GPU_CASES = [(4096, 3584, 8192, torch.bfloat16, None, None),  # 448 tiles on 132 SMs
             (4096, 28672, 1024, torch.bfloat16, None, None),  # rasterized, 27 tiles a block
             (1536, 2816, 512, torch.float16, None, 5),
             (256, 512, 128, torch.float16, GemmTiles(64, 128, 64, 3, 128), 3),  # one compute warpgroup
             (384, 768, 64, torch.bfloat16, None, 2),  # one k step, 4-5 tiles a block
             (512, 1024, 192, torch.bfloat16, GemmTiles(128, 128, 64, 4, 256), 3),  # 3 steps a tile, 4 stages
             (768, 2048, 320, torch.bfloat16, GemmTiles(128, 256, 64, 2, 256, swizzle=4), 7)]  # 5 steps, 2 stages


def _tiles(n, tiles, store="direct"):
    """A case's tiles (None: the benchmark's, rasterized as the ops do); with the TMA-store
    epilogue, at most 3 stages (its output tile lies beside them)."""
    tiles = tiles or GemmTiles(num_stages=4, swizzle=default_swizzle(n, 256))
    return tiles if store == "direct" else replace(tiles, num_stages=min(tiles.num_stages, 3))


def _blocks(m, n, tiles, blocks):
    return blocks or persistent_blocks(m, n, tiles, torch.cuda.get_device_properties(0).multi_processor_count)


#: (m, n, k) of the back-to-back test.
BACK_TO_BACK = (2048, 3584, 2048)


@pytest.fixture(scope="module")
def compiled():
    """Every kernel of the GPU tests compiled first, in parallel worker processes."""
    from tilescale_examples.benchmarks.gemm import PERSISTENT_BUILDER
    from tilescale_examples.overlap.tuning import GEMM_BUILDER
    from tilescale_examples.testing.precompile import precompile

    cases = GPU_CASES + [BACK_TO_BACK + (torch.bfloat16, None, None)]
    jobs = []
    for m, n, k, dtype, given, blocks in cases:
        for store in STORES:
            tiles = _tiles(n, given, store)
            jobs.append((PERSISTENT_BUILDER, (m, n, k, DTYPES[dtype], tiles, _blocks(m, n, tiles, blocks), store), None))
        jobs.append((GEMM_BUILDER, (m, n, k, DTYPES[dtype], replace(_tiles(n, given), pipeline="async")), None))
    precompile(jobs)


def _kernel(m, n, k, dtype, tiles, blocks, store="direct"):
    from tilescale_examples.base import compile_once

    tiles = _tiles(n, tiles, store)
    return compile_once(build_persistent_gemm(m, n, k, DTYPES[dtype], tiles, _blocks(m, n, tiles, blocks), store))


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c[:4]))
def test_gpu_persistent_gemm_matches_the_reference_and_the_async_gemm(case, store):
    from tilescale_examples.base import compile_once

    m, n, k, dtype, tiles, blocks = case
    kernel = _kernel(m, n, k, dtype, tiles, blocks, store)
    one_per_tile = compile_once(build_gemm_kernel(m, n, k, DTYPES[dtype], replace(_tiles(n, tiles), pipeline="async")))
    assert_gemm_matches(kernel, one_per_tile, m, n, k, dtype,
                        "the same products in the same k order as the one-block-per-tile kernel")


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
def test_gpu_back_to_back_calls_graph_replays_and_two_streams():
    (m, n, k), dtype = BACK_TO_BACK, torch.bfloat16
    kernel = _kernel(m, n, k, dtype, None, None)
    inputs, outs = assert_gemm_back_to_back(kernel, m, n, k, dtype)
    assert_gemm_two_streams(kernel, inputs, outs)  # the kernel keeps no state between calls
    assert_gemm_graph_replays(kernel, inputs, outs[:4])
