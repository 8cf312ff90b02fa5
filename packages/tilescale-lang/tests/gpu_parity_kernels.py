"""Kernels and per-rank bodies for the GPU tests of the Triton-distributed parity intrinsics
(put_signal under stress, a compare-and-swap lock between ranks, teams and team collectives).

Importable by spawned rank processes.  Kernels are rank-agnostic and compiled once into the
session's TileLang cache (``compile_once``), then loaded by every rank.
"""

from __future__ import annotations

import tilelang
import tilelang.language as T

from tilescale_lang.team import TEAM_SHAPE, create_team

from lang_gpu_helpers import Checks

TARGET = {"kind": "cuda", "arch": "sm_90a"}
RING = 256  # slots in flight between a producer and its consumer
SLOT = 1024  # uint32 elements per slot (4 KiB)
MAX_RANKS = 8
TEAM_N = 1 << 14  # float32 elements per rank in the team collectives
LOCK_BLOCKS = 8
#: put_signal variants of the stress kernel (mode argument)
MODES = {0: "put_signal_block", 1: "put_signal_nbi_block", 2: "put_signal_warp", 3: "put_signal_nbi_warp",
         4: "put_nbi_block + quiet + signal_op", 5: "put_nbi_warp + quiet + signal_op"}

_cache: dict = {}


def _compile(key, build):
    if key not in _cache:
        _cache[key] = tilelang.compile(build(), target=TARGET, compile_once=True)
    return _cache[key]


@T.macro
def _signalled_put(put, Src, Data, base, count, Sig, slot, sig, add, pe):
    """``put`` (a ``T.put_signal_*`` intrinsic) of ``Src[base:]`` to ``Data[base:]`` on ``pe``,
    adding 1 to ``Sig[slot]`` when ``add`` is 1, else setting it to ``sig``."""
    if add == 1:
        put(Src[base], Data[base], count, Sig[slot], 1, "add", pe)
    else:
        put(Src[base], Data[base], count, Sig[slot], sig, "set", pe)


@T.macro
def _signal(Sig, slot, sig, add, pe):
    """``T.signal_op`` on ``Sig[slot]`` of ``pe``: add 1 when ``add`` is 1, else set ``sig``."""
    if add == 1:
        T.signal_op(Sig[slot], 1, "add", pe)
    else:
        T.signal_op(Sig[slot], sig, "set", pe)


