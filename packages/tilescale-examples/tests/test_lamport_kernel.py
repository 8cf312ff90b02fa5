"""The Lamport all-reduce kernel on the CPU: the generated CUDA (the call number and buffer
rotation on the device, every put before the first get, the rank-order sum, the clear of the
previous call's buffer, no flag and no fence), nvcc compiles within the register budget, and
the builder's argument checks."""

from __future__ import annotations

import re

import pytest
from examples_helpers import kernel_body, lower_with, needs_nvcc, nvcc_resources

from tilescale_examples.collectives.lamport_kernel import (LAMPORT_BUFFERS, LAMPORT_DTYPES, build_lamport_kernel,
                                                           lamport_rows)
from tilescale_examples.collectives.reduce_engine import MAX_REGISTERS, PASS_CONFIGS, default_unroll


def source(dtype="bfloat16", world=2, threads=128, unroll=None):
    return kernel_body(lower_with(build_lamport_kernel(dtype, world, threads, unroll), PASS_CONFIGS))


def test_buffers():
    assert LAMPORT_BUFFERS == 3 and lamport_rows(4, 100) == 1200


def test_dtypes_are_those_the_sentinel_covers():
    """The kernel takes exactly the element types tilescale-lang's Lamport exchange encodes."""
    from tilescale_lang.lamport import NAN_BITS

    assert LAMPORT_DTYPES == tuple(NAN_BITS)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_protocol_order(world):
    body = source("bfloat16", world)
    U = default_unroll(world)
    read = body.index("epoch = (State[((int)blockIdx.x)] + (int64_t)1);")
    puts = [m.start() for m in re.finditer(r"tilescale::lamport_put<2, 0x7fc0ull>", body)]
    gets = [m.start() for m in re.finditer(r"tilescale::lamport_get<2>", body)]
    clears = [m.start() for m in re.finditer(r"tilescale::lamport_clear", body)]
    write = body.index("State[((int)blockIdx.x)] = epoch;")
    assert len(puts) == len(gets) == len(clears) == U * world  # every row to / from every rank
    assert read < puts[0] and max(puts) < min(gets) and max(gets) < write and max(clears) < write
    assert body.index("__syncthreads();") < write  # every thread has read State[bx] first
    # this call's buffer is epoch % 3, the cleared one (epoch + 2) % 3 (W * span rows each)
    cur = re.search(r"\bcur = (\(.*);", body).group(1)
    old = re.search(r"\bold = (\(.*);", body).group(1)
    assert "(epoch % (int64_t)3)" in cur and "((epoch + (int64_t)2) % (int64_t)3)" in old
    assert all(e.endswith(f"* span) * {world})") for e in (cur, old)) or world == 1
    # puts: this rank's slot (me * span rows in) of rank p's buffer for every p; gets and
    # clears: every slot of this rank's own buffer (local)
    put_lines = [line for line in body.splitlines() if "lamport_put" in line]
    assert all("(((int64_t)cur) * (int64_t)8)" in x and "((((int64_t)me) * ((int64_t)span)) * (int64_t)8)" in x
               for x in put_lines)
    assert sorted({re.search(r", (\d+)\);$", x).group(1) for x in put_lines}) == [str(p) for p in range(world)]
    assert all(x.rstrip().endswith(", -1);") for x in body.splitlines() if "lamport_get" in x or "lamport_clear" in x)
    assert all("((int64_t)old)" in x for x in body.splitlines() if "lamport_clear" in x)
    assert "Flags" not in body and "fence" not in body and "wait_until" not in body and "notify" not in body


def test_slots_land_in_rank_order_and_the_sum_is_in_float32():
    """Rank p's slot is read into vals[u, p] (the engine's rank_order_sum adds vals[u, 0],
    vals[u, 1], ... in that order), converted to float32 and rounded once."""
    body = source("float16", 4, unroll=1)
    dests = re.findall(r"tilescale::lamport_get<2>\(.*\(&\(vals\[(\d+)\]\)\), -1\);", body)
    assert dests == ["0", "8", "16", "24"]
    assert "__half22float2" in body and "__float22half2_rn" in body


def test_builder_rejects_bad_arguments():
    for kwargs, match in ((dict(dtype="int32"), "the Lamport sentinel is a NaN"),
                          (dict(world_size=0), "world_size must be an int"),
                          (dict(threads=48), "threads must be a multiple of 32"),
                          (dict(unroll=17), r"unroll must be at most 16 at 2 rank\(s\)")):
        args = dict(dtype="bfloat16", world_size=2)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            build_lamport_kernel(**args)


@needs_nvcc
@pytest.mark.parametrize("dtype,world", [("bfloat16", 8), ("float16", 2), ("float32", 4), ("float64", 1)])
def test_nvcc_compiles_within_the_register_budget(dtype, world, tmp_path):
    """sm_90a cubin at 512 threads: at most 128 registers (one block per SM) and no spills."""
    src = lower_with(build_lamport_kernel(dtype, world, 512), PASS_CONFIGS)
    registers, spills = nvcc_resources(src, tmp_path)
    assert registers <= MAX_REGISTERS and spills == 0, (registers, spills)
