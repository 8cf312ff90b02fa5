"""AllGatherGEMM and GemmReduceScatter on a GPU (``-m gpu``).

One spawn per world size (1, 2, 4 ranks; they share the GPU when there are fewer GPUs), each
running every case of that size:

* the benchmark shapes (k 8192, n 3584, m_local 4096, bfloat16), fused plan, three
  back-to-back calls with fresh inputs and poisoned outputs, no host synchronisation between
  them, every output checked element-wise against the float32 torch reference with
  :func:`~tilescale_examples.overlap.gemm.error_bound`;
* world 1: 300 calls of each op on the same inputs refilled in place (the repeated call's
  frozen launch, its TMA descriptors encoded once), bit for bit those of TileLang's launcher;
* world 2: the producer started only after the peer GEMM's spinning tiles hold every SM
  (the deadlock the fused plan must be free of, made to happen on purpose); float16; the
  sequential plans; and 1000 back-to-back calls of each op at a moderate shape with a random
  rank delayed before each call (a host sleep or a busy kernel on its stream), every output
  checked on the GPU without host synchronisation.

Inputs come from seeded CUDA generators, so every rank regenerates every other rank's inputs
for its reference instead of gathering them. Kernels compile with
``TILESCALE_WAIT_TIMEOUT_MS=30000`` and host waits poll with deadlines: a lost signal is an
error naming the stream or the rank, not a hang.
"""

from __future__ import annotations

import random
import time

import torch
from examples_helpers import close_rank_heap, open_rank_heap, expect_checks, gpu_rank_test

K, N, M_LOCAL = 8192, 3584, 4096  # the benchmark shapes (a 70B-class MLP's tensor-parallel GEMMs)
STRESS = dict(m_local=256, k=1024, n=512, calls=1000)
REPEATED = dict(m_local=128, k=1024, n=1024, calls=300)  # world 1: the launch benchmark's GEMM shape
SYNC_S = 180.0


