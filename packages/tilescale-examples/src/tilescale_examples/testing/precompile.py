"""Fill TileLang's disk cache with many kernels at once, in parallel worker processes.

A collective compiles its kernel on first use under the host-wide compile lock
(``compile_once=True``: one process at a time). A test or benchmark that builds many
collectives of different dtypes and world sizes would pay those compiles one after the other;
:func:`precompile` runs them first in a pool of worker processes (plain ``tilelang.compile``,
the same cache key as the collectives' compiles: same source, target, pass configuration and
TileScale compile flags), so the later ``compile_once`` calls are cache hits.

A job is ``(builder, args, pass_configs)``: ``builder`` names a kernel builder as
``"module:function"`` (``"tilescale_examples.collectives.reduce_engine:build_reduce_kernel"``), ``args``
its positional arguments, ``pass_configs`` the TileLang pass configuration the collective
compiles with (or None). A cache miss afterwards only costs time, never correctness.

:func:`precompile_op` fills the cache with every kernel one op instance compiles, found by a
dry run of its constructor (no GPU, no heap): on a build machine with nvcc and no GPU, for
GPUs of the same architecture and SM count::

    precompile_op(AllReduce, (8192,), torch.bfloat16, world_size=8, algorithm="one_shot")
"""

from __future__ import annotations

import importlib
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Iterable, Optional, Sequence, Tuple
from unittest.mock import patch

__all__ = ["precompile", "precompile_op", "reduction_jobs", "with_copies", "build_copy", "build_job", "compile_job"]

Job = Tuple[str, tuple, Optional[dict]]


def build_job(builder: str, args: tuple):
    """The ``T.prim_func`` a job's ``builder`` (``"module:function"``) makes of ``args``."""
    module, name = builder.split(":")
    return getattr(importlib.import_module(module), name)(*args)


def compile_job(job: Job, env: dict) -> str:
    """Worker body: set ``env`` (cache directory, wait timeout), build and compile one job;
    returns the kernel's global symbol."""
    os.environ.update(env)
    builder, args, pass_configs = job
    return _compile(build_job(builder, args), None, pass_configs)


def _compile(func, target, pass_configs: Optional[dict], describe: bool = False) -> str:
    """``tilelang.compile`` of the ``T.prim_func`` ``func`` for ``target`` (None: the ops'
    ``TARGET``) with ``pass_configs`` (None: TileLang's defaults), as the ops compile it; the
    kernel's global symbol. ``describe``: also keep its launch metadata in the cache
    directory (:func:`tilescale_lang.lean.describe_kernel`, what an op's repeated calls
    freeze their launch with), so the first repeated call need not lower the kernel."""
    import tilelang

    from tilescale_examples.base import TARGET

    extra = {} if pass_configs is None else {"pass_configs": dict(pass_configs)}
    kernel = tilelang.compile(func, target=target or TARGET, **extra)
    if describe and getattr(kernel, "execution_backend", None) == "tvm_ffi":  # the kernels freeze() takes
        from tilescale_lang.aot.launch_info import UnsupportedKernelError
        from tilescale_lang.lean import describe_kernel

        try:
            describe_kernel(kernel)
        except UnsupportedKernelError:  # kept as such in the cache: its calls take TileLang's launcher
            pass
    return str(func.attrs["global_symbol"])


def precompile(jobs: Iterable[Job], cache_dir: Optional[str] = None, workers: Optional[int] = None,
               env: Optional[dict] = None) -> list:
    """Compile ``jobs`` (duplicates dropped) into TileLang's disk cache ``cache_dir`` (default:
    ``$TILELANG_CACHE_DIR``) with ``workers`` processes (default: one per job, at most the CPU
    count). The workers get this process's ``TILELANG_*``, ``TILESCALE_*`` and ``CUDA_*``
    variables updated with ``env``: give them the settings that change compile flags (like
    ``TILESCALE_WAIT_TIMEOUT_MS``) as the later compiles will see them. Returns the kernels'
    symbols, one per distinct job. Call it before the ranks start (it spawns processes and
    uses no GPU)."""
    unique = list(dict.fromkeys((b, tuple(a), None if p is None else tuple(sorted(p.items()))) for b, a, p in jobs))
    if not unique:
        return []
    base = {k: v for k, v in os.environ.items() if k.startswith(("TILELANG_", "TILESCALE_", "CUDA_"))}
    env = {**base, **(env or {})}
    if cache_dir is not None:
        env["TILELANG_CACHE_DIR"] = str(cache_dir)
    n = workers or min(len(unique), os.cpu_count() or 1)
    todo = [(b, a, None if p is None else dict(p)) for b, a, p in unique]
    with ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn")) as pool:
        return list(pool.map(compile_job, todo, [env] * len(todo)))


