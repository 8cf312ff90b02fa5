"""The autotuner's exchanges over a real gloo group of 2 and 3 CPU processes (FileStore in
tmp_path): every rank ends with the same config under both policies although each rank's
clock says something else (one rank deliberately noisy), candidates failing on one rank only
are skipped on all, the cache is reused without timing, cache_only misses and disagreeing
ranks raise on every rank."""

from __future__ import annotations

import random

import pytest
import torch

#: Each rank's milliseconds per candidate (the 6 candidates of AXES, in order). Every rank's
#: own fastest differs (0, 1, 2); rank 2 is the noisy one; the slowest rank's times are
#: fastest at candidate 3 for 2 and for 3 ranks.
TIMES = [[1.0, 3.0, 3.0, 2.0, 5.0, 6.0],
         [3.0, 1.0, 3.0, 2.0, 5.0, 6.0],
         [9.0, 9.0, 0.5, 2.5, 50.0, 0.1]]
AXES = {"block_m": (64, 128), "block_n": (64, 128, 256)}
ENV = {"gpu": "Fake GPU", "arch": "sm_90", "toolkit": "12.8", "tilelang": "0.1.15", "tilescale_lang": "0.1.0"}
CANDIDATES = [{"block_m": m, "block_n": n} for m in (64, 128) for n in (64, 128, 256)]


def _init(rank, world, store_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)


def _done():
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


class _Rank:
    """This rank's fake build and clock, with counters."""

    def __init__(self, rank, noisy=False):
        self.rank, self.noisy, self.builds, self.timed = rank, noisy, [], []
        self.jitter = random.Random()  # seeded from the OS: differs on every rank and run

    def build(self, config):
        self.builds.append(config)
        index = CANDIDATES.index(config)
        if index == 4 and self.rank == 1:
            raise RuntimeError("compile fails on rank 1 only")
        wrong = index == 5 and self.rank == 0  # a wrong result on the root only
        return lambda: torch.zeros(3) if wrong else torch.ones(3)

    def timer(self, launch):
        config = self.builds[-1]  # lockstep/root: the candidate just built is the one timed
        self.timed.append(config)
        ms = TIMES[self.rank][CANDIDATES.index(config)]
        return ms * (1 + 5 * self.jitter.random()) if self.noisy else ms


def _tune(r, cache_dir, policy, *, name, shapes=None, mode=None):
    from tilescale_lang.autotune import SearchSpace, tune

    return tune(SearchSpace(AXES), r.build, name=name, dtype="float16", shapes=shapes or {"m": 512},
                reference=torch.ones(3), policy=policy, mode=mode, timer=r.timer, cache_dir=cache_dir,
                environment=ENV)


def _policies(rank, cache_dir, noisy, prefix=""):
    """Both policies, each tuned then read from the cache: what each rank saw."""
    out = {}
    for policy in ("root", "slowest"):
        r = _Rank(rank, noisy=noisy and rank == 2)
        first = _tune(r, cache_dir, policy, name=f"{prefix}toy-{policy}")
        again = _tune(r, cache_dir, policy, name=f"{prefix}toy-{policy}")
        out[policy] = {"config": first.config, "source": first.source, "builds": len(r.builds),
                       "timed": len(r.timed), "again": (again.config, again.source), "time_ms": first.time_ms,
                       "skipped": [(s.stage, s.config, s.error) for s in first.skipped]}
    return out


def _errors(rank, cache_dir, cases):
    """Each case's AutotuneError message on this rank (None: no error): a cache_only miss;
    rank 1 passing other shapes; the ranks but rank 0 with TILESCALE_AUTOTUNE=off."""
    import os

    from tilescale_lang.autotune import AutotuneError

    errors = {}
    for case in cases:
        shapes = {"m": 1024 if case == "miss" else 512 + 64 * (rank == 1 and case == "shapes")}
        if case == "mode":
            os.environ["TILESCALE_AUTOTUNE"] = "on" if rank == 0 else "off"
        try:
            _tune(_Rank(rank), cache_dir, "root", name="toy-root", shapes=shapes,
                  mode="cache_only" if case == "miss" else None)
            errors[case] = None
        except AutotuneError as exc:
            errors[case] = str(exc)
    return errors


