"""The reduction engine on the CPU: the grid plan, the generated CUDA of every mode (16-byte
accesses, the signal/wait protocol in order, the rank-order sum), nvcc compiles within the
register budget, and the reference."""

from __future__ import annotations

import difflib
import re

import pytest
import torch
from examples_helpers import kernel_body, lower_with, needs_nvcc, nvcc_resources

from tilescale_examples.collectives.reduce_engine import (FLAG_STRIDE, MAX_REGISTERS, MODES, PASS_CONFIGS, build_reduce_kernel,
                                              default_unroll, grid, plan_grid, rows_view, torch_reference,
                                              vector_elems)


def source(mode, dtype="float16", world=4, threads=128, unroll=None):
    return kernel_body(lower_with(build_reduce_kernel(mode, dtype, world, threads, unroll), PASS_CONFIGS))


# ------------------------------------------------------------------------------ plan
def test_vectors_and_unroll():
    assert [vector_elems(s) for s in (1, 2, 4, 8)] == [16, 8, 4, 2]
    assert [default_unroll(w) for w in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ValueError, match="itemsize must divide 16"):
        vector_elems(3)


def test_plan_one_shot_two_shot_reduce_scatter():
    p = plan_grid("one_shot", 2048, 2, 2, threads=512, max_blocks=132)  # 4 KiB float16
    assert (p.vec, p.span, p.shards, p.rows_in, p.blocks, p.iters, p.unroll) == (8, 256, 1, 256, 1, 1, 4)
    p = plan_grid("two_shot", 1001, 2, 2, threads=512)  # 126 rows -> 2 shards of 63 (one pad row)
    assert (p.span, p.shards, p.stage_rows, p.rows_in) == (63, 2, 126, 126)
    p = plan_grid("two_shot", 128 << 20, 2, 4, threads=512, max_blocks=132)  # 256 MiB, 4 ranks
    assert p.span == (16 << 20) // 4 and p.blocks == 132 and p.unroll == 2
    assert (p.iters - 1) * p.blocks * 1024 < p.span <= p.iters * p.blocks * 1024
    assert p.flag_words == 2 * 4 * 132 * 4  # ready + data flags of 4 ranks x 132 blocks, one per 32-byte sector
    p = plan_grid("reduce_scatter", 15, 4, 2)  # each row of 15 float32 padded to 4 vectors
    assert (p.vec, p.span, p.shards, p.rows_in, p.stage_rows) == (4, 4, 2, 8, 8)
    for bad, match in ((dict(mode="x"), "mode must be one of"), (dict(numel=0), "numel must be a positive int"),
                       (dict(unroll=0), "unroll must be a positive int"), (dict(max_blocks=0), "max_blocks")):
        args = dict(mode="one_shot", numel=8, itemsize=2, world_size=2)
        args.update(bad)
        with pytest.raises(ValueError, match=match):
            plan_grid(**args)


