"""The TileLang flash-attention forward against torch's scaled_dot_product_attention (cuDNN and flash backends), same run.

``python -m tilescale_examples.benchmarks.attention [--seq 4096 8192 16384 32768]
[--batch 1] [--heads 32] [--kv-heads 32] [--head-dim 128] [--dtype bfloat16|float16]
[--tiles BMxBN[:STAGES[:THREADS]] ...] [--fast-math off on] [--pipeline sync async] [--iters 20]
[--out DIR]``

For every sequence length, causal and not, on one GPU: GPU time per call of ``--iters``
calls (each from an idle GPU, the median; ``_timing.local_ms``) of

* ``tilescale``: :func:`~tilescale_examples.sequence.flash_attention.flash_attention`;
* ``cudnn`` and ``flash``: ``torch.nn.functional.scaled_dot_product_attention`` under
  ``torch.nn.attention.sdpa_kernel`` with that backend (``-`` when the backend refuses the
  shape); ``best torch``: the faster of the two;

and the TFLOP/s of each (``4 B H Sq Skv D`` floating-point operations, half of them for
causal), and ``vs best``: best torch time / tilescale time (above 1: TileScale is faster).
``--tiles`` times TileScale's kernel with each tile program given (``block_m x block_n``, then
optionally ``num_stages`` and ``threads``; the kernel's defaults for the fields left out), a
row each, against the same torch times; ``tiles`` names the program of a row (`` ieee`` after
it: compiled with ``fast_math=False``, the kernel's default being fast math; ``--fast-math off
on`` gives each program a row of each; `` sync`` after it: on the sync pipeline (the
kernel's default being the async one), ``--pipeline sync async`` a row of each, a program's
fields left out defaulting for its pipeline).
Before timing,
TileScale's output is compared with the cuDNN (else flash, else math) backend's at every size
(bf16 tolerance); a failure is printed and makes the exit status 1.

The goal (issue 44, one H200): at least 0.9 of the best torch backend's speed (printed last).
"""

from __future__ import annotations

from typing import Optional

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import collect, print_outcome, print_table, ratio, worst_line

__all__ = ["HEADERS", "GOAL", "flops", "parse_tiles", "tiles_label", "run_case", "goal_lines", "main"]

HEADERS = ["seq", "causal", "tilescale us", "cudnn us", "flash us", "tilescale TFLOP/s", "best torch TFLOP/s",
           "vs best", "tiles", "check"]
#: The goal: TileScale's kernel at least GOAL of the best torch backend's speed.
GOAL = 0.9


def flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Floating-point operations of one forward (two GEMMs of ``2 B H S S D``; half causal)."""
    total = 4.0 * batch * heads * seq * seq * head_dim
    return total / 2 if causal else total


def _sdpa(q, k, v, causal: bool, backend):
    """``scaled_dot_product_attention`` in the ``bhsd`` layout it takes (views of the
    ``bshd`` tensors) under ``backend``; its output back in ``bshd``."""
    import torch
    from torch.nn.attention import sdpa_kernel

    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(backend):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=groups > 1)
    return o.transpose(1, 2)


def parse_tiles(text: str) -> dict:
    """``--tiles BMxBN[:STAGES[:THREADS]]`` as flash_attention's tile keywords (the fields left
    out absent: the kernel's defaults); ``ValueError`` naming the argument when malformed."""
    from tilescale_examples.sequence.flash_attention import TILE_OPTIONS

    return _harness.tile_fields(text, TILE_OPTIONS, blocks=2)


def tiles_label(tiles: dict, fast_math: bool = True, pipeline: Optional[str] = None) -> str:
    """Tile keywords (all of them) as ``BMxBN:STAGES:THREADS``, then the pipeline's name where
    it is not the default (``pipeline`` None: the default,
    :data:`~tilescale_examples.sequence.flash_attention.DEFAULT_PIPELINE`) and `` ieee``
    without ``fast_math`` (the kernel's default is fast math)."""
    from tilescale_examples.sequence.flash_attention import DEFAULT_PIPELINE

    label = f"{tiles['block_m']}x{tiles['block_n']}:{tiles['num_stages']}:{tiles['threads']}"
    shown = "" if pipeline in (None, DEFAULT_PIPELINE) else f" {pipeline}"
    return label + shown + ("" if fast_math else " ieee")


