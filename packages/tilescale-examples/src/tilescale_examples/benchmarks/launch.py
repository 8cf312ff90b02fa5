"""Host time per eager call: TileScale's ops (lean launcher and TileLang's launcher) against torch.add, torch symmetric memory and NCCL.

``python -m tilescale_examples.benchmarks.launch [--bytes 4096] [--calls 3000] [--rounds 5]
[--enqueue-calls 300] [--dtype bfloat16|float16|float32] [--profile CALL] [--out DIR]``

One rank on one GPU (an NCCL group of one), as a serving process calls its collectives
outside CUDA graphs. Each row is the host's microseconds per call over ``--calls`` back-to-back
calls with the stream left running (``host us``: the host sets the pace where a call's GPU work
is shorter than its host cost, the GPU where it is longer), and each call's cost alone
(``enqueue us``: ``--enqueue-calls`` calls, each made from an idle GPU and timed until it
returns: the host's cost whatever the GPU's), each function's best of ``--rounds``
alternating rounds (:func:`~tilescale_examples.benchmarks._timing.host_us_rounds`):

* baselines: ``torch.add`` of two ``--bytes`` tensors, ``torch.ops.symm_mem.one_shot_all_reduce``
  on a symmetric buffer, NCCL's ``all_reduce`` (``torch.distributed``);
* TileScale ``AllReduce`` (one-shot), ``AllGather``, ``AllToAll``, ``ReduceScatter``, the
  decode op ``AllReduceResidualRMSNorm`` (1 token of ``--bytes`` / itemsize channels), the
  ``MoEDispatcher``'s dispatch of 128 tokens alone and its dispatch + combine (hidden 7168,
  top-8 of 64 experts, ``validate=False`` as a serving loop calls it), and the overlapped
  GEMMs ``AllGatherGEMM`` and ``GemmReduceScatter`` at a decode shape (128 x 1024 x 1024)
  and ``GemmAllReduce`` at 16 x 1024 x 1024, each through TileLang's launcher (the
  default) and through the lean launcher (:mod:`tilescale_lang.lean`,
  ``op.lean_launch = True``), one instance each. An op that relaunches a call laid out as its
  last (the same input buffer, as timed here: see docs/launch.md, "Repeated calls") launches,
  from its fourth call on, the launch it froze at its third, whichever its launcher: its two
  rows time that path;
* for each such op, the same op called on two inputs in turn through TileLang's launcher
  (``TileLang, new input every call``): every call its full call, except for the
  collectives and the fused norm, which move their kept launch to an input of the kept
  layout at another address;
* the raw kernel launch of the all-reduce (its kernel called with all its arguments through
  TileLang's launcher, and through a prepared :class:`~tilescale_lang.lean.LeanLaunch`), and
  the lean launch's two parts alone: its Python (checks and packing of the changing
  arguments, no launch) and the driver's ``cuLaunchKernel`` called through ctypes with the
  packed parameters, and (where the machine has a C compiler: the lean launcher's path) the
  launch records' C helper (:mod:`tilescale_lang.launch_records`) alone, and the launch frozen
  (:class:`~tilescale_lang.lean.FrozenLaunch`: that helper's call which also asks the driver
  whether the stream is capturing, what the ops' repeated calls launch); the MoE dispatch's
  frozen launch alone (its repeated call's launch, without the call's Python); and a kernel with no
  work (one block of 32 threads, which the GPU runs faster than the host launches it) through
  TileLang's launcher and through the driver call alone: the host's floor for one launch.

Before timing, every op instance's result is checked against its torch reference (fresh
random input, poisoned output); a failure is printed and makes the exit status 1.

The goals (issue 47, one H200): every TileScale op's host time per call (its default
launcher) at most 1.2x ``torch.add``'s and at most 0.8x torch symmetric memory's one-shot
all-reduce (printed last; the enqueue cost's worst ratio to ``torch.add``'s too, the host's
part of a call whose GPU work sets the pace of back-to-back calls).
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["HEADERS", "GOAL_ADD", "GOAL_SYMM", "MOE", "MOE_ROW", "MOE_DISPATCH_ROW", "MOE_FROZEN_ROW", "GEMM_SHAPE",
           "GEMM_ROWS", "GEMM_AR_SHAPE", "GEMM_AR_ROW", "op_specs", "gemm_run", "heap_bytes", "poison_outputs", "compare",
           "compare_gemm", "run", "goal_lines", "main"]

HEADERS = ["call", "launcher", "host us", "vs torch.add", "vs symm one-shot", "check", "enqueue us", "enqueue vs add"]
#: The ops' default launcher (``op.lean_launch`` False): the goals are measured on it.
DEFAULT = "TileLang"
#: The goals: TileScale's host time per call at most GOAL_ADD x torch.add's, GOAL_SYMM x symm mem's.
GOAL_ADD, GOAL_SYMM = 1.2, 0.8
DTYPES = ("bfloat16", "float16", "float32")
#: The launcher column of the rows that call an op on two inputs in turn (every call its full
#: call, or its kept launch moved to the input where the op moves it) where the same input
#: every call relaunches the last call's launch.
FULL_CALL = "TileLang, new input every call"
#: The row of the MoE dispatch's frozen launch alone (what its repeated call launches).
MOE_FROZEN_ROW = "MoE dispatch kernel, frozen launch alone"
#: Rows that time a launch alone (no op): left out of the goals.
DIAGNOSTIC_ROWS = ("all-reduce kernel, raw", "empty kernel", MOE_FROZEN_ROW)


#: The MoE row's shape: DeepSeek-V3's hidden size and routing, one decode batch.
MOE = dict(num_experts=64, hidden=7168, topk=8, max_tokens=128)


#: The MoE rows' names: the dispatch alone, and the dispatch and combine (two calls).
MOE_DISPATCH_ROW, MOE_ROW = "MoE dispatch, 128 tokens", "MoE dispatch + combine, 128 tokens"
#: The overlapped GEMMs' shape (m_local, k, n): one decode batch through a projection.
GEMM_SHAPE = (128, 1024, 1024)
#: The overlapped GEMMs' rows, checked by their relative error (:func:`compare_gemm`).
GEMM_ROWS = ("AllGatherGEMM 128x1024x1024", "GemmReduceScatter 128x1024x1024")
#: ``GemmAllReduce``'s (m, k, n) and row: 16 tokens through a row-parallel projection (checked as the GEMMs).
GEMM_AR_SHAPE, GEMM_AR_ROW = (16, 1024, 1024), "GemmAllReduce 16x1024x1024"


def op_specs(numel: int, dtype) -> dict:
    """``{name: (cls, args, kwargs)}`` of the TileScale ops measured: each is built as
    ``cls(allocator, *args, world_size=1, group=group, **kwargs)`` (what
    :func:`~tilescale_examples.testing.precompile.precompile_op` takes too), ``numel``
    elements of ``dtype`` per call."""
    from tilescale_examples import (AllGather, AllGatherGEMM, AllReduce, AllToAll, GemmReduceScatter, MoEDispatcher,
                                    ReduceScatter)
    from tilescale_examples.decode import AllReduceResidualRMSNorm, GemmAllReduce

    moe = (MoEDispatcher, (), dict(dtype=dtype, validate=False, **MOE))
    return {
        "AllReduce one-shot": (AllReduce, ((numel,), dtype), dict(algorithm="one_shot")),
        "AllGather": (AllGather, ((numel,), dtype), {}),
        "AllToAll": (AllToAll, ((1, numel), dtype), {}),
        "ReduceScatter": (ReduceScatter, ((1, numel), dtype), {}),
        "AllReduceResidualRMSNorm": (AllReduceResidualRMSNorm, ((1, numel), dtype), {}),
        MOE_DISPATCH_ROW: moe,
        MOE_ROW: moe,
        GEMM_ROWS[0]: (AllGatherGEMM, GEMM_SHAPE + (dtype,), {}),
        GEMM_ROWS[1]: (GemmReduceScatter, GEMM_SHAPE + (dtype,), {}),
        GEMM_AR_ROW: (GemmAllReduce, GEMM_AR_SHAPE + (dtype,), {}),
    }


def _ops(alloc, numel: int, dtype, group, device) -> dict:
    """``{name: (make, make_input, call, reference)}`` of the ops of :func:`op_specs`:
    ``make()`` builds one instance, ``make_input()`` a fresh random input (shaped as the op
    takes it), ``call(op, x)`` runs the op on it and returns what the op returns (nothing
    else: it is what is timed), ``reference(x)`` is the torch result at world 1 (a tensor, or
    a tuple of tensors for an op that returns several)."""
    import torch

    from tilescale_examples.decode.reference import torch_reference
    from tilescale_examples.moe.reference import torch_dispatch_reference

    def shaped(*shape):
        return lambda: torch.randn(numel, device=device).to(dtype).view(*shape)

    residual = torch.randn(1, numel, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(numel, device=device)).to(dtype)

    def moe_input():
        t, e, k = MOE["max_tokens"], MOE["num_experts"], MOE["topk"]
        idx = torch.rand(t, e, device=device).argsort(dim=1)[:, :k].contiguous()  # distinct experts per token
        return (torch.randn(t, MOE["hidden"], device=device).to(dtype), idx,
                torch.rand(t, k, device=device, dtype=torch.float32))

    def moe_call(op, inputs):
        recv, _, handle = op.dispatch(*inputs)
        return op.combine(recv, handle)  # y = the received rows: out[t] = x[t] * sum_k w[t, k]

    def moe_reference(inputs):
        x, _, w = inputs
        return (x.float() * w.sum(1, keepdim=True)).to(dtype)

    def dispatch_call(op, inputs):  # the receive buffer; its first T * topk rows are checked
        return op.dispatch(*inputs)[0]

    def dispatch_reference(inputs):
        x, idx, _ = inputs
        return torch_dispatch_reference([x], [idx], MOE["num_experts"], 0)[0]

    runs = {  # name: (make_input, call, reference)
        "AllReduce one-shot": (shaped(numel), lambda op, x: op(x), lambda x: x),
        "AllGather": (shaped(numel), lambda op, x: op(x), lambda x: x.view(1, numel)),
        "AllToAll": (shaped(1, numel), lambda op, x: op(x), lambda x: x),
        "ReduceScatter": (shaped(1, numel), lambda op, x: op(x), lambda x: x.view(numel)),
        "AllReduceResidualRMSNorm": (shaped(1, numel), lambda op, x: op(x, residual, weight),
                                     lambda x: torch_reference([(x, residual, weight)], 0)),
        MOE_DISPATCH_ROW: (moe_input, dispatch_call, dispatch_reference),
        MOE_ROW: (moe_input, moe_call, moe_reference),
        GEMM_ROWS[0]: gemm_run(GEMM_SHAPE, dtype, device),
        GEMM_ROWS[1]: gemm_run(GEMM_SHAPE, dtype, device),
        GEMM_AR_ROW: gemm_run(GEMM_AR_SHAPE, dtype, device),
    }
    ops = {}
    for name, (cls, args, kwargs) in op_specs(numel, dtype).items():
        make = (lambda cls=cls, args=args, kwargs=kwargs: cls(alloc, *args, world_size=1, group=group, **kwargs))
        ops[name] = (make,) + runs[name]
    return ops


def gemm_run(shape: tuple, dtype, device) -> tuple:
    """``(make_input, call, reference)`` of an overlapped GEMM at world 1 (as :func:`_ops`
    gives them) for ``shape = (m_local, k, n)``: ``(a, b)`` random inputs of ``dtype`` (``b``
    scaled by ``k ** -0.5``), ``op(a, b)``, and ``a @ b`` in float32 rounded to ``dtype``
    (checked by :func:`compare_gemm`)."""
    import torch

    m, k, n = shape

    def make_input():
        return (torch.randn(m, k, device=device).to(dtype), (torch.randn(k, n, device=device) / k ** 0.5).to(dtype))

    def reference(inputs):
        a, b = inputs
        return (a.float() @ b.float()).to(dtype)

    return make_input, lambda op, ab: op(*ab), reference


def heap_bytes(numel: int, dtype) -> int:
    """Heap bytes per rank for two instances of every op of :func:`_ops`."""
    from tilescale_examples import GemmAllReduce, MoEDispatcher
    from tilescale_examples.overlap import ag_gemm, gemm_rs

    moe = MoEDispatcher.heap_bytes(dtype=dtype, world_size=1, **MOE)
    m, k, n = GEMM_SHAPE
    gemms = (ag_gemm.heap_bytes(1, m, k, dtype) + gemm_rs.heap_bytes(1, m, n, dtype)
             + GemmAllReduce.heap_bytes(*GEMM_AR_SHAPE, dtype, world_size=1, device="cpu"))
    return 4 * moe + 2 * gemms + (64 << 20)


def poison_outputs(op) -> None:
    """Fill ``op``'s own floating-point outputs (``output``, ``residual_output``, a
    dispatcher's ``recv_x``) with NaN, so that a call that writes nothing fails its check."""
    import torch

    for name in ("output", "residual_output", "recv_x"):
        t = getattr(op, name, None)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(float("nan"))


