"""MoE dispatch/combine: layout planning, references, generated CUDA, nvcc compile and every
argument check on the CPU; bit-exact dispatch and tolerance-checked combine on 1, 2 and 4
ranks sharing one GPU, under CUDA graph capture, with out-of-range indices and for 1000
back-to-back calls with stragglers (``-m gpu``)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import tilelang
import torch
from examples_helpers import (LaunchRecorder, CpuAllocator, close_rank_heap, exits_naming, kernel_body, lower_with,
                              needs_nvcc, nvcc_resources, open_rank_heap, output_without_gpu, rejects_before_allocating,
                              expect_checks, gpu_rank_test)

from tilescale_examples.base import TARGET
from tilescale_examples.moe.dispatcher import (COMBINE_ATOL, COMBINE_RTOL, DispatchHandle, MoEDispatcher,
                                    expected_routes, torch_combine_reference, torch_dispatch_reference)
from tilescale_examples.moe.kernels import (DISPATCH_PHASES, PASS_CONFIGS, PUT_UNROLL, build_combine_kernel,
                                           build_dispatch_kernel)

# The configuration of the CPU object tests and the nvcc test (shared compile cache).
E, K, H, TMAX = 8, 2, 64, 16


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One TileLang cache for the module: the kernels are compiled once."""
    old = os.environ.get("TILELANG_CACHE_DIR")
    os.environ["TILELANG_CACHE_DIR"] = str(tmp_path_factory.mktemp("moe-cache"))
    yield os.environ["TILELANG_CACHE_DIR"]
    if old is None:
        os.environ.pop("TILELANG_CACHE_DIR", None)
    else:
        os.environ["TILELANG_CACHE_DIR"] = old


def source(func) -> str:
    """The ``__global__`` function's CUDA, lowered with the kernel's own pass configs."""
    assert dict(func.attrs["tilelang_pass_configs"]) == PASS_CONFIGS
    return kernel_body(lower_with(func, PASS_CONFIGS))


# ------------------------------------------------------------------------------ planning
def test_expected_routes_follow_the_documented_layout():
    # 2 ranks, 4 experts (rank 0: experts 0-1, rank 1: experts 2-3), top-2
    idx0 = torch.tensor([[1, 2], [0, 1], [3, -1]])
    idx1 = torch.tensor([[2, 1], [1, 1]])
    routes, counts = expected_routes([idx0, idx1], 4)
    assert counts.tolist() == [[1, 2, 1, 1], [0, 3, 1, 0]]
    # rank 0 on itself: expert 0 <- (r0, entry 2); expert 1 <- (r0, 1), (r0, 3), (r1, 1), (r1, 2), (r1, 3)
    assert routes[0][0].tolist() == [0, 1, 0, 0, 1, -1] and routes[0][1].tolist() == [1, 0, 0, 2, 2, -1]
    # rank 1 on rank 1: expert 2 <- (r0, 1), (r1, 0); expert 3 <- (r0, 4)
    assert routes[1][0].tolist() == [1, 0, 0, 0] and routes[1][1].tolist() == [1, 3, 4, 5]
    xs = [torch.arange(3.0).repeat_interleave(8).view(3, 8) + 10, torch.arange(2.0).repeat_interleave(8).view(2, 8) + 20]
    rows, got, origin = torch_dispatch_reference(xs, [idx0, idx1], 4, 0)
    assert rows[:, 0].tolist() == [11, 10, 11, 20, 21, 21] and got.tolist() == [1, 5]
    assert origin.tolist() == [[0, 2], [0, 0], [0, 3], [1, 1], [1, 2], [1, 3]]
    rows1, got1, _ = torch_dispatch_reference(xs, [idx0, idx1], 4, 1)
    assert rows1[:, 0].tolist() == [10, 20, 12] and got1.tolist() == [2, 1]


def test_expected_routes_rank_entries_within_expert_in_entry_order():
    g = torch.Generator().manual_seed(3)
    idxs = [torch.randint(-1, 12, (50, 3), generator=g) for _ in range(3)]
    routes, counts = expected_routes(idxs, 12)
    for d in range(3):
        rows = torch.cat([row[rank == d] for rank, row in routes])
        assert sorted(rows.tolist()) == list(range(int(counts[:, 4 * d:4 * d + 4].sum())))  # a permutation
    for s, (rank, row) in enumerate(routes):  # within (rank s, expert g) rows grow with the entry
        flat = idxs[s].view(-1)
        for e in range(12):
            sel = row[flat == e]
            assert torch.all(sel[1:] > sel[:-1])
            assert int(sel.numel()) == int(counts[s, e])
        assert torch.equal(rank[flat < 0], torch.full_like(rank[flat < 0], -1))


def test_combine_reference_of_identity_experts_scales_tokens_by_the_valid_weights():
    g = torch.Generator().manual_seed(5)
    idxs = [torch.randint(-1, 8, (20, 4), generator=g) for _ in range(2)]
    ws = [torch.rand(20, 4, generator=g) for _ in range(2)]
    xs = [torch.randn(20, 16, generator=g) for _ in range(2)]
    ys = [torch_dispatch_reference(xs, idxs, 8, d)[0] for d in range(2)]
    for r in range(2):
        want = xs[r].double() * (ws[r].double() * (idxs[r] >= 0)).sum(1, keepdim=True)
        assert torch.allclose(torch_combine_reference(ys, idxs, ws, 8, r), want)


def test_reference_argument_checks():
    with pytest.raises(ValueError, match="one tensor per rank"):
        expected_routes([], 4)
    with pytest.raises(ValueError, match="num_experts=5 is not a multiple of 2 ranks"):
        expected_routes([torch.zeros(1, 1, dtype=torch.long)] * 2, 5)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\)"):
        torch_dispatch_reference([torch.zeros(1, 8)], [torch.zeros(1, 1, dtype=torch.long)], 2, 1)


# ------------------------------------------------------------------------------ generated CUDA
def _dispatch_paths():
    """The default dispatch kernel's source and its two paths: ``(body, small, large)`` (the
    small batch's branch, ``pb == 1``, and the large batch's ``else`` branch, each up to the
    shared closing round)."""
    body = source(build_dispatch_kernel(64, 8, 7168, 4096, blocks=132))
    start = body.index("if (pb == 1) {")
    split = body.index("\n  } else {\n", start)
    tail = body.rindex("__syncthreads();")
    return body, body[start:split], body[split:tail]


