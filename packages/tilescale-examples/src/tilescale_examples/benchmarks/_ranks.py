"""Shared by the benchmarks that run real ranks, one per GPU (:mod:`.gemm_allreduce_ranks`,
:mod:`.decode_ranks`): starting the ranks after their kernels are compiled, each case's heap,
its end (every rank's failures gathered, the ops and the heap closed), and the verdict."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tilescale_examples.benchmarks import _harness

__all__ = ["spawn", "open_heap", "close_case", "verdict"]


def spawn(run: Callable, args, jobs: Callable[[int], list], what: str):
    """``(rank 0's result, world, mode)`` of ``run(rank, world, group, device, args)`` on
    ``args.ranks`` spawned ranks (or ``tilescale-run``'s), after compiling ``jobs(world)``
    (precompile jobs) in parallel when it spawns them; ``mode`` is the title's part that says
    whether the ranks had a GPU each (:func:`~tilescale_examples.benchmarks._harness.gpu_mode`).
    None where no GPU is visible (said in a line naming ``what``) or on the ranks other than 0
    under ``tilescale-run``."""
    gpus = _harness.visible_gpus(what)
    if gpus == 0:
        return None
    if "LOCAL_WORLD_SIZE" not in os.environ:  # spawned ranks: their compiles are cache hits
        from tilescale_examples.testing.precompile import precompile

        precompile(jobs(args.ranks))
    result, backend, world = _harness.run_on_ranks(run, args.ranks, args)
    if result is None:
        return None
    return result, world, _harness.gpu_mode(world, backend, min(gpus, world), "NCCL all_reduce")


def open_heap(rank: int, world: int, group, device, nbytes: int):
    """This rank's symmetric heap of ``nbytes`` (plus 8 MiB of slack) for one case."""
    import tilelang

    return tilelang.get_allocator(size=nbytes + (8 << 20), device=device, is_distributed=True, local_rank=rank,
                                  num_local_ranks=world, group=group)


def close_case(ops: Sequence, alloc, failures: list, group, device) -> list:
    """The end of a case on every rank: every rank's ``failures`` (gathered), then ``ops`` and
    ``alloc`` closed after the ranks' work is done."""
    import torch
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, failures, group=group)
    for op in ops:
        op.close()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    alloc.close()
    return [f for part in gathered for f in part]


def verdict(failures: Sequence[str], rule: str) -> int:
    """Print every failure and the correctness line (``rule``: what the outputs were checked
    against); the exit status: 0, or 1 when a check failed."""
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"\ncorrectness ({rule}): {'ok' if not failures else 'FAILED'}")
    return 0 if not failures else 1
