"""``compile_root=r``: rank ``r`` of a process group compiles, the other ranks load its result.

``tilelang.compile(func, ..., compile_root=r, compile_group=group)`` (and
``@tilelang.jit(..., compile_root=r)``) is a collective over ``group`` (default: the world
group): rank ``r`` compiles (under the host-wide compile lock, filling TileLang's disk cache),
then every rank learns the outcome through one ``all_gather_object``; the other ranks then
load the kernel from the cache (TileScale kernels are rank-agnostic, so the cache key is the
same everywhere).  When the root's compile fails, every rank -- the root included -- raises
:class:`CompileRootError` carrying the root's error message and traceback, instead of the
peers hanging or compiling the same failure again.  Every rank of the group must make the
call, with the same ``compile_root``.

``tilelang.compile(func, ..., compile_once=True, compile_group=group)`` without
``compile_root`` is the same collective with the group's rank 0 as the root (upstream
TileScale's meaning of ``compile_once``); without ``compile_group`` it is only the host-wide
lock, no collective (:mod:`tilescale_lang.compile_lock`).

The other ranks load the root's result through TileLang's disk cache, so they run no compiler
as long as the cache is on (the default; with ``TILELANG_DISABLE_CACHE=1`` each of them
compiles again after the root succeeded).

Without ``torch.distributed`` (one process) it is a plain compile under the lock.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from . import compile_lock

__all__ = ["COMPILE_ONCE_ROOT", "CompileRootError", "compile_from_root", "coordinate"]

T = TypeVar("T")


class CompileRootError(RuntimeError):
    """The compile on the root rank failed; raised on every rank with the root's message.

    Attributes:
        root: the group rank that compiled.
        root_message: the root's error and traceback, as text.
        option: how the compile was asked for (``"compile_root=2"``, ``"compile_once=True
            with compile_group"``), as the message shows it.
    """

    def __init__(self, root: int, message: str, option: str | None = None):
        option = f"compile_root={root}" if option is None else option
        super().__init__(f"compile on root rank {root} ({option}) failed:\n{message}")
        self.root = root
        self.root_message = message
        self.option = option

    def __reduce__(self):  # picklable across rank processes, with its attributes
        return type(self), (self.root, self.root_message, self.option)


def _check_root(root: Any, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"compile_root must be an int group rank, got {root!r}")
    if not 0 <= root < size:
        raise ValueError(f"compile_root must be a group rank in [0, {size}), got {root}")
    return root


def compile_from_root(build: Callable[[], T], group: Any = None, root: int = 0, *,
                      cache_dir: Any = None, timeout: float = compile_lock.DEFAULT_TIMEOUT_S,
                      option: str | None = None) -> T:
    """Run ``build()`` (a TileLang compile) on group rank ``root``, then on the others.

    Args:
        build: the compile, e.g. ``lambda: tilelang.compile(func, ...)``.
        group: the ``torch.distributed`` group (default: the world group).
        root: the group rank that compiles first.
        cache_dir: directory of the compile lock (default: TileLang's cache directory).
        timeout: seconds to wait for the compile lock.
        option: how the caller asked for this, for the error message (default
            ``"compile_root=<root>"``).

    Raises:
        TypeError / ValueError: ``root`` is not a rank of the group; the ranks disagree on it;
            this process is not a member of ``group``.
        CompileRootError: the root's compile raised (on every rank).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("compile_group was given but torch.distributed is not initialised")
        _check_root(root, 1)
        return compile_lock.compile_once(build, cache_dir=cache_dir, timeout=timeout)
    group = dist.group.WORLD if group is None else group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of compile_group")
    _check_root(root, size)
    kernel = None
    status: tuple[bool, str] | None = None
    if rank == root:
        try:
            kernel = compile_lock.compile_once(build, cache_dir=cache_dir, timeout=timeout)
            status = (True, "")
        except Exception as exc:  # reported to every rank below
            status = (False, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, (root, status), group=group)
    roots = sorted({g[0] for g in gathered})
    if len(roots) > 1:
        raise ValueError(f"the ranks disagree on compile_root: {[g[0] for g in gathered]} (rank order)")
    ok, message = gathered[root][1]
    if not ok:
        raise CompileRootError(root, message, option)
    if rank == root:
        return kernel
    return compile_lock.compile_once(build, cache_dir=cache_dir, timeout=timeout)


#: The root of ``compile_once=True`` with a ``compile_group`` (and no ``compile_root``).
COMPILE_ONCE_ROOT = 0


def coordinate(build: Callable[[], T], compile_once: bool = False, group: Any = None, root: int | None = None) -> T:
    """How ``tilelang.compile`` / ``tilelang.jit`` run a compile:

    * ``root`` given: from that group rank (collective over ``group``);
    * ``compile_once`` with a ``group``: from the group's rank 0 (collective over ``group``);
    * ``compile_once`` alone: under the host-wide lock (not collective);
    * neither: plainly.
    """
    if root is not None:
        return compile_from_root(build, group, root)
    if compile_once and group is not None:
        return compile_from_root(build, group, COMPILE_ONCE_ROOT,
                                 option="compile_once=True with compile_group")
    if compile_once:
        return compile_lock.compile_once(build)
    return build()