def test_grid_is_the_plans_blocks_and_iterations():
    """The plan's grid is :func:`grid` of its shard; the benchmark reduce_ceiling uses the same."""
    for nbytes, ranks in ((16 << 20, 2), (64 << 20, 8), (4096, 2), ((1 << 20) + 4096, 4)):
        plan = plan_grid("two_shot", nbytes // 2, 2, ranks, threads=512, max_blocks=132)
        assert grid(plan.span, 512, plan.unroll, 132) == (plan.blocks, plan.iters)
    assert grid(1000, 256, 1, 2) == (2, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        grid(0, 512, 1, 132)


def test_rows_view_needs_whole_aligned_vectors():
    x = torch.zeros(64, dtype=torch.float16)
    assert rows_view(x, 8).shape == (8, 8)
    assert rows_view(x[:60], 8) is None  # not whole vectors
    assert rows_view(x[8:], 8) is not None and rows_view(x[1:57], 8) is None  # 16-byte aligned only
    assert rows_view(torch.zeros(8, 8).t(), 4) is None  # not contiguous


def test_reference_is_rank_order_in_the_accumulation_type():
    h = [torch.full((4,), 2048.0, dtype=torch.float16), torch.ones(4, dtype=torch.float16),
         torch.ones(4, dtype=torch.float16)]
    assert torch.equal(torch_reference(h), torch.full((4,), 2050.0, dtype=torch.float16))  # one rounding
    f = [torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert float(torch_reference(f)) == 1.0  # (1e8 - 1e8) + 1; another order gives 0
    assert float(torch_reference(f[::-1])) == 0.0
    with pytest.raises(ValueError, match="one tensor per rank"):
        torch_reference([])


# ------------------------------------------------------------------------------ codegen
NOTIFY = "tilescale::notify<false>("
WAIT = "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>("


@pytest.mark.parametrize("mode", MODES)
def test_protocol_order_per_mode(mode):
    body = source(mode)
    stage = body.index("if (stage_in != 0)")
    ready = [m.start() for m in re.finditer(re.escape(NOTIFY), body)]
    waits = [m.start() for m in re.finditer(re.escape(WAIT), body)]
    loads = [m.start() for m in re.finditer(r"tilescale::remap_ptr\(Stage, [0-3]\)", body)]
    sync = [m.start() for m in re.finditer(r"__syncthreads\(\);", body)]
    # no fence: the signal is a release at system scope, cumulative over the barrier's writes
    assert "fence" not in body
    # staged here: stage, barrier, release to peer tx, wait for peer tx, barrier
    assert stage < sync[0] < ready[0] < waits[0] < sync[1]
    # staged before the kernel (else branch): a relaxed store to peer tx (no barrier before
    # it: earlier kernels' writes are performed when they complete), wait, barrier; then the reads
    other = body.index("} else {", sync[1])
    relaxed = body.index("tilescale::st<tilescale::Scope::SYS, tilescale::Sem::RELAXED, false>((&(Flags[", other)
    assert sync[1] < other < relaxed < waits[1] < sync[2] < loads[0]
    assert "__syncthreads();" not in body[other:relaxed]
    # the call number is block b's own counter + 1, read before the first round; thread 0
    # writes it back after that round's barrier (every thread of the block has read it)
    read = body.index("epoch = (State[((int)blockIdx.x)] + (int64_t)1);")
    write = body.index("State[((int)blockIdx.x)] = epoch")
    assert read < stage and sync[2] < write < loads[0]
    # ready[me, b] on peer tx is set to the call number (both paths); ready[tx, b] here is
    # waited for >= epoch; FLAG_STRIDE (4) words apart
    assert FLAG_STRIDE == 4
    mine = re.escape("(&(Flags[(((((int64_t)me) * ((int64_t)blocks)) * (int64_t)4) + "
                     "(((int64_t)((int)blockIdx.x)) * (int64_t)4))])), ")
    assert len(re.findall(mine + re.escape("((int)threadIdx.x), ((uint64_t)epoch") + r"(_\d+)?\)\);", body)) == 1
    assert len(re.findall(mine + re.escape("((uint64_t)epoch") + r"(_\d+)?\), \(\(int\)threadIdx.x\)\);", body)) == 1
    theirs = re.escape("(&(Flags[(((((int64_t)((int)threadIdx.x)) * ((int64_t)blocks)) * (int64_t)4) + "
                       "(((int64_t)((int)blockIdx.x)) * (int64_t)4))])), ((uint64_t)epoch") + r"(_\d+)?\)\);"
    assert len(re.findall(theirs, body)) == 2  # the macro's copies of epoch get suffixes
    assert body.count("if (((int)threadIdx.x) < 4)") >= 2
    if mode == "two_shot":  # pushes, then the data round: barrier, signal, wait
        assert len(ready) == 2 and len(waits) == 3
        assert loads[-1] < sync[3] < ready[1] < waits[2]
        # data[me, b]: after the W ready flags of every block (W * blocks * FLAG_STRIDE = blocks * 16 words)
        assert "(&(Flags[(((((int64_t)blocks) * (int64_t)16) + ((((int64_t)me) * ((int64_t)blocks)) * (int64_t)4)) + (((int64_t)((int)blockIdx.x)) * (int64_t)4))]))" in body
        assert "Out" not in body
    else:
        assert len(ready) == 1 and len(waits) == 2
        assert "*(uint4*)(Out + " in body


@pytest.mark.parametrize("mode", MODES)
def test_every_access_is_one_16_byte_vector(mode):
    body = source(mode, "float16", 2)
    loads = re.findall(r"\*\(uint4\*\)\(vals \+ (\d+)\) = \*\(uint4\*\)\(\(\(half_t\*\)(v_?\d*)\)", body)
    U = default_unroll(2)
    assert len(loads) == 2 * U  # W peers x U rows per iteration, into the register array
    assert "*(uint4*)(Stage + " in body  # staging: X -> Stage, 16 bytes a thread
    assert re.search(r"= \*\(uint4\*\)\(X \+ ", body)
    # two-shot: one remote 16-byte store per peer and row (tilescale-lang's st.global.v4 helper)
    stores = len(re.findall(r"tilescale::store_vec16\(\(&\(\(\(half_t\*\)v_\d+\)\[.*\)\), \*\(uint4\*\)\(res \+ \d+\)\);", body))
    assert stores == (2 * U if mode == "two_shot" else 0)


def test_loads_precede_adds_and_the_sum_is_in_rank_order():
    """float32, 4 ranks: each row loads peers 0..3 into vals (remote_ptr(Stage, p)), then
    adds ((v0 + v1) + v2) + v3."""
    body = source("reduce_scatter", "float32", 4)
    first_add = body.index("+v_")
    peers = re.findall(r"tilescale::remap_ptr\(Stage, (\d)\)", body[:first_add])
    assert peers[:4] == ["0", "1", "2", "3"]
    var_at = dict(re.findall(r"float4 (\w+) = \*\(float4\*\)\(vals \+ (\d+)\);", body))
    adds = re.findall(r"(\w+)\.x = \((\w+)\.x\+(\w+)\.x\);", body)[:3]
    a, b = var_at[adds[0][1]], var_at[adds[0][2]]
    assert (int(a), int(b)) == (0, 4)
    assert adds[1][1] == adds[0][0] and int(var_at[adds[1][2]]) == 8
    assert adds[2][1] == adds[1][0] and int(var_at[adds[2][2]]) == 12


@pytest.mark.parametrize("dtype,convert", [("float16", "__half22float2"), ("bfloat16", "__bfloat1622float2"),
                                           ("int32", None), ("float32", None)])
def test_accumulation_type(dtype, convert):
    body = source("one_shot", dtype, 2)
    if convert:
        assert convert in body and ("__float22half2_rn" in body or "__float22bfloat162_rn" in body)
    else:
        assert "float2" not in body.replace("float4", "")  # no conversion: the dtype's own adds


def test_builder_rejects_bad_arguments():
    for kwargs, exc, match in ((dict(mode="x"), ValueError, "mode must be one of"),
                               (dict(dtype="uint8"), ValueError, "dtype must be one of"),
                               (dict(world_size=0), ValueError, "world_size must be an int"),
                               (dict(threads=48), ValueError, "threads must be a multiple of 32"),
                               (dict(unroll=0), ValueError, "unroll must be a positive int"),
                               (dict(unroll=17), ValueError, r"unroll must be at most 16 at 2 rank\(s\)")):
        args = dict(mode="one_shot", dtype="float16", world_size=2)
        args.update(kwargs)
        with pytest.raises(exc, match=match):
            build_reduce_kernel(**args)


@needs_nvcc
def test_two_shot_pushes_whole_16_byte_vectors(tmp_path):
    """PTX: every push to a peer is one st.global.v4.b32 and none is split into 4-byte stores
    (nvcc split the plain assignment through the remapped pointer into four st.u32 each)."""
    from examples_helpers import TOOLKIT

    for dtype, world in (("float16", 2), ("float32", 8)):
        src = lower_with(build_reduce_kernel("two_shot", dtype, world, 512), PASS_CONFIGS)
        ptx = TOOLKIT.compile(src, tmp_path / f"{dtype}{world}", "ptx", "sm_90a")[0].read_text(encoding="utf-8")
        assert len(re.findall(r"\bst\.global\.v4\.b32\b", ptx)) == world * default_unroll(world), dtype
        assert not re.findall(r"\bst(?:\.global)?\.(?:u32|b32|f32)\b", ptx), dtype


@needs_nvcc
@pytest.mark.parametrize("mode,dtype,world", [("one_shot", "float16", 8), ("two_shot", "bfloat16", 2),
                                              ("reduce_scatter", "float32", 4)])
def test_nvcc_compiles_each_mode_within_the_register_budget(mode, dtype, world, tmp_path):
    """sm_90a cubin at 512 threads: at most 128 registers (one block per SM) and no spills."""
    src = lower_with(build_reduce_kernel(mode, dtype, world, 512), PASS_CONFIGS)
    registers, spills = nvcc_resources(src, tmp_path)
    assert registers <= MAX_REGISTERS and spills == 0, (registers, spills)


@needs_nvcc
@pytest.mark.parametrize("mode", ["one_shot", "two_shot", "reduce_scatter"])
def test_the_host_numbered_build_differs_only_in_where_the_call_number_comes_from(mode, tmp_path):
    """The A/B baseline of benchmarks.emulated (``call_number="argument"``): the call number
    is the last parameter (int64), ``State`` is neither read nor written, the symbol says so;
    the rest of the source is the library's kernel line for line; it compiles within the
    register budget. A bad ``call_number`` is refused by name."""
    from tilescale_examples.collectives.reduce_kernel import CALL_NUMBERS

    device = build_reduce_kernel(mode, "bfloat16", 4, 512)
    host = build_reduce_kernel(mode, "bfloat16", 4, 512, call_number="argument")
    assert CALL_NUMBERS == ("device", "argument") and str(host.params[-1]) == "epoch_in"
    assert host.attrs["global_symbol"] == device.attrs["global_symbol"] + "_host_epoch"
    dev_src, host_src = (kernel_body(lower_with(f, PASS_CONFIGS)) for f in (device, host))
    assert "State[" in dev_src and "State" not in host_src and "epoch = epoch_in;" in host_src
    assert "epoch = (State[((int)blockIdx.x)] + (int64_t)1);" in dev_src
    numbered = [re.sub(r"epoch_\d+", "epoch_N", src).splitlines()[1:] for src in (dev_src, host_src)]
    changed = [line[2:] for line in difflib.ndiff(*numbered) if line[:2] in ("- ", "+ ")]
    allowed = re.compile(r"\s*(epoch = |int64_t epoch_N = epoch;|State\[|if \(\(\(int\)threadIdx\.x\) == 0\) \{$|\}$)")
    assert changed and all(allowed.match(line) for line in changed), changed  # the count's load and store only
    registers, spills = nvcc_resources(lower_with(host, PASS_CONFIGS), tmp_path)
    assert registers <= MAX_REGISTERS and spills == 0, (registers, spills)
    with pytest.raises(ValueError, match=r"call_number must be one of \('device', 'argument'\), got 'host'"):
        build_reduce_kernel(mode, "bfloat16", 4, call_number="host")


def test_unroll_is_bounded_before_anything_is_traced():
    """``AllReduce(unroll=10**6)`` used to trace a kernel unrolled a million times (gigabytes,
    minutes): the plan refuses it at once, naming the argument and the bound."""
    import time

    from tilescale_examples.collectives.reduce_engine import MAX_UNROLLED_VECTORS, check_unroll, max_unroll

    assert [max_unroll(w) for w in (1, 2, 8, 32, 64)] == [32, 16, 4, 1, 1]
    assert check_unroll(None, 8) == default_unroll(8) <= max_unroll(8)
    assert all(default_unroll(w) <= max_unroll(w) for w in range(1, 1023))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"unroll must be at most 4 at 8 rank\(s\).*got 1000000"):
        plan_grid("one_shot", 4096, 2, 8, unroll=10**6)
    with pytest.raises(ValueError, match="unroll must be at most"):
        build_reduce_kernel("two_shot", "float16", 8, unroll=10**6)
    assert time.monotonic() - start < 1.0 and MAX_UNROLLED_VECTORS == 32