def compare(got, want) -> str:
    """"ok", or how ``got`` differs from the torch reference ``want`` (each a tensor or a tuple
    of tensors): the count of outputs, a shape, or values beyond ``rtol=2**-7, atol=1e-3``. A
    tensor with more rows than its reference (a receive buffer) is compared on its first rows."""
    import torch

    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    if len(got) != len(want):
        return f"FAIL ({len(got)} outputs vs {len(want)})"
    for g, w in zip(got, want):
        if g.dim() == w.dim() > 0 and g.shape[1:] == w.shape[1:] and g.shape[0] > w.shape[0]:
            g = g[:w.shape[0]]
        if g.shape != w.shape:
            return f"FAIL (shape {tuple(g.shape)} vs {tuple(w.shape)})"
        if not torch.allclose(g.float(), w.float(), rtol=2**-7, atol=1e-3):
            return "FAIL (values)"
    return "ok"


def compare_gemm(got, want) -> str:
    """"ok", or what differed (shape, values): a GEMM's output in its dtype against torch's in
    float32 (relative Frobenius error below 1e-2: the element-wise test of :func:`compare`
    does not fit a sum over k products rounded once)."""
    if got.shape != want.shape:
        return f"FAIL (shape {tuple(got.shape)} vs {tuple(want.shape)})"
    error = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
    return "ok" if float(error) < 1e-2 else "FAIL (values)"


