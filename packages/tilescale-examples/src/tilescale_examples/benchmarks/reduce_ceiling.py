"""How close the reductions' data pattern can come to the copy on one GPU: the engine's data
loop and flag rounds, hand-written in CUDA, against torch's ``copy_`` in the same run.

``python -m tilescale_examples.benchmarks.reduce_ceiling [--ranks 2 8] [--sizes 16 64]
[--threads 256 512] [--blocks-per-sm 1 2] [--rounds none ready both] [--flags block rank]
[--ops two_shot reduce_scatter copy] [--unroll U ...] [--iters 50] [--repeats 5] [--out DIR]``

:mod:`tilescale_examples.benchmarks.emulated` times the shipped TileLang kernels. This
benchmark answers the question behind its numbers: what does the same data movement cost
with nothing else in the way, and what does each flag round add? Its kernels
(``reduce_ceiling.cu``) are the engine's float16 loop written directly in CUDA: the same row
layout (block ``b`` owns rows ``((t * blocks + b) * U + u) * threads + tx`` of shard 0), the
same unroll (``max(1, 8 // ranks)`` rows per thread and iteration, every load issued before
the first add), the rank-order float32 sum, 16-byte loads and stores. They run as rank 0 of
``N`` emulated ranks whose regions are slices of one buffer (the engine's emulation, see
:mod:`tilescale_examples.testing.emulated`), with every flag preset so that waits pass at once:

* ``--ops``: ``two_shot`` (the sum stored back to shard 0 of every region, in place),
  ``reduce_scatter`` (the sum stored to a local output) and ``copy`` (one region copied to the
  output by the same loop, no sum and no rounds, ``--ranks`` ignored: what an SM copy with this
  layout reaches against ``copy_``, the yardstick of ``T.put_block`` / ``T.get_block``).
* ``--rounds``: ``none`` (the data loop alone; not a correct collective across GPUs),
  ``ready`` (the ready round before the loop) and ``both`` (also the two-shot's closing
  round after it; two-shot only).
* ``--flags``: ``block`` is the engine's ready round (thread ``p`` of every block stores
  ``ready[0, b]`` on rank ``p`` and polls ``ready[p, b]``); ``rank`` is one ready flag per rank
  (block 0 stores it, every block polls the ``N`` flags, the first poll issued before the
  store) with the rows of the first iteration that live in the rank's own region loaded before
  the round.
* ``--threads`` x ``--blocks-per-sm``: the grid (at most that many blocks per SM, no more
  than the rows need; the engine uses 512 threads and one block per SM); ``--unroll``: rows
  per thread and iteration (default the engine's ``max(1, 8 // ranks)``, 8 for the copy).

Every variant is first run once on random inputs and its output compared bit for bit with
the rank-order reference (``check``). Times are GPU time per launch of ``--iters``
back-to-back launches behind a stream hold (``tilescale_host.bench.perf_rounds`` with
``hold=True``: the hold is sized once per kernel from an untimed launch, and doubled and the
timing repeated when it ran out), the median of ``--repeats`` rounds that alternate with the
baseline (whose source and destination are allocated once per row): torch's device-to-device
``copy_`` moving the same bytes (half read, half written; two-shot and copy: ``2 S``,
reduce-scatter: ``S + S / N`` for ``S`` bytes per rank). ``ratio`` = copy us / kernel us.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["OPS", "ROUNDS", "FLAGS", "Variant", "variants", "cuda_source", "CeilingModule", "run", "main",
           "HEADERS"]

#: Kernels: the two-shot's reduce-and-push loop, the reduce-scatter's reduce loop, a plain copy.
OPS = ("two_shot", "reduce_scatter", "copy")
#: Flag rounds around the loop: none, the ready round before it, ready and closing rounds.
ROUNDS = ("none", "ready", "both")
#: Ready flags: one per rank and block (the engine's), or one per rank.
FLAGS = ("block", "rank")
#: Columns of the printed table (times in microseconds).
HEADERS = ["ranks", "size", "op", "rounds", "flags", "threads", "unroll", "blocks", "kernel us", "copy us", "ratio",
           "check"]
#: Flag value preset in every region: above any epoch, so every wait passes at its first poll.
PRESET = 1 << 62
_SOURCE = Path(__file__).with_name("reduce_ceiling.cu")


@dataclass(frozen=True)
class Variant:
    """One kernel: ``op``, ``ranks`` (2..8; 1 for the copy), ``unroll``, ``threads``, ``rounds``,
    ``flags``."""

    op: str
    ranks: int
    unroll: int
    threads: int
    rounds: str
    flags: str

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.op == "copy":
            if self.ranks != 1 or self.rounds != "none":
                raise ValueError(f"the copy has one region and no rounds (ranks=1, rounds='none'), got ranks="
                                 f"{self.ranks}, rounds={self.rounds!r}")
        elif not 2 <= self.ranks <= 8:
            raise ValueError(f"ranks must be in [2, 8] (the kernels' base table has 8 entries), got {self.ranks}")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if self.rounds not in ROUNDS:
            raise ValueError(f"rounds must be one of {ROUNDS}, got {self.rounds!r}")
        if self.rounds == "both" and self.op != "two_shot":
            raise ValueError("rounds='both' (the closing round) exists for the two-shot only")
        if self.flags not in FLAGS:
            raise ValueError(f"flags must be one of {FLAGS}, got {self.flags!r}")
        if self.rounds == "none" and self.flags != "block":
            raise ValueError("rounds='none' has no flags: use flags='block'")

    @property
    def name(self) -> str:
        """The kernel's symbol."""
        return f"ts_ceiling_{self.op}_{self.ranks}_{self.unroll}_{self.threads}_{self.rounds}_{self.flags}"


