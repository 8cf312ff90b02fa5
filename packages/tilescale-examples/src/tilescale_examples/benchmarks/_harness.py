"""The benchmarks' command line and ranks: what every benchmark module shares besides its
timing (:mod:`~tilescale_examples.benchmarks._timing`) and its table
(:mod:`~tilescale_examples.benchmarks._report`).

* :func:`parser`: a benchmark's ``argparse`` parser, with the option every benchmark has:
  ``--out DIR`` (save every table it prints into ``DIR``: CSV, JSON and, with matplotlib, a
  PNG chart; see :func:`~tilescale_examples.benchmarks._report.save_tables`).
* :func:`parse_args`: parse a benchmark's command line and act on ``--out``.
* :func:`run_on_ranks`: run a rank body on the launcher's ranks or on spawned ones.
* :func:`gpu_mode`: how a table's title says the ranks used the GPUs.
* :func:`show_progress`: rank 0 prints each kernel build (``[benchmark] building kernel ...``).
* :func:`visible_gpus`: the prologue before measuring (the kernel cache, the line without a GPU).
* :func:`fused_parser`, :func:`emulated_device`: the options and the prologue of the benchmarks
  that emulate peers in one process.
* :func:`watchdog`: a case that does not finish in time ends the process with the case named
  and every thread's stack, instead of hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
import warnings

__all__ = ["parser", "parse_args", "run_on_ranks", "gpu_mode", "show_progress", "fused_parser", "visible_gpus",
           "emulated_device", "tile_fields", "watchdog", "add_case_timeout"]


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The parser of benchmark ``name`` (``python -m tilescale_examples.benchmarks.<name>``),
    with ``--out DIR``; the benchmark adds its own options, then calls :func:`parse_args`."""
    p = argparse.ArgumentParser(prog=f"python -m tilescale_examples.benchmarks.{name}", description=description)
    p.add_argument("--out", metavar="DIR", default=None,
                   help="also save every table printed into DIR: <name>.csv, <name>.json and, with matplotlib "
                        "(the [plot] extra), the chart <name>.png")
    p.benchmark = name
    return p


