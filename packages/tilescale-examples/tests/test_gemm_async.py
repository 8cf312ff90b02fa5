"""The async-WGMMA GEMM (:mod:`tilescale_examples.overlap.gemm_async`), the library GEMM's
TMA-store epilogue (``build_gemm_kernel(..., store="tma")``) and the GEMM benchmark
(:mod:`tilescale_examples.benchmarks.gemm`).

CPU: the register budgets; the generated CUDA (a producer warpgroup giving its registers back
and issuing the TMA loads after waiting for an empty stage, compute warpgroups keeping one
WGMMA group in flight and releasing the previous step's stage, barrier counts, no implicit
wait of every step; the TMA-store epilogue's tile over the free stages, stmatrix, the TMA
store); nvcc compiles without spills; argument errors; the benchmark's argument errors, its
columns and goal lines.

GPU (``gpu``): against the float32 reference with fresh random data and poisoned outputs, at
the benchmark's shapes and at small ones (one ``k`` step, fewer steps than stages, one compute
warpgroup, float16, a rasterized grid); bit-identical repeated calls; 200 back-to-back calls;
CUDA-graph replays with fresh inputs; the same bits as stock TileLang's GEMM of the same tiles
(both add each ``k`` step's products into one float32 accumulator in ``k`` order); the
TMA-store epilogue at the same cases, the same bits as the direct store.
"""

import re
from dataclasses import replace

import pytest
import torch
from examples_helpers import (assert_gemm_back_to_back, assert_gemm_graph_replays, assert_gemm_matches, assert_gemm_two_streams,
                             exits_naming, in_order, kernel_body, lower_source, needs_nvcc, nvcc_resources, output_without_gpu)

from pipeline_model import simulate

from tilescale_examples.overlap.gemm import DTYPES, GemmTiles, build_gemm_kernel, default_swizzle
from tilescale_examples.overlap.gemm_async import consumer_registers

#: The benchmark's default tiles, with the async pipeline.
TILES = GemmTiles(num_stages=4, pipeline="async")


def build_async_gemm_kernel(m, n, k, dtype="bfloat16", tiles=None):
    """The library GEMM with ``tiles`` (default :data:`TILES`) on the async pipeline."""
    return build_gemm_kernel(m, n, k, dtype, replace(tiles or TILES, pipeline="async"))


def test_register_budgets_fit_the_sm():
    assert consumer_registers(256) == 232 and consumer_registers(128) == 232
    assert consumer_registers(384) == 152 and consumer_registers(512) == 112
    for threads in (128, 256, 384, 512, 768, 896):
        assert 128 * 40 + threads * consumer_registers(threads) <= 65536


def test_the_pipeline_keeps_one_wgmma_group_in_flight():
    src = kernel_body(lower_source(build_async_gemm_kernel(1024, 3584, 8192, "bfloat16", TILES)))
    assert "__launch_bounds__(384, 1)" in src
    assert "warpgroup_reg_dealloc<40>" in src and "warpgroup_reg_alloc<232>" in src
    assert src.count(".init(32)") == 4 and src.count(".init(256)") == 4  # four stages: full, empty
    producer, consumer = src.split("warpgroup_reg_alloc<232>")
    # Producer: wait for an empty stage (the first lap passes at once), expect its bytes, load.
    assert re.search(r"empty\[\(kk & 3\)\]\.wait\(\(\(\(kk >> 2\) & 1\) \^ 1\)\)", producer)
    assert producer.count("tma_load(A_desc") == 1 and producer.count("tma_load(B_desc") == 1
    assert "expect_transaction" in producer and "full[(kk & 3)].arrive()" in producer
    # Consumers: wait for a full stage, issue, wait for the previous group, release its stage.
    loop = consumer[consumer.index("for (int kk"):]
    order = [loop.index(s) for s in ("full[(kk_1 & 3)].wait", "wgmma_ss", "warpgroup_commit_batch", "wait_wgmma<1>",
                                     "empty[((kk_1 + 3) & 3)].arrive()", "wait_wgmma<0>", "empty[3].arrive()")]
    assert order == sorted(order)
    assert "warpgroup_wait<0>" not in consumer  # T.gemm's wait after every step is gone
    # After the last wait, the accumulator's registers are fenced: no read of them moves above it.
    assert "wait_wgmma<0>();\n    tl::warpgroup_fence_operand(reinterpret_cast<float*>(C_f + 0), 128);" in consumer


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 33])
def test_the_protocol_reads_every_step_once_in_order_and_never_deadlocks(stages, steps):
    import random

    rng = random.Random(stages * 100 + steps)
    for _ in range(50):
        assert simulate(stages, [steps], rng) == list(range(steps))