def variants(ops, ranks, threads, rounds, flags, unrolls=None) -> list:
    """Every valid :class:`Variant` of the given choices: ``unrolls`` (default the engine's
    ``max(1, 8 // ranks)``); ``none`` once, with ``block``; ``both`` for the two-shot only; the
    copy once per grid and unroll (one rank, no rounds)."""
    from tilescale_examples.collectives.reduce_engine import default_unroll

    out = []
    for op in ops:
        for n in ((1,) if op == "copy" else ranks):
            for u in (unrolls or (default_unroll(n),)):
                for th in threads:
                    for r in (("none",) if op == "copy" else rounds):
                        if r == "both" and op != "two_shot":
                            continue
                        for f in (("block",) if r == "none" else flags):
                            out.append(Variant(op, n, u, th, r, f))
    return list(dict.fromkeys(out))


def cuda_source(kernels) -> str:
    """``reduce_ceiling.cu`` plus one ``extern "C"`` wrapper per :class:`Variant`, signature
    ``(char* out, uint64 flag_off, uint64 epoch, int blocks, int iters, int64 span)``."""
    lines = [_SOURCE.read_text(encoding="utf-8")]
    for v in kernels:
        op = OPS.index(v.op)
        rounds = ROUNDS.index(v.rounds)
        lines.append(
            f'extern "C" __global__ void __launch_bounds__({v.threads}) {v.name}(char* out, '
            "unsigned long long flag_off, unsigned long long epoch, int blocks, int iters, long long span) {\n"
            f"  ceiling::body<{v.ranks}, {v.unroll}, {v.threads}, {op}, {rounds}, {str(v.flags == 'rank').lower()}>"
            "(out, flag_off, epoch, blocks, iters, span);\n}")
    return "\n".join(lines) + "\n"


