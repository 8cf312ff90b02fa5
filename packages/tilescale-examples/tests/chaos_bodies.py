"""Rank bodies of the chaos tests (test_chaos.py): collectives under a killed rank and under
random stragglers.  Uses only the collectives' public API."""

from __future__ import annotations

import os
import random
import sys
import time

import torch

CASES = ("allgather", "reducescatter", "alltoall", "allreduce")
SHAPE = (4096,)


def make(name: str, alloc, dtype=torch.float32):
    """The collective ``name`` over ``alloc`` and a reference ``ref(all_inputs, rank)``."""
    from tilescale_examples.collectives import allgather, allreduce, alltoall, reducescatter

    rows = (int(alloc.num_ranks), *SHAPE)  # the input of the ops that send one row per rank
    if name == "allgather":
        coll = allgather.AllGather(alloc, SHAPE, dtype)
    elif name == "reducescatter":
        coll = reducescatter.ReduceScatter(alloc, rows, dtype)
    elif name == "alltoall":
        coll = alltoall.AllToAll(alloc, rows, dtype)
    elif name == "allreduce":
        coll = allreduce.AllReduce(alloc, SHAPE, dtype)
    else:
        raise ValueError(name)
    return coll, coll.torch_reference


def input_shape(coll):
    return tuple(coll.shape)


def inputs_of_call(shape, world: int, seed: int, call: int, device) -> list:
    """Every rank's input of call ``call``: fresh integers-valued floats (sums are exact),
    derived from (seed, call, rank) so that each rank can build the reference alone."""
    out = []
    for r in range(world):
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + call * 131 + r)
        out.append(torch.randint(-64, 64, shape, generator=g, device=device).to(torch.float32))
    return out


def stragglers_body(rank: int, world: int, cache_dir: str, name: str, calls: int, seed: int) -> dict:
    """``calls`` calls of collective ``name``; before each one a rank picked at random (the same
    on every rank) sleeps 0-3 ms; every element of every result is checked."""
    from examples_helpers import close_rank_heap, open_rank_heap

    alloc = open_rank_heap(rank, world, cache_dir, size=2**26)
    coll, ref = make(name, alloc)
    shape, device = input_shape(coll), alloc.device
    pick = random.Random(seed)
    wrong, delayed = [], 0
    for call in range(calls):
        xs = inputs_of_call(shape, world, seed, call, device)
        straggler, delay = pick.randrange(world), pick.random() * 3e-3
        if straggler == rank:
            torch.cuda.synchronize(device)
            time.sleep(delay)
            delayed += 1
        out = coll(xs[rank])
        expected = ref(xs, rank)
        bad = (out.view(expected.shape) != expected).sum().item()
        if bad:
            wrong.append((call, bad))
            if len(wrong) > 5:
                break
    coll.close()
    report = close_rank_heap(alloc, rank, calls)
    report.update(wrong=wrong, delayed=delayed)
    return report


def killed_rank_main() -> None:
    """``python chaos_bodies.py NAME RANK WORLD PORT CACHE``: a loop of collective NAME with a
    PeerWatch; prints ``iter k`` lines (the test SIGKILLs one rank mid-loop)."""
    name, rank, world, port, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    import torch.distributed as dist

    from tilescale_core.peer_watch import PeerWatch

    os.environ["TILELANG_CACHE_DIR"] = cache
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from examples_helpers import open_rank_heap

    alloc = open_rank_heap(rank, world, cache, size=2**26, device="cuda:0")
    coll, _ = make(name, alloc)
    watch = PeerWatch()
    x = torch.ones(input_shape(coll), device="cuda:0")
    print("ready", flush=True)
    for k in range(10**9):
        coll(x)
        torch.cuda.synchronize()
        if k % 10 == 0:
            print(f"iter {k}", flush=True)
    watch.stop()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    killed_rank_main()
