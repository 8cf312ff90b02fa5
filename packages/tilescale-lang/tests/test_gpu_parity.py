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
    return str(tmp_path_factory.mktemp("tilelang-cache-parity"))


@pytest.mark.parametrize("world", [1, 2])
def test_put_signal_consumer_never_sees_stale_data(world, cache_dir):
    """10^5 rounds of put-with-signal through a ring of 256 slots, every variant: the
    consumer reads each round's data right after its signal and compares every element."""
    from tilescale_core.multiprocess import run_ranks

    import gpu_parity_kernels as G

    main = [(0, 0), (0, 1)]  # put_signal_block, set and add: the full round count
    others = [(m, a) for m in (1, 2, 3, 4, 5) for a in (0, 1)]
    reports = run_ranks(G.stress_body, world, args=(cache_dir, ROUNDS, main), backend="auto", timeout=240)
    reports += run_ranks(G.stress_body, world, args=(cache_dir, max(ROUNDS // 10, G.RING + 1), others),
                         backend="auto", timeout=240)
    for rep in reports:
        for name, res in rep.items():
            assert res["stale"] == 0, f"{name}: {res['stale']} stale elements, last at (round, index, value) {res['first_bad']}"
            assert res["signals_ok"], f"{name}: final signal values differ from the rounds sent"
            assert res["acks"] > 0, name


@pytest.mark.parametrize("world", [1, 2, 4])
def test_cas_lock_between_ranks(world, cache_dir):
    from tilescale_core.multiprocess import run_ranks

    import gpu_parity_kernels as G

    iters = 40
    out = run_ranks(G.lock_body, world, args=(cache_dir, iters), backend="auto", timeout=180)
    total = world * G.LOCK_BLOCKS * iters
    assert out[0]["count"] == total, f"lost updates under the lock: {out[0]['count']} of {total}"
    assert out[0]["big"] == total, f"64-bit CAS increments: {out[0]['big']} of {total}"
    for rank, o in enumerate(out):
        assert o["err"][:2] == [0, 0], f"rank {rank}: two holders at once or a bad unlock: {o['err']}"
    assert out[0]["lock"] == 0


@pytest.mark.parametrize("world", [1, 2, 4])
def test_teams_barrier_broadcast_fcollect(world, cache_dir):
    from tilescale_core.multiprocess import run_ranks

    import gpu_parity_kernels as G

    reports = run_ranks(G.team_body, world, args=(cache_dir, 500), backend="auto", timeout=180)
    for rank, rep in enumerate(reports):
        assert rep["errors"] == [], f"rank {rank}: {rep['errors'][:10]}"
