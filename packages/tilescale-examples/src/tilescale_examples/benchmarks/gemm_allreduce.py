"""GemmAllReduce (GEMM + all-reduce in one kernel) against torch.matmul + TileScale's all-reduce, with emulated peers.

``python -m tilescale_examples.benchmarks.gemm_allreduce [--ranks 1 2 4 8] [--m 1 2 4 ... 512]
[--k 8192] [--n 8192] [--tiles BMxBNxBK[:STAGES[:THREADS]] ...] [--dtype bfloat16|float16] [--iters 20]
[--split-k 1 auto ...] [--reduction auto one_shot two_shot ...] [--max-blocks B] [--out DIR]``

The method of :mod:`tilescale_examples.benchmarks.emulated` (and of :mod:`.decode`): one
process, no process group; ``N`` emulated ranks are ``N`` regions of one device buffer whose
metadata tables map PE ``p`` to region ``p``, so the unchanged kernel runs with local memory
standing in for NVLink. Every emulated rank's calls run alone on the GPU, in turn, with the
peers' flags preset so that waits on other ranks pass at once (:func:`preset_peer_flags`: a
rank's own flags are not preset, so the waits between its own blocks, which the blocks of a
split-``k`` tile need, stay real): a time is one rank's share (its GEMM and its reads of every
rank's tiles), without the flag latency between GPUs. ``N = 1`` is a real single rank.

For every ``N`` and ``m`` it times, per emulated rank, ``--iters`` back-to-back calls behind
a stream hold (:func:`~tilescale_examples.benchmarks._timing.held_ms_per_launch`), the mean
over the ranks:

* ``fused us``: :class:`~tilescale_examples.decode.gemm_allreduce.GemmAllReduce`;
* ``mm+AR us``: ``torch.matmul`` then TileScale's one-shot
  :class:`~tilescale_examples.collectives.allreduce.AllReduce` of its result, back to back;
* ``mm us``: ``torch.matmul`` alone;
* ``fused/(mm+AR)`` and ``fused/mm``;
* ``tiles``: the fused kernel's ``BMxBNxBK:STAGES:THREADS``, its default for the shape
  (:func:`~tilescale_examples.decode.gemm_allreduce.default_tiles`) or each of ``--tiles``
  (a row each, the fields left out default as in ``GemmAllReduce``), followed by ``split S``
  where the kernel splits ``k`` (``--split-k``: a row for each value, ``1`` and ``auto`` by
  default, the second left out where it resolves to the first) and by ``two-shot`` where it
  runs the two-shot reduction (``--reduction``: a row for each value, ``auto`` by default;
  values that resolve to the same kernel give one row; two-shot keeps ``k`` whole).

Before timing, one round of fused calls is checked (every rank's partial ``a_p @ b_p`` staged
beforehand by torch, so the ranks that run first read their peers' tiles; each rank's own tile
is its kernel's) with :func:`~tilescale_examples.decode.gemm_allreduce.compare`; a failure is
printed and makes the exit status 1. Two-shot rounds are run twice and the second is checked:
in the first, the ranks that run before a peer read reduced rows that peer has not pushed
yet (its waits are preset); in the second every rank's rows hold the first round's pushes.

The goals (issue 43, one H200): ``fused/(mm+AR)`` at most 0.85 everywhere, and ``fused/mm``
at most 1.05 at ``N = 1`` (printed at the end; with several ``--tiles``, each shape's fastest
program counts).
"""

from __future__ import annotations

from collections import Counter

from tilescale_examples.benchmarks import _fused, _harness, _timing
from tilescale_examples.benchmarks._report import print_checked, ratio

__all__ = ["HEADERS", "GOAL_RATIO", "GOAL_WORLD1", "M_SIZES", "preset_peer_flags", "check_round", "parse_tiles",
           "tiles_label", "parse_split_k", "split_variants", "reduction_variants", "run_case", "goal_lines",
           "print_results", "run", "main"]

