"""The reduction-ceiling benchmark: its variants, the generated CUDA (nvcc compiles
every kind of variant without spills or a stack frame), its arguments, and on a GPU a small
sweep whose every kernel matches the rank-order reference bit for bit (``-m gpu``)."""

from __future__ import annotations

import re

import pytest
from examples_helpers import TOOLKIT, exits_naming, needs_nvcc

from tilescale_examples.benchmarks import reduce_ceiling as rc


def test_variants_cover_the_valid_combinations_once():
    vs = rc.variants(rc.OPS, [2, 8], [512], rc.ROUNDS, rc.FLAGS)
    # two-shot: none + ready x 2 flags + both x 2 flags; reduce-scatter: none + ready x 2 flags;
    # the copy once (one rank, no rounds, the engine's unroll for one rank)
    assert len(vs) == 2 * (5 + 3) + 1 and len(set(vs)) == len(vs)
    assert [(v.ranks, v.unroll, v.rounds) for v in vs if v.op == "copy"] == [(1, 8, "none")]
    assert {v.unroll for v in vs if v.ranks == 2} == {4} and {v.unroll for v in vs if v.ranks == 8} == {1}
    assert not [v for v in vs if v.rounds == "both" and v.op == "reduce_scatter"]
    assert [v.flags for v in vs if v.rounds == "none"] == ["block"] * 5
    copies = rc.variants(["copy"], [2, 8], [256, 512], rc.ROUNDS, rc.FLAGS, unrolls=[1, 4])
    assert [(v.unroll, v.threads) for v in copies] == [(1, 256), (1, 512), (4, 256), (4, 512)]
    assert rc.Variant("two_shot", 2, 4, 512, "both", "rank").name == "ts_ceiling_two_shot_2_4_512_both_rank"


@pytest.mark.parametrize("kwargs,match", [
    (dict(op="all_gather"), "op must be one of"),
    (dict(ranks=9), r"ranks must be in \[2, 8\]"),
    (dict(unroll=0), "unroll must be >= 1"),
    (dict(threads=100), "threads must be a multiple of 32"),
    (dict(rounds="three"), "rounds must be one of"),
    (dict(op="reduce_scatter", rounds="both"), "two-shot only"),
    (dict(flags="grid"), "flags must be one of"),
    (dict(rounds="none", flags="rank"), "has no flags"),
    (dict(op="copy", ranks=1), "one region and no rounds"),
    (dict(op="copy", ranks=2, rounds="none"), "one region and no rounds"),
])
def test_variant_rejects_bad_fields(kwargs, match):
    args = dict(op="two_shot", ranks=2, unroll=4, threads=512, rounds="ready", flags="block")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rc.Variant(**args)


def test_source_has_one_wrapper_per_variant():
    vs = rc.variants(["two_shot"], [4], [256], ["ready", "both"], ["rank"])
    src = rc.cuda_source(vs)
    assert "__constant__ unsigned long long ceiling_bases[8];" in src
    assert src.count('extern "C" __global__') == 2
    assert "ts_ceiling_two_shot_4_2_256_both_rank(char* out" in src
    assert "ceiling::body<4, 2, 256, 0, 2, true>(out, flag_off, epoch, blocks, iters, span);" in src


@needs_nvcc
def test_every_kind_of_variant_compiles_without_spills(tmp_path):
    vs = rc.variants(rc.OPS, [2, 8], [512], rc.ROUNDS, rc.FLAGS)
    _, log, _ = TOOLKIT.compile(rc.cuda_source(vs), tmp_path, "cubin", "sm_90a", ptxas_verbose=True)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert len(frames) == len(vs)
    assert all(f == ("0", "0") for f in frames), frames  # registers only, as in the engine's kernels


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "1"], "invalid choice"),
    (["--threads", "100"], "multiples of 32"),
    (["--sizes", "0"], "--sizes must be positive"),
    (["--iters", "0"], "--iters and --repeats"),
    (["--rounds", "all"], "invalid choice"),
    (["--unroll", "0"], "--unroll must be positive"),
])
def test_main_rejects_bad_arguments(argv, message, capsys):
    exits_naming(rc.main, argv, message, capsys)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_every_variant_matches_the_reference_on_gpu(tmp_path):
    """A small sweep (1 MiB per rank, 2 and 4 ranks, every op, round and flag choice, two
    grids): every kernel's output equals the rank-order reference (the copy: its source) bit
    for bit."""
    import argparse

    import torch

    args = argparse.Namespace(ops=list(rc.OPS), ranks=[2, 4], threads=[256, 512], rounds=list(rc.ROUNDS),
                              flags=list(rc.FLAGS), sizes=[1], blocks_per_sm=[1, 2], iters=3, repeats=1,
                              unroll=None)
    rows = rc.run(args, torch.device("cuda", 0), tmp_path)
    assert len(rows) == 2 * 2 * 2 * 8 + 2 * 2  # + the copy: 2 thread counts x 2 grids
    assert all(r[-1] == "ok" for r in rows), [r for r in rows if r[-1] != "ok"]
    kernel, copy = rc.HEADERS.index("kernel us"), rc.HEADERS.index("copy us")
    assert all(r[kernel] > 0 and r[copy] > 0 for r in rows)