def parse_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``p.parse_args(argv)`` (``p`` from :func:`parser`); from then on every table the
    benchmark prints is also saved into ``--out`` when given (tables ``<name>``,
    ``<name>_2``, ...), and nowhere otherwise, and rank 0 (``RANK``, default 0) shows the
    kernel builds (:func:`show_progress`)."""
    from tilescale_examples.benchmarks._report import save_tables

    save_tables(None)
    args = p.parse_args(argv)
    save_tables(args.out, p.benchmark)
    show_progress(int(os.environ.get("RANK", "0")))  # under a launcher each rank runs main()
    return args


class _ProgressHandler(logging.Handler):
    """Writes ``[benchmark] <message>`` lines to ``stream``, or to whatever ``sys.stderr`` is
    when a message comes (so a replaced stderr, as under pytest, is followed)."""

    def __init__(self, stream=None):
        super().__init__()
        self.stream = stream
        self.setFormatter(logging.Formatter("[benchmark] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if self.stream is None else self.stream
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # never let a progress line break a benchmark
            self.handleError(record)


def show_progress(rank: int, stream=None) -> None:
    """On rank 0, print the library's progress messages (``tilescale_examples`` logger, INFO:
    each kernel being built and how long it took) to ``stream`` (default stderr) as
    ``[benchmark] ...`` lines, so a long first run says what it is doing; other ranks stay
    quiet. Idempotent."""
    if rank != 0:
        return
    log = logging.getLogger("tilescale_examples")
    if not any(isinstance(h, _ProgressHandler) for h in log.handlers):
        log.addHandler(_ProgressHandler(stream))
    log.setLevel(logging.INFO)


def _spawned_rank(rank: int, world: int, fn, fn_args):
    import torch
    import torch.distributed as dist
    from tilescale_core.multiprocess import rank_device

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renames
    show_progress(rank)
    device = torch.device(rank_device(rank))  # its own GPU, or shared round-robin
    torch.cuda.set_device(device)
    return fn(rank, world, dist.group.WORLD, device, *fn_args)


def run_on_ranks(fn, ranks: int, *fn_args):
    """Run ``fn(rank, world, group, device, *fn_args)`` on every rank and return ``(rank 0's
    result, backend, world)``: under ``tilescale-run``/torchrun on the launcher's ranks (group
    from ``init_dist``), otherwise on ``ranks`` spawned ranks (NCCL with one GPU each, gloo
    when they share GPUs). ``fn`` must be picklable (module level)."""
    import torch

    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:  # under tilescale-run / torchrun
        import torch.distributed as dist

        from tilelang.distributed.host import init_dist

        warnings.filterwarnings("ignore", category=FutureWarning)
        rank, world, group = init_dist(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
        show_progress(rank)
        result = fn(rank, world, group, torch.device("cuda", torch.cuda.current_device()), *fn_args)
        backend = dist.get_backend(group)
        dist.destroy_process_group()
        return (result if rank == 0 else None), backend, world
    from tilescale_core.multiprocess import auto_backend, run_ranks

    backend = auto_backend(ranks, share=False)  # NCCL when every rank has a GPU, else gloo
    result = run_ranks(_spawned_rank, ranks, args=(fn, fn_args), backend=backend, timeout=1200)[0]
    return result, backend, ranks


def gpu_mode(world: int, backend: str, gpus: int, path: str) -> str:
    """The part of a table's title that says how ``world`` ranks used ``gpus`` GPUs and what
    ``path`` (the torch baseline: ``"collective"``, ``"torch path"``) ran over: one rank per
    GPU over NCCL, or ranks sharing GPUs, time-sliced (no performance measurement), over
    ``backend`` with host staging."""
    if backend == "nccl":
        return f"one rank per GPU ({gpus} GPU(s)); {path} over NCCL"
    return (f"{world} ranks SHARING {gpus} GPU(s): time-sliced, NOT a performance measurement; "
            f"{path} over {backend} (host staging, not NCCL)")


def fused_parser(name: str, description: str, iters: int) -> argparse.ArgumentParser:
    """:func:`parser` with the options of the benchmarks of a fused op against its unfused
    sequence on emulated peers: ``--ranks`` (world sizes, default 1 2 4 8), ``--dtype``
    (bfloat16 or float16), ``--iters`` (back-to-back calls timed per rank and case, default
    ``iters``), ``--max-blocks`` (grid limit, default the SM count) and ``--case-timeout``
    (seconds a case may take before the run ends naming it: :func:`watchdog`)."""
    p = parser(name, description)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="emulated world sizes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=iters, help="back-to-back calls timed per rank and case")
    p.add_argument("--max-blocks", type=int, default=None, help="grid limit (default: the SM count)")
    add_case_timeout(p)
    return p


def add_case_timeout(p: argparse.ArgumentParser) -> None:
    """``--case-timeout`` (seconds a case may take before :func:`watchdog` ends the run naming
    it; default 120), checked positive by :func:`emulated_device`."""
    p.add_argument("--case-timeout", type=float, default=120.0,
                   help="seconds a case may take before the run ends naming it (a deadlock)")


def visible_gpus(what: str) -> int:
    """The prologue every benchmark shares before it measures: TileLang's cache defaults to the
    user's (``~/.tilelang/cache``: kernels compiled by one run serve the next), and the number
    of visible CUDA GPUs is returned, after the line ``<what>: no CUDA GPU visible, nothing to
    measure`` when there is none."""
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache"))
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print(f"{what}: no CUDA GPU visible, nothing to measure")
    return gpus


def emulated_device(p: argparse.ArgumentParser, args: argparse.Namespace, what: str, environ=None):
    """The prologue of a benchmark that emulates its peers in one process: ``--ranks`` world
    sizes each in [1, 64] (else ``p.error``), then :func:`visible_gpus` (``<what> benchmark``);
    the current CUDA device, or None when there is no GPU. ``environ``: variables set (unless
    already set) once a GPU is found and before the CUDA context is made, for those CUDA reads
    then."""
    if any(n < 1 or n > 64 for n in args.ranks):
        p.error("--ranks must be in [1, 64]")
    if not getattr(args, "case_timeout", 1.0) > 0:
        p.error("--case-timeout must be positive")
    if visible_gpus(f"{what} benchmark") == 0:
        return None
    for name, value in (environ or {}).items():
        os.environ.setdefault(name, value)
    import torch

    return torch.device("cuda", torch.cuda.current_device())


#: How a ``--tiles`` string names its fields after the block sizes.
_TILE_SUFFIXES = ("STAGES", "THREADS", "SWIZZLE")
#: The block sizes' names in a ``--tiles`` string, by count.
_TILE_BLOCKS = {2: "BMxBN", 3: "BMxBNxBK"}


def tile_fields(text: str, names, blocks: int = 3) -> dict:
    """A ``--tiles BMxBNxBK[:STAGES[:THREADS[:SWIZZLE]]]`` string (``blocks=2``:
    ``BMxBN[:STAGES[:THREADS]]``) as ``{name: int}`` for the fields it gives, ``names`` the
    field names in the string's order (the block sizes, then at most ``len(names) - blocks``
    more); ``ValueError`` naming the argument when malformed."""
    extra = len(names) - blocks
    form = _TILE_BLOCKS[blocks] + "".join(f"[:{s}" for s in _TILE_SUFFIXES[:extra]) + "]" * extra
    parts = text.split(":")
    sizes = parts[0].split("x")
    if len(sizes) != blocks or len(parts) > 1 + extra:
        raise ValueError(f"--tiles must be {form}, got {text!r}")
    try:
        values = [int(v) for v in sizes + parts[1:]]
    except ValueError:
        raise ValueError(f"--tiles must hold ints only, got {text!r}") from None
    return dict(zip(names, values))


@contextlib.contextmanager
def watchdog(seconds: float, what: str, stream=None):
    """Run the body with a deadline: ``[benchmark] <what>`` is written to ``stream`` (default
    ``sys.stderr``) first, and if the body has not finished after ``seconds`` the process
    prints every thread's stack and exits (``faulthandler.dump_traceback_later``: a thread of
    its own, so it fires while the main thread is blocked in a CUDA call, e.g. a kernel that
    waits for a peer that never runs). The last ``[benchmark]`` line names the case."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    out = sys.stderr if stream is None else stream
    print(f"[benchmark] {what} (at most {seconds:g} s)", file=out, flush=True)
    try:
        out.fileno()
        dump_to = out
    except (AttributeError, OSError, ValueError):  # a replaced stderr (pytest's) has no file descriptor
        dump_to = sys.__stderr__
    faulthandler.dump_traceback_later(seconds, exit=True, file=dump_to)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
