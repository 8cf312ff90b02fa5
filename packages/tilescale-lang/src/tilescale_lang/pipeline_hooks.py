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
* ``tilelang.cuda.transform.LowerHopperIntrin``: after stock TileLang hoisted the TMA
  descriptors to the top of the host code, the base pointers of remote TMA views
  (``tilescale_tma_peer<k>_<name>``, see :mod:`.remote_tma`) are bound before them: one call
  to ``tilescale.tma_peer_addresses(<name>, slots)`` per remote tensor fills eight ``int64``
  stack slots with its address in the heaps of PEs 0..7, and each peer variable reads its slot.
* ``tilelang.cuda.transform.LowerLDGSTG``: after the stock pass, the 16-byte vector stores
  into remote views of TileScale kernels become one ``st.global.v4.b32`` each
  (:mod:`.remote_stores`: nvcc would split them into 4-byte stores).
"""

from __future__ import annotations

from typing import Any

from . import codegen, remote_stores
from .state import STATE

#: Stock pass constructors replaced here, by ``module.attribute`` name (:attr:`.state.LangState.stock`).
STOCK: dict[str, Any] = STATE.stock
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


def _peer_bindings(func):
    """``func`` with the remote TMA peer pointers bound at the top of its (host) body."""
    import re

    from tvm import ir, tirx

    from . import remote_tma

    params = [b.data for b in func.buffer_map.values()]
    undefined = tirx.analysis.undefined_vars(func.body, list(func.params) + params)
    pattern = re.compile(rf"{remote_tma.PEER_PREFIX}(\d+)_(.+)")
    by_base: dict[str, list] = {}
    for var in undefined:
        m = pattern.fullmatch(var.name)
        if m:
            by_base.setdefault(m.group(2), []).append((int(m.group(1)), var))
    if not by_base:
        return func
    stmts = []
    for base_name, peers in sorted(by_base.items()):
        base = [d for d in params if d.name == base_name]
        if len(base) != 1:
            raise ValueError(
                f"remote TMA on {base_name!r}: the tensor must be a parameter of the kernel "
                "(a tensor of the symmetric heap passed to it)"
            )
        slots = tirx.Var(f"tilescale_tma_peers_{base_name}", ir.PointerType(ir.PrimType("int64"), "global"))
        buf = tirx.decl_buffer((remote_tma.MAX_TMA_PES,), "int64", name=f"{slots.name}_buf", data=slots)
        alloca = tirx.Call("handle", ir.Op.get("tirx.tvm_stack_alloca"),
                           [tirx.StringImm("tvm_ffi_any"), remote_tma.MAX_TMA_PES])
        fill = tirx.Call("int32", ir.Op.get("tirx.tvm_call_packed"),
                         [tirx.StringImm(remote_tma.ADDRESSES_FUNC), base[0], slots])
        stmts += [tirx.Bind(slots, alloca), tirx.DeclBuffer(buf), tirx.Evaluate(fill)]
        for k, var in sorted(peers, key=lambda p: p[0]):
            stmts.append(tirx.Bind(var, tirx.reinterpret("handle", tirx.BufferLoad(buf, [k]))))
    return func.with_body(tirx.SeqStmt([*stmts, func.body]))


def lower_hopper_intrin():
    """Stock ``LowerHopperIntrin``, then the remote TMA peer pointers bound in the host code."""
    import tvm
    from tvm import tirx

    stock = STOCK["tilelang.cuda.transform.LowerHopperIntrin"]()

    @tvm.transform.module_pass(opt_level=0, name="tilescale.LowerHopperIntrin")
    def tilescale_lower_hopper_intrin(mod, _ctx):
        mod = stock(mod)
        updates = {gv: _peer_bindings(f) for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return tilescale_lower_hopper_intrin


def lower_ldgstg():
    """Stock ``LowerLDGSTG``, then the remote 16-byte stores of TileScale kernels lowered to one
    vector store each (:func:`.remote_stores.lower_remote_vector_stores`)."""
    import tvm
    from tvm import tirx

    stock = STOCK["tilelang.cuda.transform.LowerLDGSTG"]()

    @tvm.transform.module_pass(opt_level=0, name="tilescale.LowerLDGSTG")
    def tilescale_lower_ldgstg(mod, _ctx):
        mod = stock(mod)
        updates = {gv: remote_stores.lower_remote_vector_stores(f) for gv, f in mod.functions.items()
                   if isinstance(f, tirx.PrimFunc) and codegen.uses_tilescale(f)}
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return tilescale_lower_ldgstg


def install() -> None:
    """Wrap the stock passes (once)."""
    import tilelang.cuda.transform as cuda_transform
    import tilelang.transform as tl_transform

    for module, name, wrapper in (
        (tl_transform, "AnnotateReadOnlyParams", annotate_read_only_params),
        (cuda_transform, "LowerHopperIntrin", lower_hopper_intrin),
        (cuda_transform, "LowerLDGSTG", lower_ldgstg),
    ):
        key = f"{module.__name__}.{name}"
        if key not in STOCK:
            STOCK[key] = getattr(module, name)
            setattr(module, name, wrapper)
