"""What the MoE kernels share: their constants and argument checks, the module-level ``T.macro``
machinery (:data:`T`, :func:`macro`, :class:`Scope`, from :mod:`tilescale_examples._macros`)
and the macros and expressions both dispatch paths or both kernels use. The protocol is
described in ``docs/moe.md``.
"""

# (no `from __future__ import annotations`: TileLang reads the macros' annotations)

from tilescale_examples._macros import Scope, T, macro

__all__ = ["PLAN_THREADS", "PLAN_WARPS", "MAX_PARTS", "CHUNK", "PUT_UNROLL", "MAX_EXPERTS", "PASS_CONFIGS",
           "DISPATCH_PHASES", "RANK_BITS", "T", "macro", "Scope", "check_sizes", "grid_ids", "expert_key",
           "lanes_below", "lowest_bit", "unit_entry", "unit_vector", "inclusive_warp_scan", "write_status",
           "phase_done"]

#: Threads (and warps) per block of the dispatch kernel, whose block 0 plans: each of its
#: warps ranks one contiguous range of entries.
PLAN_THREADS = 1024
PLAN_WARPS = PLAN_THREADS // 32
#: Most column ranges one entry's row is cut into when a large batch has fewer entries than the
#: dispatch grid has warps (a 7168-element row in 8 parts: 112 16-byte vectors each).
MAX_PARTS = 8
#: 32-entry batches whose indices and weights a ranking warp loads at once before ranking them
#: (a warp has one batch unless the grid has fewer than ``NT * K / threads`` blocks).
CHUNK = 4
#: 16-byte vectors each lane loads before storing in the row copies (``T.put_warp``; a last,
#: shorter round takes the rest): a 7168-element bfloat16 row is 28 vectors per lane, seven
#: rounds. Four: seven or eight (which also fit the 64 registers of a 1024-thread block
#: without spills) made the dispatch slower (see docs/benchmarks.md).
PUT_UNROLL = 4
#: Largest supported expert count: each ranking block keeps a ``(PLAN_WARPS, E + 2)`` int32 count
#: table in shared memory (33 KiB at 256).
MAX_EXPERTS = 256
#: Every ``__syncthreads`` in these kernels is written out by hand (TileLang would otherwise
#: insert its own around shared-memory accesses, some of them inside warp-divergent code),
#: and every shared buffer keeps its own bytes (no reuse across phases that only the hand-
#: written barriers separate).
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True, "tl.disable_shared_memory_reuse": True}
#: The points a profiled dispatch kernel (``build_dispatch_kernel(..., profile=True)``) records,
#: in order; event ``p`` (task and slot ``p``) is thread 0 of a block reaching the end of
#: phase ``p``: the call number read (``start``), its entry's index arrived (small batches),
#: the entries ranked (the small path's first barrier; a large batch's ranking blocks), the
#: warps' counts scanned (small), the plan complete (a large batch: released to the block),
#: the block's rows issued (the closing barrier), and the closing round done.
DISPATCH_PHASES = ("start", "index loaded", "ranked", "scanned", "planned", "data issued", "end")
#: Bits of a packed plan entry below the expert key: the entry's rank within its ranking
#: block's range of entries (fewer than ``TMAX * K + threads <= 2**16``).
RANK_BITS = 16


def check_sizes(num_experts: int, topk: int, hidden: int, max_tokens: int, threads: int = PLAN_THREADS) -> None:
    """``ValueError`` unless the kernels support these sizes."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if hidden < 8 or hidden % 8:
        raise ValueError(f"hidden must be a positive multiple of 8, got {hidden}")
    if threads % 32 or not num_experts < threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in ({num_experts}, 1024] (the plan gives each of "
                         f"the {num_experts} experts a thread, plus one), got {threads}")
    if not 1 <= max_tokens * topk <= (1 << RANK_BITS) - threads:
        raise ValueError(f"max_tokens * topk must be in [1, {(1 << RANK_BITS) - threads}] (an entry's rank within "
                         f"its ranking block is a {RANK_BITS}-bit field), got {max_tokens * topk}")


def grid_ids(bx, threads: int, num_experts: int):
    """``(tx, lane, global warp, rank, world size, experts per rank)`` inside a kernel whose
    blocks have ``threads`` threads (block ``bx``); the last is an ``int32`` variable."""
    tx = T.get_thread_binding()
    world = T.get_num_ranks()
    return (tx, tx % 32, bx * (threads // 32) + tx // 32, T.get_rank(), world,
            T.alloc_var("int32", init=num_experts // world))


def expert_key(v, E):
    """An index's key: the expert ``v`` when ``0 <= v < E``, ``E`` for ``-1`` (an unused
    slot), ``E + 1`` for any other value (out of range); both of the last are skipped."""
    return T.if_then_else(T.And(v >= 0, v < E), T.Cast("int32", v), T.if_then_else(v == -1, E, E + 1))


def unit_entry(u, K: int, PARTS: int):
    """The entry (flat ``t * K + slot``) of data unit ``u = q * K + slot``, ``q`` the token part
    (token ``q // PARTS``), of a dispatch whose rows are ``PARTS`` parts of 32 16-byte vectors."""
    return u // (PARTS * K) * K + u % K


def unit_vector(u, K: int, PARTS: int):
    """The first 16-byte vector of unit ``u``'s part within its row (see :func:`unit_entry`)."""
    return u // K % PARTS * 32


def lanes_below(mask, lane):
    """How many of the lanes below ``lane`` are set in the ``uint32`` lane ``mask`` (int32)."""
    return T.Cast("int32", T.popcount(mask & ((T.uint32(1) << T.Cast("uint32", lane)) - T.uint32(1))))


def lowest_bit(mask):
    """Index of the lowest set bit of a non-zero ``uint64`` ballot ``mask`` (int32): the
    popcount of the ones below it."""
    return T.Cast("int32", T.popcount((mask & (~mask + T.uint64(1))) - T.uint64(1)))


@macro
def inclusive_warp_scan(acc, lane):
    """``acc[0]`` becomes the sum of ``acc[0]`` over lanes ``0 .. lane`` of the warp (five
    shuffle steps; every lane of the warp must call it)."""
    for d in [1, 2, 4, 8, 16]:
        up = T.shfl_up(acc[0], d)
        if lane >= d:
            acc[0] = acc[0] + up


@macro
def write_status(Status, Idx, nbad, first, K):
    """``Status = [bad entries, first bad flat index or -1, its value (0 if none)]`` (``K``: the
    top-k, the columns of ``Idx``)."""
    Status[0] = nbad
    Status[1] = T.Cast("int64", first)
    Status[2] = 0
    if first >= 0:
        Status[2] = T.Cast("int64", Idx[first // K, first % K])


@macro
def phase_done(Prof, tx, phase):
    """With profiling (``Prof`` not None): thread 0 of the block records the end of
    ``DISPATCH_PHASES[phase]``."""
    if Prof is not None:
        if tx == 0:
            T.profile_event(Prof, phase, slot=phase)
