"""Teams: strided subsets of the ranks, made on the host and passed to kernels as arguments.

Host side::

    from tilescale_lang.team import create_team
    tp = create_team([0, 2], allocator)            # or create_team(process_group, allocator)
    tp.size, tp.my_rank, tp.translate(1)           # 2, 0/1 (or -1 on ranks 1 and 3), 2

Every rank of the allocator calls :func:`create_team` in the same order (it allocates the
team's storage from the symmetric heap), members or not.  In a kernel the team is an
``int32`` tensor argument of shape :data:`TEAM_SHAPE`::

    @T.prim_func
    def k(Team: T.Tensor(TEAM_SHAPE, "int32"), ...):
        with T.Kernel(1, threads=128) as _:
            r = T.team_rank(Team)                  # -1 on a rank that is not a member
            T.team_barrier(Team)                   # one block on every member
            T.broadcast_block(Team, dst, src, n, 0)

    kernel(tp.tensor, ...)

Layout of the tensor (``include/tilescale/team.cuh``): ``[start, stride, size, TEAM_MAGIC]``
then one uint32 arrival counter per member for the team barrier.  Team barriers and
collectives are block-scope operations taken part in by ONE block on every member (like
NVSHMEM's ``*_block`` operations); on a rank that is not a member they return at once.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._tvm import tirx

from . import validation as V

#: int32 words before the per-member counters.
TEAM_HEADER = 4
#: Largest team (members); the metadata table holds at most 1022 ranks.
MAX_TEAM_SIZE = 1020
#: int32 words of a team tensor, and the shape to declare a team kernel argument with.
TEAM_WORDS = TEAM_HEADER + MAX_TEAM_SIZE
TEAM_SHAPE = (TEAM_WORDS,)
#: team[3] of a real team (tells it from zeroed memory).
TEAM_MAGIC = 0x7E47EA11


# ------------------------------------------------------------------------------ host side
@dataclass(frozen=True)
class TeamLayout:
    """The members ``start, start + stride, ..., start + (size - 1) * stride`` of a team."""

    start: int
    stride: int
    size: int

    @property
    def ranks(self) -> list[int]:
        """The members' global ranks, in team order."""
        return [self.start + i * self.stride for i in range(self.size)]

    def team_rank(self, rank: int) -> int:
        """``rank``'s index in the team, or -1 when it is not a member."""
        d = rank - self.start
        if d < 0 or d % self.stride:
            return -1
        r = d // self.stride
        return r if r < self.size else -1

    def translate(self, team_rank: int) -> int:
        """Global rank of member ``team_rank``, or -1 outside ``[0, size)``."""
        return self.start + team_rank * self.stride if 0 <= team_rank < self.size else -1


def team_layout(ranks: Iterable[int], num_ranks: int) -> TeamLayout:
    """Check that ``ranks`` is a contiguous or strided subset of ``range(num_ranks)`` and
    return its layout (members in the order given, which must be increasing).

    Raises:
        TypeError: a rank is not an integer.
        ValueError: empty, not a subset of the ranks, repeated, decreasing, not evenly
            strided, or larger than :data:`MAX_TEAM_SIZE`.
    """
    try:
        given = list(ranks)
        members = [operator.index(r) for r in given]
    except TypeError:
        raise TypeError(f"team ranks must be integers, got {ranks!r}") from None
    if any(isinstance(r, bool) for r in given):  # True would be rank 1
        raise TypeError(f"team ranks must be integers, not bools, got {ranks!r}")
    if not members:
        raise ValueError("a team needs at least one rank")
    outside = [r for r in members if not 0 <= r < num_ranks]
    if outside:
        raise ValueError(f"team ranks {outside} are not a subset of the {num_ranks} ranks (0..{num_ranks - 1})")
    if len(set(members)) != len(members):
        raise ValueError(f"team ranks repeat a rank: {members}")
    if len(members) > MAX_TEAM_SIZE:
        raise ValueError(f"a team has at most {MAX_TEAM_SIZE} members, got {len(members)}")
    stride = members[1] - members[0] if len(members) > 1 else 1
    if stride <= 0 or any(b - a != stride for a, b in zip(members, members[1:])):
        raise ValueError(
            f"team ranks {members} are not contiguous or evenly strided in increasing order "
            "(a team is start, start + stride, ...)"
        )
    return TeamLayout(members[0], stride, len(members))