def _body(rank, world, store_path, cache_dir, more):
    """Both policies; with ``more`` also a noisy rank 2 and the disagreements."""
    _init(rank, world, store_path)
    try:
        out = {"clean": _policies(rank, cache_dir, False)}
        if more:
            out["noisy"] = _policies(rank, cache_dir, True, prefix="noisy-")
        out["errors"] = _errors(rank, cache_dir, ("miss", "shapes", "mode") if more else ("miss",))
    finally:
        _done()
    return out


def _run(world, tmp_path, more):
    from tilescale_core.multiprocess import run_ranks

    return run_ranks(_body, world, args=(str(tmp_path / "store"), str(tmp_path / "cache"), more), backend=None,
                     timeout=180)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """One run of 3 ranks (each spawn pays torch's and TileLang's import): every case."""
    return _run(3, tmp_path_factory.mktemp("three"), True)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_ends_with_the_same_config(world, tmp_path, request):
    out = _run(2, tmp_path, False) if world == 2 else request.getfixturevalue("three_ranks")
    root = out[0]["clean"]
    # "root": the root's clock decides (candidate 0), nobody else builds or times anything
    assert root["root"]["config"] == CANDIDATES[0] and root["root"]["time_ms"] == 1.0
    # "slowest": the slowest rank decides: candidate 3 (2.0 ms for 2 ranks, 2.5 ms for 3)
    assert root["slowest"]["config"] == CANDIDATES[3] and root["slowest"]["time_ms"] == max(
        TIMES[r][3] for r in range(world))
    for rank, o in enumerate(o["clean"] for o in out):
        for policy in ("root", "slowest"):
            assert o[policy]["config"] == root[policy]["config"], (rank, policy, o)
            assert o[policy]["again"] == (root[policy]["config"], "cache"), (rank, policy)  # not timed again
        assert (o["root"]["builds"], o["root"]["timed"]) == ((6, 5) if rank == 0 else (0, 0))
        assert o["slowest"]["builds"] == 6  # every rank builds every candidate in lockstep
        assert o["slowest"]["timed"] == 4  # not the one failing to compile on rank 1, nor the wrong one on rank 0
        assert o["slowest"]["skipped"] == root["slowest"]["skipped"]
    skipped = {s[1]["block_n"] + s[1]["block_m"]: s for s in root["slowest"]["skipped"]}
    assert skipped[128 + 128][0] == "compile" and skipped[128 + 128][2].startswith("rank 1: RuntimeError: compile")
    assert skipped[256 + 128][0] == "check" and skipped[256 + 128][2].startswith("rank 0: AssertionError")
    assert [s[0] for s in root["root"]["skipped"]] == ["check"]  # the root alone: its wrong candidate only
    for o in out:
        assert "no entry for key" in o["errors"]["miss"] and "'m': 1024" in o["errors"]["miss"]


def test_noisy_rank_cannot_split_the_choice(three_ranks):
    """Rank 2's clock is random on every call: whatever it says, all ranks take one config."""
    for policy in ("root", "slowest"):
        assert len({str(o["noisy"][policy]["config"]) for o in three_ranks}) == 1, [o["noisy"] for o in three_ranks]
    assert three_ranks[0]["noisy"]["root"]["config"] == CANDIDATES[0]  # the noisy rank does not time under "root"


def test_disagreeing_ranks_all_raise(three_ranks):
    for o in three_ranks:
        assert "the ranks disagree (rank 1 differs from rank 0 in ['shapes']" in o["errors"]["shapes"]
        assert "rank 1 differs from rank 0 in ['mode']: mode: 'on' vs 'off'" in o["errors"]["mode"]
