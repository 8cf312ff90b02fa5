"""Tie generated CUDA to the TileScale headers: the include line, the compile flags, the cache.

* :func:`postproc` (registered as TileLang's CUDA post-processing callback, chaining any
  callback registered before) puts ``#include <tilescale/tilescale.cuh>`` at the top of every
  generated CUDA file that calls into ``tilescale::``.  It runs for every backend and also
  for ``tilelang.lower`` without nvcc.
* :func:`wrap_cached` wraps TileLang's compile entry (``tilelang.jit.cached``, used by
  ``tilelang.compile``, ``tilelang.par_compile`` and ``@tilelang.jit``) so that a PrimFunc
  that uses an intrinsic is compiled with :func:`tilescale_lang.headers.compile_flags`
  (include path, header hash, wait timeout).  Kernels that use no intrinsic go through
  untouched.  The flags are part of TileLang's kernel-cache key.
  A kernel that calls a helper the CUDA toolkit cannot compile is rejected there
  (:func:`tilescale_lang.toolkit.check_features`).
* :func:`wrap_compile` / :func:`wrap_jit` add ``compile_once=`` / ``compile_group=`` /
  ``compile_root=`` to ``tilelang.compile`` and ``@tilelang.jit`` (see
  :mod:`tilescale_lang.compile_lock` and :mod:`tilescale_lang.compile_root`).
"""

from __future__ import annotations

import functools
from typing import Any

from . import compile_lock, headers, toolkit
from . import compile_root as compile_root_mod
from .state import STATE

#: Namespace of every device helper; its presence marks a TileScale kernel.
NAMESPACE = "tilescale::"
INCLUDE_LINE = f"#include <{headers.MAIN_HEADER}>\n"
_POSTPROC_NAME = "tilelang_callback_cuda_postproc"

# The CUDA post-processing callback's entry of the process-wide state (tilescale_lang.state):
# the callback registered before ours ("previous") and whether ours is installed.
_state: dict[str, Any] = STATE.hooks.setdefault("cuda_postproc", {"previous": None, "installed": False})


def add_include(code: str) -> str:
    """Return ``code`` with the TileScale include at the top if it calls ``tilescale::``."""
    if NAMESPACE in code and INCLUDE_LINE not in code:
        return INCLUDE_LINE + code
    return code


def postproc(code: str, target: Any) -> str:
    """TileLang CUDA post-processing callback: earlier callback first, then the include."""
    previous = _state["previous"]
    if previous is not None:
        code = previous(code, target)
    return add_include(str(code))


def install_postproc() -> None:
    """Register :func:`postproc` (once), keeping any earlier callback in the chain."""
    if _state["installed"]:
        return
    import tvm_ffi

    _state["previous"] = tvm_ffi.get_global_func(_POSTPROC_NAME, allow_missing=True)
    tvm_ffi.register_global_func(_POSTPROC_NAME, f=postproc, override=True)
    _state["installed"] = True


def tilescale_helpers(func: Any) -> set[str]:
    """The ``tilescale::`` helpers (TileScale intrinsics) the PrimFunc calls, by extern name."""
    from tvm import tirx

    body = getattr(func, "body", None)
    if body is None:
        return set()
    found: set[str] = set()

    def visit(node):
        if not isinstance(node, tirx.Call):
            return
        op = getattr(node.op, "name", "")
        if op == "tirx.call_extern" and node.args and isinstance(node.args[0], tirx.StringImm):
            if node.args[0].value.startswith(NAMESPACE):
                found.add(node.args[0].value)

    tirx.stmt_functor.post_order_visit(body, visit)
    return found


def uses_tilescale(func: Any) -> bool:
    """True when the PrimFunc calls a ``tilescale::`` helper (a TileScale intrinsic)."""
    return bool(tilescale_helpers(func))


def merge_flags(compile_flags: list[str] | str | None) -> list[str]:
    """``compile_flags`` plus the TileScale flags (not repeated)."""
    if compile_flags is None:
        flags: list[str] = []
    elif isinstance(compile_flags, str):
        flags = [compile_flags]
    else:
        flags = list(compile_flags)
    for flag in headers.compile_flags():
        if flag not in flags:
            flags.append(flag)
    return flags


