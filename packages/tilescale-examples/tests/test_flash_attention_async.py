"""The async flash-attention pipeline (tilescale_examples.sequence.flash_attention_async).

CPU: the protocol of its two rings (K and V stages, their full and empty barriers, TMA loads
landing in any order, WGMMA groups retiring in order) under random interleavings for 1-3
stages and 1-9 key tiles (no deadlock, no stage reloaded while a group reads it, every group
reads its own tile); the generated CUDA (producer and consumer warpgroups, the scores GEMM of a
tile and the output GEMM of the one before in flight together, the softmax between the waits,
the fences, the causal loop bound and tail mask of the sync kernel); nvcc without spills at
head dims 64, 128 and 256; the ``pipeline`` argument. GPU (``gpu``): outputs and log-sum-exps
against the float32 reference and the sync kernel for every case of the sync kernel's GPU
test, fresh inputs and poisoned outputs; 200 back-to-back calls; a side stream and CUDA graph
replays; two calls at once on two streams."""

from __future__ import annotations

import random

import re

import pytest
import torch
from examples_helpers import exits_naming, in_order, lower_with, needs_nvcc, nvcc_resources
from pipeline_model import Barrier
from test_flash_attention import CASES, _inputs

from tilescale_examples.sequence.flash_attention import (build_flash_attention_kernel, compile_options,
                                                         default_tiles, flash_attention, torch_reference)