HEADERS = ["ranks", "m", "fused us", "mm+AR us", "mm us", "fused/(mm+AR)", "fused/mm", "tiles", "check"]
#: The goals: fused / (matmul + all-reduce) at most GOAL_RATIO; at one rank fused / matmul at most GOAL_WORLD1.
GOAL_RATIO, GOAL_WORLD1 = 0.85, 1.05
M_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def preset_peer_flags(ops) -> None:
    """Every emulated rank's flags preset (waits on its peers pass at once), then each rank's
    own row of them (``ready[me, b]``: the flags its own blocks set) cleared, so that a wait on
    a block of the same rank (the members of a split-``k`` tile wait for each other's
    partials) stays a real wait, as on a real rank. The kernels' flags only grow (the call
    number times the rounds per call), so a cleared row is below any value a call waits for."""
    import torch

    from tilescale_examples.benchmarks.emulated import preset_flags

    preset_flags(ops)
    for op in ops:
        op.flags.view(torch.int64).view(op.world_size, -1)[op.rank].zero_()


def check_round(ops, inputs) -> list:
    """One call of every emulated rank (rank order, peers' flags preset:
    :func:`preset_peer_flags`), every rank's partial staged by torch beforehand, compared with
    the exact sum; failure messages. Two-shot (several ranks): two rounds, the second checked
    (see the module docstring)."""
    import torch

    from tilescale_examples.decode.gemm_allreduce import compare
    from tilescale_examples.testing.emulated import run_round

    two_shot = ops[0].reduction == "two_shot"
    for op, (a, b) in zip(ops, inputs):  # where the next call's rounded product goes, the rows peers read
        exact, parity = a.float() @ b.float(), (op.epoch + 1) % 2
        if op.split_k > 1:  # as float32, after the split_k partials' rows
            op.stage_buffer[(op.split_k + parity) * op.mp:][:op.m].copy_(exact.to(op.dtype).float())
        else:
            (op.stages[0] if two_shot else op.stages[parity])[:op.m].copy_(exact.to(op.dtype))
    for _ in range(2 if two_shot else 1):
        results = run_round(ops, call=lambda op: op(*inputs[op.rank]), preset=preset_peer_flags)
    torch.cuda.synchronize()
    bad = []
    for op, got in zip(ops, results):
        bad += compare(got, inputs, f"{op.world_size} ranks m={op.m} rank {op.rank}")
    return bad


def parse_tiles(text: str) -> dict:
    """``--tiles BMxBNxBK[:STAGES[:THREADS]]`` as GemmAllReduce's tile keywords (the fields
    left out absent: the op's defaults); ``ValueError`` naming the argument when malformed."""
    from tilescale_lang.autotune import GEMM_TILE_AXES

    return _harness.tile_fields(text, GEMM_TILE_AXES)  # no swizzle: its own tile order


def tiles_label(tiles, split_k: int = 1) -> str:
    """A GemmTiles as ``BMxBNxBK:STAGES:THREADS``, then `` split S`` when ``split_k`` > 1."""
    label = f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}:{tiles.num_stages}:{tiles.threads}"
    return label + (f" split {split_k}" if split_k > 1 else "")


