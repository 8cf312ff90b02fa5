"""The tilescale-lang extension of stock tilelang (entry point ``lang``).

Called by tilescale-core's import hook right after ``import tilelang``; attaches:

* the intrinsics to ``tilelang.language`` (``T.get_rank``, ``T.put_warp``, ``T.wait_eq``,
  ..., and upstream's NVSHMEM-style names ``T.get_pe``, ``T.putmem_nbi_block``, ``T.Amo``, ...
  where stock has none: :mod:`.nvshmem_names`), and ``T.copy`` / ``T.tma_copy`` wrappers that accept ``src_pe``/``dst_pe`` and are
  stock TileLang when no peer is given;
* ``JITKernel.initialize(allocator=..., stream=None)``;
* wrappers around stock pipeline passes for TileScale kernels (:mod:`.pipeline_hooks`);
* the CUDA post-processing callback that includes the TileScale headers, the
  ``runtime.nvshmem.cumodule_init`` module hook (before any launch), and the compile
  wrappers that add the header flags (``tilelang.compile`` / ``@tilelang.jit`` with
  ``compile_once=``, ``compile_group=``, ``compile_root=`` too);
* ``tilelang.utils.target`` (upstream TileScale's module of target helpers, aliases of stock
  TileLang's) where stock has none: ``_facade/utils`` beside this file is appended to
  ``tilelang.utils.__path__``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .state import STATE

#: Directory appended to ``tilelang.utils.__path__`` (holds ``target.py``).
UTILS_FACADE_DIR = Path(__file__).parent / "_facade" / "utils"

#: Stock callables replaced by TileScale wrappers, by name (:attr:`.state.LangState.stock`).
STOCK: dict[str, Any] = STATE.stock


def intrinsics() -> dict[str, Any]:
    """Name -> callable of every intrinsic exported on ``tilelang.language``."""
    from . import atomics, barrier, lamport, memory, multimem, nvshmem_names, peer_copy, profiler, rank, signals, team, wait

    names = {
        "get_rank": rank.get_rank,
        "get_num_ranks": rank.get_num_ranks,
        "symm_at": rank.symm_at,
        "put_warp": peer_copy.put_warp,
        "get_warp": peer_copy.get_warp,
        "put_block": peer_copy.put_block,
        "get_block": peer_copy.get_block,
        "put_rows_block": peer_copy.put_rows_block,
        "get_rows_block": peer_copy.get_rows_block,
        "ld": memory.ld,
        "st": memory.st,
        "atom_add": memory.atom_add,
        "fence_cta": memory.fence_cta,
        "fence_gpu": memory.fence_gpu,
        "fence_sys": memory.fence_sys,
        "init_barrier_gpu": barrier.init_barrier_gpu,
        "arrive_barrier_gpu": barrier.arrive_barrier_gpu,
        "wait_barrier_gpu": barrier.wait_barrier_gpu,
        "sync_barrier_gpu": barrier.sync_barrier_gpu,
        "barrier_blocks": barrier.barrier_blocks,
        "sync_blocks": barrier.sync_blocks,
        "notify": barrier.notify,
        "profile_event": profiler.profile_event,
        "multimem_ld_reduce": multimem.multimem_ld_reduce,
        "multimem_st": multimem.multimem_st,
        "multimem_red": multimem.multimem_red,
        "multimem_signal": multimem.multimem_signal,
        "multimem_signal_add": multimem.multimem_signal_add,
        "multimem_tma_store": multimem.multimem_tma_store,
        "MultimemReduceOp": multimem.MultimemReduceOp,
    }
    names.update(wait.WAITS)
    for module in (signals, atomics, team, lamport, nvshmem_names):
        names.update(module.EXPORTS)
    return names


def _initialize(self, allocator=None, stream=None):
    """Copy ``allocator.table`` ([local_rank, num_ranks, base_0, ...], <= 1024 uint64) into
    this kernel's metadata table, before or after its module is loaded.

    Args:
        allocator: the distributed allocator (``tilelang.get_allocator(...)``).
        stream: raw CUDA stream handle (non-negative int) for the copy; None means 0.

    Returns:
        the kernel itself.
    """
    from . import remote_tma
    from .metadata import initialize, table_from_allocator

    kernel = initialize(self, allocator=allocator, stream=stream)
    remote_tma.register_heap(allocator, table_from_allocator(allocator))  # remote TMA descriptors
    return kernel


def attach_intrinsics(language) -> list[str]:
    """Set every intrinsic of :func:`intrinsics` on ``language`` (``tilelang.language``),
    except an NVSHMEM-style name (:mod:`.nvshmem_names`) that ``language`` already has from
    stock TileLang, which stays stock's.  Returns the names left alone."""
    from . import nvshmem_names

    kept = []
    for name, fn in intrinsics().items():
        if name in nvshmem_names.EXPORTS and getattr(language, name, fn) is not fn:
            kept.append(name)
            continue
        setattr(language, name, fn)
    return kept


def add_utils_facade(utils_module) -> None:
    """Append :data:`UTILS_FACADE_DIR` to ``tilelang.utils.__path__`` (once, after stock's
    own directory, so that stock modules of the same name win)."""
    from tilescale_core.interface import add_facade_dir

    add_facade_dir(utils_module, UTILS_FACADE_DIR)


def extend(tilelang_module) -> None:
    """Attach tilescale-lang to the freshly imported ``tilelang`` module."""
    import importlib

    import tilelang.language as T
    from tilelang.jit.kernel import JITKernel

    from . import atomics, codegen, metadata, peer_copy, pipeline_hooks, remote_tma

    attach_intrinsics(T)
    wrappers = {"copy": peer_copy.copy, "tma_copy": peer_copy.tma_copy, **atomics.WRAPPERS}
    for name, wrapper in wrappers.items():
        current = getattr(T, name)
        if current is not wrapper:
            STOCK.setdefault(name, current)
            setattr(T, name, wrapper)

    JITKernel.initialize = _initialize
    tl_jit = importlib.import_module("tilelang.jit")  # the package (tilelang.jit is the decorator)
    add_utils_facade(importlib.import_module("tilelang.utils"))

    codegen.install_postproc()
    pipeline_hooks.install()
    remote_tma.install()
    metadata.install_module_hook()

    tl_jit.cached = codegen.wrap_cached(tl_jit.cached)
    wrapped = codegen.wrap_compile(tl_jit.compile)
    tl_jit.compile = wrapped
    tilelang_module.compile = wrapped
    jit = codegen.wrap_jit(tl_jit.jit)
    tl_jit.jit = jit
    tilelang_module.jit = jit
    tl_jit.JITImpl.compile = codegen.wrap_jit_impl_compile(tl_jit.JITImpl.compile)


#: Position among the TileScale extensions (lower runs first; see ``tilescale_core._bootstrap``).
extend.order = 20
