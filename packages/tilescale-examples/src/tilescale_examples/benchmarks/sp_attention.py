"""Sequence-parallel attention at one rank: SPAllGatherAttention against the flash kernel alone, SPFlashDecode against torch's decode attention.

``python -m tilescale_examples.benchmarks.sp_attention [--seq 4096 16384] [--heads 32]
[--kv-heads 8] [--head-dim 128] [--batch 1 16 64] [--kv 8192 32768 131072] [--splits N ...]
[--dtype bfloat16|float16] [--iters 20] [--out DIR]``

One rank on one GPU (an NCCL group of one), where the communication machinery has no peer and
should cost nothing. Table 1: median GPU time of ``--iters`` calls, each from an idle GPU
(``_timing.local_ms``). Table 2 (decode, where a call's GPU work is a few microseconds and the
host's launch cost would otherwise be most of the time): GPU time per call of ``--iters``
back-to-back calls enqueued behind a stream hold (``_timing.held_ms_per_launch``), as a decode
step runs in a CUDA graph or on a busy stream:

* table 1, per sequence length, causal: ``SPAllGatherAttention`` with its default algorithm
  (printed; at one rank the fused algorithm is the attention kernel alone) against
  :func:`~tilescale_examples.sequence.flash_attention.flash_attention` on the same tensors,
  ``flash/sp`` (goal at least 0.95); and the sequential algorithm (its all-gathers, then the
  kernel over the gathered buffers), ``flash/sequential``;
* table 2, per batch and KV length: ``SPFlashDecode`` (batch x 32 query heads, one token each)
  against ``torch.nn.functional.scaled_dot_product_attention`` of the one-token queries over
  the cache (the faster of its flash and cuDNN backends, ``enable_gqa``); ``torch/decode``
  (goal at least 0.9), and the combine kernel alone (goal at most 3 us); ``splits`` the
  partial blocks per (sequence, kv head): the op's default, or each of ``--splits`` (a row
  each; a value must divide the cache's 64-position tiles).

Every output is compared with torch's before timing; a failure is printed and makes the exit
status 1.
"""

from __future__ import annotations

from tilescale_examples.benchmarks import _harness, _timing
from tilescale_examples.benchmarks._report import print_outcome, print_table, ratio

__all__ = ["SP_HEADERS", "DECODE_HEADERS", "GOAL_SP", "GOAL_DECODE", "GOAL_COMBINE_US", "run", "goal_lines", "main"]

SP_HEADERS = ["seq", "sp us", "flash us", "flash/sp", "algorithm", "sequential us", "flash/sequential", "check"]
DECODE_HEADERS = ["batch", "kv", "decode us", "torch us", "combine us", "torch/decode", "splits", "check"]
#: Goals: SP attention at least GOAL_SP of the flash kernel's speed; flash-decode at least
#: GOAL_DECODE of torch's; the combine at most GOAL_COMBINE_US.
GOAL_SP, GOAL_DECODE, GOAL_COMBINE_US = 0.95, 0.9, 3.0


def _close(a, b) -> bool:
    import torch

    return bool(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2))


def _sp_row(args, alloc, group, device, seq: int) -> tuple:
    import torch

    from tilescale_examples import SPAllGatherAttention
    from tilescale_examples.sequence.flash_attention import flash_attention

    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(seq)
    q = torch.randn((1, seq, args.heads, args.head_dim), generator=g, device=device).to(dtype)
    k, v = (torch.randn((1, seq, args.kv_heads, args.head_dim), generator=g, device=device).to(dtype) for _ in "kv")
    ops = [SPAllGatherAttention(alloc, 1, seq, args.heads, args.kv_heads, args.head_dim, dtype, world_size=1,
                                group=group, causal=True, algorithm=algorithm) for algorithm in ("auto", "sequential")]
    try:
        want, _ = flash_attention(q, k, v, causal=True)
        ok = True
        for op in ops:
            o, _ = op(q, k, v)
            torch.cuda.synchronize(device)
            ok = ok and _close(o, want)
        sp, sequential = (_timing.local_ms(lambda op=op: op(q, k, v), args.iters) for op in ops)
        alone = _timing.local_ms(lambda: flash_attention(q, k, v, causal=True, out=want), args.iters)
        algorithm = ops[0].algorithm
    finally:
        for op in ops:
            op.close()
    return [seq, sp * 1e3, alone * 1e3, ratio(alone, sp), algorithm, sequential * 1e3, ratio(alone, sequential),
            "ok" if ok else "FAIL"], ok


def _torch_decode(q, k, v):
    """torch's decode attention: ``q (B, H, D)`` one token per sequence over ``k``, ``v (B, S,
    Hkv, D)``, the faster-backend choice left to the caller."""
    import torch

    o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                                         enable_gqa=q.shape[1] != k.shape[2])
    return o[:, :, 0]