def reduction_jobs(modes: Sequence[str], dtypes: Sequence[str], world_sizes: Sequence[int],
                   threads: int = 512, unroll: Optional[int] = None, call_numbers: Sequence[str] = ("device",)) -> list:
    """Jobs of the reduction kernels (:func:`~tilescale_examples.collectives.reduce_engine.build_reduce_kernel`,
    and :func:`~tilescale_examples.collectives.lamport_kernel.build_lamport_kernel` for mode
    ``"lamport"``, whose integer dtypes are left out) that
    :class:`~tilescale_examples.collectives.allreduce.AllReduce` / ``ReduceScatter`` built with these
    ``threads`` and ``unroll`` (None: the default) compile, for every ``mode x dtype name x
    world size``; the flag kernels once per entry of ``call_numbers`` (``"argument"`` adds the
    host-numbered build of :func:`build_reduce_kernel`, the baseline of
    ``benchmarks.emulated``'s A/B)."""
    from tilescale_examples.collectives.lamport_kernel import LAMPORT_DTYPES
    from tilescale_examples.collectives.reduce_engine import LAMPORT, PASS_CONFIGS, default_unroll

    jobs = []
    for w in world_sizes:
        u = default_unroll(w) if unroll is None else unroll
        for m in modes:
            for d in dtypes:
                if m != LAMPORT:
                    jobs += [("tilescale_examples.collectives.reduce_engine:build_reduce_kernel",
                              (m, d, w, threads, u) + (() if number == "device" else (number,)), PASS_CONFIGS)
                             for number in call_numbers]
                elif d in LAMPORT_DTYPES:
                    jobs.append(("tilescale_examples.collectives.lamport_kernel:build_lamport_kernel",
                                 (d, w, threads, u), PASS_CONFIGS))
    return jobs


def build_copy(builder: str, args: tuple, variant: int):
    """The ``T.prim_func`` of the builder ``builder`` (``"module:function"``) on ``args``, as
    copy ``variant`` of it: the same code under the symbol
    :func:`~tilescale_examples.base.copy_symbol` gives it (an op whose shared kernel another
    allocator holds compiles that copy: :meth:`~tilescale_examples.base.KernelOwner._compile_kernel`)."""
    from tilescale_examples.base import copy_symbol

    func = build_job(builder, args)
    return func.with_attr("global_symbol", copy_symbol(str(func.attrs["global_symbol"]), variant))


def with_copies(jobs: Iterable[Job], copies: int) -> list:
    """``jobs`` and, after each, the jobs of its copies ``1 .. copies - 1`` (:func:`build_copy`):
    the kernels ``copies`` emulated ranks running at once compile, one of their own each
    (:func:`~tilescale_examples.testing.emulated.build_concurrent`)."""
    out = []
    for builder, args, pass_configs in jobs:
        out.append((builder, tuple(args), pass_configs))
        out += [("tilescale_examples.testing.precompile:build_copy", (builder, tuple(args), v), pass_configs)
                for v in range(1, copies)]
    return out


#: SM count of the GPUs :func:`precompile_op` compiles for by default (H100 SXM and H200).
SM_COUNT = 132


def precompile_op(cls, *args, world_size: int, sm_count: int = SM_COUNT, cache_dir: Optional[str] = None,
                  **kwargs) -> list:
    """Compile (nvcc; no GPU needed) every kernel ``cls(allocator, *args, world_size=world_size,
    **kwargs)`` compiles, into TileLang's disk cache ``cache_dir`` (default:
    ``$TILELANG_CACHE_DIR``), so that the op built later on a GPU of ``sm_count`` SMs loads
    them without compiling (and with their launch metadata, which the op's repeated calls
    use: :func:`tilescale_lang.lean.describe_kernel`). The kernels are found by a dry run of the constructor on a
    :class:`~tilescale_examples._contract.RecordingAllocator` (the grid cap some kernels are
    built for is the SM count); an op whose ``algorithm="auto"`` chooses by probing devices
    gets the kernels of every algorithm it may choose. Compiles one after the other in this
    process, with this process's ``TILESCALE_*`` settings (the compile flags must be those of
    the later run); call it in a fresh process (TileLang serves a kernel this process has
    compiled before from memory, without writing it to ``cache_dir``). Returns the kernels'
    global symbols, in build order.

    Raises the constructor's ``TypeError`` / ``ValueError`` for bad arguments, before
    compiling anything.
    """
    from tilescale_examples._contract import RecordingAllocator

    algorithms = [kwargs.get("algorithm")]
    probes = getattr(cls, "_AUTO_PROBES", ())
    if probes and kwargs.get("algorithm", "auto") == "auto":
        algorithms = list(probes)
    builds = []
    for algorithm in algorithms:
        allocator = RecordingAllocator(world_size, sm_count=sm_count)
        cls(allocator, *args, world_size=world_size,
            **(kwargs if algorithm is None else dict(kwargs, algorithm=algorithm)))
        builds += allocator.builds
    with patch.dict(os.environ, {} if cache_dir is None else {"TILELANG_CACHE_DIR": str(cache_dir)}):
        return [_compile(build(), target, pass_configs, describe=True) for build, target, pass_configs in builds]