def _check(op, make_input, call, reference, device, check=compare) -> str:
    """"ok", or what differed (``check``: :func:`compare`): two calls on a fresh random input, then
    twice the same input tensors refilled in place with fresh values (the timed rows'
    pattern), outputs poisoned, a call, checked: an op that relaunches a call laid out as its
    last does so in both, the first through its launcher, the second with the launch it froze
    then."""
    import torch

    x = make_input()
    call(op, x), call(op, x)  # two full calls on one input: an op that relaunches keeps the launch here
    for _ in range(2):
        for dst, src in zip(*((t if isinstance(t, tuple) else (t,)) for t in (x, make_input()))):
            dst.copy_(src)
        want = reference(x)
        poison_outputs(op)
        got = call(op, x)
        torch.cuda.synchronize(device)
        result = check(got, want)
        if result != "ok":
            return result
    return "ok"


def run(rank: int, world: int, group, device, args) -> list | None:
    """Rank body (one rank): every row of the table."""
    import torch
    import torch.distributed as dist

    import tilelang
    from tilescale_lang.lean import freeze, prepare

    from tilescale_examples._launch import prepared_launch
    from tilescale_examples.benchmarks import _timing

    dtype = getattr(torch, args.dtype)
    numel = args.bytes // dtype.itemsize
    a, b = torch.randn(numel, device=device).to(dtype), torch.randn(numel, device=device).to(dtype)
    fns, labels = [lambda: torch.add(a, b)], [("torch.add", "torch")]
    symm_reason = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group.group_name)
        buf.copy_(a)
        torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)
        fns.append(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name))
        labels.append(("symm_mem.one_shot_all_reduce", "torch"))
    except Exception as exc:  # an old torch, or no symmetric memory backend
        symm_reason = f"{type(exc).__name__}: {exc}"[:120]
    nccl_in = a.clone()
    fns.append(lambda: dist.all_reduce(nccl_in, group=group))
    labels.append(("NCCL all_reduce", "torch.distributed"))

    alloc = tilelang.get_allocator(size=heap_bytes(numel, dtype), local_rank=rank, num_local_ranks=world, group=group)
    checks = {}
    ops = []
    for name, (make, make_input, call, reference) in _ops(alloc, numel, dtype, group, device).items():
        lean_op, plain_op = make(), make()
        lean_op.lean_launch = True
        x = make_input()
        call(lean_op, x), call(plain_op, x)  # first calls: module loads, the lean launcher prepared
        check = compare_gemm if name in (*GEMM_ROWS, GEMM_AR_ROW) else compare
        checks[name, "lean"] = _check(lean_op, make_input, call, reference, device, check)
        checks[name, DEFAULT] = _check(plain_op, make_input, call, reference, device, check)
        ops.append(lean_op)
        ops.append(plain_op)
        for op, launcher in ((plain_op, "TileLang"), (lean_op, "lean")):
            fns.append(lambda op=op, call=call, x=x: call(op, x))
            labels.append((name, launcher))
        if getattr(plain_op, "_kept_launch", None) is not None:  # it relaunches: time its full call too
            fns.append(_alternating(plain_op, call, (x, make_input())))
            labels.append((name, FULL_CALL))
        if name == MOE_DISPATCH_ROW:  # its frozen launch alone: the rest of its repeated call is Python
            for _ in range(3):  # kept at the second call on x, frozen at the third
                call(plain_op, x)
            frozen = plain_op._kept_launch.frozen if plain_op._kept_launch is not None else None
            if frozen:
                fns.append(frozen)
                labels.append((MOE_FROZEN_ROW, "frozen launch"))
    ar = ops[0]  # the lean AllReduce: its kernel, raw
    xr = torch.randn(numel, device=device).to(dtype)
    ar(xr)
    launch = prepared_launch(ar._lean_launches, ar.kernel)
    raw_args = list(launch._args)
    fns.append(lambda: ar.kernel(*raw_args))
    labels.append(("all-reduce kernel, raw", "TileLang"))
    raw = prepare(ar.kernel, raw_args, changing=launch.changing)
    changing = [raw_args[i] for i in raw.positions]
    fns.append(lambda: raw(*changing))
    labels.append(("all-reduce kernel, raw", "lean" if raw.lean else f"lean: {raw.why_not}"))
    if raw.lean:  # where the lean launch's time goes: its Python alone, the driver call alone
        fns.append(lambda: raw._fill(changing, True))
        labels.append(("all-reduce kernel, raw", "lean checks and packing only"))
        fns.append(_driver_call_alone(raw, device))
        labels.append(("all-reduce kernel, raw", "cuLaunchKernel (ctypes) only"))
        if raw._records is not None:  # the launch records' C helper: the lean path where a C compiler is
            fns.append(_records_alone(raw, device))
            labels.append(("all-reduce kernel, raw", "launch records (C helper) only"))
            # what the ops' repeated calls launch: the helper asking about captures too, its
            # changing buffers' addresses written anew (a frozen launch fixes every scalar)
            moving = [i for i in raw.positions if isinstance(raw_args[i], torch.Tensor)]
            frozen = freeze(ar.kernel, raw_args, moving)
            if frozen is not None:
                addresses = [raw_args[i].data_ptr() for i in moving]
                fns.append(lambda: frozen(*addresses))
                labels.append(("all-reduce kernel, raw", "frozen launch"))
    # the host's floor: a kernel with no work (one block of 32 threads), which the GPU runs
    # faster than the host launches it
    from tilescale_examples.benchmarks.moe_phases import empty_grid_kernel

    empty, empty_out = empty_grid_kernel(1, 32), torch.zeros(32, dtype=torch.int32, device=device)
    empty(empty_out)
    fns.append(lambda: empty(empty_out))
    labels.append(("empty kernel", "TileLang"))
    empty_lean = prepare(empty, (empty_out,), changing=())
    if empty_lean.lean:
        fns.append(_driver_call_alone(empty_lean, device))
        labels.append(("empty kernel", "cuLaunchKernel (ctypes) only"))
    torch.cuda.synchronize(device)
    profile = _profile(fns, labels, args.profile, args.calls) if args.profile else None
    times = _timing.host_us_rounds(fns, args.calls, args.rounds)
    enqueue = _timing.host_us_rounds(fns, args.enqueue_calls, args.rounds, warmup=10, clock="enqueue")
    add_us = times[0]
    symm_us = times[1] if symm_reason is None else None
    rows = []
    for (name, launcher), us, alone in zip(labels, times, enqueue):
        rows.append([name, launcher, us, ratio(us, add_us), ratio(us, symm_us) if symm_us else "n/a",
                     checks.get((name, launcher), "-"), alone, ratio(alone, enqueue[0])])
    for op in ops:
        op.close()
    torch.cuda.synchronize(device)
    alloc.close()
    return [rows, symm_reason, profile]