def stress_kernel():
    """Block 0 produces ``rounds`` rounds to the next rank, block 1 consumes the previous
    rank's.  Round r uses slot r % RING; a slot is refilled once the consumer acknowledged
    it.  The consumer reads the data right after its signal and counts every stale element
    (element i of round r carries r * 2654435761 + i * 40503 + 12345, uint32 arithmetic)."""

    def build():
        @T.prim_func
        def stress(Src: T.Tensor((RING * SLOT,), "uint32"), Data: T.Tensor((RING * SLOT,), "uint32"),
                   Sig: T.Tensor((RING,), "uint64"), Ack: T.Tensor((2,), "uint64"), Err: T.Tensor((4,), "uint32"),
                   rounds: T.int32, mode: T.int32, add: T.int32):
            with T.Kernel(2, threads=128) as bx:
                tx = T.get_thread_binding()
                me = T.get_rank()
                n = T.get_num_ranks()
                nxt = (me + 1) % n
                prv = (me + n - 1) % n
                v = T.alloc_var("uint32")
                if bx == 0:
                    for r in T.serial(rounds):
                        base = (r % RING) * SLOT
                        cnt = 256 + (r * 37) % (SLOT - 256)  # elements this round
                        if r >= RING:
                            if tx == 0:
                                T.signal_wait_until(Ack[0], "ge", r - RING + 1)
                        T.sync_threads()
                        for j in T.serial(SLOT // 128):
                            Src[base + j * 128 + tx] = T.Cast("uint32", r) * T.uint32(2654435761) + T.Cast(
                                "uint32", j * 128 + tx) * T.uint32(40503) + T.uint32(12345)
                        T.sync_threads()
                        sig = T.if_then_else(add == 1, T.uint64(1), T.Cast("uint64", r + 1))
                        if mode == 0:
                            _signalled_put(T.put_signal_block, Src, Data, base, cnt, Sig, r % RING, sig, add, nxt)
                        elif mode == 1:
                            _signalled_put(T.put_signal_nbi_block, Src, Data, base, cnt, Sig, r % RING, sig, add, nxt)
                        elif mode == 2:
                            if tx < 32:
                                _signalled_put(T.put_signal_warp, Src, Data, base, cnt, Sig, r % RING, sig, add, nxt)
                        elif mode == 3:
                            if tx < 32:
                                _signalled_put(T.put_signal_nbi_warp, Src, Data, base, cnt, Sig, r % RING, sig,
                                               add, nxt)
                        elif mode == 4:
                            T.put_nbi_block(Src[base], Data[base], cnt, nxt)
                            T.quiet()
                            T.sync_threads()
                            if tx == 0:
                                _signal(Sig, r % RING, sig, add, nxt)
                        else:
                            if tx < 32:
                                T.put_nbi_warp(Src[base], Data[base], cnt, nxt)
                                T.quiet()
                                T.sync_warp()
                                if tx == 0:
                                    _signal(Sig, r % RING, sig, add, nxt)
                        T.sync_threads()  # Src of this slot may be refilled RING rounds later only
                else:
                    for r in T.serial(rounds):
                        base = (r % RING) * SLOT
                        cnt = 256 + (r * 37) % (SLOT - 256)
                        if tx == 0:
                            if add == 1:
                                T.signal_wait_until(Sig[r % RING], "ge", r // RING + 1)
                            else:
                                T.signal_wait_until(Sig[r % RING], "ge", r + 1)
                        T.sync_threads()
                        for j in T.serial(SLOT // 128):
                            if j * 128 + tx < cnt:
                                v = Data[base + j * 128 + tx]
                                if v != T.Cast("uint32", r) * T.uint32(2654435761) + T.Cast(
                                        "uint32", j * 128 + tx) * T.uint32(40503) + T.uint32(12345):
                                    T.atom_add(Err[0], 1)
                                    Err[1] = r
                                    Err[2] = j * 128 + tx
                                    Err[3] = v
                        T.sync_threads()
                        if tx == 0:
                            T.signal_op(Ack[0], r + 1, "set", prv)

        return stress

    return _compile(("stress",), build)


def lock_kernel():
    """LOCK_BLOCKS blocks per rank take a compare-and-swap lock that lives on rank 0 and
    increment a plain counter on rank 0 inside it; then a 64-bit CAS-loop increment."""

    def build():
        @T.prim_func
        def cas_lock(Lock: T.Tensor((4,), "uint32"), Count: T.Tensor((4,), "uint32"), Big: T.Tensor((4,), "uint64"),
                     Inside: T.Tensor((4,), "uint32"), Err: T.Tensor((4,), "uint32"), iters: T.int32):
            with T.Kernel(LOCK_BLOCKS, threads=32) as _:
                tx = T.get_thread_binding()
                c = T.alloc_var("uint32")
                old = T.alloc_var("uint64")
                got = T.alloc_var("uint64")
                if tx == 0:
                    for _i in T.serial(iters):
                        while T.atomic_cas(Lock[0], 0, 1, scope="sys", sem="acquire", pe=0) != 0:
                            pass
                        if T.atomic_cas(Inside[0], 0, 1, scope="sys", pe=0) != 0:  # someone else inside
                            Err[0] = Err[0] + 1
                        c = T.ld(Count[0], src_pe=0)
                        T.st(Count[0], c + 1, dst_pe=0)
                        if T.atomic_cas(Inside[0], 1, 0, scope="sys", pe=0) != 1:
                            Err[0] = Err[0] + 1
                        if T.atomic_cas(Lock[0], 1, 0, scope="sys", sem="release", pe=0) != 1:
                            Err[1] = Err[1] + 1
                    for _i in T.serial(iters):
                        old = T.ld(Big[0], scope="sys", sem="relaxed", src_pe=0)
                        got = T.atomic_cas(Big[0], old, old + 1, scope="sys", pe=0)
                        while got != old:
                            old = got
                            got = T.atomic_cas(Big[0], old, old + 1, scope="sys", pe=0)

        return cas_lock

    return _compile(("lock",), build)


def team_kernel():
    """op 0: ``rounds`` team barriers, each member stamping its round on every member before
    and checking every stamp after; op 1: broadcast_block; op 2: fcollect_block."""

    def build():
        @T.prim_func
        def team_ops(Team: T.Tensor(TEAM_SHAPE, "int32"), Stamp: T.Tensor((MAX_RANKS,), "int32"),
                     Src: T.Tensor((TEAM_N,), "float32"), Dst: T.Tensor((MAX_RANKS * TEAM_N,), "float32"),
                     Out: T.Tensor((8,), "int32"), op: T.int32, rounds: T.int32, root: T.int32, n: T.int32):
            with T.Kernel(1, threads=128) as _:
                tx = T.get_thread_binding()
                me = T.team_rank(Team)
                size = T.team_num_ranks(Team)
                s = T.alloc_var("int32")
                if tx == 0:
                    Out[0] = me
                    Out[1] = size
                    Out[2] = T.team_translate_pe(Team, 0)
                    Out[3] = T.team_translate_pe(Team, size - 1)
                    Out[4] = T.team_translate_pe(Team, size)
                if op == 0:
                    for r in T.serial(rounds):
                        if tx < size:
                            if me >= 0:
                                T.st(Stamp[me], r + 1, dst_pe=T.team_translate_pe(Team, tx))
                        T.team_barrier(Team)
                        if tx < size:
                            if me >= 0:
                                s = Stamp[tx]
                                if s < r + 1:
                                    Out[5] = Out[5] + 1
                        T.team_barrier(Team)  # nobody stamps round r + 1 before every check of r
                elif op == 1:
                    T.broadcast_block(Team, Dst, Src, n, root)
                else:
                    T.fcollect_block(Team, Dst, Src, n)

        return team_ops

    return _compile(("team",), build)


# ------------------------------------------------------------------------------ rank bodies
def _setup(rank, world, cache_dir):
    from lang_gpu_helpers import open_rank

    return open_rank(rank, world, cache_dir)


def stress_body(rank: int, world: int, cache_dir: str, runs) -> dict:
    """Every ``(mode, add, rounds)`` of ``runs``; returns what each run saw."""
    import torch

    alloc, sync = _setup(rank, world, cache_dir)
    k = stress_kernel().initialize(allocator=alloc)
    Src = torch.empty(RING * SLOT, dtype=torch.uint32, device=alloc.device)
    Data = tilelang.tensor((RING * SLOT,), torch.uint32, allocator=alloc)
    Sig = tilelang.tensor((RING,), torch.uint64, allocator=alloc)
    Ack = tilelang.tensor((2,), torch.uint64, allocator=alloc)
    Err = torch.zeros(4, dtype=torch.uint32, device=alloc.device)
    out = {}
    for mode, add, rounds in runs:
        Data.fill_(7)  # poison: a stale read sees 7 or an older round
        Sig.zero_()
        Ack.zero_()
        Err.zero_()
        sync()
        k(Src, Data, Sig, Ack, Err, rounds, mode, add)
        sync()
        e = [int(x) for x in Err.view(torch.int32).cpu()]
        sig = Sig.view(torch.int64).cpu()
        last = rounds - 1  # the final value of every slot's signal
        want = torch.tensor([(last - ((last - s) % RING)) // RING + 1 if add else last - ((last - s) % RING) + 1
                             for s in range(RING)], dtype=torch.int64)
        if rounds < RING:
            want[rounds:] = 0
        out[f"{MODES[mode]} {'add' if add else 'set'}"] = {
            "stale": e[0], "first_bad": e[1:], "signals_ok": bool(torch.equal(sig, want)),
            "acks": int(Ack[0].item()),
        }
        sync()
    alloc.close()
    return out


def lock_body(rank: int, world: int, cache_dir: str, iters: int) -> dict:
    import torch

    alloc, sync = _setup(rank, world, cache_dir)
    k = lock_kernel().initialize(allocator=alloc)
    Lock = tilelang.tensor((4,), torch.uint32, allocator=alloc)
    Count = tilelang.tensor((4,), torch.uint32, allocator=alloc)
    Big = tilelang.tensor((4,), torch.uint64, allocator=alloc)
    Inside = tilelang.tensor((4,), torch.uint32, allocator=alloc)
    Err = torch.zeros(4, dtype=torch.uint32, device=alloc.device)
    for t in (Lock, Count, Big, Inside):
        t.zero_()
    if rank == 0:
        Big.fill_((1 << 40) - 3)  # the 64-bit CAS crosses 2**40: the high word matters
    sync()
    k(Lock, Count, Big, Inside, Err, iters)
    sync()
    out = {"err": [int(x) for x in Err.view(torch.int32).cpu()], "lock": int(Lock[0].item())}
    if rank == 0:
        out["count"] = int(Count[0].item())
        out["big"] = int(Big.view(torch.int64)[0].item()) - ((1 << 40) - 3)
    sync()
    alloc.close()
    return out


def _seeded(shape, rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=g)


def team_body(rank: int, world: int, cache_dir: str, rounds: int, lock_iters: int) -> dict:
    """Team queries, a subset's barriers while the other ranks run their own team's, and
    broadcast / fcollect against torch on the world team and on a strided team; then the
    compare-and-swap lock (:func:`lock_body`) in the same processes."""
    report = _team_checks(rank, world, cache_dir, rounds)
    report["lock"] = lock_body(rank, world, cache_dir, lock_iters)
    return report


def _team_checks(rank: int, world: int, cache_dir: str, rounds: int) -> dict:
    import torch

    alloc, sync = _setup(rank, world, cache_dir)
    k = team_kernel().initialize(allocator=alloc)
    evens = create_team(range(0, world, 2), alloc)  # collective, same order everywhere
    odds = create_team(range(1, world, 2), alloc) if world > 1 else None
    everyone = create_team(list(range(world)), alloc)
    Stamp = tilelang.tensor((MAX_RANKS,), torch.int32, allocator=alloc)
    Src = tilelang.tensor((TEAM_N,), torch.float32, allocator=alloc)
    Dst = tilelang.tensor((MAX_RANKS * TEAM_N,), torch.float32, allocator=alloc)
    Out = torch.zeros(8, dtype=torch.int32, device=alloc.device)
    check = Checks()
    report = check.report

    # 1. queries, and the subset barrier: each parity runs its own team's barriers at the
    #    same time (a barrier that counted non-members would deadlock or fail the stamps).
    mine, other = (evens, odds) if rank % 2 == 0 else (odds, evens)
    Stamp.zero_()
    Out.zero_()
    sync()
    k(mine.tensor, Stamp, Src, Dst, Out, 0, rounds, 0, 0)
    torch.cuda.synchronize()
    o = Out.tolist()
    check(o[:5] == [mine.my_rank, mine.size, mine.translate(0), mine.translate(mine.size - 1), -1], f"team queries {o}")
    check(o[5] == 0, f"stale stamps after the team barrier: {o[5]}")
    check(mine.my_rank == mine.ranks.index(rank), f"host my_rank {mine.my_rank}")
    if other is not None:  # a non-member returns at once and sees -1
        Out.zero_()
        k(other.tensor, Stamp, Src, Dst, Out, 0, rounds, 0, 0)
        torch.cuda.synchronize()
        check(Out.tolist()[0] == -1 and Out.tolist()[5] == 0, f"non-member {Out.tolist()}")
    sync()

    # 2. broadcast and fcollect against torch, world team (every root) and the evens team
    for step, (team, n) in enumerate([(everyone, TEAM_N), (everyone, 1000), (evens, 4099)]):
        members = team.ranks
        for root in range(team.size):
            if rank in members:
                Src.copy_(_seeded(TEAM_N, rank, step))
                Dst.fill_(float("nan"))
            sync()
            if rank in members:
                k(team.tensor, Stamp, Src, Dst, Out, 1, 0, root, n)
            sync()
            if rank in members:
                want = _seeded(TEAM_N, team.translate(root), step)[:n]
                got = Dst[:n].cpu()
                check(torch.equal(got, want), f"broadcast team {members} root {root} n {n}")
                check(bool(torch.isnan(Dst[n:n + 16]).all()), f"broadcast wrote past n={n}")
        if rank in members:
            Src.copy_(_seeded(TEAM_N, rank, 50 + step))
            Dst.fill_(float("nan"))
        sync()
        if rank in members:
            k(team.tensor, Stamp, Src, Dst, Out, 2, 0, 0, n)
        sync()
        if rank in members:
            want = torch.cat([_seeded(TEAM_N, r, 50 + step)[:n] for r in members])
            got = Dst[: n * team.size].cpu()
            check(torch.equal(got, want), f"fcollect team {members} n {n}")
        sync()
    alloc.close()
    return report