def parse_split_k(text: str):
    """``--split-k`` values: ``auto`` or an int >= 1; ``ValueError`` naming the argument."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--split-k values must be ints >= 1 or auto, got {text!r}")
    return int(text)


def reduction_variants(reductions, m: int, n: int, n_ranks: int, dtype: str) -> list:
    """The distinct reductions among ``reductions`` (``--reduction``) for one shape, resolved
    as the op resolves them (with ``split_k="auto"``), in order."""
    import torch

    from tilescale_examples.decode.gemm_allreduce import resolve_reduction

    resolved = []
    for reduction in reductions:
        value = resolve_reduction(reduction, m * n * getattr(torch, dtype).itemsize, n_ranks)
        if value not in resolved:
            resolved.append(value)
    return resolved


def split_variants(splits, m: int, k: int, n: int, n_ranks: int, max_blocks: int, tiles: dict,
                   reduction: str = "one_shot") -> list:
    """The distinct ``split_k`` values among ``splits`` (``--split-k``) for one shape, tile
    keywords and (resolved) reduction, resolved as the op resolves them, in order; ``[1]``
    for the two-shot reduction (it keeps ``k`` whole)."""
    from tilescale_examples.decode.gemm_allreduce import default_tiles, resolve_split_k

    if reduction == "two_shot":
        return [1]
    t = default_tiles(m, n, max_blocks, **tiles)
    resolved = []
    for split in splits:
        value = resolve_split_k(split, m, k, n, n_ranks, t, max_blocks, reduction)
        if value not in resolved:
            resolved.append(value)
    return resolved


def run_case(args, n_ranks: int, m: int, device, tiles: dict, split_k: int = 1, reduction: str = "one_shot") -> tuple:
    """``(fused ms, matmul + all-reduce ms, failures, tiles label)`` of one case (built,
    checked, timed, closed), the fused op built with the tile keywords ``tiles``, ``split_k``
    and ``reduction``."""
    import torch

    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(m * 31 + n_ranks)
    inputs = [(torch.randn((m, args.k), generator=g, device=device).to(dtype),
               (torch.randn((args.k, args.n), generator=g, device=device) / args.k**0.5).to(dtype))
              for _ in range(n_ranks)]
    label = []

    def check(ops):
        two_shot = " two-shot" if ops[0].reduction == "two_shot" else ""
        label.append(tiles_label(ops[0].tiles, ops[0].split_k) + two_shot)
        return check_round(ops, inputs)

    fused, bad = _fused.measure(GemmAllReduce, n_ranks, (m, args.k, args.n, dtype), device,
                                lambda op: op(*inputs[op.rank]), args.iters, check=check, preset=preset_peer_flags,
                                max_blocks=args.max_blocks, split_k=split_k, reduction=reduction, **tiles)
    unfused, _ = _fused.measure(AllReduce, n_ranks, ((m, args.n), dtype), device,
                                lambda ar: ar(torch.matmul(*inputs[ar.rank])), args.iters, algorithm="one_shot",
                                max_blocks=args.max_blocks)
    torch.cuda.empty_cache()
    return fused, unfused, bad, label[0]


def run(args, device) -> tuple:
    """``({ranks: rows}, failures)`` of the whole sweep; a row is :data:`HEADERS`."""
    import torch

    tables, failures, alone = {}, [], {}
    sms = args.max_blocks or torch.cuda.get_device_properties(device).multi_processor_count
    for m in args.m:
        a = torch.randn((m, args.k), device=device).to(getattr(torch, args.dtype))
        b = torch.randn((args.k, args.n), device=device).to(a.dtype)
        alone[m] = _timing.held_ms_per_launch(lambda: torch.matmul(a, b), args.iters, device)
    for n_ranks in args.ranks:
        rows = tables.setdefault(n_ranks, [])
        for m in args.m:
            for tiles, reduction, split in _variants(args, n_ranks, m, sms):
                with _harness.watchdog(args.case_timeout, f"gemm_allreduce: {n_ranks} ranks, m {m}, tiles "
                                                          f"{tiles or 'default'}, split_k {split}, {reduction}"):
                    fused, unfused, bad, label = run_case(args, n_ranks, m, device, tiles, split, reduction)
                failures += bad
                rows.append([n_ranks, m, fused * 1e3, unfused * 1e3, alone[m] * 1e3, ratio(fused, unfused),
                             ratio(fused, alone[m]), label, "ok" if not bad else "FAIL"])
    return tables, failures


def _variants(args, n_ranks: int, m: int, sms: int) -> list:
    """``(tile keywords, reduction, split_k)`` of every row of one shape, in order."""
    return [(tiles, reduction, split) for tiles in args.tiles or [{}]
            for reduction in reduction_variants(args.reduction, m, args.n, n_ranks, args.dtype)
            for split in split_variants(args.split_k, m, args.k, args.n, n_ranks, sms, tiles, reduction)]


def goal_lines(tables: dict) -> list:
    """The goals' lines: the worst ``fused/(mm+AR)`` (goal <= :data:`GOAL_RATIO`) and the
    worst ``fused/mm`` at one rank (goal <= :data:`GOAL_WORLD1`), over the shapes; where a
    shape has rows of several tile programs (``--tiles``), its fastest one counts (said in the
    lines)."""
    best, count = {}, Counter()
    for row in (r for rows in tables.values() for r in rows):
        key = (row[0], row[1])  # ranks, m
        count[key] += 1
        if key not in best or row[2] < best[key][2]:
            best[key] = row
    programs = max(count.values(), default=1)
    of = f" (the fastest of {programs} tile programs per shape)" if programs > 1 else ""
    unfused = [r[5] for r in best.values()]
    alone = [r[6] for r in best.values() if r[0] == 1]
    return [f"worst fused/(matmul + all-reduce){of}: {max(unfused):.3f} (goal <= {GOAL_RATIO})" if unfused
            else "worst fused/(matmul + all-reduce): not measured",
            f"worst fused/matmul at 1 rank{of}: {max(alone):.3f} (goal <= {GOAL_WORLD1})" if alone
            else "worst fused/matmul at 1 rank: not measured"]


def print_results(tables: dict, failures: list, args, device_name: str) -> None:
    """One table per world size, the failures, the goals and the verdict."""
    baselines = "torch.matmul + TileScale one-shot all-reduce and torch.matmul alone"
    print_checked(tables, lambda n_ranks: f"GEMM + all-reduce, fused (one TileScale kernel) vs {baselines}, "
                  f"{n_ranks} rank(s), k {args.k}, n {args.n}", HEADERS, failures, goal_lines(tables),
                  "the exact sum", args, device_name)


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.fused_parser("gemm_allreduce", __doc__.splitlines()[0], iters=20)
    p.add_argument("--m", type=int, nargs="+", default=list(M_SIZES), help="rows of a (tokens)")
    p.add_argument("--k", type=int, default=8192, help="columns of a (a multiple of 64)")
    p.add_argument("--n", type=int, default=8192, help="columns of b and the output (a multiple of 64)")
    p.add_argument("--tiles", nargs="+", default=None, metavar="BMxBNxBK[:STAGES[:THREADS]]",
                   help="the fused kernel's tiles, each a row per case (default: the op's choice per shape)")
    p.add_argument("--split-k", nargs="+", default=["1", "auto"], metavar="S",
                   help="the fused kernel's split_k values (ints or auto), a row each where they differ")
    p.add_argument("--reduction", nargs="+", default=["auto"], choices=["auto", "one_shot", "two_shot"],
                   help="the fused kernel's reductions, a row each where they differ (default: the op's choice)")
    args = _harness.parse_args(p, argv)
    try:
        args.tiles = [parse_tiles(t) for t in args.tiles] if args.tiles else None
        args.split_k = [parse_split_k(s) for s in args.split_k]
    except ValueError as error:
        p.error(str(error))
    if any(m < 1 for m in args.m) or args.iters < 1 or args.k < 64 or args.k % 64 or args.n < 64 or args.n % 64:
        p.error("--m and --iters must be >= 1 and --k, --n positive multiples of 64")
    device = _harness.emulated_device(p, args, "gemm_allreduce")
    if device is None:
        return 0
    import torch

    from tilescale_examples.decode.gemm_allreduce import gemm_allreduce_jobs
    from tilescale_examples.testing.precompile import precompile, reduction_jobs

    sms = args.max_blocks or torch.cuda.get_device_properties(device).multi_processor_count
    jobs = [job for n_ranks in args.ranks for m in args.m
            for tiles, reduction, split in _variants(args, n_ranks, m, sms)
            for job in gemm_allreduce_jobs([m], args.k, args.n, args.dtype, [n_ranks], sms, split, reduction, **tiles)]
    precompile(jobs
               + reduction_jobs(["one_shot"], [args.dtype], args.ranks))  # in parallel: cache hits below
    tables, failures = run(args, device)
    print_results(tables, failures, args, torch.cuda.get_device_name(device))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