def _alternating(op, call, inputs):
    """A function calling ``call(op, x)`` with ``x`` each of ``inputs`` in turn: no call is
    at the last one's address, so every call is the op's full call (its checks, its views),
    or its kept launch moved to ``x`` where the op moves it (the collectives)."""
    turn = [0]

    def fn():
        turn[0] ^= 1
        return call(op, inputs[turn[0]])

    return fn


def _driver_call_alone(prepared, device):
    """A call of the driver's ``cuLaunchKernel`` (through ctypes, as the lean launcher makes
    it) with ``prepared``'s packed parameters of its first launch, on ``device``'s current
    stream: a :class:`~tilescale_lang.lean.LeanLaunch`'s launch without its Python."""
    import torch

    from tilescale_lang import lean

    driver_launch = lean._driver_calls()[0]
    fn, (_, dims, smem, _, _, _, _, _, address) = prepared._functions[0], prepared._launches[0]
    stream = torch.cuda.current_stream(device).cuda_stream
    return lambda: driver_launch(fn, *dims, smem, stream, address)


def _records_alone(prepared, device):
    """One call of the launch records' C helper (:mod:`tilescale_lang.launch_records`) with
    ``prepared``'s records, on ``device``'s current stream: the lean launch without its Python."""
    import torch

    stream = torch.cuda.current_stream(device).cuda_stream
    records, address, failed = prepared._records, prepared._records_address, prepared._failed_ref
    run = prepared._run
    return lambda: run(address, len(records), stream, failed)