class CeilingModule:
    """The compiled kernels of a list of :class:`Variant` (compiled with the CUDA toolkit's
    nvcc into ``workdir``, loaded with the CUDA driver into the primary context of ``device``,
    the one torch uses, which becomes current: ``device`` becomes the current device)."""

    def __init__(self, kernels, workdir, device):
        import torch
        from tilescale_core import driver
        from tilescale_lang.toolkit import find_toolkit

        toolkit = find_toolkit()
        if toolkit is None or toolkit.nvcc is None:
            raise RuntimeError("reduce_ceiling compiles its kernels with nvcc: set CUDA_HOME to a CUDA toolkit")
        # the driver calls below act on the calling thread's current context: make it torch's
        driver.init()
        driver.ensure_context(torch.cuda.current_device() if device.index is None else device.index)
        self._call = driver.call
        cubin, _, _ = toolkit.compile(cuda_source(kernels), workdir, "cubin", "sm_90a")
        self._image = ctypes.create_string_buffer(cubin.read_bytes())
        self._module = driver.call("cuModuleLoadData", ctypes.addressof(self._image))
        self._functions = {v: driver.call("cuModuleGetFunction", self._module, v.name.encode()) for v in kernels}
        self._bases = driver.call("cuModuleGetGlobal", self._module, b"ceiling_bases")[0]
        self._stream_type = driver.driver_module().CUstream

    def set_bases(self, bases) -> None:
        """Point ``ceiling_bases`` at the regions (``bases[p]``: device address of region p; the
        rest of the 8 entries repeat region 0). Synchronous."""
        table = (ctypes.c_uint64 * 8)(*(list(bases) + [bases[0]] * (8 - len(bases))))
        self._call("cuMemcpyHtoD", self._bases, ctypes.addressof(table), ctypes.sizeof(table))

    def launch(self, variant: Variant, blocks: int, out: int, flag_off: int, epoch: int, iters: int, span: int,
               stream: int) -> None:
        """Enqueue ``variant`` on ``stream`` (a CUDA stream handle)."""
        values = (ctypes.c_uint64(out), ctypes.c_uint64(flag_off), ctypes.c_uint64(epoch), ctypes.c_int(blocks),
                  ctypes.c_int(iters), ctypes.c_longlong(span))
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        self._call("cuLaunchKernel", self._functions[variant], blocks, 1, 1, variant.threads, 1, 1, 0,
                   self._stream_type(stream), ctypes.addressof(params), 0)