# ------------------------------------------------------------------------------ the protocol
def simulate(stages: int, tiles: int, rng, release_v_early: bool = False, unguarded_tail: bool = False) -> list:
    """The async attention pipeline's protocol over one block's ``tiles`` key tiles with
    ``stages`` stages per ring, under a random interleaving drawn from ``rng``: the producer
    warp (per tile: wait until K's stage is empty, load it, arrive; the same for V), the TMA
    loads landing in any order, the consumer threads (per tile ``k``: wait for K[k], issue the
    scores group; for ``k > 0`` wait for V[k - 1] and issue its output group; wait until one
    group is left in flight (none for ``k = 0``), release K[k]; wait for all, release V[k - 1];
    after the last tile the last output group, waited for, its V released; none with no tile)
    and the WGMMA groups retiring in order. Returns the ``(ring, tile)`` reads in issue order;
    an AssertionError on a deadlock, a stage reloaded while a group reads it or before it was
    read, or a group reading a stage that does not hold its tile. ``release_v_early``: a mutant
    that releases V[k - 1] at the one-group wait, while its output group may still read it;
    ``unguarded_tail``: a mutant that issues the last output group with no tile too (tile -1:
    a stage no load filled)."""
    S = stages
    rings = {name: {"full": [Barrier(1) for _ in range(S)], "empty": [Barrier(1) for _ in range(S)],
                    "data": [None] * S, "read": set()} for name in "KV"}
    loads, groups, reads = [], [], []

    def producer_ops():
        for k in range(tiles):
            for name in "KV":
                yield ("wait_empty", name, k)
                yield ("arrive_full", name, k)

    def consumer_ops():
        for k in range(tiles):
            yield ("issue", "K", k)
            if k > 0:
                yield ("issue", "V", k - 1)
            yield ("wait_groups", 1 if k > 0 else 0)
            yield ("release", "K", k)
            if k > 0 and release_v_early:
                yield ("release", "V", k - 1)
            yield ("wait_groups", 0)
            if k > 0 and not release_v_early:
                yield ("release", "V", k - 1)
        if tiles > 0 or unguarded_tail:
            yield ("issue", "V", tiles - 1)
            yield ("wait_groups", 0)
            yield ("release", "V", tiles - 1)

    def run(op) -> bool:
        kind, *rest = op
        if kind == "wait_empty":
            name, k = rest
            ring, s = rings[name], k % S
            if not ring["empty"][s].passes(((k // S) & 1) ^ 1):
                return False
            assert all(g[:2] != (name, s) for g in groups), f"{name} stage {s} reloaded while a WGMMA group reads it"
            assert ring["data"][s] is None or ring["data"][s] in ring["read"], f"{name} stage {s} reloaded unread"
            ring["full"][s].expect(1)
            ring["data"][s] = None
            loads.append((name, s, k))
        elif kind == "arrive_full":
            name, k = rest
            rings[name]["full"][k % S].arrive()
        elif kind == "issue":
            name, k = rest
            ring, s = rings[name], k % S
            if not ring["full"][s].passes((k // S) & 1):
                return False
            assert ring["data"][s] == k, f"tile {k} reads {name} stage {s} holding {ring['data'][s]}"
            groups.append((name, s, k))
            ring["read"].add(k)
            reads.append((name, k))
        elif kind == "wait_groups":
            if len(groups) > rest[0]:
                return False
        else:  # release
            name, k = rest
            rings[name]["empty"][k % S].arrive()
        return True

    def land() -> bool:
        if not loads:
            return False
        name, s, k = loads.pop(rng.randrange(len(loads)))
        rings[name]["data"][s] = k
        rings[name]["full"][s].land(1)
        return True

    def retire() -> bool:
        if not groups:
            return False
        name, s, k = groups.pop(0)
        assert rings[name]["data"][s] == k, f"{name} stage {s} changed under the WGMMA group of tile {k}"
        return True

    programs = {"producer": producer_ops(), "consumer": consumer_ops()}
    current = {who: next(ops, None) for who, ops in programs.items()}

    def step(who):
        def go() -> bool:
            op = current[who]
            if op is None or not run(op):
                return False
            current[who] = next(programs[who], None)
            return True
        return go

    actors = [step("producer"), step("consumer"), land, retire]
    while current["consumer"] is not None or groups:
        rng.shuffle(actors)
        assert any(actor() for actor in actors), f"deadlock: producer at {current['producer']}, consumer at " \
                                                 f"{current['consumer']}"
    return reads


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 9])
def test_the_protocol_reads_every_tile_once_in_order_and_never_deadlocks(stages, tiles):
    rng = random.Random(stages * 100 + tiles)
    want = [("K", 0)] + [x for k in range(1, tiles) for x in (("K", k), ("V", k - 1))] + [("V", tiles - 1)]
    for _ in range(300):
        assert simulate(stages, tiles, rng) == (want if tiles else [])


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_an_output_group_with_no_tile_is_caught(stages):
    """A block with no key tile (the SP peer kernel's first-chunk blocks of zigzag rank 0)
    issues no output group: the model catches the mutant that issues the last one anyway,
    reading a V stage that no load filled."""
    with pytest.raises(AssertionError, match="tile -1 reads V stage"):
        simulate(stages, 0, random.Random(stages), unguarded_tail=True)


def test_releasing_v_before_its_group_finished_is_caught():
    """The model catches the mistake it guards against: a V stage released at the one-group
    wait (while its output group may still read it) is reloaded under that group in some
    interleaving."""
    rng = random.Random(7)
    failures = 0
    for _ in range(300):
        try:
            simulate(1, 4, rng, release_v_early=True)
        except AssertionError as error:
            assert "reloaded while a WGMMA group reads it" in str(error) or "changed under" in str(error)
            failures += 1
    assert failures > 0


# ------------------------------------------------------------------------------ generated code
def _source(causal=False, seq=1024, D=128, **tiles):
    return lower_with(build_flash_attention_kernel(1, 8, 2, seq, seq, D, causal, D ** -0.5,
                                                   **{**default_tiles(D, "async"), **tiles}, pipeline="async"), {})


def test_the_two_gemms_are_in_flight_together_and_the_softmax_runs_between_the_waits():
    src = _source()
    loop = src[src.index("for (int kb_1 = 0;"):]
    assert in_order(loop, "k_full[", ".wait(", "wgmma_ss<", "v_full[", ".wait(", "wgmma_rs<", "wait_wgmma<1>()",
                    "warpgroup_fence_operand(reinterpret_cast<float*>(scores + 0), 64)", "k_empty[", ".arrive()",
                    "exp2", "wait_wgmma<0>()", "warpgroup_fence_operand(reinterpret_cast<float*>(out + 0), 64)",
                    "warpgroup_fence_operand(reinterpret_cast<uint32_t*>(probs + 0), 32)", "v_empty[", ".arrive()",
                    "__float22bfloat162_rn")
    # after the loop: the last tile's output GEMM (none without a key tile), waited for, its stage
    # released, then the rows stored
    tail = src[src.rindex("wgmma_rs<"):]
    assert in_order(tail, "wait_wgmma<0>()", "v_empty[", ".arrive()", "LSE[")



def test_a_block_with_no_key_tile_issues_no_output_gemm():
    """The SP peer kernel's key tile count is a run-time value, 0 for the first-chunk blocks of
    zigzag rank 0: the last output GEMM, its wait and its stage's release are inside
    ``if (0 < tiles)`` after the loop (unguarded, such a block multiplied P = 0 by a V stage no
    load filled: NaN where that shared memory held NaN bits)."""
    from tilescale_examples.sequence.sp_kernels import build_sp_peer_attention_kernel

    src = lower_with(build_sp_peer_attention_kernel(4, 1, 256, 4, 2, 128, True, 128 ** -0.5, "bfloat16", 128, 128,
                                                    2, 256, "zigzag", "async"), {})
    tail = src[src.rindex("if (0 < condval"):]
    assert "for (int kb" not in tail and "k_full[" not in tail  # after the key-tile loop
    assert in_order(tail, "v_full[", ".wait(", "wgmma_rs<", "wait_wgmma<0>()", "v_empty[", ".arrive()", "LSE[")


def test_producer_and_consumer_warpgroups_and_their_registers():
    src = _source()
    assert in_order(src, "if (((int)threadIdx.x) < 128)", "warpgroup_reg_dealloc<40>()", "tma_load(Q_desc",
                    "tma_load(K_desc", "tma_load(V_desc", "warpgroup_reg_alloc<232>()")
    assert src.count("k_empty[0].init(256)") == 1 and src.count("k_full[0].init(32)") == 1


def test_causal_bound_and_tail_mask_are_the_sync_kernels():
    sync = lower_with(build_flash_attention_kernel(1, 8, 2, 1000, 1000, 128, True, 128 ** -0.5), {})
    src = _source(causal=True, seq=1000)
    bound = "kb_1 < min(8, (((q_start + 1151) >> 7) - ((int)blockIdx.x)))"
    assert bound in src and bound.replace("kb_1", "kb") in sync
    assert src.count("float condval;") >= 1 and "q_start" in src[src.index("float condval;"):]


@needs_nvcc
@pytest.mark.parametrize("D", [64, 128, 256])
def test_kernel_compiles_without_spills(D, tmp_path):
    import tilelang
    from tilelang import tvm

    from tilescale_examples.base import TARGET

    func = build_flash_attention_kernel(1, 4, 2, 1000, 1000, D, True, D ** -0.5, **default_tiles(D, "async"),
                                        pipeline="async")
    with tvm.transform.PassContext(config=compile_options(True)), tvm.target.Target(TARGET):
        src = tilelang.lower(func, target=TARGET).kernel_source
    _, spills = nvcc_resources(src, tmp_path)
    assert spills == 0


# ------------------------------------------------------------------------------ the argument
def test_pipeline_argument_and_defaults(capsys):
    from tilescale_examples.benchmarks.attention import main, tiles_label
    from tilescale_examples.sequence.flash_attention import check_tiles

    assert default_tiles(128, "async") == {"block_m": 128, "block_n": 128, "num_stages": 2, "threads": 256}
    assert default_tiles(128) == default_tiles(128, "sync") and default_tiles(128)["num_stages"] == 1
    assert tiles_label(check_tiles({}, 128, "async")) == "128x128:2:256"  # the default pipeline
    assert tiles_label(check_tiles({}, 128), False, "sync") == "128x128:1:256 sync ieee"
    q = torch.zeros(1, 256, 4, 64, dtype=torch.bfloat16)
    for bad in ("fast", None, 1):
        with pytest.raises(ValueError, match="pipeline must be one of"):
            flash_attention(q, q, q, pipeline=bad)
    exits_naming(main, ["--pipeline", "fast"], "--pipeline", capsys)


# ------------------------------------------------------------------------------ GPU
GPU_CASES = CASES  # the sync kernel's GPU cases: B, Sq, Skv, H, Hkv, D, causal, dtype


def _poisoned(q, H):
    B, Sq, _, D = q.shape
    return (torch.full((B, Sq, H, D), float("nan"), dtype=q.dtype, device="cuda"),
            torch.full((B, H, Sq), float("nan"), device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_gpu_async_attention_matches_the_reference_and_the_sync_kernel(case):
    """Three seeds, the third compiled without fast math; the sync kernel on the same inputs
    within the same bound (the same arithmetic in another order of issue)."""
    B, Sq, Skv, H, Hkv, D, causal, dtype = case
    for seed in range(3):
        q, k, v = _inputs(B, Sq, Skv, H, Hkv, D, dtype, "cuda", seed)
        out, lse = _poisoned(q, H)
        flash_attention(q, k, v, causal=causal, out=out, lse=lse, fast_math=seed != 2, pipeline="async")
        sync_o, sync_lse = flash_attention(q, k, v, causal=causal, fast_math=seed != 2, pipeline="sync")
        want_o, want_lse = torch_reference(q, k, v, causal=causal)
        torch.cuda.synchronize()
        for got, want, tol in ((out.float(), want_o, 2e-2), (lse, want_lse, 1e-3), (out.float(), sync_o.float(), 2e-2),
                               (lse, sync_lse, 1e-3)):
            assert torch.allclose(got, want, atol=tol, rtol=tol), (seed, (got - want).abs().max())


@pytest.mark.gpu
def test_gpu_async_attention_back_to_back_side_stream_and_graph_replays():
    shape, H = (1, 2048, 2048, 16, 4, 128), 16
    inputs = [_inputs(*shape, torch.bfloat16, "cuda", seed) for seed in range(4)]
    wants = [torch_reference(q, k, v, causal=True)[0] for q, k, v in inputs]
    outs = [_poisoned(inputs[0][0], H)[0] for _ in range(200)]
    for i, out in enumerate(outs):  # no host synchronisation between calls
        flash_attention(*inputs[i % 4], causal=True, out=out, pipeline="async")
    torch.cuda.synchronize()
    for i in range(4):
        assert torch.allclose(outs[i].float(), wants[i], atol=2e-2, rtol=2e-2), f"call {i}"
    assert all(torch.equal(outs[i], outs[i % 4]) for i in range(4, len(outs)))

    q, k, v = (t.clone() for t in inputs[0])
    out, lse = _poisoned(q, H)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attention(q, k, v, causal=True, out=out, lse=lse, pipeline="async")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, outs[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_attention(q, k, v, causal=True, out=out, lse=lse, pipeline="async")
    for i in (1, 2, 3):
        for dst, src in zip((q, k, v), inputs[i]):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, outs[i]), f"graph replay {i}"


@pytest.mark.gpu
def test_gpu_async_attention_two_calls_at_once_on_two_streams():
    """Two calls in flight together on two side streams (each 50 calls, no host
    synchronisation between them, other inputs and outputs): each stream's outputs are the
    bits of the same call made alone (the kernel keeps no state between calls)."""
    shape, H = (1, 2048, 2048, 16, 4, 128), 16
    inputs = [_inputs(*shape, torch.bfloat16, "cuda", seed) for seed in (10, 11)]
    alone = [flash_attention(q, k, v, causal=True, pipeline="async")[0] for q, k, v in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[_poisoned(inputs[0][0], H)[0] for _ in range(50)] for _ in streams]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for i in range(50):  # interleaved: the two streams' kernels overlap on the GPU
        for s, (q, k, v), out in zip(streams, inputs, outs):
            with torch.cuda.stream(s):
                flash_attention(q, k, v, causal=True, out=out[i], pipeline="async")
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for j, want in enumerate(alone):
        bad = [i for i, out in enumerate(outs[j]) if not torch.equal(out, want)]
        assert not bad, f"stream {j}: calls {bad[:5]} differ from the call made alone"