def test_one_stage_would_deadlock():  # why GemmTiles refuses it
    import random

    with pytest.raises(AssertionError, match="deadlock"):
        simulate(1, [3], random.Random(0))


def test_small_tiles_and_fewer_steps_than_stages_lower():
    src = kernel_body(lower_source(build_async_gemm_kernel(256, 512, 128, "float16", GemmTiles(64, 128, 64, 3, 128))))
    assert "__launch_bounds__(256, 1)" in src and "wait_wgmma<1>" in src and src.count(".init(128)") == 3
    wide = kernel_body(lower_source(build_async_gemm_kernel(256, 28672, 64, "bfloat16", GemmTiles(swizzle=8))))
    assert "blockIdx = tl::rasterization2DRow<8>()" in wide  # the grid order of build_gemm_kernel's


def test_the_overlapped_gemms_fused_kernels_take_the_async_pipeline():
    from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel
    from tilescale_examples.overlap.gemm_rs import build_gemm_rs_kernel

    ag = kernel_body(lower_source(build_ag_gemm_kernel(1024, 8192, 3584, 2, 4, "bfloat16", TILES)))
    # The chunk's flag is waited for by every thread of the block (a barrier) before the roles split.
    assert in_order(ag, "wait_until<", "__syncthreads()", "fence_proxy_async", "threadIdx.x) < 128", "wait_wgmma<1>",
                     "wait_wgmma<0>", "Out + ")
    assert "__launch_bounds__(384, 1)" in ag
    rs = kernel_body(lower_source(build_gemm_rs_kernel(1024, 8192, 3584, 2, "bfloat16", replace(TILES, num_stages=3))))
    _, consumer = rs.split("warpgroup_reg_alloc<232>")
    # The epilogue on the compute threads: its barrier is theirs (named, 256 threads), thread 128 signals.
    assert in_order(consumer, "wait_wgmma<0>", "store_vec16", "__sync_thread_partial(1, 256)", "threadIdx.x) == 128",
                     "fence_sys", "notify<true>")
    assert "__syncthreads" not in consumer


def test_the_persistent_kernels_refuse_the_async_pipeline():
    from tilescale_examples.decode.gemm_ar_kernel import build_gemm_ar_kernel
    from tilescale_examples.overlap.stream_k import StreamKGemm, build_stream_k_gemm

    for call in (lambda: build_stream_k_gemm(256, 512, 128, "bfloat16", TILES, 4),
                 lambda: StreamKGemm(256, 512, 128, tiles=TILES),
                 lambda: build_gemm_ar_kernel(16, 1024, 2048, 2, "bfloat16", TILES)):
        with pytest.raises(ValueError, match="pipeline='async' is not available for this persistent kernel"):
            call()


def test_the_sync_pipeline_is_stock_tilelangs():
    src = kernel_body(lower_source(build_gemm_kernel(1024, 3584, 8192, "bfloat16", replace(TILES, pipeline="sync"))))
    assert "__launch_bounds__(384, 1)" in src and "warpgroup_wait<0>" in src and "wait_wgmma<1>" not in src