class _Regions:
    """``ranks`` regions of one float16 buffer: ``ranks`` shards of ``span`` rows each, then
    the flag words (ready and closing flags of every rank and block, then one rank flag per
    rank; 32 bytes apart), 256-byte aligned; plus a local output of ``span`` rows."""

    def __init__(self, ranks: int, span: int, blocks: int, device):
        import torch

        self.ranks, self.span = ranks, span
        self.flag_off = ranks * span * 16
        flag_bytes = (2 * ranks * blocks + ranks) * 32
        self.stride = -(-(self.flag_off + flag_bytes) // 256) * 256
        self.buf = torch.empty(ranks * self.stride, dtype=torch.uint8, device=device)
        self.out = torch.empty(span * 16, dtype=torch.uint8, device=device)
        self.bases = [self.buf.data_ptr() + p * self.stride for p in range(ranks)]

    def shard(self, p: int):
        """Shard 0 of region p as float16."""
        import torch

        return self.buf[p * self.stride: p * self.stride + self.span * 16].view(torch.float16)

    def fill(self, seed: int) -> None:
        """Random inputs in [-1, 1) in every shard (drawn on the device from ``seed``), every
        flag preset."""
        import torch

        generator = torch.Generator(device=self.buf.device).manual_seed(seed)
        for p in range(self.ranks):
            data = self.buf[p * self.stride: p * self.stride + self.flag_off].view(torch.float16)
            torch.rand(data.shape, generator=generator, device=data.device, out=data).mul_(2).sub_(1)
            self.buf[p * self.stride + self.flag_off: (p + 1) * self.stride].view(torch.int64).fill_(PRESET)


def _measure(module, variant: Variant, nbytes: int, blocks_per_sm: int, iters: int, repeats: int, device) -> list:
    """One table row: check, then interleaved timings against the copy."""
    import torch

    from tilescale_host.bench import perf_rounds

    from tilescale_examples.benchmarks.emulated import copy_fn
    from tilescale_examples.collectives.reduce_engine import grid, torch_reference
    from tilescale_examples.benchmarks._report import format_bytes

    n = variant.ranks
    if nbytes % (16 * n):
        raise ValueError(f"size {nbytes} bytes is not {n} shards of whole 16-byte rows")
    span = nbytes // 16 // n
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks, loops = grid(span, variant.threads, variant.unroll, blocks_per_sm * sms)
    regions = _Regions(n, span, blocks, device)
    regions.fill(nbytes % 100003 + n)
    want = torch_reference([regions.shard(p) for p in range(n)])
    module.set_bases(regions.bases)
    stream = torch.cuda.current_stream(device).cuda_stream
    epoch = [0]

    def launch():
        epoch[0] += 1
        module.launch(variant, blocks, regions.out.data_ptr(), regions.flag_off, epoch[0], loops, span, stream)

    regions.out.fill_(0xFF)  # poison: NaN rows
    launch()
    torch.cuda.synchronize(device)
    got = [regions.shard(p) for p in range(n)] if variant.op == "two_shot" else [regions.out.view(torch.float16)]
    ok = all(torch.equal(g.view(torch.int16), want.view(torch.int16)) for g in got)
    moved = nbytes + nbytes // n if variant.op == "reduce_scatter" else 2 * nbytes
    ms = perf_rounds({"kernel": launch, "copy": copy_fn(moved // 2, device)}, repeats, warmup=1, rep=iters, hold=True,
                     stream=torch.cuda.current_stream(device), group="local")
    k, c = ms["kernel"] * 1e3, ms["copy"] * 1e3
    row = [n, format_bytes(nbytes), variant.op, variant.rounds, variant.flags if variant.rounds != "none" else "-",
           variant.threads, variant.unroll, blocks, k, c, ratio(c, k), "ok" if ok else "FAIL"]
    del regions
    return row


def run(args, device, workdir) -> list:
    """The table's rows for ``args`` (see :func:`main`)."""
    kernels = variants(args.ops, args.ranks, args.threads, args.rounds, args.flags, args.unroll)
    module = CeilingModule(kernels, workdir, device)
    rows = []
    for mib in args.sizes:
        for v in kernels:
            for bps in args.blocks_per_sm:
                if bps * v.threads > 2048:
                    continue
                rows.append(_measure(module, v, mib << 20, bps, args.iters, args.repeats, device))
    return rows


def main(argv=None) -> int:
    """Parse ``argv``, run the sweep on GPU 0, print the table; exit status 1 when a check
    failed, 0 otherwise (also when there is no GPU: nothing to measure)."""
    import tempfile

    p = _harness.parser("reduce_ceiling", __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8], choices=range(2, 9), metavar="N",
                   help="emulated world sizes (2..8)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="MiB per rank")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--rounds", nargs="+", default=list(ROUNDS), choices=ROUNDS)
    p.add_argument("--flags", nargs="+", default=list(FLAGS), choices=FLAGS)
    p.add_argument("--threads", type=int, nargs="+", default=[256, 512])
    p.add_argument("--blocks-per-sm", type=int, nargs="+", default=[1, 2])
    p.add_argument("--unroll", type=int, nargs="+", default=None,
                   help="rows per thread and iteration (default: the engine's, max(1, 8 // ranks))")
    p.add_argument("--iters", type=int, default=50, help="back-to-back launches per timing")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds (median), alternating with the copy")
    args = _harness.parse_args(p, argv)
    for name in ("sizes", "threads", "blocks_per_sm", "unroll"):
        if any(x < 1 for x in getattr(args, name) or ()):
            p.error(f"--{name.replace('_', '-')} must be positive")
    for t in args.threads:
        if t % 32 or t > 1024:
            p.error(f"--threads must be multiples of 32 up to 1024, got {t}")
    if args.iters < 1 or args.repeats < 1:
        p.error("--iters and --repeats must be >= 1")
    import torch

    if not torch.cuda.is_available():
        print("reduce_ceiling: no GPU, nothing to measure")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="ts_ceiling_") as work:
        rows = run(args, device, work)
    title = (f"reduction data loop and flag rounds in CUDA, rank 0 of emulated ranks ({torch.cuda.get_device_name(device)}, "
             "float16, flags preset); kernel and copy us: GPU time per launch, median of "
             f"{args.repeats} rounds of {args.iters}; ratio = copy us / kernel us (same bytes, same run)")
    print_table(title, HEADERS, rows)
    return 1 if any(r[-1] != "ok" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