def _group_ranks(group: Any, allocator: Any) -> list[int]:
    """The allocator ranks of a torch process group's members."""
    import torch.distributed as dist

    members = dist.get_process_group_ranks(group)
    alloc_group = getattr(getattr(allocator, "_comm", None), "group", None)
    if alloc_group is None or alloc_group is dist.group.WORLD:
        return list(members)
    alloc_members = dist.get_process_group_ranks(alloc_group)
    missing = [g for g in members if g not in alloc_members]
    if missing:
        raise ValueError(f"process group ranks {missing} are not ranks of the allocator's group {alloc_members}")
    return [alloc_members.index(g) for g in members]


class Team:
    """A team made by :func:`create_team`: its layout, this rank's place in it, and
    ``tensor``, the symmetric int32 tensor to pass to kernels (shape :data:`TEAM_SHAPE`)."""

    shape = TEAM_SHAPE

    def __init__(self, layout: TeamLayout, tensor: Any, rank: int):
        self.layout = layout
        self.tensor = tensor
        self.rank = rank

    start = property(lambda self: self.layout.start, doc="first member's global rank")
    stride = property(lambda self: self.layout.stride, doc="distance between members")
    size = property(lambda self: self.layout.size, doc="number of members")
    ranks = property(lambda self: self.layout.ranks, doc="members' global ranks")

    @property
    def my_rank(self) -> int:
        """This process's index in the team, or -1 when it is not a member."""
        return self.layout.team_rank(self.rank)

    def translate(self, team_rank: int) -> int:
        """Global rank (PE) of member ``team_rank`` (-1 outside the team)."""
        return self.layout.translate(team_rank)

    def __repr__(self) -> str:
        return f"Team(ranks={self.ranks}, my_rank={self.my_rank})"


def create_team(ranks: Any, allocator: Any) -> Team:
    """Make a team of ``ranks`` (a list/range of allocator ranks, or a torch process group)
    over ``allocator``'s heap.  Collective: every rank of the allocator calls it, in the
    same order as its other heap allocations, members or not.

    Raises:
        TypeError / ValueError: see :func:`team_layout` (checked before anything is allocated).
    """
    import torch

    if allocator is None or not hasattr(allocator, "num_ranks"):
        raise TypeError(f"create_team needs the distributed allocator, got {allocator!r}")
    if not isinstance(ranks, (list, tuple, range)) and hasattr(ranks, "size") and hasattr(ranks, "rank"):
        ranks = _group_ranks(ranks, allocator)
    layout = team_layout(ranks, allocator.num_ranks)
    import tilelang

    t = tilelang.tensor(TEAM_SHAPE, torch.int32, allocator=allocator)
    host = torch.zeros(TEAM_WORDS, dtype=torch.int32)
    magic = TEAM_MAGIC - (1 << 32) if TEAM_MAGIC >= 1 << 31 else TEAM_MAGIC
    host[:TEAM_HEADER] = torch.tensor([layout.start, layout.stride, layout.size, magic], dtype=torch.int32)
    t.copy_(host)
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    comm = getattr(allocator, "_comm", None)
    if comm is not None:
        comm.barrier()  # no member's barrier may reach a peer's counters before they are zeroed
    return Team(layout, t, allocator.local_rank)


# ------------------------------------------------------------------------------ kernel side
def _team(team) -> V.Operand:
    from .barrier import _available_elements

    op = V.operand(team, "team")
    if op.dtype != "int32":
        raise TypeError(f"team must be the int32 team tensor (create_team(...).tensor), got dtype {op.dtype}")
    V.require_global(op, "team", "(the team tensor lives in the symmetric heap)")
    avail = _available_elements(team)
    if avail is not None and avail < TEAM_WORDS:
        raise ValueError(f"team must be a tensor of shape {TEAM_SHAPE} (from create_team), got {avail} elements")
    return op


def team_rank(team) -> tirx.PrimExpr:
    """This rank's index in ``team`` (int32), or -1 when it is not a member."""
    return V.extern("int32", "tilescale::team_rank", _team(team).ptr)


