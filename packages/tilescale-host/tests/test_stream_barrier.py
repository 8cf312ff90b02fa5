"""barrier_all_on_stream: argument checks and the kernel's code on CPU; on a GPU, a barrier
between ranks with one rank delayed (the others' host threads never block, their streams
do) and the wait timeout that turns a missing rank into an error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from tilescale_host import stream_barrier as sb


def test_single_process_is_a_no_op():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert sb.barrier_all_on_stream() is None
    with pytest.raises(TypeError, match="stream"):
        sb.barrier_all_on_stream(stream=5)
    with pytest.raises(ValueError, match="not initialised"):
        sb.barrier_all_on_stream(group=object())


def test_exported():
    import tilelang.distributed as td

    import tilescale_host

    assert tilescale_host.barrier_all_on_stream is sb.barrier_all_on_stream
    assert td.barrier_all_on_stream is sb.barrier_all_on_stream


def test_kernel_code_releases_then_acquires(tmp_path, monkeypatch):
    """One release store per peer of the epoch, then acquire polls of every slot."""
    pytest.importorskip("tilescale_lang")
    import tilelang

    from tilescale_lang.codegen import cuda_source

    captured = {}
    monkeypatch.setattr(tilelang, "compile", lambda f, **kw: captured.setdefault("f", f))
    monkeypatch.setattr(sb, "_kernel_cache", {})
    sb._kernel()
    src = cuda_source(captured["f"])
    assert "tilescale::st<tilescale::Scope::SYS, tilescale::Sem::RELEASE, false>((&(Slots[me])), ((uint64_t)epoch)" in src
    assert "tilescale::wait_until<tilescale::Cmp::GE, tilescale::Scope::SYS, tilescale::Sem::ACQUIRE>" in src


def _delayed_rank(rank, world, cache_dir, rounds, delay):
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import tilelang
    import torch
    import torch.distributed as dist

    from tilescale_core.multiprocess import rank_device

    torch.cuda.set_device(rank_device(rank))
    alloc = tilelang.get_allocator(size=2**22, device=rank_device(rank), is_distributed=True, local_rank=rank,
                                   num_local_ranks=world, group=dist.group.WORLD)
    X = tilelang.tensor((4096,), torch.float32, allocator=alloc, return_peers=True)
    mine, peers = X[rank], X
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    mine.fill_(-1)
    sb.barrier_all_on_stream()  # first call: makes the heap and loads the kernel (collective)
    torch.cuda.synchronize()
    out = {"call_s": [], "busy_after_call": [], "errors": []}
    stream = torch.cuda.current_stream()
    for r in range(rounds):
        late = world > 1 and r % 2 == 1 and r < 4  # the last rank is late in rounds 1 and 3
        if rank == world - 1 and late:
            time.sleep(delay)
        g = torch.Generator(device="cpu").manual_seed(100 * r + rank)
        peers[nxt].copy_(torch.randn(4096, generator=g).to(mine.device))  # write into the next rank's X
        t0 = time.perf_counter()
        sb.barrier_all_on_stream(stream)
        out["call_s"].append(time.perf_counter() - t0)
        if rank != world - 1 and late:
            out["busy_after_call"].append(not stream.query())  # waiting for the late rank
        got = mine.clone()  # enqueued after the barrier
        torch.cuda.synchronize()
        want = torch.randn(4096, generator=torch.Generator().manual_seed(100 * r + prv))
        if not torch.equal(got.cpu(), want):
            out["errors"].append(f"round {r}: data from rank {prv} not visible after the barrier")
        sb.barrier_all_on_stream(stream)  # nobody overwrites X before every rank read it
    torch.cuda.synchronize()
    dist.barrier()
    sb.close_stream_barriers()
    alloc.close()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_barrier_with_a_delayed_rank(world, tmp_path):
    pytest.importorskip("tilescale_lang")  # the barrier kernel
    from tilescale_core.multiprocess import run_ranks

    delay = 1.0
    out = run_ranks(_delayed_rank, world, args=(str(tmp_path), 12, delay), backend="auto", timeout=240)
    for rank, o in enumerate(out):
        assert o["errors"] == [], f"rank {rank}: {o['errors']}"
        assert max(o["call_s"]) < 0.2, f"rank {rank}: a barrier call blocked the host ({max(o['call_s']):.3f} s)"
        if world > 1 and rank != world - 1:
            assert o["busy_after_call"] and all(o["busy_after_call"]), "the stream did not wait for the late rank"


_TIMEOUT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from tilescale_core.multiprocess import run_ranks

    def body(rank, world):
        import torch, torch.distributed as dist
        from tilescale_host import stream_barrier as sb
        torch.cuda.set_device(0)
        sb.barrier_all_on_stream()          # both ranks: heap and kernel
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            time.sleep(8)                   # never calls the second barrier
            return "absent"
        sb.barrier_all_on_stream()
        try:
            torch.cuda.synchronize()
        except Exception as exc:
            return "ERROR " + str(exc)[:300]
        return "no error"

    if __name__ == "__main__":
        print("RESULTS", run_ranks(body, 2, backend="gloo", timeout=120), flush=True)
""")


@pytest.mark.gpu
def test_missing_rank_times_out_with_the_wait_timeout(tmp_path):
    pytest.importorskip("tilescale_lang")
    script = tmp_path / "stream_timeout.py"
    script.write_text(_TIMEOUT_SCRIPT)
    env = dict(os.environ, TILESCALE_WAIT_TIMEOUT_MS="300", TILELANG_CACHE_DIR=str(tmp_path / "cache"),
               TILESCALE_SHARE_GPUS="1")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=200)
    text = res.stdout + res.stderr
    assert "[tilescale] wait timed out after 300 ms: rank 0" in text, text[-3000:]
    # rank 0's result is the CUDA error (repr quotes it with " when the message holds a ')
    assert re.search(r"RESULTS \[['\"]ERROR", text), text[-3000:]
    assert "'absent']" in text, text[-3000:]
