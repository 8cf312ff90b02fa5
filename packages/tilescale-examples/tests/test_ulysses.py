"""The Ulysses all-to-all (tilescale_examples.sequence.ulysses): reference, generated CUDA, nvcc
compile, the object on a CPU stand-in and argument checks on the CPU; the result on 1, 2 and 4
ranks sharing one GPU (``-m gpu``): both directions, shapes whose rows are not a multiple of
the chunk, poisoned outputs, a round trip, 200 back-to-back calls with stragglers, CUDA graph
replays, and two instances at once (one on a side stream), every element compared with the
torch reference."""

from __future__ import annotations

import pytest
import tilelang
import torch
from examples_helpers import (CpuAllocator, LaunchRecorder, close_rank_heap, kernel_body, lower_source, needs_nvcc,
                              expect_checks, gpu_rank_test, open_rank_heap, rejects_before_allocating,
                              side_stream_beside)

from tilescale_examples import ClosedError
from tilescale_examples.base import TARGET, plan_chunks
from tilescale_examples.sequence.ulysses import UlyssesAllToAll, build_ulysses_kernel, torch_reference


def _local_inputs(W, B=2, S=8, H=4, D=3, direction="seq_to_head"):
    """Every rank's input with each element naming (rank, b, position, head, channel)."""
    SP, HP = S // W, H // W
    xs = []
    for p in range(W):
        b, s, h, d = torch.meshgrid(torch.arange(B), torch.arange(S), torch.arange(H), torch.arange(D), indexing="ij")
        full = b * 10**6 + s * 10**4 + h * 100 + d  # the global tensor (B, S, H, D), same on every rank
        xs.append(full[:, p * SP:(p + 1) * SP] if direction == "seq_to_head" else full[:, :, p * HP:(p + 1) * HP])
    return xs, full


@pytest.mark.parametrize("W", [1, 2, 4])
def test_torch_reference_is_the_layout_change(W):
    xs, full = _local_inputs(W)
    HP, SP = 4 // W, 8 // W
    for r in range(W):
        assert torch.equal(torch_reference(xs, r), full[:, :, r * HP:(r + 1) * HP])
    heads = [full[:, :, p * HP:(p + 1) * HP] for p in range(W)]
    for r in range(W):
        assert torch.equal(torch_reference(heads, r, "head_to_seq"), full[:, r * SP:(r + 1) * SP])
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\)"):
        torch_reference(xs[:1], 1)
    with pytest.raises(ValueError, match="direction must be one of"):
        torch_reference(xs, 0, "sideways")


@pytest.mark.parametrize("direction", ["seq_to_head", "head_to_seq"])
@pytest.mark.parametrize("W, B, S, H, D, chunk", [(1, 2, 6, 3, 4, 4), (2, 3, 10, 4, 2, 2), (2, 3, 10, 4, 2, 7),
                                                  (4, 1, 8, 8, 3, 1), (2, 4, 4, 2, 2, 3), (2, 4, 4, 2, 2, 8)])