def wrap_cached(cached):
    """Wrap ``tilelang.cache.cached``: add the flags for TileScale kernels; capture every
    kernel's module at its first launch (:func:`~tilescale_lang.metadata.track_kernel`: a
    TileScale kernel's table is copied into it, and the lean launcher can launch any kernel
    whose module it knows, a stock one too, e.g. a TMA GEMM it freezes)."""
    if getattr(cached, "__tilescale_wrapped__", False):
        return cached

    @functools.wraps(cached)
    def tilescale_cached(func=None, out_idx=None, *args, **kwargs):
        from .metadata import guard_launch, table_readers, track_kernel

        helpers_used = tilescale_helpers(func) if func is not None else set()
        if helpers_used:
            toolkit.check_features(helpers_used)  # a feature the toolkit lacks: a clear error, before nvcc
            install_postproc()
            kwargs["compile_flags"] = merge_flags(kwargs.get("compile_flags"))
        kernel = cached(func, out_idx, *args, **kwargs)
        track_kernel(kernel)  # one wrapped first launch, then TileLang's own launch path
        if helpers_used:
            guard_launch(kernel, table_readers(func))
        return kernel

    tilescale_cached.__tilescale_wrapped__ = True
    return tilescale_cached


def wrap_compile(compile_fn):
    """Wrap ``tilelang.compile`` with ``compile_once`` / ``compile_group`` / ``compile_root``.

    * ``compile_root=r`` (collective over ``compile_group``, default the world group): rank
      ``r`` compiles, the others load its result from the disk cache; a failure on ``r``
      raises on every rank with ``r``'s message (:mod:`tilescale_lang.compile_root`).
    * ``compile_once=True`` with ``compile_group`` and without ``compile_root``: the same
      collective with the group's rank 0 as the root: only rank 0 runs the compiler, the
      others load its result, and a failure on rank 0 raises on every rank with its message.
    * ``compile_once=True`` alone: the compile runs under a host-wide file lock beside
      TileLang's disk cache (:mod:`tilescale_lang.compile_lock`): the first rank compiles,
      every later rank loads the cached result.  No collective is involved, so a kernel that
      only some ranks compile is fine.
    * neither: plain ``tilelang.compile``.
    """
    if getattr(compile_fn, "__tilescale_wrapped__", False):
        return compile_fn

    @functools.wraps(compile_fn)
    def tilescale_compile(*args, compile_once: bool = False, compile_group: Any = None,
                          compile_root: int | None = None, **kwargs):
        return compile_root_mod.coordinate(lambda: compile_fn(*args, **kwargs), compile_once, compile_group,
                                           compile_root)

    tilescale_compile.__tilescale_wrapped__ = True
    tilescale_compile.__wrapped_compile__ = compile_fn
    return tilescale_compile


#: Attribute of a ``JITImpl`` holding its compile coordination (compile_once, group, root).
JIT_OPTIONS = "_tilescale_compile_options"


def wrap_jit(jit_fn):
    """Wrap the ``tilelang.jit`` decorator with ``compile_once`` / ``compile_group`` /
    ``compile_root`` (same meaning as for :func:`wrap_compile`); each compile the decorated
    function makes (one per distinct set of arguments) is coordinated that way."""
    if getattr(jit_fn, "__tilescale_wrapped__", False):
        return jit_fn

    def attach(impl, options):
        impl.__dict__[JIT_OPTIONS] = options
        return impl

    @functools.wraps(jit_fn)
    def tilescale_jit(func=None, *, compile_once: bool = False, compile_group: Any = None,
                      compile_root: int | None = None, **kwargs):
        result = jit_fn(func, **kwargs)
        if not compile_once and compile_root is None:
            return result
        options = (compile_once, compile_group, compile_root)
        if func is not None:
            return attach(result, options)
        return functools.wraps(result)(lambda f: attach(result(f), options))

    tilescale_jit.__tilescale_wrapped__ = True
    return tilescale_jit


def wrap_jit_impl_compile(method):
    """Wrap ``JITImpl.compile`` so that a decorated function's compiles follow its options."""
    if getattr(method, "__tilescale_wrapped__", False):
        return method

    @functools.wraps(method)
    def compile(self, *args, **kwargs):
        options = self.__dict__.get(JIT_OPTIONS)
        if options is None:
            return method(self, *args, **kwargs)
        return compile_root_mod.coordinate(lambda: method(self, *args, **kwargs), *options)

    compile.__tilescale_wrapped__ = True
    return compile


#: The default target for :func:`cuda_source`: Hopper with its architecture-specific features.
DEFAULT_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def cuda_source(func: Any, target: Any = None) -> str:
    """Return the CUDA C++ that TileLang generates for ``func``, without running nvcc.

    Works on machines without a GPU (it only lowers), so tests and users can inspect which
    TileScale helpers a kernel calls.  The TileScale include line is in the result.

    Args:
        func: a ``T.prim_func``.
        target: a TileLang target (a dict such as ``{"kind": "cuda", "arch": "sm_90a"}``);
            default :data:`DEFAULT_TARGET`.
    """
    import tilelang
    from tilelang import tvm

    target = DEFAULT_TARGET if target is None else target
    with tvm.target.Target(target):  # kernels using T.copy need the target context
        return tilelang.lower(func, target=target).kernel_source
