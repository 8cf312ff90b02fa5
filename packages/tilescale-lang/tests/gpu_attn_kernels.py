"""The per-rank body of the GPU test of upstream TileScale's sequence-parallel attention
all-to-all kernels (``example_pre_attn_all2all``, ``example_pre_attn_all2all_transpose``,
``example_post_attn_all2all_transpose``), taken verbatim from the programs' sources: the
tensors come from ``pynvshmem`` (the process's default heap, so the kernels launch without
``kernel.initialize``, as in the programs), the reference from every rank's input gathered
with ``torch.distributed.all_gather`` (the programs' own reference calls ``dist.all_to_all``,
which the gloo group of ranks sharing a GPU lacks).  Importable by spawned rank processes."""

from __future__ import annotations

import torch

#: (program, factory, the destination of rank ``me`` from every rank's source).
KERNELS = {
    "example_pre_attn_all2all": "sequence_parallel_all_to_all",
    "example_pre_attn_all2all_transpose": "sequence_parallel_all_to_all_transpose",
    "example_post_attn_all2all_transpose": "sequence_parallel_reverse_all_to_all_transpose",
}
#: (batch, heads, sequence, head_dim): upstream's defaults, and for the two pre-attention
#: kernels a longer sequence whose per-block source offset is an odd multiple of 2**15
#: elements (one (512, 64) head).  Not for post_attn: every block of its grid (batch * sequence
#: / ranks blocks per rank) waits for a whole row of the grid, which must then be resident at
#: once (upstream's design; 792 of its blocks fit an H200).
SHAPES = [(2, 16, 256, 64)]
LONG = (2, 16, 1024, 64)
REPEATS = 3


def shapes_for(program: str) -> list:
    """The shapes ``program``'s kernel is checked at."""
    return SHAPES + ([LONG] if program != "example_post_attn_all2all_transpose" else [])


def expected_checks() -> int:
    """Checks one rank makes."""
    return sum(len(shapes_for(p)) for p in KERNELS) * REPEATS


def shapes(program: str, world: int, B: int, NH: int, S: int, D: int):
    """``(source shape, destination shape)`` of a rank."""
    SP, HP = S // world, NH // world
    return {
        "example_pre_attn_all2all": ((B, NH, SP, D), (B, HP, S, D)),
        "example_pre_attn_all2all_transpose": ((B, SP, NH, D), (B, HP, S, D)),
        "example_post_attn_all2all_transpose": ((B, HP, S, D), (B, SP, NH, D)),
    }[program]


def reference(program: str, sources: list, me: int, world: int, NH: int, S: int) -> torch.Tensor:
    """Rank ``me``'s destination from every rank's source (a torch re-statement of each
    program's ``dist.all_to_all`` reference)."""
    SP, HP = S // world, NH // world
    heads, seq = slice(me * HP, (me + 1) * HP), slice(me * SP, (me + 1) * SP)
    if program == "example_pre_attn_all2all":  # (B, NH, SP, D) -> (B, HP, S, D)
        return torch.cat([src[:, heads] for src in sources], dim=2)
    if program == "example_pre_attn_all2all_transpose":  # (B, SP, NH, D) -> (B, HP, S, D)
        return torch.cat([src[:, :, heads].transpose(1, 2) for src in sources], dim=2)
    return torch.cat([src[:, :, seq].transpose(1, 2) for src in sources], dim=2)  # (B, HP, S, D) -> (B, SP, NH, D)


def rank_body(rank: int, world: int, cache_dir: str) -> dict:
    """Every kernel at every shape, ``REPEATS`` times with fresh data, poisoned destinations."""
    import os

    import tilelang
    import torch.distributed as dist
    from tilescale_core.multiprocess import rank_device
    from upstream_nvshmem import factories

    from tilescale_host import pynvshmem

    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    os.environ.setdefault("TILESCALE_WAIT_TIMEOUT_MS", "30000")
    torch.cuda.set_device(rank_device(rank))
    pynvshmem.init_nvshmem_by_uniqueid(dist.group.WORLD)
    gen = torch.Generator().manual_seed(77 + rank)
    checks, errors = 0, []
    for program, factory in KERNELS.items():
        for B, NH, S, D in shapes_for(program):
            func = factories(program)[factory](world, B, NH, S, D, "float16")
            kernel = tilelang.compile(func, pass_configs={"tl.disable_tma_lower": True,
                                                          "tl.disable_warp_specialized": True})
            src_shape, dst_shape = shapes(program, world, B, NH, S, D)
            src = pynvshmem.nvshmem_create_tensor(list(src_shape), torch.float16)
            dst = pynvshmem.nvshmem_create_tensor(list(dst_shape), torch.float16)
            signal = pynvshmem.nvshmem_create_tensor([world], torch.uint64)
            for rep in range(REPEATS):
                src.copy_(torch.randn(src_shape, generator=gen).half())
                dst.fill_(float("nan"))
                signal.zero_()
                pynvshmem.nvshmem_barrier_all()  # every rank's buffers are ready
                kernel(src, dst, signal)
                pynvshmem.nvshmem_barrier_all()
                every = [torch.empty_like(src) for _ in range(world)]
                dist.all_gather(every, src)  # device tensors: gloo and NCCL both gather them
                want = reference(program, every, rank, world, NH, S)
                if not torch.equal(dst, want):
                    bad = (dst != want).sum().item()
                    errors.append(f"{program} {(B, NH, S, D)} repeat {rep}: {bad} of {dst.numel()} elements differ")
                checks += 1
    pynvshmem.nvshmem_finalize()
    return {"checks": checks, "errors": errors}
