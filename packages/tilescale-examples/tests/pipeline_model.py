"""A model of the async GEMM pipeline's protocol (``tilescale_examples.overlap.gemm_async``:
mbarriers with arrival counts and transaction bytes, TMA loads landing in any order, WGMMA
groups completing in order) that the CPU tests run under random interleavings."""


class Barrier:
    """An mbarrier: ``count`` arrivals and the expected transaction bytes complete a phase;
    ``wait(parity)`` passes once the phase of that parity is the last completed one (a fresh
    barrier passes ``wait(1)``)."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def arrive(self):
        self.pending -= 1
        self._complete()

    def expect(self, nbytes: int):
        self.tx += nbytes

    def land(self, nbytes: int):
        self.tx -= nbytes
        self._complete()

    def passes(self, parity: int) -> bool:
        return self.phase % 2 != parity


def simulate(stages: int, tile_steps: list, rng) -> list:
    """The async pipeline's protocol (``overlap.gemm_async``: the producer warp, its TMA loads,
    the compute warpgroups, their WGMMA groups) over one block's tiles, ``tile_steps[i]`` ``k``
    steps each, the ring of ``stages`` stages running on from tile to tile (a tile's step
    ``kk`` is the running step ``first + kk``), under a random interleaving drawn from ``rng``.
    Returns the running steps in the order the WGMMA groups read them; fails (an
    AssertionError) on a deadlock, or a stage reloaded while a group reads it or before it was
    read, or a group reading a stage that does not hold its step."""
    S = stages
    full, empty = [Barrier(1) for _ in range(S)], [Barrier(1) for _ in range(S)]
    firsts = [sum(tile_steps[:i]) for i in range(len(tile_steps))]
    work = [(i, kk, firsts[i] + kk) for i in range(len(tile_steps)) for kk in range(tile_steps[i])]
    stage_data = [None] * S
    loads, groups, read = [], [], []
    prod = {"at": 0, "phase": "wait"}
    cons = {"at": 0, "phase": "wait"}

    def producer():
        if prod["at"] == len(work):
            return False
        _, _, g = work[prod["at"]]
        s = g % S
        if prod["phase"] == "wait":
            if not empty[s].passes(((g // S) & 1) ^ 1):
                return False
            assert all(x[0] != s for x in groups), f"stage {s} reloaded while a WGMMA group reads it"
            assert stage_data[s] is None or stage_data[s] in read, f"stage {s} reloaded before it was read"
            full[s].expect(2)
            stage_data[s] = None
            loads.extend([(s, g), (s, g)])
            prod["phase"] = "arrive"
        else:
            full[s].arrive()
            prod.update(at=prod["at"] + 1, phase="wait")
        return True

    def consumer():
        if cons["phase"] == "done":
            return False
        if cons["phase"] == "drain":  # end of a tile: wait_wgmma(0), release its last stage
            if groups:
                return False
            i, kk, g = work[cons["at"] - 1]
            empty[g % S].arrive()
            cons["phase"] = "done" if cons["at"] == len(work) else "wait"
            return True
        i, kk, g = work[cons["at"]]
        if cons["phase"] == "wait":
            if not full[g % S].passes((g // S) & 1):
                return False
            assert stage_data[g % S] == g, f"step {g} reads stage {g % S} holding {stage_data[g % S]}"
            groups.append((g % S, g))
            read.append(g)
            cons["phase"] = "wait1"
            return True
        if len(groups) > 1:  # wait_wgmma(1)
            return False
        if kk > 0:
            empty[(g - 1) % S].arrive()
        cons["at"] += 1
        last_of_tile = cons["at"] == len(work) or work[cons["at"]][1] == 0
        cons["phase"] = "drain" if last_of_tile else "wait"
        return True

    def land():
        if not loads:
            return False
        s, g = loads.pop(rng.randrange(len(loads)))
        if not any(x[0] == s for x in loads):
            stage_data[s] = g
        full[s].land(1)
        return True

    def finish_group():
        if not groups:
            return False
        s, g = groups.pop(0)
        assert stage_data[s] == g, f"stage {s} changed under the WGMMA group of step {g}"
        return True

    actors = [producer, consumer, land, finish_group]
    while cons["phase"] != "done":
        rng.shuffle(actors)
        assert any(actor() for actor in actors), f"deadlock: producer {prod}, consumer {cons}"
    return read
