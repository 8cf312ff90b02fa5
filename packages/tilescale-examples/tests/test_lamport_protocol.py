"""The Lamport all-reduce's buffer rotation, model-checked on the host: ranks run their calls as
kernels (a rank's call ``e + 1`` starts after its call ``e`` ended), and inside a call its puts,
gets and clears interleave with every other rank's steps in random orders. With
:data:`~tilescale_examples.collectives.lamport_kernel.LAMPORT_BUFFERS` (3) buffers rotated by
the call number, no put ever lands on a slot that still holds unread data, every get reads the
data of its own call from the right rank (never a stale or cleared slot), and no schedule
deadlocks. With two buffers the same model finds an overwrite: the check can fail."""

from __future__ import annotations

import random

import pytest

from tilescale_examples.collectives.lamport_kernel import LAMPORT_BUFFERS


class Violation(AssertionError):
    pass


def _steps(rank: int, world: int, call: int, nb: int) -> list:
    """One rank's call as the kernel orders it: every put (to each rank's slot ``rank`` of
    buffer ``call % nb``), then per slot the get of this rank's own buffer and the clear of
    the previous call's buffer (``(call + nb - 1) % nb``), slot by slot."""
    b, old = call % nb, (call + nb - 1) % nb
    puts = [("put", q, b, rank, call) for q in range(world)]
    reads = []
    for p in range(world):
        reads += [("get", rank, b, p, call), ("clear", rank, old, p, call)]
    return puts + reads


def run_schedule(world: int, calls: int, nb: int, rng: random.Random) -> int:
    """Every rank makes ``calls`` calls; at each step a random rank whose next step is enabled
    (a get waits for its slot's data) takes it. Raises :class:`Violation` on an overwrite of
    unread data, a get of the wrong data, or a deadlock; returns the number of steps."""
    buf = [[[None] * world for _ in range(nb)] for _ in range(world)]  # [rank][buffer][slot]: None = sentinel
    todo = {r: [s for e in range(1, calls + 1) for s in _steps(r, world, e, nb)] for r in range(world)}
    taken = 0
    while any(todo.values()):
        ready = [r for r, steps in todo.items() if steps and not (steps[0][0] == "get"
                                                                  and buf[r][steps[0][2]][steps[0][3]] is None)]
        if not ready:
            raise Violation(f"deadlock: every rank waits ({ {r: s[0] for r, s in todo.items() if s} })")
        r = rng.choice(ready)
        kind, owner, b, slot, call = todo[r].pop(0)
        cell = buf[owner][b]
        if kind == "put":
            if cell[slot] is not None:
                raise Violation(f"rank {r} call {call} overwrote rank {owner}'s unread {cell[slot]} in buffer {b}")
            cell[slot] = (call, r)
        elif kind == "get":
            if cell[slot] != (call, slot):
                raise Violation(f"rank {r} call {call} read {cell[slot]} from slot {slot} of buffer {b}")
        else:
            cell[slot] = None
        taken += 1
    return taken


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_three_buffers_are_safe_in_every_random_schedule(world):
    assert LAMPORT_BUFFERS == 3
    rng = random.Random(world)
    for _ in range(400):
        steps = run_schedule(world, calls=7, nb=LAMPORT_BUFFERS, rng=rng)
        assert steps == 7 * world * 3 * world


def test_two_buffers_overwrite_unread_data():
    rng = random.Random(0)
    with pytest.raises(Violation, match="overwrote|read"):
        for _ in range(400):
            run_schedule(2, calls=7, nb=2, rng=rng)