@needs_nvcc
def test_kernel_compiles_without_spills(tmp_path):
    from tilescale_examples.overlap.ag_gemm import build_ag_gemm_kernel
    from tilescale_examples.overlap.gemm_rs import build_gemm_rs_kernel

    for func in (build_async_gemm_kernel(4096, 28672, 8192, "bfloat16", GemmTiles(num_stages=4, swizzle=8)),
                 build_async_gemm_kernel(256, 512, 128, "float16", GemmTiles(64, 128, 64, 3, 128)),
                 build_ag_gemm_kernel(1024, 8192, 3584, 2, 4, "bfloat16", TILES),
                 build_gemm_rs_kernel(1024, 8192, 3584, 2, "bfloat16", replace(TILES, num_stages=3)),
                 build_gemm_kernel(4096, 3584, 8192, "bfloat16", GemmTiles(num_stages=4), store="tma"),
                 build_gemm_kernel(4096, 3584, 8192, "bfloat16", replace(TILES, num_stages=3), store="tma")):
        regs, spills = nvcc_resources(lower_source(func), tmp_path)
        assert spills == 0, (str(func.attrs["global_symbol"]), regs, spills)


@pytest.mark.parametrize("dims,match", [(dict(m=100), "m=100 is not a multiple of block_m=128"),
                                        (dict(n=300), "n=300 is not a multiple of block_n=256"),
                                        (dict(k=0), "k must be a positive int")])
def test_bad_dimensions_are_named(dims, match):
    args = dict(m=256, n=512, k=128) | dims
    with pytest.raises(ValueError, match=match):
        build_async_gemm_kernel(args["m"], args["n"], args["k"])


def test_one_stage_is_refused():  # the release of a step's stage waits for the next step's load
    with pytest.raises(ValueError, match="num_stages must be >= 2 for the async pipeline"):
        build_async_gemm_kernel(256, 512, 128, tiles=GemmTiles(num_stages=1))


# ------------------------------------------------------------------------------ TMA-store epilogue
def test_the_tma_store_epilogue_stages_the_tile_over_the_free_stages():
    src = kernel_body(lower_source(build_gemm_kernel(4096, 28672, 8192, "bfloat16", GemmTiles(num_stages=4, swizzle=8),
                                                     store="tma")))
    assert "gemm_tma_store_kernel" in src
    # The output tile lies over the pipeline's stages (free once the last WGMMA is waited for).
    assert re.search(r"C_s = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ 0\)\)", src)
    assert in_order(src, "warpgroup_wait<0>", "__sync_thread_partial(3, 256)", "ptx_stmatrix_m8n8_x4",
                     "__sync_thread_partial(3, 256)", "fence_proxy_async", "tma_store(C_desc", "tma_store_wait<0")
    direct = kernel_body(lower_source(build_gemm_kernel(4096, 28672, 8192, "bfloat16", GemmTiles(num_stages=4, swizzle=8))))
    assert "tma_store" not in direct and "stmatrix" not in direct


def test_the_async_tma_store_keeps_its_tile_beside_the_stages():
    from tilescale_examples.overlap.gemm import tma_store_stages

    assert tma_store_stages(GemmTiles()) == 3 and tma_store_stages(GemmTiles(64, 128, 64, 3, 128)) == 8
    src = kernel_body(lower_source(build_gemm_kernel(4096, 3584, 8192, "bfloat16", replace(TILES, num_stages=3),
                                                     store="tma")))
    assert "gemm_async_tma_store_kernel" in src
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    assert sorted(offsets.values(), key=int) == ["0", "98304", "163840"]  # B's 3 stages, C's tile, A's 3 stages
    _, consumer = src.split("warpgroup_reg_alloc<232>")
    # On the compute threads: their own barrier (3, 256 threads), stmatrix, one elected thread's TMA store.
    assert in_order(consumer, "wait_wgmma<0>", "__sync_thread_partial(3, 256)", "ptx_stmatrix_m8n8_x4",
                     "__sync_thread_partial(3, 256)", "tl_shuffle_elect<256>", "tma_store(C_desc", "tma_store_wait<0")
    assert "__syncthreads" not in consumer


@pytest.mark.parametrize("call,match", [
    (lambda: build_gemm_kernel(256, 512, 128, "bfloat16", GemmTiles(), store="fast"), "store must be one of"),
    (lambda: build_gemm_kernel(256, 512, 128, "bfloat16", TILES, store="tma"),
     "num_stages=4 does not fit beside the TMA-store epilogue's 128x256 output tile .* use num_stages <= 3")])
