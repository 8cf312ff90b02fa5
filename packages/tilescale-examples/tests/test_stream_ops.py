"""Stream-ordered communication on the CPU: chunk plans, the plan choice, and the copy-engine
producer's operation list (addresses, order, flags)."""

from __future__ import annotations

import ctypes
import logging
import random
from types import SimpleNamespace

import pytest
import torch

from tilescale_examples.overlap.stream_ops import (PLANS, CopyEnginePush, choose_plan, plan_row_chunks, resolve_plan,
                                           stream_ops_available)


@pytest.mark.parametrize("units,max_chunks,sizes", [
    (1, 8, [1]),
    (2, 8, [1, 1]),
    (3, 8, [1, 2]),
    (8, 8, [1, 2, 5]),          # m_local 1024 in 128-row units
    (16, 8, [1, 2, 4, 9]),
    (32, 8, [1, 2, 4, 8, 17]),
    (64, 8, [1, 2, 4, 8, 16, 33]),  # m_local 8192
    (64, 3, [1, 2, 61]),
    (64, 1, [64]),
])
def test_row_chunks_grow_and_cover(units, max_chunks, sizes):
    chunks = plan_row_chunks(units, max_chunks)
    assert [n for _, n in chunks] == sizes
    assert [f for f, _ in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert len(chunks) <= max_chunks


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_row_chunks_reject_bad_arguments(bad):
    with pytest.raises(ValueError, match="units must be a positive int"):
        plan_row_chunks(bad)
    with pytest.raises(ValueError, match="max_chunks must be a positive int"):
        plan_row_chunks(4, bad)


def test_plan_choice():
    assert PLANS == ("auto", "fused", "sequential")
    assert choose_plan("auto", True, "ok") == ("fused", "ok")
    assert choose_plan("auto", False, "no memops") == ("sequential", "no memops")
    assert choose_plan("fused", True) == ("fused", "")
    assert choose_plan("sequential", True) == ("sequential", "requested")
    with pytest.raises(RuntimeError, match="algorithm='fused' needs stream memory operations on every rank: no memops"):
        choose_plan("fused", False, "no memops")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        choose_plan("overlap", True)


def test_resolve_plan_on_a_cpu_device_falls_back_with_a_log_line(caplog):
    ok, reason = stream_ops_available(torch.device("cpu"))
    assert not ok and "not a CUDA device" in reason
    with caplog.at_level(logging.WARNING, logger="tilescale_examples"):
        assert resolve_plan("Thing", "auto", torch.device("cpu")) == ("sequential", reason)
    assert "Thing: cpu is not a CUDA device; using the sequential plan" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tilescale_examples"):
        assert resolve_plan("Thing", "sequential", torch.device("cpu")) == ("sequential", "requested")
    assert caplog.text == ""
    with pytest.raises(RuntimeError, match="algorithm='fused' needs stream memory operations"):
        resolve_plan("Thing", "fused", torch.device("cpu"))


def _push(world=3, rank=1, m_local=512, k=64, chunks=((0, 1), (1, 3)), dtype=torch.bfloat16, views=None):
    """A CopyEnginePush of ``rank`` over host tensors (or the given ``(gathered, flags, free)``
    views of every rank): ``(push, gathered, flags, free)``."""
    gathered, flags, free = views or (
        [torch.zeros((world, m_local, k), dtype=dtype) for _ in range(world)],
        [torch.zeros((world * len(chunks),), dtype=torch.int64) for _ in range(world)],
        [torch.ones((world,), dtype=torch.int64) for _ in range(world)])
    return CopyEnginePush(gathered, flags, free, rank, world, list(chunks), 128, "cpu"), gathered, flags, free


@pytest.mark.parametrize("needs_own_gpus,shared,plan", [
    (True, True, "sequential"), (True, False, "fused"), (False, True, "fused"),
])
def test_resolve_plan_needs_own_gpus_when_asked(monkeypatch, caplog, needs_own_gpus, shared, plan):
    from tilescale_examples import base as collective
    from tilescale_examples.overlap import stream_ops

    monkeypatch.setattr(stream_ops, "stream_ops_available", lambda device: (True, "supported"))
    monkeypatch.setattr(collective, "all_ranks_agree", lambda ok, group, device: ok)
    asked = []
    monkeypatch.setattr(stream_ops, "ranks_share_a_gpu", lambda device, group, world: asked.append(world) or shared)
    with caplog.at_level(logging.WARNING, logger="tilescale_examples"):
        got, reason = resolve_plan("Thing", "auto", torch.device("cuda:0"), object(), 2, needs_own_gpus)
    assert got == plan
    assert asked == ([2] if needs_own_gpus else [])
    if plan == "sequential":
        assert reason.startswith("ranks share a GPU") and "Thing: ranks share a GPU" in caplog.text
        with pytest.raises(RuntimeError, match="algorithm='fused' needs .*ranks share a GPU"):
            resolve_plan("Thing", "fused", torch.device("cuda:0"), object(), 2, needs_own_gpus)


def test_ranks_share_a_gpu_is_false_for_one_rank():
    from tilescale_examples.overlap.stream_ops import ranks_share_a_gpu

    assert ranks_share_a_gpu(torch.device("cpu"), None, 1) is False


def test_copy_engine_ops_cover_every_chunk_of_every_peer_in_order():
    world, rank, m_local, k = 3, 1, 512, 64
    push, gathered, flags, free = _push(world, rank, m_local, k)
    row = k * 2
    a = 1 << 40
    ops = push.ops(a)
    assert len(ops) == 2 * (world - 1)
    # chunk 0 to ranks 2, 0 (rank + 1, rank + 2), then chunk 1 likewise; never to itself
    assert [j for j, *_ in ops] == [1, 2, 1, 2]
    for i, (j, dst, src, nbytes, flag) in enumerate(ops):
        c, p = i // (world - 1), (rank + j) % world
        assert p != rank
        first, n = ((0, 1), (1, 3))[c]
        assert dst == gathered[p][rank, first * 128].data_ptr()  # slot `rank` on p
        assert src == a + first * 128 * row and nbytes == n * 128 * row
        assert flag == flags[p][rank * 2 + c].data_ptr()  # flags[src * chunks + c] on p
    assert sum(nbytes for _, _, _, nbytes, _ in ops) == (world - 1) * m_local * row
    # claims: stream j - 1 takes free[(rank + j) % world] of this rank; releases: every other
    # source's chunk flags here, then free[rank] on the source
    assert push.claims() == [(1, free[1][2].data_ptr()), (2, free[1][0].data_ptr())]
    assert push.releases() == [([flags[1][0].data_ptr(), flags[1][1].data_ptr()], free[0][1].data_ptr()),
                               ([flags[1][4].data_ptr(), flags[1][5].data_ptr()], free[2][1].data_ptr())]


class _RecordingDriver:
    """The stream memory operations a push enqueues, recorded; like the driver, a write with
    any flag but the default (``CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`` is refused by the
    current API: CUDA_ERROR_INVALID_VALUE) fails."""

    class CUstreamWaitValue_flags:
        CU_STREAM_WAIT_VALUE_GEQ = "geq"

    class CUstreamWriteValue_flags:
        CU_STREAM_WRITE_VALUE_DEFAULT = 0
        CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER = 1

    def __init__(self):
        self.ops = []

    def cuStreamWaitValue64(self, handle, address, value, flags):
        self.ops.append(("wait", handle, address, value, flags))
        return 0

    def cuStreamWriteValue64(self, handle, address, value, flags):
        self.ops.append(("write", handle, address, value, flags))
        return 0 if flags == 0 else 1  # CUDA_ERROR_INVALID_VALUE

    def cuMemcpyAsync(self, dst, src, nbytes, handle):
        self.ops.append(("copy", handle, dst, src, nbytes))
        return 0


def _checked(status, name):
    assert status == 0, f"{name} failed: CUDA_ERROR_INVALID_VALUE"


def test_enqueued_stream_operations_use_flags_the_driver_accepts(monkeypatch):
    """The release on the consumer's stream and a chunk's copy on a side stream, through a
    recording driver: every wait is GEQ 1 followed by its reset, every write has the default
    flag (the fenced write the current driver API accepts), in protocol order."""
    from tilescale_examples.overlap import stream_ops

    drv = _RecordingDriver()
    monkeypatch.setattr(stream_ops, "_driver", lambda: (drv, _checked))
    push, _, flags, free = _push(3, 1, 512, 64)
    push.release(SimpleNamespace(cuda_stream=7))
    expected = []
    for chunk_flags, free_word in push.releases():
        for f in chunk_flags:
            expected += [("wait", 7, f, 1, "geq"), ("write", 7, f, 0, 0)]
        expected.append(("write", 7, free_word, 1, 0))
    assert drv.ops == expected
    drv.ops.clear()
    j, dst, src, nbytes, flag = push.ops(1 << 40)[0]
    push._copy_then_set(drv, _checked, 9, dst, src, nbytes, flag)
    assert drv.ops == [("copy", 9, dst, src, nbytes), ("write", 9, flag, 1, 0)]
    drv.ops.clear()
    stream_ops._take(drv, _checked, 5, free[1][0].data_ptr())
    assert drv.ops == [("wait", 5, free[1][0].data_ptr(), 1, "geq"), ("write", 5, free[1][0].data_ptr(), 0, 0)]


def test_copy_engine_rejects_inconsistent_views():
    gathered = [torch.empty((2, 256, 64), dtype=torch.float16) for _ in range(2)]
    flags = [torch.empty((2,), dtype=torch.uint64) for _ in range(2)]
    free = [torch.empty((2,), dtype=torch.uint64) for _ in range(2)]
    with pytest.raises(ValueError, match="one gathered, one flags and one free view per rank"):
        CopyEnginePush(gathered[:1], flags, free, 0, 2, [(0, 2)], 128, "cpu")
    with pytest.raises(ValueError, match="gathered has 2 rank slots, world_size is 3"):
        CopyEnginePush(gathered + gathered[:1], flags + flags[:1], free + free[:1], 0, 3, [(0, 2)], 128, "cpu")
    with pytest.raises(ValueError, match="do not cover m_local=256"):
        CopyEnginePush(gathered, flags, free, 0, 2, [(0, 1)], 128, "cpu")
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        CopyEnginePush(gathered[:1], flags[:1], free[:1], 0, 1, [(0, 2)], 128, "cpu")


def _word(address: int):
    return ctypes.c_int64.from_address(address)


@pytest.mark.parametrize("world, chunks, seed", [(2, ((0, 1),), 0), (3, ((0, 1), (1, 3)), 1), (4, ((0, 2), (2, 2)), 2),
                                                 (5, ((0, 1), (1, 1), (2, 2)), 3)])
def test_the_handshake_delivers_every_call_under_any_interleaving(world, chunks, seed):
    """Every rank's streams as queues of the push's own operations, run one operation at a
    time in a random order that only respects stream order and the waits (a wait blocks its
    stream until the word reaches the value): per call, main forks the side streams (claims,
    copies, ready flags), its consumer waits for every chunk flag and reads the gathered rows,
    then releases; the next call's operand is written only after the side streams joined.
    Every consumer must read every source's rows of the same call, and nothing may deadlock,
    over 6 calls."""
    calls, m_local, k = 6, 128 * sum(n for _, n in chunks), 2
    rng = random.Random(seed)
    views = ([torch.zeros((world, m_local, k), dtype=torch.int64) for _ in range(world)],
             [torch.zeros((world * len(chunks),), dtype=torch.int64) for _ in range(world)],
             [torch.ones((world,), dtype=torch.int64) for _ in range(world)])
    pushes = [_push(world, r, m_local, k, chunks, views=views)[0] for r in range(world)]
    operands = [torch.zeros((m_local, k), dtype=torch.int64) for _ in range(world)]
    queues = {}  # (rank, stream) -> list of operations; stream "main" or a side stream index
    joined = {r: 0 for r in range(world)}

    def side_ops(r, call):
        push, ops = pushes[r], []
        for j, free in push.claims():
            ops += [("side", j, ("wait", free, 1)), ("side", j, ("write", free, 0))]
        for j, dst, src, nbytes, flag in push.ops(operands[r].data_ptr()):
            ops += [("side", j, ("copy", dst, src, nbytes)), ("side", j, ("write", flag, 1))]
        return ops

    for r in range(world):
        main = []
        for call in range(calls):
            main.append(("produce", call))  # the operand of this call
            main.append(("fork", call))
            flag_addresses = [f for flags, _ in pushes[r].releases() for f in flags]
            main += [("wait", f, 1) for f in flag_addresses]  # the consumer kernel's waits
            main.append(("consume", call))
            for flags, free in pushes[r].releases():
                for f in flags:
                    main += [("wait", f, 1), ("write", f, 0)]
                main.append(("write", free, 1))
            main.append(("join", call))
        queues[(r, "main")] = main
        for j in range(1, world):
            queues[(r, j)] = []

    def runnable(key):
        q = queues[key]
        if not q:
            return False
        op = q[0]
        if op[0] == "wait":
            return _word(op[1]).value >= op[2]
        if op[0] == "join":
            return all(not queues[(key[0], j)] for j in range(1, world))
        return True

    steps = 0
    while any(queues.values()):
        ready = [key for key in queues if runnable(key)]
        assert ready, f"deadlock after {steps} operations: {[(key, q[0]) for key, q in queues.items() if q]}"
        key = rng.choice(ready)
        r, op = key[0], queues[key].pop(0)
        steps += 1
        if op[0] == "produce":
            operands[r].fill_(1000 * (op[1] + 1) + r)
        elif op[0] == "fork":
            for _, j, side in side_ops(r, op[1]):
                queues[(r, j)].append(side)
        elif op[0] == "write":
            _word(op[1]).value = op[2]
        elif op[0] == "copy":
            ctypes.memmove(op[1], op[2], op[3])
        elif op[0] == "consume":
            for src in range(world):
                if src != r:
                    assert (views[0][r][src] == 1000 * (op[1] + 1) + src).all(), (r, src, op[1])
        elif op[0] == "join":
            joined[r] += 1
    assert joined == {r: calls for r in range(world)}
    assert all(int(f.sum()) == 0 for f in views[1]) and all((f == 1).all() for f in views[2])
