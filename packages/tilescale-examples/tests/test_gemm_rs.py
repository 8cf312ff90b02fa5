"""GEMM + reduce-scatter on the CPU: reference, generated CUDA of both kernels, nvcc
compiles, argument checks and the plan choice. The GPU runs are in ``test_overlap_gpu.py``."""

from __future__ import annotations

import pytest
import tilelang
import torch
from examples_helpers import (CpuAllocator, gemm_fused_on_one_rank, gemm_heap_bytes_per_plan, gemm_sequential_on_cpu,
                              kernel_body, lower_source, needs_nvcc, rejects_before_allocating)

from tilescale_examples.base import TARGET
from tilescale_examples import ClosedError
from tilescale_examples.overlap.gemm_rs import (GemmReduceScatter, build_gemm_rs_kernel, build_reduce_kernel, heap_bytes,
                                        partial_magnitudes, torch_reference)


def test_torch_reference_sums_the_owned_rows_of_every_rank():
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(6, 4, generator=g) for _ in range(3)]  # world 3, m_local 2
    b = [torch.randn(4, 5, generator=g) for _ in range(3)]
    full = sum(x @ y for x, y in zip(a, b))
    inputs = list(zip(a, b))  # every rank's (a, b)
    for r in range(3):
        assert torch.allclose(torch_reference(inputs, r), full[2 * r:2 * r + 2], atol=1e-6)
        assert torch.equal(GemmReduceScatter.torch_reference(inputs, r), torch_reference(inputs, r))
        assert torch.allclose(partial_magnitudes(a, b, r), sum((x @ y).abs() for x, y in zip(a, b))[2 * r:2 * r + 2])
    with pytest.raises(ValueError, match="one \\(a, b\\) pair per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        torch_reference(inputs, 3)


def test_generated_gemm_pushes_each_tile_to_its_owner_then_signals():
    m_local, k, n, W = 512, 256, 512, 4
    body = kernel_body(lower_source(build_gemm_rs_kernel(m_local, k, n, W)))
    assert "int me = tilescale::get_rank();" in body
    # owner = (me + 1 + by // U) % W with U = 4 row blocks per rank: next ranks first, own last
    assert "((((int)blockIdx.y) >> 2) + me) + 1) & 3)" in body
    loop_end = body.rindex("mbarrier[((kk_1 % 3) + 3)].arrive();")
    epilogue = body[loop_end:]
    stage = epilogue.index("ptx_stmatrix")  # fragment -> shared (rounded to the dtype)
    remap = epilogue.index("tilescale::remap_ptr(Partials,")
    store = epilogue.index("tilescale::store_vec16((&(((bfloat16_t*)v)[")  # 16-byte stores into the owner's heap
    fence = epilogue.index("tilescale::fence_sys();")
    notify = epilogue.index("tilescale::notify<true>((&(Counters[me]))")  # release add of 1
    assert stage < remap < store < fence < notify
    assert "__sync_thread_partial" in epilogue[store:fence]  # every thread's stores before the signal
    # slot partials[epoch % 2, me] on the owner
    assert "parity = ((int)((Calls[0] + (uint)1) & (uint)1));" in body  # the call's buffer, from the device
    assert f"(((int64_t)parity) * (int64_t){W * m_local * n})" in epilogue[store:fence]
    assert f"(((int64_t)me) * (int64_t){m_local * n})" in epilogue[store:fence]
    assert "wait_until" not in body  # the GEMM never waits


def test_generated_reduction_sums_in_rank_order_in_float32():
    m_local, n, W = 256, 256, 3
    body = kernel_body(lower_source(build_reduce_kernel(m_local, n, W, "float16")))
    assert "wait_until" not in body  # launched after the stream waits
    assert body.count("tilescale::") == 1 and "tilescale::fence_gpu();" in body  # before advancing the call count
    assert "parity = ((int)((Calls[0] + (uint)1) & (uint)1));" in body  # call Calls[0] + 1, from the device
    # the last block of the call (Calls[1] counts finished blocks) takes the call's tiles off
    # every counter (2 x 1 tiles of 128 x 256 per source: -2 mod 2**32), then advances Calls[0]
    tail = body[body.index("done = AtomicAddRet((&(Calls[1])), (uint)1);"):]
    assert tail.count("if (done == (uint)1) {") == 4
    assert tail.index("AtomicAdd((&(Counters[src])), (uint)4294967294);") < tail.index("Calls[1] = (uint)0;") \
        < tail.index("tilescale::fence_gpu();") < tail.index("Calls[0] = (Calls[0] + (uint)1);")
    # partials of src 0, 1, 2 of parity epoch % 2, loaded as 16-byte vectors in that order
    loads = [body.index(f"condval{suffix} = *(uint4*)(Partials") for suffix in ("", "_1", "_2")]
    assert loads == sorted(loads)
    assert f"(((int64_t)parity) * (int64_t){W * m_local * n})" in body
    assert f"+ (int64_t){m_local * n}));" in body and f"+ (int64_t){2 * m_local * n}));" in body
    # (p0 + p1) + p2 in float32, one rounding to float16
    first, second = body.index("__3.x = (__4.x+__5.x);"), body.index("__2.x = (__3.x+__6.x);")
    assert first < second and body.count("__half22float2") == 3 * 2
    assert "__float22half2_rn(((float2*)(&__2))[0])" in body


@needs_nvcc
@pytest.mark.parametrize("world", [1, 3])
def test_both_kernels_compile_for_sm90a(world, tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    for func in (build_gemm_rs_kernel(256, 128, 256, world, "bfloat16"), build_reduce_kernel(256, 256, world, "bfloat16")):
        kernel = tilelang.compile(func, target=TARGET, execution_backend="tvm_ffi")
        assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


def test_auto_plan_on_cpu_falls_back_to_sequential_with_a_log_line(compiles, caplog):
    _, grs = gemm_sequential_on_cpu(GemmReduceScatter, "float16", caplog)
    assert compiles == ["reducescatter", "gemm_tma_store"]
    assert grs.output is grs.reduce_scatter.output and grs.output.shape == (256, 256)
    assert grs.flops() == 2.0 * 512 * 256 * 128
    with pytest.raises(ValueError, match=r"a has shape \(256, 128\), expected \(world_size \* m_local, k\) = \(512, 128\)"):
        grs.check_inputs(torch.zeros(256, 128, dtype=torch.float16), torch.zeros(128, 256, dtype=torch.float16))
    grs.close()
    assert grs.closed and grs.reduce_scatter is None
    with pytest.raises(ClosedError, match="GemmReduceScatter is closed"):
        grs(torch.zeros(512, 128, dtype=torch.float16), torch.zeros(128, 256, dtype=torch.float16))


def test_fused_plan_allocates_double_partials_and_counters(compiles, fused_available):
    alloc = CpuAllocator(num_ranks=4, rank=1)
    grs = GemmReduceScatter(alloc, 256, 128, 512, torch.bfloat16)
    assert grs.algorithm == "fused" and grs.tiles_per_rank == 2 * 2
    assert alloc.allocations == [((2, 4, 256, 512), torch.bfloat16), ((4,), torch.uint32)]
    assert int(grs.counters.sum()) == 0
    assert compiles == ["gemm_rs", "reduce_partials"]
    assert grs.output.shape == (256, 512)


def test_fused_plan_on_one_rank_is_the_gemm_alone(compiles, fused_available):
    assert gemm_fused_on_one_rank(GemmReduceScatter, torch.float16, compiles).reduce_kernel is None


test_constructor_rejects_before_allocating = rejects_before_allocating(
    GemmReduceScatter, dict(m_local=128, k=64, n=256, dtype=torch.float16), [
    (dict(dtype="float32"), TypeError, "dtype must be one of"),
    (dict(m_local=192), ValueError, "GemmReduceScatter: m_local=192 is not a multiple of block_m=128"),
    (dict(k=96), ValueError, "GemmReduceScatter: k=96 is not a multiple of block_k=64"),
    (dict(n=100), ValueError, "GemmReduceScatter: n=100 is not a multiple of block_n=256"),
    (dict(block_k=0), ValueError, "block_k must be a positive int"),
    (dict(algorithm="fused"), RuntimeError, "algorithm='fused' needs stream memory operations"),
    (dict(allocator=None), TypeError, "allocator must be a tilescale-core allocator"),
])


def test_heap_bytes_is_the_larger_plan_of_a_dry_run(compiles, request):
    assert heap_bytes(2, 4096, 3584) >= 2 * 2 * 4096 * 3584 * 2  # the module's 0.1.0 function: a dry run too
    request.getfixturevalue("fused_available")  # from here on
    sizes = gemm_heap_bytes_per_plan(GemmReduceScatter, (128, 64, 256, torch.float16), 2)
    assert heap_bytes(2, 128, 256, torch.float16, max_blocks=128) == max(sizes.values())