def test_bad_stores_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------ benchmark
def test_benchmark_without_a_gpu_and_its_argument_errors(monkeypatch, capsys):
    from tilescale_examples.benchmarks import gemm as bench

    assert "nothing to measure" in output_without_gpu(bench.main, [], monkeypatch, capsys)
    exits_naming(bench.main, ["--tiles", "128x256"], "--tiles must be", capsys)
    exits_naming(bench.main, ["--n", "300"], "n=300 is not a multiple of block_n=256", capsys)
    exits_naming(bench.main, ["--iters", "0"], "--iters and --rounds must be >= 1", capsys)
    exits_naming(bench.main, ["--kernels", "cublas"], "invalid choice: 'cublas'", capsys)
    exits_naming(bench.main, ["--tiles", "128x256x64:1:256"], "the async and persistent kernels need at least 2 stages", capsys)
    assert "nothing to measure" in output_without_gpu(bench.main, ["--tiles", "128x256x64:1:256", "--kernels", "stock"],
                                                      monkeypatch, capsys)


def test_benchmark_columns_and_goal_lines_follow_the_kernels():
    from tilescale_examples.benchmarks import gemm as bench

    assert bench.headers(["async"]) == ["m", "n", "k", "waves", "matmul TFLOP/s", "async TFLOP/s", "async x matmul",
                                        "check"]
    rows = [[1024, 3584, 8192, 0.85, 700.0, 640.0, 690.0, 0.914, 0.986, "ok"],
            [4096, 3584, 8192, 3.39, 750.0, 650.0, 720.0, 0.867, 0.96, "ok"]]
    assert bench.goal_lines(rows, ["stock", "async"]) == ["worst stock vs torch.matmul: 0.867 (goal >= 0.97)",
                                                          "worst async vs torch.matmul: 0.960 (goal >= 0.97)"]
    assert bench.goal_lines([], ["stream-K"]) == ["worst stream-K vs torch.matmul: not measured"]


def test_benchmark_compiles_what_it_times_in_parallel_first():
    from tilescale_examples.benchmarks import gemm as bench
    from tilescale_examples.testing.precompile import build_job

    jobs = bench.kernel_jobs(["stock", "async", "persistent", "stream-K"], [(1024, 3584, 8192), (4096, 28672, 8192)],
                             "bfloat16", GemmTiles(num_stages=4), 132)
    assert [(b.split(":")[1], a[:3], a[4].swizzle, a[4].pipeline) for b, a, _ in jobs] == [
        ("build_gemm_kernel", (1024, 3584, 8192), 0, "sync"), ("build_gemm_kernel", (1024, 3584, 8192), 0, "async"),
        ("build_persistent_gemm", (1024, 3584, 8192), 0, "async"), ("build_stream_k_gemm", (1024, 3584, 8192), 0, "sync"),
        ("build_gemm_kernel", (4096, 28672, 8192), 8, "sync"), ("build_gemm_kernel", (4096, 28672, 8192), 8, "async"),
        ("build_persistent_gemm", (4096, 28672, 8192), 8, "async"),
        ("build_stream_k_gemm", (4096, 28672, 8192), 0, "sync")]
    assert jobs[2][1][5] == 112 and jobs[6][1][5] == 132  # the persistent grid: no more blocks than tiles
    assert jobs[3][1][5] == 132 and all(p is None for _, _, p in jobs)
    assert str(build_job(*jobs[1][:2]).attrs["global_symbol"]) == "gemm_async"
    assert str(build_job(*jobs[2][:2]).attrs["global_symbol"]) == "gemm_persistent"
    tma = bench.kernel_jobs(["stock-tma", "async-tma", "persistent-tma"], [(1024, 3584, 8192)], "bfloat16",
                            GemmTiles(num_stages=4), 132)
    assert [(a[4].pipeline, a[4].num_stages, a[-1]) for _, a, _ in tma] == [("sync", 4, "tma"), ("async", 3, "tma"),
                                                                            ("async", 3, "tma")]
    assert [str(build_job(*job[:2]).attrs["global_symbol"]) for job in tma] == [
        "gemm_tma_store", "gemm_async_tma_store", "gemm_persistent_tma_store"]
    assert bench.stage_lines(["stock-tma", "async-tma", "persistent"], GemmTiles(num_stages=4)) == [
        "async-tma: 3 stages (the TMA-store epilogue's output tile beside them)"]