def test_dispatch_kernel_small_batch_plans_in_every_block_and_stores_rows_from_registers():
    """A small batch (at most one entry per thread): every block ranks and plans all entries
    itself in shared memory and registers, so no block waits for another; the data phase's
    units (token part, slot) are split evenly over the grid's warps, each warp loads the (at
    most two) parts of its first units at the kernel's start and stores them from registers,
    one 16-byte store per unit and lane."""
    body, small, _ = _dispatch_paths()
    # residency: one block always fits on an SM (launch bounds; 64 registers, checked below)
    assert "__launch_bounds__(1024, 1) moe_dispatch_kernel(" in body
    assert "int capacity" in body and "int num_tokens" in body  # run-time dimensions
    assert "pb = max(1, min(132, ((num_tokens + 127) >> 7)));" in body  # ranking blocks
    # 0. units = tokens * 28 parts * 8 slots, split evenly over the 4224 warps (the first
    # units % 4224 warps one more); no 64-bit division
    assert "units = (num_tokens * 224);" in small
    split = small[:small.index("qa = (u0 >> 3);")]
    assert split.count("/ 4224)") == 2 and "int64_t" not in split
    # 1. the entry's index and weight are loaded first, then the warp's two parts (16 bytes
    # per lane each), which stay in flight during the plan
    idx = small.index("sidx = Idx[((int)threadIdx.x)];")
    first = small.index("*(uint4*)(xv + 0) = condval")
    second = small.index("*(uint4*)(xv2 + 0) = condval")
    assert small.index("sweight = Wt[((int)threadIdx.x)];") < idx < first < second < small.index("__match_any_sync(")
    assert "if (qa < ((u1 - 1) >> 3)) {" in small[first:second]  # the second part only if the warp reaches it
    # one entry per thread: its rank among its warp's entries of the same expert, the warp's
    # counts in its row of the table, key and rank for the data phase, the bad entries by
    # ballot; one block barrier
    votes = small.index("__match_any_sync(")
    assert small.index("__syncwarp();") < votes < small.index("__ballot_sync(") < small.index("__syncthreads();")
    first_sync = small.index("__syncthreads();")
    assert "((int*)skey_s)[((int)threadIdx.x)] = skey;" in small[votes:first_sync]
    assert "((int*)srank_s)[((int)threadIdx.x)] = srank;" in small[votes:first_sync]
    # 2. the table's columns are scanned over the warps with shuffles (no serial loop over the
    # warps), the bad entries summed with xor shuffles; a second block barrier
    scans = small[first_sync:small.index("__syncthreads();", first_sync + 1)]
    assert scans.count("__shfl_up_sync(") == 5 and scans.count("__shfl_xor_sync(") == 5
    assert "for (int w" not in scans and "((int*)stot)[" in scans
    # 3. with several ranks, block 0 sends its counts and signals after a block barrier; every
    # block waits for every other rank's counts (a rank never signals itself)
    several = small.index("if (1 < W) {")
    st = small.index("tilescale::st<tilescale::Scope::GPU, tilescale::Sem::WEAK, false>((&(Counts[", several)
    assert "((int*)stot)[((int)threadIdx.x)], p);" in small[st:st + 400]
    notify = small.index("tilescale::notify<false>((&(Sig[", st)
    assert small.rindex("__syncthreads();", 0, notify) > st
    wait = small.index("tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Sig[", notify)
    assert small.rindex("if ((((int)threadIdx.x) < W) && (((int)threadIdx.x) != me)) {", 0, wait) > notify
    # block 0's last thread reports the bad entries from its registers (no re-read of Base)
    status = small.index("Status[0] = ((int64_t)run);", wait)
    assert "Base[" not in small and "Packed[" not in small
    # 4. warp 0 alone reads the count matrix (once per rank and expert slot), scans the totals
    # over the experts with shuffles into erow, then eoff / edst per expert (the owner x * W /
    # 64: no run-time division) and block 0's RecvCounts / RecvOffsets; a block barrier
    expert = small[small.index("if ((((int)threadIdx.x) >> 5) == 0) {", status):]
    planned = expert.index("__syncthreads();")
    expert = expert[:planned]
    assert expert.index("Counts[") < expert.index("__shfl_up_sync(") < expert.index("((int*)erow)[") < expert.index("((int*)eoff)[")
    assert "* W) >> 6)" in expert and "/ EL" not in expert and "% EL" not in expert
    assert "RecvCounts[" in expert and "RecvOffsets[" in expert
    assert small.count("__syncthreads();") == 5  # 1, 2, the count exchange's two, before the data
    # block 0 alone writes the routes, weights and origins (after the barrier, with the data)
    after = small[small.index("__syncthreads();", small.index("RecvCounts[")):]
    routes = after.index("if ((((int)blockIdx.x) == 0) && (((int)threadIdx.x) < (num_tokens * 8))) {")
    for store in ("tilescale::st<tilescale::Scope::GPU, tilescale::Sem::WEAK, false>((&(RecvSrc[",
                  "RouteRow[((int)threadIdx.x)] = srow_v;", "Weights[((int)threadIdx.x)] = sweight;"):
        assert routes < after.index(store) < after.index("staged = "), store
    # 5. data: lane j finds unit j's row, owner and column once; every unit takes them with
    # three shuffles and each lane stores its 16-byte vector straight from registers (no
    # shared staging, no put_warp, no block barrier)
    moves = after[after.index("staged = "):]
    lanes = moves.index("urow = ((((int*)eoff)[")
    assert moves.index("udst = ((int*)edst)[") > lanes
    units = re.search(r"for \(int (j_\d+) = 0; \1 < min\(32, \(\(u1 - u0\) - \(c_\d+ \* 32\)\)\); \+\+\1\) \{", moves).start()
    assert lanes < units
    inner = moves[units:]
    assert inner.count("__shfl_sync(") == 3
    assert inner.count("tilescale::store_vec16(") == 2  # from xv (first part) or xv2
    assert "*(uint4*)(xv + 0));" in inner and "*(uint4*)(xv2 + 0));" in inner
    assert "tilescale::remap_ptr(RecvX, dst);" in inner
    assert "put_warp" not in small and "stage)" not in small and "__syncthreads" not in moves
    # a warp with more than K + 1 units loads later parts in the loop (small grids only)
    assert "staged = (u >> 3);" in inner


def test_dispatch_kernel_small_batch_checks_each_prefetched_part_against_its_own_row_end():
    """Rows of 897 16-byte vectors (hidden 7176): a row's last part has one vector, so a lane
    may have a vector of one part and not of the next. Each of the two parts loaded at the
    kernel's start is guarded by its own part's lanes (a load of part qa + 1 nested in part
    qa's check left lanes 1-31 of a warp whose first part ends a row without the next token's
    vectors: wrong rows on the GPU at 37 tokens on a 2-block grid)."""
    body = source(build_dispatch_kernel(64, 8, 7176, 128, blocks=2))
    small = body[body.index("if (pb == 1) {"):]
    first = small.index("*(uint4*)(xv + 0) = condval")
    second = small.index("*(uint4*)(xv2 + 0) = condval")
    own = "(((int)threadIdx.x) & 31)) < 897)"
    guard_first = small.rindex("if (", 0, small.rindex("uint4 condval", 0, first))
    assert "((qa % 29) * 32)) + " + own in small[guard_first:first]
    guard_second = small.rindex("if (", 0, small.rindex("uint4 condval", 0, second))
    assert "(((qa + 1) % 29) * 32)) + " + own in small[guard_second:second]
    has_second = small.index("if (qa < ((u1 - 1) >> 3)) {")
    assert first < has_second < guard_second
    between = small[guard_first:has_second]  # the first part's check is closed: not nested in it
    assert between.count("{") == between.count("}"), between


def test_dispatch_kernel_small_batch_scans_only_the_warps_a_narrower_block_has():
    """With fewer than 32 warps per block (512 threads: 16), the small batch's column scans and
    bad-entry sum read and write only the rows of the warps there are (lanes 16-31 add 0)."""
    body = source(build_dispatch_kernel(64, 8, 7168, 4096, blocks=132, threads=512))
    start = body.index("if (pb == 1) {")
    small = body[start:body.index("\n  } else {\n", start)]
    first_sync = small.index("__syncthreads();")
    scans = small[first_sync:small.index("__syncthreads();", first_sync + 1)]
    guard = r"if \(\(\(\(\(int\)threadIdx.x\) & 31\) < 16\)\) \{\n\s+condval_\d+ = \(\(int\*\)wcnt\)\["
    assert re.search(guard, scans), scans
    assert "if ((((int)threadIdx.x) & 31) < 16) {\n        ((int*)wcnt)[" in scans  # the write-back
    for table in ("wbad", "wfirst"):
        read = scans.index(f"= ((int*)wfirst)[" if table == "wfirst" else "= ((int*)wbad)[")
        assert "< 16)" in scans[read - 120:read], table