def _profile(fns, labels, call: str, calls: int) -> str:
    """cProfile's report (the 25 functions with the most own time) of ``calls`` calls of the
    row named ``call`` (its default launcher's, else the first of that name)."""
    import cProfile
    import io
    import pstats

    import torch

    picks = [i for i, (name, _) in enumerate(labels) if name == call]
    if not picks:
        return f"--profile: no row named {call!r} (rows: {sorted({name for name, _ in labels})})"
    i = next((j for j in picks if labels[j][1] == DEFAULT), picks[0])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fns[i]()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return f"profile of {calls} calls of {call} ({labels[i][1]}):\n{out.getvalue()}"


def goal_lines(rows: list) -> list:
    """The goals' lines: the worst TileScale op (its default launcher) against torch.add (goal
    <= :data:`GOAL_ADD`) and against symm mem's one-shot all-reduce (goal <= :data:`GOAL_SYMM`),
    per call: the MoE dispatch + combine row (two calls) counts half its time."""
    ops = [r if r[0] != MOE_ROW else [f"{r[0]}, per call", r[1], *(v / 2 if isinstance(v, float) else v for v in r[2:])]
           for r in rows if r[1] == DEFAULT and r[0] not in DIAGNOSTIC_ROWS]
    if not ops:
        return ["TileScale ops: not measured"]
    worst_add = max(ops, key=lambda r: r[3])
    lines = [f"worst op vs torch.add: {worst_add[3]:.2f} ({worst_add[0]}; goal <= {GOAL_ADD})"]
    if len(worst_add) > 7:  # each call's cost alone, from an idle GPU: the host's, whatever the GPU's
        alone = max(ops, key=lambda r: r[7])
        lines.append(f"worst op's enqueue cost vs torch.add's: {alone[7]:.2f} ({alone[0]}; goal <= {GOAL_ADD})")
    symm = [r for r in ops if isinstance(r[4], float)]
    if symm:
        worst = max(symm, key=lambda r: r[4])
        lines.append(f"worst op vs symm_mem one-shot all-reduce: {worst[4]:.2f} ({worst[0]}; goal <= {GOAL_SYMM})")
    else:
        lines.append("worst op vs symm_mem one-shot all-reduce: not measured")
    return lines


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("launch", __doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=4096, help="bytes per rank of each call's input")
    p.add_argument("--calls", type=int, default=3000, help="back-to-back calls per round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (best round per call)")
    p.add_argument("--enqueue-calls", type=int, default=300,
                   help="calls per round of the enqueue column (each from an idle GPU, timed alone)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--profile", metavar="CALL", default=None,
                   help="also print cProfile's report of --calls calls of the row named CALL (e.g. "
                        "AllReduceResidualRMSNorm): where an op's host time goes")
    args = _harness.parse_args(p, argv)
    if args.calls < 1 or args.rounds < 1 or args.enqueue_calls < 1 or args.bytes < 16 or args.bytes % 16:
        p.error("--calls, --enqueue-calls and --rounds must be >= 1 and --bytes a positive multiple of 16")
    if _harness.visible_gpus("launch benchmark") == 0:
        return 0
    import torch

    result, backend, world = _harness.run_on_ranks(run, 1, args)
    rows, symm_reason, profile = result
    print_table(f"host us per eager call, 1 rank on {torch.cuda.get_device_name(0)}, {args.bytes} bytes of "
                f"{args.dtype}, {args.calls} calls per round, best of {args.rounds} rounds"
                + (f"; symm_mem: n/a ({symm_reason})" if symm_reason else ""), HEADERS, rows)
    print()
    for line in goal_lines(rows):
        print(line)
    if profile:
        print("\n" + profile)
    failed = [r[0] for r in rows if isinstance(r[5], str) and r[5].startswith("FAIL")]
    print(f"\ncorrectness (every instance vs the torch reference): {'ok' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