# ------------------------------------------------------------------------------ GPU
#: (m, n, k, dtype, tiles) of the GPU cases (tiles None: the benchmark's, rasterized as the ops do).
GPU_CASES = [(1024, 3584, 8192, torch.bfloat16, None),
             (4096, 28672, 1024, torch.bfloat16, None),  # rasterized (112 column blocks)
             (1536, 2816, 512, torch.float16, None),
             (256, 512, 128, torch.float16, GemmTiles(64, 128, 64, 3, 128)),  # one compute warpgroup
             (384, 768, 64, torch.bfloat16, None),  # one k step
             (512, 1024, 192, torch.bfloat16, GemmTiles(128, 128, 64, 4, 256))]  # fewer steps than stages


def _tiles(n, tiles):
    return tiles or GemmTiles(num_stages=4, swizzle=default_swizzle(n, 256))


#: (m, n, k) of the back-to-back test.
BACK_TO_BACK = (1024, 3584, 2048)


@pytest.fixture(scope="module")
def compiled():
    """Every kernel of the GPU tests compiled first, in parallel worker processes (the tests'
    compiles are then cache hits)."""
    from tilescale_examples.overlap.tuning import GEMM_BUILDER
    from tilescale_examples.testing.precompile import precompile

    cases = [(m, n, k, DTYPES[dtype], _tiles(n, tiles)) for m, n, k, dtype, tiles in GPU_CASES]
    cases.append(BACK_TO_BACK + ("bfloat16", _tiles(BACK_TO_BACK[1], None)))
    precompile([(GEMM_BUILDER, case[:4] + (replace(case[4], pipeline=p),), None) for case in cases for p in ("async", "sync")]
               + [(GEMM_BUILDER, case[:4] + (case[4], "tma"), None) for case in cases]
               + [(GEMM_BUILDER, case[:4] + (replace(case[4], pipeline="async", num_stages=min(case[4].num_stages, 3)),
                                             "tma"), None) for case in cases])


#: The kernels checked against stock TileLang's GEMM of the same tiles: the async pipeline (same
#: products in the same k order) and the TMA-store epilogue (the same accumulator, stored another way).
VARIANTS = {"async": lambda m, n, k, dtype, tiles: build_async_gemm_kernel(m, n, k, dtype, tiles),
            "tma-store": lambda m, n, k, dtype, tiles: build_gemm_kernel(m, n, k, dtype, tiles, store="tma"),
            "async-tma-store": lambda m, n, k, dtype, tiles: build_gemm_kernel(
                m, n, k, dtype, replace(tiles, pipeline="async", num_stages=min(tiles.num_stages, 3)), store="tma")}


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c[:4]))
def test_gpu_kernel_matches_the_reference_and_stock_tilelang(case, variant):
    from tilescale_examples.base import compile_once

    m, n, k, dtype, tiles = case
    tiles = _tiles(n, tiles)
    kernel = compile_once(VARIANTS[variant](m, n, k, DTYPES[dtype], tiles))
    stock = compile_once(build_gemm_kernel(m, n, k, DTYPES[dtype], tiles))
    assert_gemm_matches(kernel, stock, m, n, k, dtype, f"{variant}: the same bits as stock TileLang's GEMM")


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
def test_gpu_back_to_back_calls_graph_replays_and_two_streams():
    from tilescale_examples.base import compile_once

    (m, n, k), dtype = BACK_TO_BACK, torch.bfloat16
    kernel = compile_once(build_async_gemm_kernel(m, n, k, DTYPES[dtype], _tiles(n, None)))
    inputs, outs = assert_gemm_back_to_back(kernel, m, n, k, dtype)
    assert_gemm_two_streams(kernel, inputs, outs)
    assert_gemm_graph_replays(kernel, inputs, outs[:4])