def test_dispatch_kernel_large_batch_ranks_in_every_block_plans_in_block_0_then_puts_rows_to_the_owner():
    """A large batch: the ranking blocks rank, block 0 plans and releases the plan, every
    block acquires it and puts each entry's row (or a column range of it) to the owner."""
    body, _, large = _dispatch_paths()
    # step 1 in the ranking blocks: a chunk of 4 batches: every index and weight load of the
    # chunk comes before the first vote, so they are in flight together
    ranking = large.index("if (((int)blockIdx.x) < pb) {")
    chunk = large[re.search(r"for \(int (c_\d+) = 0; \1 < \(\(nb \+ 3\) >> 2\); \+\+\1\) \{", large).start():]
    chunk = chunk[:chunk.index("__syncthreads();")]
    votes = chunk.index("__match_any_sync(")
    assert "Idx[" in chunk[:votes] and "Wt[" in chunk[:votes] and "Idx[" not in chunk[votes:]
    assert chunk.count("__syncwarp();") == 2 and "Packed[" in chunk[votes:] and "Weights[" in chunk[votes:]
    # step 2: the block's totals into its row of Base, then ranks within the block
    total = large.index("Base[((((int)blockIdx.x) * 67) + ((int)threadIdx.x))] = run;", ranking)
    rerank = re.compile(r"Packed\[i_\d+\] = \(pk \+ \(\(int\*\)wcnt\)\[").search(large, total).start()
    # every block but 0 arrives (GPU-scope release after a block barrier); block 0 waits for
    # them, then resets the counter for the next call
    arrive = large.index("tilescale::atom_add<tilescale::Scope::GPU, tilescale::Sem::RELEASE>((&(Ctr[3])), (uint)1);", rerank)
    assert large.rindex("__syncthreads();", 0, arrive) > rerank
    assert "if ((0 < ((int)blockIdx.x)) && (((int)threadIdx.x) == 0)) {" in large[rerank:arrive]
    assert body.count("Ctr[3]") == 3  # the arrival, block 0's wait and its reset
    plan = large.index("if (((int)blockIdx.x) == 0) {", arrive)  # the planning block
    counted = large.index("tilescale::wait_until<tilescale::Cmp::EQ, tilescale::Scope::GPU, tilescale::Sem::ACQUIRE>((&(Ctr[3])), (uint)131);", plan)
    assert large.index("Ctr[3] = (uint)0;", counted) > counted
    # counts: the sum over the ranking blocks, a weak store to every other rank, then the
    # block barrier and the release signal; a rank never signals itself
    st = large.index("tilescale::st<tilescale::Scope::GPU, tilescale::Sem::WEAK, false>((&(Counts[", plan)
    assert large.rindex("if (p_2 != me) {", 0, st) > plan
    sync = large.index("__syncthreads();", st)
    notify = large.index("tilescale::notify<false>((&(Sig[", sync)
    assert "__syncthreads();" not in large[sync + 1:notify]
    status = large.index("if (((int)threadIdx.x) == 1023) {", notify)  # block 0's last thread
    assert large.index("Status[0] = nbad_1;", status) > status
    wait = large.index("tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Sig[", notify)
    assert large.rindex("if ((((int)threadIdx.x) < W) && (((int)threadIdx.x) != me)) {", 0, wait) > status
    # step 4: this rank's own counts come from its plan (`run`); the count matrix is read
    # once per (rank, expert), and the totals are scanned with warp shuffles
    release = large.index("tilescale::st<tilescale::Scope::GPU, tilescale::Sem::RELEASE, false>((&(Ctr[2]))")
    base = large.rindex("Base[", 0, release)  # the plan's store of the per-block offsets
    offsets = large[wait:base]
    assert re.search(r"if \(\(s_1 == me\)\) \{\n\s*condval_\d+ = run;", offsets), offsets
    assert len(re.findall(r"(?<!Recv)Counts\[", offsets)) == 1, offsets
    assert offsets.count("__shfl_up_sync(") == 5
    assert large.rindex("__syncthreads();", 0, release) > base
    # the plan is released to the other blocks (GPU scope), and every block acquires it
    # before it reads Packed / Base
    acquire = large.index("tilescale::wait_until<tilescale::Cmp::EQ, tilescale::Scope::GPU, tilescale::Sem::ACQUIRE>((&(Ctr[2]))", release)
    data = large.index("__syncthreads();", acquire)
    put = large.index(f"tilescale::put_warp<{PUT_UNROLL}, false>(", data)
    assert "(&(RecvX[" in large[put:large.index(";", put)]
    assert large.index("Packed[", data) < put and large.index("Base[", data) < put
    assert large.index("tilescale::st<tilescale::Scope::GPU, tilescale::Sem::WEAK, false>((&(RecvSrc[", put) > put
    # only the hand-written block barriers: the ranking blocks' two, the arrival, the plan's
    # five, the one before the data phase
    assert large.count("__syncthreads();") == 9
    # fewer entries than warps: rows are cut into column ranges, so every warp has columns
    cuts = large.index("cuts = max(1, min(8, ")  # G / (NT * K) = 4224 / (8 * NT), folded to 528 / NT
    folded = re.search(r"int (rdiv_\d+) = \(528 / num_tokens\);", large[cuts - 200:cuts])
    assert folded and folded.group(1) in large[cuts:cuts + 200]


def test_dispatch_kernel_closes_with_one_round_and_keeps_call_numbers_per_block():
    body, _, _ = _dispatch_paths()
    assert "fence_sys" not in body
    # the closing round: every other rank gets one add per block; a rank's own rows are
    # ordered by the kernel's end, so it waits for the other ranks' blocks only
    tail = body[body.rindex("__syncthreads();"):]
    assert tail.index("if (p_4 != me) {") < tail.index("tilescale::notify<true>((&(Ctr[0]))") < tail.index("tilescale::wait_until<")
    closing = tail.index("tilescale::wait_until<tilescale::Cmp::EQ, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Ctr[0])), ((uint)((epoch * (((int64_t)W) - (int64_t)1)) * (int64_t)132)))")
    # every block reads its own copy of the call number at its start and advances it after
    # the block barrier (no cross-block round)
    assert "epoch = (State[((int)blockIdx.x)] + (int64_t)1);" in body
    assert closing < tail.index("State[((int)blockIdx.x)] = epoch;")
    assert body.count("State[") == 2


def test_profiled_dispatch_kernel_only_adds_one_timestamp_per_phase():
    """profile=True: the plain kernel's code, in order, plus thread 0's timestamp at the end of
    each phase (one slot each; "ranked" and "planned" on both paths) and one more parameter;
    the plain kernel has no profiling code."""
    plain_func = build_dispatch_kernel(64, 8, 7168, 4096)
    prof_func = build_dispatch_kernel(64, 8, 7168, 4096, profile=True)
    assert [p.name for p in prof_func.params] == [p.name for p in plain_func.params] + ["Prof_handle"]
    assert list(prof_func.buffer_map[prof_func.params[-1]].shape) == [132, 1 + 2 * len(DISPATCH_PHASES)]
    plain, prof = source(plain_func), source(prof_func)
    assert "profile_event" not in plain and "Prof" not in plain
    events = [prof.count(f"tilescale::profile_event_at<7>((&(Prof[0])), (uint){p}, (uint){p}, (bool)1);")
              for p in range(len(DISPATCH_PHASES))]
    assert events == [1, 1, 2, 1, 2, 1, 1], events
    assert prof.count("profile_event") == sum(events)
    lines = iter(prof.splitlines()[1:])  # the plain body, line by line, is a subsequence
    missing = [line for line in plain.splitlines()[1:] if not any(line == other for other in lines)]
    assert not missing, missing[:3]
    # the index event waits for thread 0's loaded index
    index_event = prof.index("(uint)1, (uint)1, (bool)1);")
    assert prof.rindex("if (sidx != (int64_t)9223372036854775807) {", 0, index_event) > prof.index("sidx = Idx[")


@needs_nvcc
def test_dispatch_fits_1024_threads_without_spills(tmp_path):
    """The dispatch block (1024 threads, one per SM) needs at most 64 registers per thread."""
    registers, spills = nvcc_resources(lower_with(build_dispatch_kernel(E, K, 7168, 4096), PASS_CONFIGS), tmp_path)
    assert registers <= 64 and spills == 0, (registers, spills)


def test_dispatch_kernel_rejects_a_grid_the_plan_cannot_use():
    with pytest.raises(ValueError, match=r"threads must be a multiple of 32 in \(64, 1024\]"):
        build_dispatch_kernel(64, 8, 7168, 4096, threads=64)
    with pytest.raises(ValueError, match=r"max_tokens \* topk must be in \[1, 65024\] \(an entry's rank"):
        build_dispatch_kernel(64, 8, 7168, 8192, threads=512)
    build_dispatch_kernel(64, 8, 7168, 8128, threads=512)  # 65024 entries: the largest