def run_case(args, seq: int, causal: bool, device, programs=({},)) -> tuple:
    """``(rows, failures)`` of one sequence length: a row per program of ``programs``
    (flash_attention's tile keywords, and ``fast_math`` where given; ``{}``: its defaults),
    each checked against torch and timed against the same torch times."""
    import torch
    from torch.nn.attention import SDPBackend

    from tilescale_examples.sequence.flash_attention import DEFAULT_PIPELINE, check_tiles, flash_attention

    g = torch.Generator(device=device).manual_seed(seq + causal)
    dtype = getattr(torch, args.dtype)
    q = torch.randn((args.batch, seq, args.heads, args.head_dim), generator=g, device=device).to(dtype)
    k = torch.randn((args.batch, seq, args.kv_heads, args.head_dim), generator=g, device=device).to(dtype)
    v = torch.randn((args.batch, seq, args.kv_heads, args.head_dim), generator=g, device=device).to(dtype)
    times, reference = {}, None
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("math", SDPBackend.MATH)):
        try:
            o = _sdpa(q, k, v, causal, backend)
        except RuntimeError:  # the backend does not take this shape or GPU
            continue
        reference = o if reference is None else reference
        if name != "math":
            times[name] = _timing.local_ms(lambda b=backend: _sdpa(q, k, v, causal, b), args.iters)
    work = flops(args.batch, args.heads, seq, args.head_dim, causal)
    best = min(times.values()) if times else None
    rows, failures = [], []
    for tiles in programs:
        pipeline = tiles.get("pipeline", DEFAULT_PIPELINE)
        label = tiles_label(check_tiles({k: v for k, v in tiles.items() if k not in ("fast_math", "pipeline")},
                                        args.head_dim, pipeline), tiles.get("fast_math", True), pipeline)
        out = torch.full_like(q, float("nan"))
        flash_attention(q, k, v, causal=causal, out=out, **tiles)
        torch.cuda.synchronize(device)
        bad = None
        if reference is None:
            bad = f"seq {seq} causal {causal}: no torch backend ran"
        elif not torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2):
            bad = f"seq {seq} causal {causal} tiles {label}: output differs from torch's"
        failures += [bad] if bad else []
        ours = _timing.local_ms(lambda: flash_attention(q, k, v, causal=causal, out=out, **tiles), args.iters)
        rows.append([seq, causal, ours * 1e3, times["cudnn"] * 1e3 if "cudnn" in times else "-",
                     times["flash"] * 1e3 if "flash" in times else "-", work / ours / 1e9,
                     work / best / 1e9 if best else "-", ratio(best, ours) if best else "-", label,
                     "ok" if bad is None else "FAIL"])
    return rows, failures


def goal_lines(rows: list) -> list:
    """The goal's line: the smallest ``vs best`` (goal >= :data:`GOAL`)."""
    return [worst_line("worst tilescale vs best torch backend", [r[7] for r in rows], GOAL)]


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("attention", __doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20, help="calls timed per case (median)")
    p.add_argument("--tiles", nargs="+", default=None, metavar="BMxBN[:STAGES[:THREADS]]",
                   help="tile programs of TileScale's kernel, a row each (default: its own)")
    p.add_argument("--fast-math", nargs="+", default=["on"], choices=["off", "on"],
                   help="compile TileScale's kernel without / with fast math (its default), a row each")
    p.add_argument("--pipeline", nargs="+", default=None, choices=["sync", "async"],
                   help="TileScale's kernel on the sync / async pipeline, a row each (default: its own, async)")
    args = _harness.parse_args(p, argv)
    try:
        tiles = [parse_tiles(t) for t in args.tiles] if args.tiles else [{}]
    except ValueError as exc:
        p.error(str(exc))
    pipelines = args.pipeline or [None]  # None: flash_attention's default
    programs = [dict(t, fast_math=mode == "on", **({"pipeline": pipeline} if pipeline else {})) for t in tiles
                for pipeline in dict.fromkeys(pipelines) for mode in dict.fromkeys(args.fast_math)]
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.iters < 1 or args.batch < 1 or args.kv_heads < 1 or args.heads % args.kv_heads or any(s < 1 for s in args.seq):
        p.error("--iters, --batch, --seq and --kv-heads must be >= 1, and --heads a multiple of --kv-heads")
    if _harness.visible_gpus("flash-attention benchmark") == 0:
        return 0
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    rows, failures = collect(run_case(args, seq, causal, device, programs)
                             for seq in args.seq for causal in (False, True))
    print_table(f"flash-attention forward vs torch scaled_dot_product_attention, {torch.cuda.get_device_name(device)}, "
                f"batch {args.batch}, {args.heads} heads ({args.kv_heads} kv) of {args.head_dim}, {args.dtype}; "
                f"median GPU time of {args.iters} calls", HEADERS, rows)
    return print_outcome(failures, goal_lines(rows), "TileScale's output against torch's")


if __name__ == "__main__":
    raise SystemExit(main())