def team_num_ranks(team) -> tirx.PrimExpr:
    """Number of members of ``team`` (int32)."""
    return V.extern("int32", "tilescale::team_num_ranks", _team(team).ptr)


def team_translate_pe(team, team_pe) -> tirx.PrimExpr:
    """Global rank (PE, int32) of member ``team_pe`` of ``team``; -1 when ``team_pe`` is
    outside ``[0, size)``.  Use it as the ``dst_pe``/``src_pe`` of any peer operation."""
    op = _team(team)
    if isinstance(team_pe, bool) or not isinstance(team_pe, (int, tirx.PrimExpr)):
        raise TypeError(f"team_pe must be an integer expression, got {team_pe!r}")
    if isinstance(team_pe, tirx.PrimExpr) and not V.is_int_dtype(team_pe.dtype):
        raise TypeError(f"team_pe must be an integer expression, got dtype {team_pe.dtype}")
    return V.extern("int32", "tilescale::team_translate_pe", op.ptr, V.cast_to(team_pe, "int32", "team_pe"))


def team_barrier(team):
    """Barrier of one block on every member of ``team`` (all threads of the block call it):
    system-scope release before, acquire after.  Ranks outside the team return at once.
    Honours ``TILESCALE_WAIT_TIMEOUT_MS``."""
    return V.extern("handle", "tilescale::barrier_team", _team(team).ptr)


def _collective(kind: str, dst, src, n):
    d = V.operand(dst, "dst")
    s = V.operand(src, "src")
    for op, name in ((d, "dst"), (s, "src")):
        V.require_global(op, name, f"({kind} reads and writes the symmetric heap)")
    return d, s, V.copy_bytes(kind, src, s, dst, d, n, "n")


def _root(root) -> tirx.PrimExpr:
    """``root`` as int32; a constant outside ``[0, MAX_TEAM_SIZE)`` is a ValueError (a
    run-time root outside ``[0, size)`` traps on the device)."""
    if isinstance(root, bool) or not isinstance(root, (int, tirx.PrimExpr)):
        raise TypeError(f"root must be an integer team rank, got {root!r}")
    value = V.cast_to(root, "int32", "root")
    if isinstance(value, tirx.IntImm) and not 0 <= int(value.value) < MAX_TEAM_SIZE:
        raise ValueError(
            f"root={int(value.value)} is not a team rank: it must be in [0, size) "
            f"(a team has at most {MAX_TEAM_SIZE} members)"
        )
    return value


def broadcast_block(team, dst, src, n, root):
    """Copy ``n`` elements of ``src`` on team member ``root`` to ``dst`` on every member
    (root included).  One block on every member calls it; on return ``dst`` holds the data
    and root's ``src`` may be reused.  ``dst``/``src`` are symmetric global buffers.

    A constant ``n`` larger than ``src`` or ``dst`` holds, a non-contiguous region and a
    constant ``root`` outside the team are errors while tracing; a run-time ``root`` outside
    ``[0, size)`` and a tensor that is not a team (no ``TEAM_MAGIC``) trap on the device."""
    t = _team(team)
    d, s, nbytes = _collective("broadcast_block", dst, src, n)
    return V.extern("handle", "tilescale::broadcast_block", t.ptr, d.ptr, s.ptr, nbytes, _root(root))


def fcollect_block(team, dst, src, n):
    """All-gather of equal pieces: member ``i``'s ``n`` elements of ``src`` land at
    ``dst[i * n : (i + 1) * n]`` on every member.  One block on every member calls it; on
    return ``dst`` is complete and ``src`` may be reused.  A constant ``n`` larger than
    ``src`` or ``dst`` holds (``dst`` needs ``n * size``), or a non-contiguous region, is an
    error while tracing; a tensor that is not a team traps on the device."""
    t = _team(team)
    d, s, nbytes = _collective("fcollect_block", dst, src, n)
    return V.extern("handle", "tilescale::fcollect_block", t.ptr, d.ptr, s.ptr, nbytes)


#: Name -> object exported on ``tilelang.language`` by this module.
EXPORTS = {
    "team_rank": team_rank,
    "team_num_ranks": team_num_ranks,
    "team_translate_pe": team_translate_pe,
    "team_barrier": team_barrier,
    "broadcast_block": broadcast_block,
    "fcollect_block": fcollect_block,
}