def test_combine_kernel_handshakes_pushes_then_sums_in_float32():
    body = source(build_combine_kernel(64, 8, 7168, 4096, blocks=132))
    assert "__launch_bounds__(1024, 1) moe_combine_kernel(" in body and "__shared__" not in body
    # every block reads its own copies of the combine's call numbers (State is (3, 132))
    assert "epoch = (State[(((int)blockIdx.x) + 132)] + (int64_t)1);" in body
    assert "routing = State[((int)blockIdx.x)];" in body  # the dispatch's block's copy
    guard = body.index("again = ((int)(routing == State[(((int)blockIdx.x) + 264)]));")
    # with one rank there is no handshake, no push and no counter round (grid-uniform)
    several = body.index("if (1 < W) {", guard)
    # the ready handshake runs only when no dispatch came since the previous combine
    ready = body.index("tilescale::notify<false>((&(Sig[")
    assert body.rindex("if (again == 1) {", 0, ready) > several
    handshake_wait = body.index("tilescale::wait_until<tilescale::Cmp::GE", ready)
    assert body.rindex("if (again == 1) {", 0, handshake_wait) > ready
    # a rank neither signals nor waits for itself
    assert body.rindex("if (p != me) {", 0, ready) > guard
    assert body.rindex("if ((((int)threadIdx.x) < W) && (((int)threadIdx.x) != me)) {", 0, handshake_wait) > ready
    put = body.index(f"tilescale::put_warp<{PUT_UNROLL}, false>(", ready)
    assert "(&(CombBuf[" in body[put:body.index(";", put)]
    # after the block barrier: one release add per other rank, then the wait for the other
    # ranks' blocks; no local arrival counter (the blocks' call numbers are their own)
    sync = body.index("__syncthreads();", put)
    add = body.index("tilescale::notify<true>((&(Ctr[1]))", sync)
    assert body.rindex("if (p_1 != me) {", 0, add) > sync
    assert "fence_sys" not in body  # the release add after bar.sync covers the block's rows
    assert "Ctr[4]" not in body and "atom_add" not in body
    wait = body.index("tilescale::wait_until<tilescale::Cmp::EQ, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>((&(Ctr[1])), ((uint)((epoch * (((int64_t)W) - (int64_t)1)) * (int64_t)132)));", add)
    assert body.index("__syncthreads();", wait) < body.index("for (int j_1 = 0;", wait)  # still in the W > 1 branch
    sums = body[body.index("for (int j_1 = 0;", wait):]
    assert sums.count("*(uint4*)(Y + ") == 1 and sums.count("*(uint4*)(CombBuf + ") == 1  # 16-byte loads
    assert sums.index("RouteRow[") < sums.index("*(uint4*)(Y + ")
    assert "float acc[8];" in body and "__float22bfloat162_rn(" in sums
    # the block records the call in its own copies after a barrier (all its threads read them)
    tail = body[body.rindex("__syncthreads();"):]
    assert body.rindex("__syncthreads();") > body.rindex("__float22bfloat162_rn(")
    assert "State[(((int)blockIdx.x) + 132)] = epoch;" in tail and "State[(((int)blockIdx.x) + 264)] = routing;" in tail


@needs_nvcc
def test_combine_fits_1024_threads_without_spills(tmp_path):
    """The default combine block (1024 threads, one per SM) needs at most 64 registers per
    thread; spills would put the K rows' vectors in local memory."""
    registers, spills = nvcc_resources(lower_with(build_combine_kernel(E, K, 7168, 4096), PASS_CONFIGS), tmp_path)
    assert registers <= 64 and spills == 0, (registers, spills)


@needs_nvcc
def test_kernels_compile_with_nvcc(cache_dir):
    for func in (build_dispatch_kernel(E, K, H, TMAX, "float16", "int32", blocks=128),
                 build_dispatch_kernel(E, K, H, TMAX, "float16", "int32", blocks=128, profile=True),
                 build_combine_kernel(E, K, H, TMAX, "float16", blocks=128)):
        kernel = tilelang.compile(func, target=TARGET, execution_backend="tvm_ffi")
        assert kernel.adapter.rt_mod.imports[0].kind == "cuda"


# ------------------------------------------------------------------------------ the object (CPU)
def _make(alloc=None, **kwargs):
    args = dict(num_experts=E, hidden=H, topk=K, max_tokens=TMAX, dtype=torch.bfloat16)
    args.update(kwargs)
    return MoEDispatcher(alloc or CpuAllocator(num_ranks=2), **args)


@needs_nvcc
def test_dispatcher_on_cpu_allocator(cache_dir):
    alloc = CpuAllocator(num_ranks=2)
    moe = _make(alloc, index_dtype=torch.int32, dtype=torch.float16)
    cap = 2 * TMAX * K
    assert moe.capacity == cap and moe.experts_per_rank == 4
    assert alloc.allocations == [((cap, H), torch.float16), ((cap,), torch.int32), ((TMAX * K, H), torch.float16),
                                 ((2, 2, E), torch.int32), ((2, 2), torch.uint64), ((4,), torch.uint32)]
    assert not moe.flags.ne(0).any() and not moe.counters.ne(0).any() and not moe.count_matrix.ne(0).any()
    assert alloc.heap_bytes == MoEDispatcher.heap_bytes(E, H, K, TMAX, torch.float16, world_size=2)
    launched = []
    moe.dispatch_kernel = LaunchRecorder(launched, "dispatch")
    moe.combine_kernel = LaunchRecorder(launched, "combine")

    x = torch.randn(5, H).half()
    idx = torch.tensor([[0, 7], [1, -1], [2, 3], [4, 4], [6, 5]], dtype=torch.int32)
    w = torch.rand(5, K)
    recv, counts, handle = moe.dispatch(x, idx, w)
    assert recv is moe.recv_x and counts.shape == (4,) and handle.recv_offsets.shape == (5,)
    assert [n for n, _ in launched] == ["dispatch"]
    disp = launched[0][1]
    assert disp[0] is idx and disp[1] is w and disp[2] is x and disp[8] is moe.recv_x and disp[16] is moe.state
    assert moe.state.shape == (3, moe.blocks) and not moe.state.ne(0).any()  # one column per block
    assert handle.epoch == 1 and handle.num_tokens == 5 and handle.dest_rank.shape == (5, K)
    y = torch.randn(cap, H).half()
    out = moe.combine(y, handle)
    assert out.shape == (5, H) and launched[-1][0] == "combine" and launched[-1][1][0] is y
    assert launched[-1][1][1].data_ptr() == moe.output.data_ptr() and moe.combines == 1
    moe.combine(y, handle)  # a handle may be combined more than once
    # an empty rank still takes part
    moe.dispatch(x[:0], idx[:0], w[:0])
    assert len(launched) == 4 and moe.epoch == 2

    def rejects(exc, match, fn, *args, **kw):
        before = len(launched)
        with pytest.raises(exc, match=match):
            fn(*args, **kw)
        assert len(launched) == before, "a kernel ran before the error"

    rejects(TypeError, "x must be a torch.Tensor", moe.dispatch, x.numpy(), idx, w)
    rejects(TypeError, "x has dtype torch.float32", moe.dispatch, x.float(), idx, w)
    rejects(ValueError, r"x has shape \(5, 32\), expected \(tokens, hidden=64\)", moe.dispatch, x[:, :32], idx, w)
    rejects(ValueError, "x has 17 tokens, more than max_tokens=16", moe.dispatch,
            torch.zeros(17, H).half(), torch.zeros(17, K, dtype=torch.int32), torch.zeros(17, K))
    rejects(ValueError, "x must be contiguous", moe.dispatch, torch.zeros(H, 5).half().t(), idx, w)
    rejects(TypeError, "topk_idx has dtype torch.int64", moe.dispatch, x, idx.long(), w)
    rejects(ValueError, r"topk_idx has shape \(5, 1\)", moe.dispatch, x, idx[:, :1].contiguous(), w)
    rejects(TypeError, "topk_weights has dtype torch.float16", moe.dispatch, x, idx, w.half())
    rejects(ValueError, r"topk_weights has shape \(4, 2\)", moe.dispatch, x, idx, w[:4])
    rejects(ValueError, r"topk_idx\[3, 1\] = 8 is out of range: expert indices must be in \[0, 8\) or -1 for an "
            r"unused slot \(2 bad entries\); nothing was sent", moe.dispatch, x,
            torch.tensor([[0, 1], [1, 1], [2, 3], [4, 8], [-2, 0]], dtype=torch.int32), w)
    bad = torch.tensor([[0, 1], [1, 1], [2, 3], [4, 8], [-2, 0]], dtype=torch.int32)
    moe.dispatch(x, bad, w, validate=False)  # on the device: skipped and reported
    assert launched[-1][0] == "dispatch" and moe.epoch == 3
    moe.status.copy_(torch.tensor([2, 7, 8]))  # what the dispatch kernel's plan would have written
    with pytest.raises(ValueError, match=r"topk_idx\[3, 1\] = 8 is out of range.*\(2 bad entries\); the dispatch skipped them"):
        moe.check_index_errors()
    moe.status.zero_()
    moe.check_index_errors()

    # the profiled dispatch: the same call (a dispatch call: the epoch advances) with the
    # profiler's buffer last; compiled at its first call (replaced here)
    from tilescale_lang.profiler import EventProfiler

    assert moe._profiled_kernel is None
    rejects(ValueError, "x has 17 tokens", moe.dispatch_profiled, torch.zeros(17, H).half(),
            torch.zeros(17, K, dtype=torch.int32), torch.zeros(17, K), "not checked yet")
    assert moe._profiled_kernel is None  # nothing compiled for a call that failed its checks
    moe._profiled_kernel = LaunchRecorder(launched, "profiled")
    prof = EventProfiler(blocks=moe.blocks + 2, capacity=len(DISPATCH_PHASES), device="cpu")
    recv, counts, handle = moe.dispatch_profiled(x, idx, w, prof)
    assert launched[-1][0] == "profiled" and moe.epoch == 4 and handle.epoch == 4 and recv is moe.recv_x
    assert all(a is b for a, b in zip(launched[-1][1][:17], disp[:17]))
    assert launched[-1][1][17].shape == (moe.blocks, 15) and launched[-1][1][17].data_ptr() == prof.buffer.data_ptr()
    rejects(ValueError, r"profiler must have at least 128 blocks and capacity 7 \(buffer shape \(128, 15\)\), "
            r"got \(128, 13\)", moe.dispatch_profiled, x, idx, w, EventProfiler(blocks=moe.blocks, capacity=6, device="cpu"))
    rejects(ValueError, r"at least 128 blocks", moe.dispatch_profiled, x, idx, w,
            EventProfiler(blocks=moe.blocks - 1, capacity=7, device="cpu"))
    rejects(TypeError, "profiler must be an EventProfiler", moe.dispatch_profiled, x, idx, w, prof.buffer)
    rejects(ValueError, "x has 17 tokens", moe.dispatch_profiled, torch.zeros(17, H).half(),
            torch.zeros(17, K, dtype=torch.int32), torch.zeros(17, K), prof)
    assert moe.epoch == 4

    handle = moe.dispatch(x, idx, w)[2]
    made = DispatchHandle(moe, handle.epoch, handle.num_tokens, handle.counts, handle.recv_offsets,
                          handle.dest_rank, handle.dest_row)  # the dataclass's own __init__: the same handle
    assert list(vars(made)) == list(vars(handle)) == [f.name for f in dataclasses.fields(DispatchHandle)]
    assert all(getattr(made, f.name) is getattr(handle, f.name) for f in dataclasses.fields(DispatchHandle))
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.epoch = 7
    rejects(TypeError, "handle must be a DispatchHandle", moe.combine, y, "handle")
    rejects(RuntimeError, "handle is from dispatch call 3, but dispatch call 5", moe.combine, y,
            DispatchHandle(moe, 3, 5, *[handle.counts] * 4))
    rejects(ValueError, r"y has shape \(64, 32\), expected \(capacity, hidden\) = \(64, 64\)", moe.combine,
            y[:, :32].contiguous(), handle)
    rejects(TypeError, "y has dtype torch.bfloat16", moe.combine, y.bfloat16(), handle)
    rejects(ValueError, "y must be 16-byte aligned", moe.combine,
            torch.empty(cap * H + 1).half()[1:].view(cap, H), handle)
    other = _make(CpuAllocator(num_ranks=2), index_dtype=torch.int32, dtype=torch.float16)
    rejects(TypeError, "handle must be a DispatchHandle returned by this MoEDispatcher", other.combine, y, handle)

    assert repr(moe).startswith("MoEDispatcher(num_experts=8, hidden=64, topk=2, max_tokens=16, dtype=torch.float16, world_size=2")
    moe.close()
    assert moe.closed and moe.recv_x is None and moe.dispatch_kernel is None and moe._profiled_kernel is None
    with pytest.raises(RuntimeError, match="MoEDispatcher is closed"):
        moe.dispatch(x, idx, w)
    with pytest.raises(RuntimeError, match="MoEDispatcher is closed"):  # before compiling anything
        moe.dispatch_profiled(x, idx, w, prof)