def test_the_kernels_strided_copies_make_the_reference(direction, W, B, S, H, D, chunk):
    """The exchange emulated with the kernel's own arithmetic (block ``(c, p)`` of rank ``me``
    splits its chunk's rows at batch entries, :func:`batch_segment`, and copies each piece as
    rows of ``HP * D`` elements, ``H * D`` apart on the sequence-sharded side and ``HP * D`` on
    the head-sharded one, from the offsets of its first row) gives the reference on every
    rank, for chunks shorter and longer than a batch entry's rows."""
    from tilescale_examples.sequence.ulysses import (batch_segment, batch_segments, head_sharded_offset,
                                                     seq_sharded_offset)

    SP, HP, ROW, R = S // W, H // W, H // W * D, B * S // W
    chunks = -(-R // chunk)
    xs, _ = _local_inputs(W, B, S, H, D, direction)
    outs = [torch.full((xs[0].numel(),), -1, dtype=xs[0].dtype) for _ in range(W)]
    for me in range(W):
        flat = xs[me].reshape(-1)
        for p in range(W):
            for c in range(chunks):
                first, end = c * chunk, min(c * chunk + chunk, R)
                for k in range(batch_segments(B, chunk, SP)):
                    lo, hi = batch_segment(first, end, k, SP)
                    if direction == "seq_to_head":
                        src, dst = seq_sharded_offset(lo, p, H, HP, D), head_sharded_offset(lo, me, S, SP, HP, D)
                        src_stride, dst_stride = H * D, ROW
                    else:
                        src, dst = head_sharded_offset(lo, p, S, SP, HP, D), seq_sharded_offset(lo, me, H, HP, D)
                        src_stride, dst_stride = ROW, H * D
                    for i in range(hi - lo):
                        at, to = src + i * src_stride, dst + i * dst_stride
                        assert (outs[p][to:to + ROW] == -1).all(), "a row written twice"
                        outs[p][to:to + ROW] = flat[at:at + ROW]
    for p in range(W):
        want = torch_reference(xs, p, direction)
        assert torch.equal(outs[p].view(want.shape), want), (p, direction)


def test_batch_segments_cover_a_chunk_once():
    from tilescale_examples.sequence.ulysses import batch_segment, batch_segments

    for B, SP in ((1, 5), (3, 4), (5, 1), (4, 7)):
        R = B * SP
        for chunk in range(1, R + 1):
            n = batch_segments(B, chunk, SP)
            assert n <= B
            for first in range(0, R, chunk):
                end = min(first + chunk, R)
                pieces = [batch_segment(first, end, k, SP) for k in range(n)]
                rows = [r for lo, hi in pieces for r in range(lo, hi)]
                assert rows == list(range(first, end)), (B, SP, chunk, first, pieces)
                assert all(lo // SP == (hi - 1) // SP for lo, hi in pieces if lo < hi)  # one batch entry each


def _source(direction, B=2, S=1000, H=16, D=64, W=4, threads=256):
    C, CH = plan_chunks(B * S // W, H // W * D * 2, W, 32, 4096)
    return kernel_body(lower_source(build_ulysses_kernel(B, S, H, D, W, "bfloat16", direction, C, CH, threads))), C, CH


def test_generated_cuda_puts_each_row_in_its_place():
    body, C, CH = _source("seq_to_head")
    assert "ulysses_seq_to_head_kernel(" in body
    # a chunk of 63 rows touches at most 2 of the 250-row batch entries: one strided copy each
    assert (C, CH) == (8, 63) and "for (int k = 0; k < 2; ++k) {" in body
    put = body[body.index("tilescale::put_rows_block<8>("):]
    put = put[:put.index(";")]
    # rows of HP * D = 256 elements (512 bytes), to rank p = blockIdx.y; from heads [p HP, (p+1)
    # HP) of the segment's first row lo (lo * H * D + p * 256; rows H * D = 1024 elements = 2048
    # bytes apart), to position me * SP + lo % SP of batch entry lo / SP on p (S * HP * D =
    # 256000 elements per batch entry, SP * HP * D = 64000 per rank; rows 512 bytes apart)
    assert put.endswith(", (uint64_t)512, (uint64_t)2048, (uint64_t)512, ((int)blockIdx.y))")
    assert "(((int64_t)lo) * (int64_t)1024) + (((int64_t)((int)blockIdx.y)) * (int64_t)256))])), (&(Out[" in put
    assert "/ (int64_t)250) * (int64_t)256000)" in put and "(((int64_t)me) * (int64_t)64000))" in put
    assert "% (int64_t)250) * (int64_t)256))" in put and "checked_count((hi - lo)" in put
    # the all-gather's protocol: ready signal and wait, a barrier after the puts, the data
    # signal (a release) and its acquire wait, the call counter on the device
    assert body.count("tilescale::signal_op<true>(") == 2 and body.count("tilescale::wait_until<") == 2
    assert body.count("__syncthreads();") == 2 and "State[" in body
    other, _, _ = _source("head_to_seq")
    assert "ulysses_head_to_seq_kernel(" in other
    put = other[other.index("tilescale::put_rows_block<8>("):]
    put = put[:put.index(";")]
    # the inverse: from positions [p SP, (p+1) SP) of this rank's heads (rows 512 bytes apart),
    # to heads [me HP, ...) on p (rows 2048 bytes apart)
    assert "(((int64_t)((int)blockIdx.y)) * (int64_t)64000))" in put
    assert "(&(Out[((((int64_t)lo) * (int64_t)1024) + (((int64_t)me) * (int64_t)256))])" in put
    assert put.endswith(", (uint64_t)512, (uint64_t)512, (uint64_t)2048, ((int)blockIdx.y))")



@pytest.mark.parametrize("direction", ["seq_to_head", "head_to_seq"])
def test_one_rank_moves_the_rows_without_flags(direction):
    """World 1: the same strided row copies (into this rank's own output), then the call count;
    no handshake, no signal, no wait, no barrier, and no flags parameter."""
    body, C, CH = _source(direction, W=1)
    put = body.index("tilescale::put_rows_block<8>(")
    assert put < body.index("State[((int)blockIdx.x)] = epoch;")
    rows = ", (uint64_t)2048, (uint64_t)2048, (uint64_t)2048, 0)"  # whole rows of H * D, to rank 0
    assert body[put:body.index(";", put)].endswith(rows)
    for absent in ("Flags", "signal", "wait_until", "__syncthreads"):
        assert absent not in body, absent

def test_kernel_rejects_a_plan_that_does_not_tile_the_rows():
    with pytest.raises(ValueError, match="does not tile the 500 rows"):
        build_ulysses_kernel(2, 1000, 16, 64, 4, "bfloat16", "seq_to_head", 3, 100)
    with pytest.raises(ValueError, match="direction must be one of"):
        build_ulysses_kernel(2, 1000, 16, 64, 4, "bfloat16", "up", 5, 100)


@needs_nvcc
def test_real_compile_to_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    B, S, H, D = 1, 4096, 32, 128
    for W, direction in ((4, "seq_to_head"), (4, "head_to_seq"), (1, "seq_to_head")):  # one rank: no flags
        C, CH = plan_chunks(B * S // W, H // W * D * 2, W, 132, 64 * 1024)
        kernel = tilelang.compile(build_ulysses_kernel(B, S, H, D, W, "bfloat16", direction, C, CH), target=TARGET,
                                  execution_backend="tvm_ffi")
        assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


@needs_nvcc
def test_object_on_cpu_allocator(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    alloc = CpuAllocator(num_ranks=2)
    op = UlyssesAllToAll(alloc, (2, 4, 4, 16), "float16", threads=64, min_chunk_bytes=64)
    assert (op.input_shape, op.output_shape) == ((2, 4, 4, 16), (2, 8, 2, 16))
    assert (op.batch, op.seq_len, op.num_heads, op.head_dim, op.algorithm) == (2, 8, 4, 16, "sm")
    assert (op.chunks, op.chunk) == (8, 1)  # 8 rows of 64 bytes, 64-byte pieces: one row each
    assert alloc.allocations == [((2, 4, 4, 16), torch.float16), ((2, 8, 2, 16), torch.float16),
                                 ((2 * 2 * op.chunks,), torch.uint64)]
    assert not op.flags.ne(0).any() and op.bus_bytes() == 0.5 * 2 * 4 * 4 * 16 * 2
    assert repr(op).startswith("UlyssesAllToAll(shape=(2, 4, 4, 16), direction='seq_to_head', dtype=torch.float16")
    launched = []
    op.kernel = LaunchRecorder(launched)
    with pytest.raises(ValueError, match=r"input has shape \(2, 8, 2, 16\), expected the shape \(2, 4, 4, 16\)"):
        op(torch.zeros(2, 8, 2, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="input has dtype torch.float32"):
        op(torch.zeros(2, 4, 4, 16))
    with pytest.raises(ValueError, match=r"out has shape \(2, 4, 4, 16\), expected the output shape \(2, 8, 2, 16\)"):
        op(torch.zeros(2, 4, 4, 16, dtype=torch.float16), out=torch.zeros(2, 4, 4, 16, dtype=torch.float16))
    assert launched == []
    x = torch.randn(2, 4, 4, 16).half()
    assert op(x) is op.output and launched[0][0].data_ptr() == x.data_ptr() and launched[0][3] is op.state
    assert op.epoch == 1
    back = UlyssesAllToAll(alloc, (2, 8, 2, 16), "float16", direction="head_to_seq", threads=64)
    assert (back.input_shape, back.output_shape) == ((2, 8, 2, 16), (2, 4, 4, 16))
    assert (back.batch, back.seq_len, back.num_heads, back.head_dim) == (2, 8, 4, 16)
    op.close()
    assert op.output is None and op.closed
    with pytest.raises(ClosedError, match="UlyssesAllToAll is closed"):
        op(x)


test_constructor_rejects_before_allocating = rejects_before_allocating(
    UlyssesAllToAll, dict(shape=(2, 4, 4, 16), dtype=torch.float16), [
    (dict(shape=(2, 4, 3, 16)), ValueError, r"shape\[2\] \(the heads\) = 3 is not a multiple of world_size=2"),
    (dict(shape=(2, 7, 2, 16), direction="head_to_seq"), ValueError,
     r"shape\[1\] \(the sequence\) = 7 is not a multiple of world_size=2"),
    (dict(shape=(2, 4, 4)), ValueError, r"shape must be \(batch, positions, heads, head_dim\)"),
    (dict(shape=(2, 0, 4, 16)), ValueError, "shape must be non-empty positive ints"),
    (dict(direction="sideways"), ValueError, "direction must be one of"),
    (dict(algorithm="ce"), ValueError, "algorithm must be one of"),
    (dict(dtype=torch.bool), TypeError, "dtype must be one of"),
    (dict(world_size=4), ValueError, r"world_size=4 but the allocator spans 2 rank\(s\)"),
    (dict(min_chunk_bytes=0), ValueError, "min_chunk_bytes must be"),
    (dict(threads=48), ValueError, "threads"),
    (dict(num_ranks=4, shape=(2, 4, 6, 16)), ValueError, "= 6 is not a multiple of world_size=4"),
    (dict(num_ranks=4, shape=(2, 4, 8, 16)), None, None),
])


# ------------------------------------------------------------------------------ the benchmark
def test_benchmark_without_gpu_bad_arguments_and_goal(monkeypatch, capsys):
    from examples_helpers import exits_naming, output_without_gpu

    from tilescale_examples.benchmarks import BENCHMARKS, ulysses

    assert "ulysses" in BENCHMARKS
    assert output_without_gpu(ulysses.main, [], monkeypatch, capsys) == (
        "ulysses benchmark: no CUDA GPU visible, nothing to measure\n")
    exits_naming(ulysses.main, ["--ranks", "0"], "--ranks must be in [1, 64]", capsys)
    exits_naming(ulysses.main, ["--ranks", "3"], "every --seq and --heads a multiple of every --ranks", capsys)
    for argv in (["--threads", "100"], ["--threads", "2048"], ["--min-chunk-kib", "0"]):
        exits_naming(ulysses.main, argv, "--threads must be a multiple of 32 in [32, 1024] and --min-chunk-kib >= 1",
                     capsys)
    rows = {1: [[1, 4096, "seq_to_head", 10.0, 9.5, 30.0, 0.95, 3.0, 132, "ok"]],
            4: [[4, 4096, "head_to_seq", 10.0, 8.0, 30.0, 0.8, 3.0, 128, "ok"]]}
    assert ulysses.goal_lines(rows) == ["worst copy/ulysses: 0.800 (goal >= 0.9)"]
    assert ulysses.goal_lines({})[0].endswith("not measured")


@pytest.mark.parametrize("W", [1, 2, 4])
def test_benchmark_torch_path_makes_the_output_layout(W):
    """The torch path's layout changes, with its exchange a local copy: the output layout's
    shape at every rank count, and the reference itself at one rank (where the copy is the
    whole exchange)."""
    from tilescale_examples.benchmarks.ulysses import torch_path

    B, S, H, D = 2, 8, 4, 3
    xs, full = _local_inputs(W, B, S, H, D)
    got = torch_path(xs[0], W, "seq_to_head")
    assert got.shape == (B, S, H // W, D)
    if W == 1:
        assert torch.equal(got, torch_reference(xs, 0))
    heads, _ = _local_inputs(W, B, S, H, D, "head_to_seq")
    back = torch_path(heads[0], W, "head_to_seq")
    assert back.shape == (B, S // W, H, D)
    if W == 1:
        assert torch.equal(back, torch_reference(heads, 0, "head_to_seq"))


# ------------------------------------------------------------------------------ GPU
#: (batch, seq_len, num_heads, head_dim, dtype) of the GPU cases (all ranks together): a small
#: odd shape, a long-context one, heads of 64 channels in float32.
GPU_CASES = [(1, 8 * 3, 4, 8, torch.float16), (2, 4096, 32, 128, torch.bfloat16), (3, 40, 8, 64, torch.float32)]
STEPS = 4


def _gathered(x, world):
    """Every rank's ``x`` (device tensors: gloo and NCCL both gather them)."""
    import torch.distributed as dist

    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x.contiguous())
    return every


def _check(out, x, rank, world, direction, where):
    want = torch_reference(_gathered(x, world), rank, direction)
    if not torch.equal(out, want):
        bad = (out != want).nonzero()[:5].tolist()
        raise AssertionError(f"rank {rank}/{world} {where}: first mismatches at {bad}")


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank and case: both directions on fresh data with poisoned outputs (heap and plain
    inputs), a round trip, 200 back-to-back calls with a straggler every 50, graph replays, two
    instances at once (one on a side stream)."""
    alloc = open_rank_heap(rank, world, cache_dir, 2**30)
    dev = torch.device(alloc.device)
    checks = 0
    for case, (B, S, H, D, dtype) in enumerate(GPU_CASES):
        pre = UlyssesAllToAll(alloc, (B, S // world, H, D), dtype, min_chunk_bytes=4096)
        post = UlyssesAllToAll(alloc, (B, S, H // world, D), dtype, direction="head_to_seq", min_chunk_bytes=4096)
        g = torch.Generator().manual_seed(rank * 1000003 + case * 7919)
        for step in range(STEPS):
            x = torch.randn(pre.input_shape, generator=g).to(dtype).to(dev)
            pre.output.fill_(float("nan"))
            post.output.fill_(float("nan"))
            if step % 2:
                pre.input.copy_(x)
            heads = pre(pre.input if step % 2 else x)
            torch.cuda.synchronize()
            _check(heads, x, rank, world, "seq_to_head", f"case {case} step {step}")
            back = post(heads.clone())
            torch.cuda.synchronize()
            if not torch.equal(back, x):
                raise AssertionError(f"rank {rank}/{world} case {case} step {step}: round trip differs")
            checks += 2
        # back-to-back calls: the handshake orders them; a straggling rank every 50 calls
        x = torch.randn(pre.input_shape, generator=g).to(dtype).to(dev)
        for call in range(200):
            if call % 50 == 0 and rank == (call // 50) % world:
                torch.cuda._sleep(2_000_000)
            out = post(pre(x).clone())
        torch.cuda.synchronize()
        if not torch.equal(out, x):
            raise AssertionError(f"rank {rank}/{world} case {case}: 200 back-to-back round trips differ")
        checks += 1
        # one captured round trip, replayed on fresh inputs copied in
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = post(pre(pre.input))
        for replay in range(3):
            x = torch.randn(pre.input_shape, generator=g).to(dtype).to(dev)
            pre.input.copy_(x)
            post.output.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _check(pre.output, x, rank, world, "seq_to_head", f"case {case} replay {replay}")
            if not torch.equal(captured, x):
                raise AssertionError(f"rank {rank}/{world} case {case} replay {replay}: round trip differs")
            checks += 1
        # two instances at once: pre on a side stream, a second seq_to_head op on the current stream
        other = UlyssesAllToAll(alloc, (B, S // world, H, D), dtype, min_chunk_bytes=4096)
        xa = torch.randn(pre.input_shape, generator=g).to(dtype).to(dev)
        xb = torch.randn(pre.input_shape, generator=g).to(dtype).to(dev)
        pre.output.fill_(float("nan"))
        other.output.fill_(float("nan"))
        checks += side_stream_beside(lambda: pre(xa), lambda: other(xb),
                                     (lambda: _check(pre.output, xa, rank, world, "seq_to_head",
                                                     f"case {case} side stream"),
                                      lambda: _check(other.output, xb, rank, world, "seq_to_head",
                                                     f"case {case} second instance")))
        other.close()
        pre.close()
        post.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, 4, timeout=400, cache="ulysses")
def test_ulysses_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) * (2 * STEPS + 1 + 3 + 2))
