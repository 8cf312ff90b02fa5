"""GPU tests of the Triton-distributed parity intrinsics: put_signal ordering under stress,
a compare-and-swap lock between ranks, team barriers on a subset while the other ranks run
their own, and broadcast / fcollect against torch -- on 1 rank (peer = self) and on 2 and 4
ranks (sharing one GPU when there is one).

Run with ``pytest -m gpu``; skipped with a reason when no GPU is visible.
``TILESCALE_STRESS_ROUNDS`` overrides the 10^5 rounds of the put_signal stress test.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu

ROUNDS = int(os.environ.get("TILESCALE_STRESS_ROUNDS", "100000"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from lang_gpu_helpers import session_cache

    return session_cache(tmp_path_factory, "tilelang-cache-parity")


@pytest.mark.parametrize("world", [1, 2])
def test_put_signal_consumer_never_sees_stale_data(world, cache_dir):
    """10^5 rounds of put-with-signal through a ring of 256 slots (put_signal_block, set and
    add), 10^4 for every other variant: the consumer reads each round's data right after its
    signal and compares every element."""
    from tilescale_core.multiprocess import run_ranks

    import gpu_parity_kernels as G

    short = max(ROUNDS // 10, G.RING + 1)
    runs = [(0, 0, ROUNDS), (0, 1, ROUNDS)] + [(m, a, short) for m in (1, 2, 3, 4, 5) for a in (0, 1)]
    reports = run_ranks(G.stress_body, world, args=(cache_dir, runs), backend="auto", timeout=280)
    for rep in reports:
        assert len(rep) == len(runs)
        for name, res in rep.items():
            assert res["stale"] == 0, f"{name}: {res['stale']} stale elements, last at (round, index, value) {res['first_bad']}"
            assert res["signals_ok"], f"{name}: final signal values differ from the rounds sent"
            assert res["acks"] > 0, name


@pytest.mark.parametrize("world", [1, 2, 4])
def test_teams_barrier_broadcast_fcollect_and_cas_lock(world, cache_dir):
    """Teams (a subset's barriers while the other ranks run their own team's, broadcast and
    fcollect against torch), then a compare-and-swap lock on rank 0 taken by every block of
    every rank, guarding a plain read-modify-write, and a 64-bit CAS-loop counter."""
    from tilescale_core.multiprocess import run_ranks

    import gpu_parity_kernels as G

    iters = 40
    reports = run_ranks(G.team_body, world, args=(cache_dir, 200, iters), backend="auto", timeout=240)
    for rank, rep in enumerate(reports):
        assert rep["errors"] == [], f"rank {rank}: {rep['errors'][:10]}"
    out = [rep["lock"] for rep in reports]
    total = world * G.LOCK_BLOCKS * iters
    assert out[0]["count"] == total, f"lost updates under the lock: {out[0]['count']} of {total}"
    assert out[0]["big"] == total, f"64-bit CAS increments: {out[0]['big']} of {total}"
    for rank, o in enumerate(out):
        assert o["err"][:2] == [0, 0], f"rank {rank}: two holders at once or a bad unlock: {o['err']}"
    assert out[0]["lock"] == 0