@needs_nvcc
def test_repeated_dispatches_and_combines_launch_the_kept_launch(cache_dir, monkeypatch):
    """A dispatch without the host check (``validate=False``) on tensors laid out as the last
    two such calls' launches the kept launch again (no argument check; the call counted, a
    new handle), and so does a combine of the same ``y`` for the same token count; any other
    call (validated, profiled, another token count or tensor) is the full call."""
    from tilescale_examples.moe import dispatcher as module

    check_tensor = module.check_tensor
    moe = _make(CpuAllocator(num_ranks=2), index_dtype=torch.int32, dtype=torch.float16)
    launched, checked = [], []
    moe.dispatch_kernel = LaunchRecorder(launched, "dispatch")
    moe.combine_kernel = LaunchRecorder(launched, "combine")
    monkeypatch.setattr(module, "check_tensor", lambda t, *a: checked.append(a[3]) or check_tensor(t, *a))
    x = torch.randn(5, H).half()
    idx = torch.tensor([[0, 7], [1, -1], [2, 3], [4, 4], [6, 5]], dtype=torch.int32)
    w = torch.rand(5, K)
    y = torch.randn(moe.capacity, H).half()
    for i in range(4):
        recv, counts, handle = moe.dispatch(x, idx, w, validate=False)
        assert recv is moe.recv_x and handle.epoch == moe.epoch == i + 1 and handle.num_tokens == 5
        assert launched[-1][0] == "dispatch" and launched[-1][1][0].data_ptr() == idx.data_ptr()
        assert launched[-1][1][2].data_ptr() == x.data_ptr() and launched[-1][1][3] is moe.packed
        out = moe.combine(y, handle)
        assert out.shape == (5, H) and launched[-1][0] == "combine" and launched[-1][1][0].data_ptr() == y.data_ptr()
    assert checked.count("x") == 2 and checked.count("y") == 2  # the third and fourth calls: relaunched
    assert len(launched) == 8 and moe.combines == 4
    moe.dispatch(x, idx, w)  # validated: the full call, and nothing kept
    assert checked.count("x") == 3 and moe._kept_launch is None
    moe.dispatch(x, idx, w, validate=False), moe.dispatch(x, idx, w, validate=False)
    handle = moe.dispatch(x[:3], idx[:3], w[:3], validate=False)[2]  # another token count: the full call
    assert checked.count("x") == 6 and handle.num_tokens == 3
    assert moe.combine(y, handle).shape == (3, H) and checked.count("y") == 3  # its output differs: the full call
    with pytest.raises(RuntimeError, match="handle is from dispatch call"):
        moe.combine(y, DispatchHandle(moe, 1, 5, *[handle.counts] * 4))  # a stale handle: still refused
    moe.close()
    with pytest.raises(RuntimeError, match="MoEDispatcher is closed"):
        moe.dispatch(x, idx, w, validate=False)


test_constructor_rejects_before_allocating = rejects_before_allocating(
    MoEDispatcher, dict(num_experts=E, hidden=H, topk=K, max_tokens=TMAX, dtype=torch.bfloat16), [
    (dict(hidden=60), ValueError, "hidden must be a multiple of 8"),
    (dict(hidden=0), ValueError, "hidden must be a positive int"),
    (dict(topk=9), ValueError, "topk must be at most 8"),
    (dict(max_tokens=4097), ValueError, "max_tokens must be at most 4096"),
    (dict(num_experts=257), ValueError, "num_experts must be at most 256"),
    (dict(num_experts=7), ValueError, r"num_experts=7 must be a multiple of world_size=2"),
    (dict(dtype=torch.float32), TypeError, "dtype must be one of"),
    (dict(index_dtype=torch.int16), TypeError, "index_dtype must be torch.int64 or torch.int32"),
    (dict(world_size=4), ValueError, r"world_size=4 but the allocator spans 2 rank\(s\)"),
    (dict(validate=1), TypeError, "validate must be a bool"),
])