def _randn(shape, seed: int, device, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def _seed(kind: str, rank: int, call: int) -> int:
    return {"a": 1, "b": 2}[kind] * 1_000_003 + rank * 7919 + call * 104_729


def _sync(device) -> None:
    from tilescale_host import synchronize_streams

    synchronize_streams([torch.cuda.current_stream(device)], timeout=SYNC_S)


def _ag_inputs(p: int, call: int, m_local: int, k: int, n: int, dtype, device):
    """Rank ``p``'s ``a`` of call ``call`` and its ``b`` (scaled so outputs are about N(0, 1))."""
    return (_randn((m_local, k), _seed("a", p, call), device, dtype=dtype),
            _randn((k, n), _seed("b", p, 0), device, k ** -0.5, dtype))


def _rs_inputs(p: int, call: int, world: int, m_local: int, k: int, n: int, dtype, device):
    return (_randn((world * m_local, k), _seed("a", p, call), device, dtype=dtype),
            _randn((k, n), _seed("b", p, 0), device, k ** -0.5, dtype))


def _ag_expected(rank, world, call, m_local, k, n, dtype, device):
    from tilescale_examples.overlap.ag_gemm import torch_reference

    return torch_reference([_ag_inputs(p, call, m_local, k, n, dtype, device) for p in range(world)], rank), None


def _rs_expected(rank, world, call, m_local, k, n, dtype, device):
    from tilescale_examples.overlap.gemm_rs import partial_magnitudes, torch_reference

    ins = [_rs_inputs(p, call, world, m_local, k, n, dtype, device) for p in range(world)]
    a, b = [x for x, _ in ins], [y for _, y in ins]
    return torch_reference(ins, rank), partial_magnitudes(a, b, rank)


OPS = {"ag": (_ag_inputs, _ag_expected), "rs": (_rs_inputs, _rs_expected)}


def _build(op: str, alloc, m_local, k, n, dtype, plan="auto"):
    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.overlap.gemm_rs import GemmReduceScatter

    cls = AllGatherGEMM if op == "ag" else GemmReduceScatter
    return cls(alloc, m_local, k, n, dtype, algorithm=plan)


def _inputs(op, p, call, world, m_local, k, n, dtype, device):
    if op == "ag":
        return _ag_inputs(p, call, m_local, k, n, dtype, device)
    return _rs_inputs(p, call, world, m_local, k, n, dtype, device)


def shared_gpu(world: int) -> bool:
    """Whether the ranks of this run share GPUs (fewer visible GPUs than ranks)."""
    return torch.cuda.device_count() < world


def auto_plan(op: str, world: int) -> str:
    """The plan ``plan="auto"`` must pick: the all-gather + GEMM needs one GPU per rank for its
    fused plan (a copy within one GPU may run on the SMs its waiting GEMM holds)."""
    return "sequential" if op == "ag" and world > 1 and shared_gpu(world) else "fused"


def check_calls(op: str, alloc, rank: int, world: int, m_local: int, k: int, n: int, dtype,
                calls: int = 3, plan: str = "auto", expect_plan: str = None) -> int:
    """``calls`` back-to-back calls (fresh inputs, poisoned output, no host sync between
    them), then every output against the float32 reference. Returns the checks made."""
    from tilescale_examples.overlap.gemm import count_outside

    device = torch.device(alloc.device)
    obj = _build(op, alloc, m_local, k, n, dtype, plan)
    expect_plan = expect_plan or auto_plan(op, world)
    assert obj.algorithm == expect_plan, (f"rank {rank}: algorithm {obj.algorithm} ({obj.algorithm_reason}), "
                                          f"expected {expect_plan}")
    kept = []
    for call in range(calls):
        a, b = _inputs(op, rank, call, world, m_local, k, n, dtype, device)
        obj.output.fill_(float("nan"))
        kept.append((a, b, obj(a, b).clone()))
    _sync(device)
    for call, (_, _, out) in enumerate(kept):
        ref, rounded = OPS[op][1](rank, world, call, m_local, k, n, dtype, device)
        bad, worst = count_outside(out, ref, dtype, rounded)
        assert bad == 0, (f"{op} rank {rank}/{world} {dtype} m_local={m_local} k={k} n={n} algorithm={obj.algorithm} "
                          f"call {call}: {bad} element(s) outside the bound (worst {worst:.3g}x)")
    assert obj.epoch == calls
    obj.close()
    return calls


def repeated_calls_at_one_rank(op: str, alloc, rank: int, m_local: int, k: int, n: int, calls: int) -> int:
    """One rank: ``calls`` calls on the same ``a`` and ``b`` refilled in place (the serving
    loop), whose repeated calls launch the kept launch and, from the second on, its frozen
    launch (the GEMM's TMA descriptors encoded once); each output equals, bit for bit, that of
    a second instance called with ``out=`` (TileLang's launcher, a full call every time),
    checked on the GPU without host synchronisation, and the first ones against the float32
    reference. Returns the calls checked."""
    from tilescale_examples.overlap.gemm import count_outside

    device = torch.device(alloc.device)
    obj, ref_op = (_build(op, alloc, m_local, k, n, torch.bfloat16) for _ in range(2))
    a0, b0 = _inputs(op, rank, 0, 1, m_local, k, n, torch.bfloat16, device)
    a, b = a0.clone(), b0.clone()
    ref = torch.empty_like(obj.output)
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    for call in range(calls):
        fresh = _inputs(op, rank, call, 1, m_local, k, n, torch.bfloat16, device)
        a.copy_(fresh[0])
        b.copy_(fresh[1])
        obj.output.fill_(float("nan"))
        out = obj(a, b)
        ref_op(a, b, out=ref)
        mismatches += (out.view(torch.int16) != ref.view(torch.int16)).sum()
        if call < 3:
            want, rounded = OPS[op][1](rank, 1, call, m_local, k, n, torch.bfloat16, device)
            bad, worst = count_outside(out, want, torch.bfloat16, rounded)
            assert bad == 0, f"{op} call {call}: {bad} element(s) outside the bound (worst {worst:.3g}x)"
    _sync(device)
    assert int(mismatches) == 0, f"{op}: {int(mismatches)} element(s) differ from TileLang's launcher's"
    kept = obj._kept_launch
    assert kept is not None and kept.frozen, f"{op}: the repeated calls did not launch a frozen launch ({kept})"
    assert obj.epoch == calls
    obj.close()
    ref_op.close()
    return calls


def producer_after_the_gemm_holds_every_sm(alloc, rank: int, world: int, m_local: int, k: int, n: int) -> int:
    """Every rank launches its peer GEMM first, on a grid larger than the GPU, with nothing
    pushed yet (every tile spins), waits 200 ms, then enqueues the copy-engine pushes, then
    the GEMM of its own rows. With an SM-based producer this is the deadlock the fused plan
    must be free of; here the copies and flag writes need no SM."""
    import torch.distributed as dist

    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.overlap.gemm import count_outside
    from tilescale_examples.overlap.stream_ops import CopyEnginePush

    device = torch.device(alloc.device)
    agg = AllGatherGEMM(alloc, m_local, k, n, torch.bfloat16)
    assert agg.algorithm == "fused" and agg.world_size == world >= 2
    a, b = _ag_inputs(rank, 0, m_local, k, n, torch.bfloat16, device)
    push = CopyEnginePush(*agg._peers, rank, world, agg.chunks, agg.tiles.block_m, device)
    main, other = torch.cuda.current_stream(device), torch.cuda.Stream(device=device)
    agg.output.fill_(float("nan"))
    tiles = (world - 1) * (m_local // agg.tiles.block_m) * (n // agg.tiles.block_n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert tiles > sms, f"{tiles} tiles do not fill {sms} SMs"
    torch.cuda.synchronize(device)
    dist.barrier()
    push.mark(other)  # the copies follow nothing on the GEMM's stream
    agg.kernel(agg.gathered.view(-1, k), b, agg.output, agg.flags, agg._order)
    time.sleep(0.2)
    spinning = not main.query()
    dist.barrier()  # no rank pushes before every rank has looked at its spinning GEMM
    assert spinning, f"rank {rank}: the peer GEMM finished before anything was pushed"
    push.enqueue(a.data_ptr())
    push.release(main)
    push.finish(main)
    agg.own_kernel(a, b, agg.output[rank * m_local:(rank + 1) * m_local])
    _sync(device)
    ref, _ = _ag_expected(rank, world, 0, m_local, k, n, torch.bfloat16, device)
    bad, worst = count_outside(agg.output, ref, torch.bfloat16)
    assert bad == 0, f"rank {rank}: {bad} element(s) outside the bound (worst {worst:.3g}x)"
    agg.close()
    return 1


def straggler_stress(op: str, alloc, rank: int, world: int, m_local: int, k: int, n: int, calls: int,
                     pool: int = 4) -> int:
    """``calls`` back-to-back calls; before each, one rank (the same random choice on every
    rank) is delayed by a host sleep or a busy kernel on its stream (up to 1 ms). Each
    output is poisoned before and checked on the GPU after its call; one host sync at the end."""
    from tilescale_examples.overlap.gemm import error_bound

    device = torch.device(alloc.device)
    dtype = torch.bfloat16
    obj = _build(op, alloc, m_local, k, n, dtype)
    inputs = [_inputs(op, rank, j, world, m_local, k, n, dtype, device) for j in range(pool)]
    refs = []
    for j in range(pool):
        ref, rounded = OPS[op][1](rank, world, j, m_local, k, n, dtype, device)
        refs.append((ref, error_bound(ref, dtype, rounded)))
    bad = torch.zeros((), dtype=torch.int64, device=device)
    rng = random.Random(20261201)  # the same sequence on every rank
    cycles_per_ms = 2_000_000  # about 1 ms of torch.cuda._sleep at an H200's clock
    for i in range(calls):
        slow, busy, ms = rng.randrange(world), rng.random() < 0.5, rng.uniform(0.0, 1.0)
        if slow == rank:
            if busy:
                torch.cuda._sleep(int(ms * cycles_per_ms))  # a busy kernel ahead of the call on this stream
            else:
                time.sleep(ms * 1e-3)
        j = i % pool
        obj.output.fill_(float("nan"))
        out = obj(*inputs[j])
        ref, bound = refs[j]
        bad += (~((out.float() - ref).abs() <= bound)).sum()
    _sync(device)
    assert int(bad.item()) == 0, f"{op} rank {rank}: {int(bad.item())} wrong element(s) over {calls} calls"
    assert obj.epoch == calls
    obj.close()
    return calls


def _heap(world: int, cases) -> int:
    from tilescale_examples.overlap import ag_gemm, gemm_rs

    total = 64 << 20
    for op, m_local, k, n, dtype in cases:
        total += (ag_gemm.heap_bytes(world, m_local, k, dtype) if op == "ag"
                  else gemm_rs.heap_bytes(world, m_local, n, dtype))
    return total


def gpu_rank_body(rank: int, world: int, cache_dir: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references in float32
    big = [(op, M_LOCAL, K, N, torch.bfloat16) for op in ("ag", "rs")]
    small = dict(m_local=512, k=1024, n=512)
    extra = []
    if world == 2:
        extra = [(op, small["m_local"], small["k"], small["n"], dt) for op in ("ag", "rs")
                 for dt in (torch.float16, torch.bfloat16)]
        extra += [(op, STRESS["m_local"], STRESS["k"], STRESS["n"], torch.bfloat16) for op in ("ag", "rs")]
        extra += [("ag", M_LOCAL, K, N, torch.bfloat16)]  # the SM-starved producer
    alloc = open_rank_heap(rank, world, cache_dir, _heap(world, big + extra))
    checks = 0
    for op in ("ag", "rs"):
        checks += check_calls(op, alloc, rank, world, M_LOCAL, K, N, torch.bfloat16)
    if world == 1:
        for op in ("ag", "rs"):
            checks += repeated_calls_at_one_rank(op, alloc, rank, **REPEATED)
    if world == 2:
        if not shared_gpu(world):  # the fused all-gather + GEMM needs one GPU per rank
            checks += producer_after_the_gemm_holds_every_sm(alloc, rank, world, M_LOCAL, K, N)
        for op in ("ag", "rs"):
            checks += check_calls(op, alloc, rank, world, **small, dtype=torch.float16, calls=2)
            checks += check_calls(op, alloc, rank, world, **small, dtype=torch.bfloat16, calls=2,
                                  plan="sequential", expect_plan="sequential")
            checks += straggler_stress(op, alloc, rank, world, STRESS["m_local"], STRESS["k"], STRESS["n"],
                                       STRESS["calls"])
    return close_rank_heap(alloc, rank, checks)


def expected_checks(world: int) -> int:
    """Checks every rank must report (the starved-producer case needs one GPU per rank)."""
    if world == 1:
        return 3 + 3 + 2 * REPEATED["calls"]
    if world != 2:
        return 3 + 3
    return 3 + 3 + (0 if shared_gpu(world) else 1) + 2 * (2 + 2 + STRESS["calls"])


@gpu_rank_test(1, 2, 4, timeout=420, rank_timeout=360, cache="overlap")
def test_overlapped_gemms_on_gpu(world, rank, world_size, kernel_cache):
    expect_checks(gpu_rank_body(rank, world_size, kernel_cache), expected_checks(world_size))
