"""Hooks into stock TileLang's CUDA pass pipeline for kernels that use TileScale intrinsics.

The pipeline (``tilelang/cuda/pipeline.py``) looks its passes up on their modules at every
compile, so wrapping a module attribute wraps the pass; kernels that call no ``tilescale::``
helper go through the stock passes untouched.

* ``tilelang.transform.AnnotateReadOnlyParams``: stock TileLang marks every kernel parameter
  that the kernel never writes as read-only, and nvcc then reads it through the
  non-coherent path (``ld.global.nc``), which PTX allows only for data that no one writes
  while the kernel runs.  In a TileScale kernel a peer may write such a buffer during the
  kernel (the consumer of a put-with-signal only reads its data buffer), so the read-only
  marks are dropped there and its pointer parameters lose ``__restrict__`` (all of them
  are listed in ``tl.non_restrict_params``: nvcc infers the read-only path by itself for a
  never-written pointer as long as any parameter is ``__restrict__``).  The consumer's
  loads stay coherent and see the data published before the signal it acquired.
"""

from __future__ import annotations

from typing import Any

from . import codegen

#: Stock pass constructors replaced here, by ``module.attribute`` name.
STOCK: dict[str, Any] = {}
READONLY_ATTR = "tl.readonly_param_indices"
NON_RESTRICT_ATTR = "tl.non_restrict_params"


def _coherent_params(func):
    """``func`` without read-only marks and with no ``__restrict__`` pointer parameter."""
    pointers = [p for p in func.params if str(p.dtype) == "handle"]
    func = func.without_attr(READONLY_ATTR) if READONLY_ATTR in func.attrs else func
    return func.with_attr(NON_RESTRICT_ATTR, pointers)


def _without_readonly_marks(mod):
    from tvm import tirx

    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and codegen.uses_tilescale(func):
            updates[gv] = _coherent_params(func)
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def annotate_read_only_params():
    """Stock ``AnnotateReadOnlyParams``, then the read-only marks of TileScale kernels removed."""
    import tvm

    stock = STOCK["tilelang.transform.AnnotateReadOnlyParams"]()

    @tvm.transform.module_pass(opt_level=0, name="tilescale.AnnotateReadOnlyParams")
    def tilescale_annotate_read_only_params(mod, _ctx):
        return _without_readonly_marks(stock(mod))

    return tilescale_annotate_read_only_params


def install() -> None:
    """Wrap the stock passes (once)."""
    import tilelang.transform as tl_transform

    key = "tilelang.transform.AnnotateReadOnlyParams"
    if key not in STOCK:
        STOCK[key] = tl_transform.AnnotateReadOnlyParams
        tl_transform.AnnotateReadOnlyParams = annotate_read_only_params