# ------------------------------------------------------------------------------ GPU
#: (experts, topk, hidden, max_tokens) of the GPU correctness cases: 25 vectors per row (the
#: last lane-column partly used), an odd top-k, experts that 1, 2 and 4 ranks divide.
SMALL = (16, 3, 200, 96)
FULL = (64, 8, 7168, 4096)
#: Up to 1280 entries: more than one block ranks (1024 entries each), at a small hidden size.
WIDE = (16, 8, 200, 160)
# a row that is not a whole number of 256-column parts (897 vectors: the last part has one)
NARROW = (64, 8, 7176, 128)


def _heap_bytes(config, world: int, dispatchers: int = 1) -> int:
    """Heap bytes per rank for ``dispatchers`` dispatchers of ``config`` = ``(experts, topk,
    hidden, max_tokens)``, plus 64 MiB for the rest of the test."""
    experts, topk, hidden, max_tokens = config
    one = MoEDispatcher.heap_bytes(experts, hidden, topk, max_tokens, torch.bfloat16, world_size=world)
    return dispatchers * one + (64 << 20)


def _gather(t: torch.Tensor, world: int) -> list:
    """Every rank's ``t`` (first dims may differ), through the group."""
    import torch.distributed as dist

    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    padded = torch.zeros((int(max(sizes)), *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return [o[:int(s)] for o, s in zip(out, sizes)]


def _routing(kind: str, tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """``(tokens, topk)`` int64 indices: distinct uniform experts, Zipf-skewed experts,
    experts 0 and ``experts - 1`` only with -1 slots and repeats ("sparse"), or anything
    ("dupes": repeats allowed)."""
    if kind == "uniform":
        return torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk].contiguous()
    if kind == "skewed":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.5
        return torch.multinomial(p.expand(tokens, experts), topk, generator=gen) if tokens else \
            torch.zeros(0, topk, dtype=torch.int64)
    if kind == "sparse":
        pick = torch.tensor([0, experts - 1, -1])
        return pick[torch.randint(0, 3, (tokens, topk), generator=gen)]
    return torch.randint(0, experts, (tokens, topk), generator=gen)


def _experts(recv: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A stand-in for the expert MLPs, on the device without host synchronisation: row ``r``
    of local expert ``j`` (of ``EL``) becomes ``recv[r] * (1 + j / (4 EL)) - 1 / 8``."""
    rows = torch.arange(recv.shape[0], device=recv.device, dtype=torch.int32)
    expert = torch.bucketize(rows, offsets[1:].contiguous(), right=True).to(torch.float32)
    return (recv.float() * (1 + expert[:, None] / (4 * (offsets.numel() - 1))) - 0.125).to(recv.dtype)


def _check_call(moe, rank, world, x, idx, w, label, validate=True):
    """One checked dispatch + combine: poisoned buffers, fresh data, references over the
    group's inputs; dispatch bit-exact, combine within the documented tolerance."""
    moe.recv_x.fill_(-777)
    moe.recv_counts.fill_(-7)
    moe.output.fill_(-777)
    recv, counts, handle = moe.dispatch(x, idx, w, validate=validate)
    y = _experts(recv, handle.recv_offsets)
    out = moe.combine(y, handle)
    torch.cuda.synchronize()
    xs, idxs, ws = _gather(x, world), _gather(idx, world), _gather(w, world)
    rows, want_counts, origin = torch_dispatch_reference(xs, idxs, moe.num_experts, rank)
    total = rows.shape[0]
    where = f"rank {rank}/{world} {label}"
    assert counts.tolist() == want_counts.tolist(), f"{where}: counts {counts.tolist()} != {want_counts.tolist()}"
    assert handle.recv_offsets.tolist() == [0] + want_counts.cumsum(0).tolist(), where
    if not torch.equal(recv[:total], rows):
        bad = (recv[:total] != rows).any(1).nonzero()[:5].view(-1).tolist()
        raise AssertionError(f"{where}: received rows differ at {bad} of {total}")
    src_rank, src_entry = handle.origin()
    assert torch.equal(torch.stack([src_rank[:total], src_entry[:total]], 1).cpu().long(), origin), where
    ys = _gather(y[:int(handle.recv_offsets[-1])], world)
    want = torch_combine_reference(ys, idxs, ws, moe.num_experts, rank)
    rtol = COMBINE_RTOL[moe.dtype]
    if not torch.allclose(out.double(), want, rtol=rtol, atol=COMBINE_ATOL):
        err = ((out.double() - want).abs() - rtol * want.abs()).max().item()
        raise AssertionError(f"{where}: combine off by {err:g} beyond rtol {rtol:g}")
    return 1


def _check_routings(moe, rank, world, cases, gen, label: str) -> int:
    """``_check_call`` on fresh bfloat16 tokens, routing and softmax weights for every ``(kind,
    tokens)`` of ``cases`` (drawn in that order from ``gen``); returns the checks made."""
    checks = 0
    for kind, tokens in cases:
        x = torch.randn(tokens, moe.hidden, generator=gen).to(torch.bfloat16).to(moe.device)
        idx = _routing(kind, tokens, moe.num_experts, moe.topk, gen).to(moe.device)
        w = torch.softmax(torch.randn(tokens, moe.topk, generator=gen), 1).to(moe.device)
        checks += _check_call(moe, rank, world, x, idx, w, f"{tokens} tokens {kind}, {label}")
    return checks


def _back_to_back(moe, rank, world, calls, gen):
    """``calls`` dispatch + combine pairs without host synchronisation (every third call
    combines twice: the second one repeats the routing, so it runs the ready handshake), 4
    rotating input sets (checked once above), a straggling rank every 50 calls, poisoned
    buffers each call; every result must equal the checked one bit for bit."""
    dev = moe.device
    sets, checks = [], 0
    for s in range(4):
        tokens = moe.max_tokens - 7 * s - rank
        x = torch.randn(tokens, moe.hidden, generator=gen).to(moe.dtype).to(dev)
        idx = _routing("uniform" if s % 2 else "skewed", tokens, moe.num_experts, moe.topk, gen).to(dev, moe.index_dtype)
        w = (torch.rand(tokens, moe.topk, generator=gen) / moe.topk).to(dev)
        checks += _check_call(moe, rank, world, x, idx, w, f"back-to-back set {s}")
        recv, counts, handle = moe.dispatch(x, idx, w, validate=False)
        y = _experts(recv, handle.recv_offsets)
        sets.append((x, idx, w, recv.clone(), counts.clone(), moe.combine(y, handle).clone()))
    rows = torch.arange(moe.capacity, device=dev)[:, None]
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    for call in range(calls):
        x, idx, w, want_recv, want_counts, want_out = sets[call % 4]
        if call % 50 == 0 and rank == (call // 50) % world:
            torch.cuda._sleep(2_000_000)  # this rank arrives late (about 1 ms)
        moe.recv_x.fill_(-777)
        moe.output.fill_(-777)
        recv, counts, handle = moe.dispatch(x, idx, w, validate=False)
        valid = rows < handle.recv_offsets[-1]
        mismatches += ((recv != want_recv) & valid).sum() + (counts != want_counts).sum()
        y = _experts(recv, handle.recv_offsets)
        out = moe.combine(y, handle)  # after a dispatch: no ready handshake
        mismatches += (out != want_out).sum()
        if call % 3 == 0:  # the same routing combined again: with the ready handshake
            moe.output.fill_(-777)
            mismatches += (moe.combine(y, handle) != want_out).sum()
    torch.cuda.synchronize()
    assert int(mismatches) == 0, f"rank {rank}/{world}: {int(mismatches)} wrong elements over {calls} calls"
    return checks + 1


def _on_one_buffer(moe, rank, world, gen, calls: int = 60) -> int:
    """A serving loop's steady state: dispatch and combine on the same buffers, refilled in
    place with one of 3 checked input sets (one token count) before every call,
    ``validate=False``, a straggling rank every 20 calls, poisoned outputs: from the third
    call on the dispatcher launches its kept launches (frozen from the fourth). Every result
    must equal its set's bit for bit."""
    dev = moe.device
    tokens = moe.max_tokens - 3 - rank
    bufs = (torch.empty(tokens, moe.hidden, dtype=moe.dtype, device=dev),
            torch.empty(tokens, moe.topk, dtype=moe.index_dtype, device=dev), torch.empty(tokens, moe.topk, device=dev))
    y = torch.empty(moe.capacity, moe.hidden, dtype=moe.dtype, device=dev)
    sets, checks = [], 0
    for s, kind in enumerate(("uniform", "skewed", "dupes")):
        x = torch.randn(tokens, moe.hidden, generator=gen).to(moe.dtype).to(dev)
        idx = _routing(kind, tokens, moe.num_experts, moe.topk, gen).to(dev, moe.index_dtype)
        w = (torch.rand(tokens, moe.topk, generator=gen) / moe.topk).to(dev)
        checks += _check_call(moe, rank, world, x, idx, w, f"one-buffer set {s}")
        recv, counts, handle = moe.dispatch(x, idx, w, validate=False)
        sets.append(((x, idx, w), recv.clone(), counts.clone(),
                     moe.combine(_experts(recv, handle.recv_offsets), handle).clone()))
    rows = torch.arange(moe.capacity, device=dev)[:, None]
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    for call in range(calls):
        inputs, want_recv, want_counts, want_out = sets[call % 3]
        for buf, src in zip(bufs, inputs):
            buf.copy_(src)
        if call % 20 == 0 and rank == (call // 20) % world:
            torch.cuda._sleep(2_000_000)  # this rank arrives late (about 1 ms)
        moe.recv_x.fill_(-777)
        moe.output.fill_(-777)
        recv, counts, handle = moe.dispatch(*bufs, validate=False)
        mismatches += ((recv != want_recv) & (rows < handle.recv_offsets[-1])).sum() + (counts != want_counts).sum()
        y.copy_(_experts(recv, handle.recv_offsets))
        mismatches += (moe.combine(y, handle) != want_out).sum()
    torch.cuda.synchronize()
    assert moe._kept_launch is not None and moe._kept_combine is not None, f"rank {rank}: no launch was kept"
    assert moe._kept_launch.frozen is not None and moe._kept_combine.frozen is not None, f"rank {rank}: not repeated"
    assert int(mismatches) == 0, f"rank {rank}/{world}: {int(mismatches)} wrong elements over {calls} calls on one buffer"
    return checks + 1


def _graph_capture(moe, rank, world, gen):
    """Capture dispatch + experts + combine in a CUDA graph (validate=False) and replay it on
    fresh inputs copied into the captured tensors; each replay is checked."""
    dev = moe.device
    tokens = moe.max_tokens - 3
    x = torch.empty(tokens, moe.hidden, dtype=moe.dtype, device=dev)
    idx = torch.zeros(tokens, moe.topk, dtype=moe.index_dtype, device=dev)
    w = torch.zeros(tokens, moe.topk, device=dev)

    def step():
        recv, counts, handle = moe.dispatch(x, idx, w, validate=False)
        return moe.combine(_experts(recv, handle.recv_offsets), handle)

    step()  # warm-up outside the capture (module load, table upload)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe.dispatch(x, idx, w, validate=True)
    with torch.cuda.graph(graph):
        out = step()
    checks = 0
    for replay in range(3):
        x.copy_(torch.randn(tokens, moe.hidden, generator=gen).to(moe.dtype))
        idx.copy_(_routing("dupes" if replay else "uniform", tokens, moe.num_experts, moe.topk, gen))
        w.copy_(torch.rand(tokens, moe.topk, generator=gen) / moe.topk)
        moe.output.fill_(-777)
        graph.replay()
        torch.cuda.synchronize()
        xs, idxs, ws = (_gather(t, world) for t in (x, idx, w))
        offsets = moe.recv_offsets[:moe.experts_per_rank + 1]
        ys = _gather(_experts(moe.recv_x, offsets)[:int(offsets[-1])], world)
        want = torch_combine_reference(ys, idxs, ws, moe.num_experts, rank)
        rows, _, _ = torch_dispatch_reference(xs, idxs, moe.num_experts, rank)
        assert torch.equal(moe.recv_x[:rows.shape[0]], rows), f"rank {rank}: graph replay {replay} dispatch"
        assert torch.allclose(out.double(), want, rtol=COMBINE_RTOL[moe.dtype], atol=COMBINE_ATOL), \
            f"rank {rank}: graph replay {replay} combine"
        checks += 1
    return checks


def _index_errors(moe, rank, world, gen):
    """validate=True: every rank passes a bad index and gets ValueError before anything is
    sent (and the next call works); validate=False: rank ``world - 1`` passes bad indices,
    the call completes everywhere with those slots skipped and only that rank's
    check_index_errors() raises."""
    dev = moe.device
    tokens = 40
    x = torch.randn(tokens, moe.hidden, generator=gen).to(moe.dtype).to(dev)
    idx = _routing("dupes", tokens, moe.num_experts, moe.topk, gen).to(dev, moe.index_dtype)
    w = (torch.rand(tokens, moe.topk, generator=gen) / moe.topk).to(dev)
    bad = idx.clone()
    bad[7, 1] = moe.num_experts + rank
    with pytest.raises(ValueError, match=rf"topk_idx\[7, 1\] = {moe.num_experts + rank} is out of range.*nothing was sent"):
        moe.dispatch(x, bad, w)
    checks = _check_call(moe, rank, world, x, idx, w, "after a rejected call")
    if rank == world - 1:
        idx = idx.clone()
        idx[3, 0], idx[11, 2] = -5, moe.num_experts
    checks += _check_call(moe, rank, world, x, idx, w, "bad indices skipped on the device", validate=False)
    if rank == world - 1:
        with pytest.raises(ValueError, match=rf"topk_idx\[3, 0\] = -5 is out of range.*\(2 bad entries\); the dispatch skipped them"):
            moe.check_index_errors()
    else:
        moe.check_index_errors()
    return checks


GPU_CASES = [("uniform", torch.bfloat16, torch.int64), ("skewed", torch.bfloat16, torch.int64),
             ("sparse", torch.bfloat16, torch.int64), ("dupes", torch.float16, torch.int32),
             ("skewed", torch.float16, torch.int32)]


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: the routing cases (bf16/int64 and fp16/int32; a rank with no tokens in the
    sparse case), graph capture, index errors, back-to-back calls (1000 on 1 or 2 ranks,
    200 on 4) and 60 calls on one set of buffers (the kept launches, on the fp16 dispatcher:
    never captured), all at SMALL size."""
    experts, topk, hidden, max_tokens = SMALL
    alloc = open_rank_heap(rank, world, cache_dir, _heap_bytes(SMALL, world, dispatchers=2))
    dev = torch.device(alloc.device)
    gen = torch.Generator().manual_seed(1234 + 97 * rank + 7 * world)
    checks = 0
    dispatchers = {}
    for case, (kind, dtype, index_dtype) in enumerate(GPU_CASES):
        if (dtype, index_dtype) not in dispatchers:  # collective: same order on every rank
            dispatchers[dtype, index_dtype] = MoEDispatcher(alloc, experts, hidden, topk, max_tokens, dtype,
                                                            index_dtype=index_dtype)
        moe = dispatchers[dtype, index_dtype]
        tokens = 0 if kind == "sparse" and rank == world - 1 and world > 1 else max_tokens - 5 * case - rank
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(dev)
        idx = _routing(kind, tokens, experts, topk, gen).to(index_dtype).to(dev)
        w = (torch.rand(tokens, topk, generator=gen) / topk).to(dev)
        checks += _check_call(moe, rank, world, x, idx, w, f"case {case} {kind} {dtype}")
    moe = dispatchers[torch.bfloat16, torch.int64]
    checks += _graph_capture(moe, rank, world, gen)
    checks += _index_errors(moe, rank, world, gen)
    checks += _back_to_back(moe, rank, world, 1000 if world <= 2 else 200, gen)
    # an instance once captured in a CUDA graph keeps no launch (docs/launch.md): the other one
    checks += _on_one_buffer(dispatchers[torch.float16, torch.int32], rank, world, gen)
    for moe in dispatchers.values():
        moe.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, 4, timeout=300, cache="moe")
def test_moe_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), len(GPU_CASES) + 3 + 2 + 5 + 4)


def full_size_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: 4096 tokens, hidden 7168, top-8 of 64 experts, bf16, uniform and skewed; on
    the default grid (32 ranking blocks, one batch of 32 entries per warp) and on a 3-block
    grid (each warp ranks 11 batches: whole and partial chunks, offsets across blocks). On
    the default grid also 128 tokens (1024 entries: one ranking block, so every block plans),
    129 (two ranking blocks) and 128 + rank % 2 (with 2 ranks, one plans in every block and
    the other hands block 0's plan over, in the same call)."""
    experts, topk, hidden, max_tokens = FULL
    alloc = open_rank_heap(rank, world, cache_dir, _heap_bytes(FULL, world, dispatchers=2))
    gen = torch.Generator().manual_seed(99 + rank)
    checks = 0
    for max_blocks in (None, 3):
        moe = MoEDispatcher(alloc, experts, hidden, topk, max_tokens, torch.bfloat16, max_blocks=max_blocks)
        cases = [("uniform", max_tokens), ("skewed", max_tokens)]
        if max_blocks is None:
            cases += [("uniform", 128), ("skewed", 129), ("uniform", 128 + rank % 2)]
        checks += _check_routings(moe, rank, world, cases, gen, f"max_blocks={max_blocks}")
        moe.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, timeout=300, cache="moe-full")
def test_moe_full_size_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(full_size_rank_body(rank, world_size, kernel_cache), 7)


def narrow_grid_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: small batches (128 tokens of top-8 = 1024 entries, 37 tokens, 128 + rank % 2
    with 2 ranks) on a 2-block grid, so every warp stores hundreds of row pieces and loads
    most parts in the data loop (not only the two loaded at the kernel's start), with rows of
    897 16-byte vectors (the last piece has one); uniform and skewed, then 50 back-to-back
    calls."""
    experts, topk, hidden, max_tokens = NARROW
    alloc = open_rank_heap(rank, world, cache_dir, _heap_bytes(NARROW, world))
    gen = torch.Generator().manual_seed(555 + rank)
    moe = MoEDispatcher(alloc, experts, hidden, topk, max_tokens, torch.bfloat16, max_blocks=2)
    cases = [("uniform", 128), ("skewed", 37), ("uniform", 127 + rank % 2)]
    checks = _check_routings(moe, rank, world, cases, gen, "2 blocks")
    checks += _back_to_back(moe, rank, world, 50, gen)
    moe.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(1, 2, timeout=300, cache="moe-narrow")
def test_moe_small_batch_on_a_two_block_grid_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(narrow_grid_rank_body(rank, world_size, kernel_cache), 3 + 5)


def wide_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Per rank: 200 back-to-back calls with stragglers at 138-160 tokens of top-8 (1104-1280
    entries: two ranking blocks, so block 0 plans and hands the plan to the other blocks)."""
    experts, topk, hidden, max_tokens = WIDE
    alloc = open_rank_heap(rank, world, cache_dir, _heap_bytes(WIDE, world))
    gen = torch.Generator().manual_seed(4321 + rank)
    moe = MoEDispatcher(alloc, experts, hidden, topk, max_tokens, torch.bfloat16)
    checks = _back_to_back(moe, rank, world, 200, gen)
    moe.close()
    return close_rank_heap(alloc, rank, checks)


@gpu_rank_test(2, timeout=300, cache="moe-wide")
def test_moe_two_ranking_blocks_back_to_back_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(wide_rank_body(rank, world_size, kernel_cache), 5)


# ------------------------------------------------------------------------------ benchmark (CPU)
def torch_path_rank_body(rank: int, world: int) -> int:
    """The benchmark's torch all-to-all path on a CPU gloo group equals the references."""
    import torch.distributed as dist

    from tilescale_examples.benchmarks.moe import TorchAllToAllMoE, make_routing

    experts, topk, hidden = 8, 3, 16
    gen = torch.Generator().manual_seed(rank)
    path = TorchAllToAllMoE(experts, dist.group.WORLD, world)
    checks = 0
    for kind, tokens in (("uniform", 13 + rank), ("skewed", 9)):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        idx = make_routing(kind, tokens, experts, topk, gen)
        w = torch.softmax(torch.randn(tokens, topk, generator=gen), 1)
        rows, counts = path.dispatch(x, idx)
        xs, idxs, ws = _gather(x, world), _gather(idx, world), _gather(w, world)
        want, want_counts, _ = torch_dispatch_reference(xs, idxs, experts, rank)
        assert torch.equal(rows, want) and counts.tolist() == want_counts.tolist()
        ys = _gather(rows, world)
        out = path.combine(rows, w)
        ref = torch_combine_reference(ys, idxs, ws, experts, rank)
        assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), ref, rtol=COMBINE_RTOL[torch.bfloat16], atol=COMBINE_ATOL)
        checks += 1
    return checks


@pytest.mark.timeout(120)
def test_benchmark_torch_path_matches_the_reference_layout():
    from tilescale_core.multiprocess import run_ranks

    assert run_ranks(torch_path_rank_body, 2, backend="gloo", timeout=100) == [2, 2]


def test_benchmark_routing_and_arguments(monkeypatch, capsys):
    from tilescale_examples.benchmarks import moe as bench

    g = torch.Generator().manual_seed(0)
    for kind in ("uniform", "skewed"):
        idx = bench.make_routing(kind, 500, 64, 8, g)
        assert idx.shape == (500, 8) and idx.dtype == torch.int64 and int(idx.min()) >= 0 and int(idx.max()) < 64
        assert all(len(set(row)) == 8 for row in idx.tolist())  # distinct experts per token
    skew = torch.bincount(bench.make_routing("skewed", 2000, 64, 8, g).view(-1), minlength=64)
    assert skew[0] > 3 * skew[32:].float().mean()
    with pytest.raises(ValueError, match="routing must be"):
        bench.make_routing("hot", 1, 4, 1, g)
    for argv, message in ((["--tokens", "0"], "--tokens must be in [1, 4096]"),
                          (["--tokens", "4097"], "--tokens must be in [1, 4096]"),
                          (["--tokens", "a"], "--tokens must be comma-separated ints"),
                          (["--routing", "zipf"], "--routing must list uniform and/or skewed"),
                          (["--topk", "9"], "need 1 <= --topk <= min(8, --experts)"),
                          (["--hidden", "100"], "--hidden a positive multiple of 8"),
                          (["--ranks", "0"], "--ranks must be >= 1"),
                          (["--mode", "low_latency", "--ll-blocks", "0"], "--ll-blocks must be >= 1"),
                          (["--threads", "100"], "--threads must be a multiple of 32 in [32, 1024]"),
                          (["--threads", "2048"], "--threads must be a multiple of 32 in [32, 1024]")):
        exits_naming(bench.main, argv, message, capsys)
    out = output_without_gpu(bench.main, [], monkeypatch, capsys)
    assert out == "MoE benchmark: no CUDA GPU visible, nothing to measure\n"


def test_phase_benchmark_offsets_and_arguments(monkeypatch, capsys):
    from tilescale_examples.benchmarks import moe_phases
    from tilescale_lang.profiler import Event

    def ev(block, task, ns):
        return Event(block=block, warp=0, sm=block, task=task, is_start=True, time_ns=ns)

    # two blocks; phase 1 only in block 1, phase 3 in neither: left out
    events = [ev(0, 0, 10_000), ev(1, 0, 10_400), ev(1, 1, 11_000), ev(0, 2, 12_000), ev(1, 2, 13_000)]
    rows = moe_phases.phase_offsets(events, ("start", "loaded", "ranked", "scanned"))
    assert rows == [("start", 0.0, 0.2, 0.4), ("loaded", 1.0, 1.0, 1.0), ("ranked", 2.0, 2.5, 3.0)]
    with pytest.raises(ValueError, match="no 'start' event was recorded"):
        moe_phases.phase_offsets(events[2:], ("start", "loaded", "ranked"))
    for argv, message in ((["--tokens", "0"], "--tokens must be in [1, 4096]"),
                          (["--tokens", "x"], "--tokens must be comma-separated ints"),
                          (["--routing", "hot"], "--routing must list uniform and/or skewed"),
                          (["--hidden", "12"], "--hidden a positive multiple of 8"),
                          (["--replays", "0"], "--replays and --ranks must be >= 1"),
                          (["--iters", "0"], "--iters >= 1"),
                          (["--ranks", "3"], "--experts=64 must be a multiple of --ranks=3")):
        exits_naming(moe_phases.main, argv, message, capsys)
    out = output_without_gpu(moe_phases.main, [], monkeypatch, capsys)
    assert out == "MoE dispatch phases: no CUDA GPU visible, nothing to measure\n"
