"""The quick-start program: every rank puts its tensor into the next rank's heap.

Run it on N ranks (add ``--share-gpus`` on a machine with fewer GPUs than ranks)::

    tilescale-run -n 2 --share-gpus -m tilescale_examples.tutorials.ring_put

Every rank allocates ``src`` and ``dst`` in the same order, so they sit at the same offsets
in every rank's heap; ``dst_pe=peer`` makes the kernel write through the peer's mapping of
that offset.  ``kernel.initialize(allocator=...)`` gives the one compiled binary its rank.
"""

# No ``from __future__ import annotations`` here: T.prim_func evaluates the parameter
# annotations, which refer to the enclosing function's ``n`` and ``dtype``.
import os

import tilelang
import tilelang.language as T

__all__ = ["build_ring_put", "main", "ring_put"]

#: Elements each rank sends.
N = 4096


def build_ring_put(n: int = N, dtype: str = "float32"):
    """A one-block kernel that copies ``src[0:n]`` into ``dst[0:n]`` on rank ``rank + 1``.

    Args:
        n: elements to send, > 0.
        dtype: element type of both tensors (a TileLang dtype string).
    """

    # TileLang names the CUDA kernel after the prim_func plus "_kernel": ``ring_put_kernel``.
    @T.prim_func
    def ring_put(src: T.Tensor((n,), dtype), dst: T.Tensor((n,), dtype)):
        with T.Kernel(1, threads=128):
            peer = (T.get_rank() + 1) % T.get_num_ranks()
            T.put_block(T.address_of(src[0]), T.address_of(dst[0]), n, dst_pe=peer)

    return ring_put


def ring_put(rank: int, world_size: int, group, n: int = N) -> None:
    """Run the ring put once on this rank and check what arrived; raises AssertionError if wrong."""
    import torch
    import torch.distributed as dist

    allocator = tilelang.get_allocator(size=2**24, is_distributed=True, local_rank=rank,
                                       num_local_ranks=world_size, group=group)
    try:
        kernel = tilelang.compile(build_ring_put(n), compile_once=True)
        kernel.initialize(allocator=allocator)
        src = tilelang.tensor((n,), torch.float32, allocator=allocator)
        dst = tilelang.tensor((n,), torch.float32, allocator=allocator)
        src.copy_(torch.rand(n, device=src.device) + rank)  # fresh data, rank in the integer part
        dst.fill_(float("nan"))  # poison
        torch.cuda.synchronize()
        dist.barrier(group)
        kernel(src, dst)
        torch.cuda.synchronize()
        dist.barrier(group)
        sent = [torch.empty_like(src).cpu() for _ in range(world_size)]
        dist.all_gather(sent, src.cpu(), group=group)
        expected = sent[(rank - 1) % world_size]
        assert torch.equal(dst.cpu(), expected), f"rank {rank}: dst differs from rank {(rank - 1) % world_size}'s src"
        dist.barrier(group)
    finally:
        allocator.close()


def main() -> int:
    """Entry point under ``tilescale-run`` (reads LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    from tilelang.distributed.host import init_dist

    local_rank = int(os.environ["LOCAL_RANK"])
    num_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    rank, world_size, group = init_dist(local_rank, num_ranks)
    ring_put(rank, world_size, group)
    print(f"rank {rank}: ring put of {N} floats from rank {(rank - 1) % world_size}: ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