def _decode_row(args, alloc, group, device, batch: int, kv: int, splits=None) -> tuple:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tilescale_examples import SPFlashDecode

    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(batch * 7 + kv)
    q = torch.randn((batch, args.heads, args.head_dim), generator=g, device=device).to(dtype)
    k, v = (torch.randn((batch, kv, args.kv_heads, args.head_dim), generator=g, device=device).to(dtype) for _ in "kv")
    op = SPFlashDecode(alloc, batch, args.heads, args.kv_heads, kv, args.head_dim, dtype, world_size=1, group=group,
                       splits=splits)
    try:
        o, _ = op(q, k, v)
        torch_ms, want = [], None
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    want = _torch_decode(q, k, v) if want is None else want

                    def call():
                        return _torch_decode(q, k, v)

                    call()
                    torch_ms.append(_timing.held_ms_per_launch(call, args.iters, device))
            except RuntimeError:  # the backend does not take this shape
                continue
        torch.cuda.synchronize(device)
        ok = want is not None and _close(o, want)
        ours = _timing.held_ms_per_launch(lambda: op(q, k, v), args.iters, device)
        gathered = op.gather(op.partials)
        combine = _timing.held_ms_per_launch(lambda: op.combine_kernel(gathered, op.output, op.lse), args.iters,
                                             device)
    finally:
        op.close()
    best = min(torch_ms) if torch_ms else None
    return [batch, kv, ours * 1e3, best * 1e3 if best else "-", combine * 1e3, ratio(best, ours) if best else "-",
            op.splits, "ok" if ok else "FAIL"], ok


def run(rank: int, world: int, group, device, args) -> list:
    """Rank body (one rank): ``[sp rows, decode rows, failures]``."""
    import tilelang

    alloc = tilelang.get_allocator(size=args.heap_mib << 20, local_rank=rank, num_local_ranks=world, group=group)
    sp_rows, decode_rows, failures = [], [], []
    try:
        for seq in args.seq:
            row, ok = _sp_row(args, alloc, group, device, seq)
            sp_rows.append(row)
            failures += [] if ok else [f"sp attention seq {seq}"]
        for batch in args.batch:
            for kv in args.kv:
                for splits in args.splits or [None]:
                    row, ok = _decode_row(args, alloc, group, device, batch, kv, splits)
                    decode_rows.append(row)
                    failures += [] if ok else [f"flash-decode batch {batch} kv {kv} splits {row[6]}"]
    finally:
        alloc.close()
    return [sp_rows, decode_rows, failures]


def goal_lines(sp_rows: list, decode_rows: list) -> list:
    """The goals' lines (see the module docstring)."""
    sp = [r[3] for r in sp_rows if isinstance(r[3], float)]
    dec = [r[5] for r in decode_rows if isinstance(r[5], float)]
    comb = [r[4] for r in decode_rows if isinstance(r[4], float)]
    return [f"worst flash/sp: {min(sp):.3f} (goal >= {GOAL_SP})" if sp else "worst flash/sp: not measured",
            f"worst torch/decode: {min(dec):.3f} (goal >= {GOAL_DECODE})" if dec else "worst torch/decode: not measured",
            f"slowest combine: {max(comb):.2f} us (goal <= {GOAL_COMBINE_US})" if comb else "slowest combine: not measured"]


def main(argv=None) -> int:
    """The command line (see the module docstring); 0, or 1 when a check failed."""
    p = _harness.parser("sp_attention", __doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="*", default=[4096, 16384],
                   help="sequence lengths (SP attention; none: no SP attention table)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    p.add_argument("--kv", type=int, nargs="+", default=[8192, 32768, 131072], help="decode KV lengths")
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="SPFlashDecode's splits per (sequence, kv head), each a row (default: the op's own choice)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20, help="calls timed per case (median)")
    p.add_argument("--heap-mib", type=int, default=1024, help="symmetric heap MiB (the all-gathers' buffers)")
    args = _harness.parse_args(p, argv)
    if args.iters < 1 or args.heads % args.kv_heads or any(x < 1 for x in args.seq + args.batch + args.kv
                                                            + (args.splits or [])):
        p.error("--iters, --seq, --batch, --kv and --splits must be >= 1 and --heads a multiple of --kv-heads")
    if _harness.visible_gpus("sequence-parallel attention benchmark") == 0:
        return 0
    import torch

    (sp_rows, decode_rows, failures), _, _ = _harness.run_on_ranks(run, 1, args)
    name = torch.cuda.get_device_name(0)
    if sp_rows:
        print_table(f"SPAllGatherAttention vs the flash kernel alone, 1 rank on {name}, {args.heads} heads "
                    f"({args.kv_heads} kv) of {args.head_dim}, causal, {args.dtype}; median GPU time of "
                    f"{args.iters} calls", SP_HEADERS, sp_rows)
    print_table(f"SPFlashDecode vs torch scaled_dot_product_attention (one-token queries), 1 rank on {name}, "
                f"{args.heads} heads ({args.kv_heads} kv) of {args.head_dim}, {args.dtype}; median GPU time of "
                f"{args.iters} calls", DECODE_HEADERS, decode_rows)
    return print_outcome(failures, goal_lines(sp_rows, decode_rows), "against torch")


if __name__ == "__main__":
    raise SystemExit(main())
