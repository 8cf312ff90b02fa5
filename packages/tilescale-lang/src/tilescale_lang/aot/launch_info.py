"""Lower a PrimFunc with stock TileLang and read what a launcher needs from the result.

:func:`lower` runs ``tilelang.lower`` the way ``tilelang.compile`` does (the pass configs in a
``PassContext``, the target in scope, TileScale's CUDA post-processing callback installed, so
the source includes ``tilescale/tilescale.cuh`` when the kernel calls an intrinsic).
:func:`describe` turns the PrimFunc and the lowered modules into the JSON launch metadata of a
bundle entry:

* ``params``: the PrimFunc's parameters in call order. A buffer is
  ``{"name", "kind": "buffer", "dtype", "shape", "strides"}`` (a dimension is an int or the
  name of a symbolic variable; ``strides`` None when contiguous), a scalar is
  ``{"name", "kind": "scalar", "dtype"}``.
* ``dynamic_vars``: each symbolic shape or stride variable, where it is read from:
  ``{"name", "dtype", "param", "axis", "of": "shape" | "stride"}``.
* ``launches``: one per device kernel, in launch order: ``{"symbol", "grid": [x, y, z],
  "block": [x, y, z], "dynamic_smem" (bytes), "cluster" ([x, y, z] or None), "cooperative",
  "args"}``; a grid or block extent is an int or a Python expression (``(m + 3) // 4``) over
  the scalar parameters and symbolic variables; ``args`` are the kernel's parameters in the
  device order: ``{"kind": "pointer", "param", "dtype"}`` (the data pointer of a buffer
  parameter) or ``{"kind": "scalar", "dtype", "value"}`` (an int or an expression); with
  ``tensormaps=True`` also ``{"kind": "tensormap", "param", "data_type", "rank", "dims",
  "strides", "box", "element_strides", "interleave", "swizzle", "l2_promotion",
  "oob_fill"}``: a TMA descriptor that TileLang's host code encodes at each call with
  ``cuTensorMapEncodeTiled`` over buffer ``param`` (the driver's enum values as ints; ``dims``,
  ``strides`` (bytes, the first the element size, which the driver does not take), ``box``
  and ``element_strides`` one entry per dimension, innermost first, ints or expressions).
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnsupportedKernelError", "describe", "expr_text", "lower", "parameters", "symbol_of"]


class UnsupportedKernelError(ValueError):
    """The lowered kernel needs a host-side step an AOT bundle does not record (e.g. a TMA
    descriptor built on the host at each call)."""


_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "FloorDiv": "//", "FloorMod": "%", "Div": "//", "Mod": "%"}


def expr_text(expr: Any) -> int | str:
    """``expr`` (a TIR integer expression) as an int, or as Python expression text over
    variable names (``+ - * // %``, ``min``, ``max``; casts dropped).

    Raises:
        UnsupportedKernelError: an operation outside that set, naming it.
    """
    from tvm import tirx

    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return expr.name
    if isinstance(expr, tirx.Cast):
        return expr_text(expr.value)
    kind = type(expr).__name__
    if kind in ("Min", "Max"):
        return f"{kind.lower()}({expr_text(expr.a)}, {expr_text(expr.b)})"
    if kind in _BINARY:
        return f"({expr_text(expr.a)} {_BINARY[kind]} {expr_text(expr.b)})"
    raise UnsupportedKernelError(f"launch expression {expr} uses {kind}, which an AOT bundle cannot record")


def lower(func: Any, arch: str, pass_configs: dict[str, Any] | None = None) -> Any:
    """Lower ``func`` for ``{"kind": "cuda", "arch": arch}`` as ``tilelang.compile`` does (no
    nvcc); returns TileLang's ``CompiledArtifact`` (``kernel_source``, ``device_mod``,
    ``host_mod``)."""
    import tilelang
    from tilelang import tvm

    from .. import codegen

    codegen.install_postproc()  # the TileScale include line in sources that call tilescale::
    target = {"kind": "cuda", "arch": arch}
    with tvm.transform.PassContext(opt_level=3, config=dict(pass_configs or {})), tvm.target.Target(target):
        return tilelang.lower(func, target=target)


def symbol_of(func: Any) -> str:
    """``func``'s ``global_symbol`` (``"kernel"`` when it has none)."""
    attrs = getattr(func, "attrs", None)
    return str(attrs["global_symbol"]) if attrs is not None and "global_symbol" in attrs else "kernel"


def _dim(value: Any) -> int | str:
    return expr_text(value)


def _params(func: Any) -> tuple[list[dict], list[dict], dict[str, str]]:
    """``params``, ``dynamic_vars`` and data-var name -> buffer parameter name."""
    from tvm import tirx

    params, dynamic, data_names = [], {}, {}
    scalars = {p.name for p in func.params if p not in func.buffer_map}
    for p in func.params:
        if p not in func.buffer_map:
            params.append({"name": p.name, "kind": "scalar", "dtype": str(p.dtype)})
            continue
        buf = func.buffer_map[p]
        data_names[buf.data.name] = buf.name
        strides = [_dim(s) for s in buf.strides] if len(buf.strides) else None
        params.append({"name": buf.name, "kind": "buffer", "dtype": str(buf.dtype),
                       "shape": [_dim(d) for d in buf.shape], "strides": strides})
        for of, dims in (("shape", buf.shape), ("stride", buf.strides)):
            for axis, d in enumerate(dims):
                if isinstance(d, tirx.Var) and d.name not in scalars and d.name not in dynamic:
                    dynamic[d.name] = {"name": d.name, "dtype": str(d.dtype), "param": buf.name, "axis": axis,
                                       "of": of}
    return params, list(dynamic.values()), data_names


def parameters(func: Any) -> tuple[list[dict], list[dict]]:
    """``(params, dynamic_vars)`` of PrimFunc ``func`` (see the module docstring), without lowering it."""
    params, dynamic, _ = _params(func)
    return params, dynamic


def _host_calls(host_mod: Any) -> list[tuple[str, list]]:
    """``(name, argument expressions)`` of every ``tvm_call_packed`` of the host function
    whose name is a string, in call order."""
    from tvm import ir, tirx
    from tvm.tirx.stmt_functor import post_order_visit

    calls: list[tuple[str, list]] = []
    op = ir.Op.get("tirx.tvm_call_packed")

    def visit(node):
        if (isinstance(node, tirx.Call) and node.op.same_as(op) and node.args
                and isinstance(node.args[0], tirx.StringImm)):
            calls.append((node.args[0].value, list(node.args[1:])))

    for fn in host_mod.functions.values():
        post_order_visit(fn.body, visit)
    return calls


def _packed_calls(calls: list[tuple[str, list]]) -> dict[str, list]:
    """Device kernel name -> the argument expressions of its call among the host function's
    ``calls`` (:func:`_host_calls`; dict order is launch order)."""
    launches: dict[str, list] = {}
    for name, args in calls:
        if name and not name.startswith("__tvm"):
            launches.setdefault(name, args)
    return launches


#: The host function's call that encodes a tiled TMA descriptor (TileLang's runtime), and
#: the fields of its arguments after the descriptor: its ``TensorMapArgs`` layout.
TENSORMAP_CALL = "__tvm_tensormap_create_tiled"
_TENSORMAP_ENUMS = ("interleave", "swizzle", "l2_promotion", "oob_fill")


def _tensormaps(calls: list[tuple[str, list]], data_names: dict[str, str], symbol: str) -> dict[str, dict]:
    """Descriptor variable name -> its ``tensormap`` launch argument, for every tiled TMA
    descriptor the host function encodes among its ``calls`` (:func:`_host_calls`,
    :data:`TENSORMAP_CALL`).

    Raises:
        UnsupportedKernelError: a descriptor over an address that is not a buffer parameter's
            data pointer, or with an argument list of another layout.
    """
    from tvm import tirx

    found = {}
    for name, call_args in calls:
        if name != TENSORMAP_CALL:
            continue
        desc, args = call_args[0], call_args[1:]
        rank = int(args[1].value) if len(args) > 1 and isinstance(args[1], tirx.IntImm) else -1
        address = args[2] if len(args) > 2 else None
        if not 1 <= rank <= 5 or len(args) != 7 + 4 * rank or not (
                isinstance(address, tirx.Var) and address.name in data_names):
            raise UnsupportedKernelError(f"kernel {symbol!r}: TMA descriptor {desc} is encoded over {address} with "
                                         f"{len(args)} arguments; only a buffer parameter's data pointer with the "
                                         f"tiled layout (7 + 4 x rank arguments) can be recorded")
        lists = [[expr_text(e) for e in args[3 + i * rank: 3 + (i + 1) * rank]] for i in range(4)]
        spec = {"kind": "tensormap", "param": data_names[address.name], "data_type": int(args[0].value),
                "rank": rank, "dims": lists[0], "strides": lists[1], "box": lists[2], "element_strides": lists[3]}
        spec.update((key, int(e.value)) for key, e in zip(_TENSORMAP_ENUMS, args[3 + 4 * rank:]))
        found[desc.name] = spec
    return found


def _launch_arg(expr: Any, data_names: dict[str, str], dtypes: dict[str, str], symbol: str, index: int,
                tensormaps: dict[str, dict]) -> dict:
    from tvm import tirx

    if isinstance(expr, tirx.Var) and expr.name in data_names:
        return {"kind": "pointer", "param": data_names[expr.name], "dtype": dtypes[data_names[expr.name]]}
    if isinstance(expr, tirx.Var) and expr.name in tensormaps:
        return dict(tensormaps[expr.name])
    if str(expr.dtype) == "handle":
        raise UnsupportedKernelError(
            f"kernel {symbol!r} argument {index} ({expr}) is a handle built on the host (a TMA descriptor or a "
            "workspace); AOT bundles record only buffer pointers and scalars")
    return {"kind": "scalar", "dtype": str(expr.dtype), "value": expr_text(expr)}


def _launch(gvar: Any, dev: Any, args: list, data_names: dict[str, str], dtypes: dict[str, str],
            tensormaps: dict[str, dict]) -> dict:
    symbol = gvar.name_hint
    attrs = dev.attrs
    grid: list[int | str] = [1, 1, 1]
    block: list[int | str] = [1, 1, 1]
    for tag, extent in (attrs["thread_extent"].items() if "thread_extent" in attrs else []):
        target = block if "threadIdx" in tag else grid if "blockIdx" in tag else None
        if target is not None:
            target["xyz".index(str(tag)[-1])] = expr_text(extent)
    cluster = [int(c) for c in attrs["cluster_dims"]] if "cluster_dims" in attrs else None
    smem = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0
    kernel_args = [_launch_arg(a, data_names, dtypes, symbol, i, tensormaps)
                   for i, a in enumerate(args[: len(dev.params)])]
    return {"symbol": symbol, "grid": grid, "block": block, "dynamic_smem": smem, "cluster": cluster,
            "cooperative": bool(attrs["use_cooperative_groups"]) if "use_cooperative_groups" in attrs else False,
            "args": kernel_args}


def describe(func: Any, artifact: Any, tensormaps: bool = False) -> dict[str, Any]:
    """The launch metadata (``params``, ``dynamic_vars``, ``launches``; see the module doc) of
    PrimFunc ``func`` lowered into ``artifact``. ``tensormaps``: describe the tiled TMA
    descriptors the host code encodes (``tensormap`` arguments, which the lean launcher
    encodes itself), instead of refusing them (an AOT bundle does not record them).

    Raises:
        UnsupportedKernelError: a device kernel takes an argument the metadata cannot describe.
    """
    params, dynamic, data_names = _params(func)
    dtypes = {p["name"]: p["dtype"] for p in params}
    host = _host_calls(artifact.host_mod)
    calls = _packed_calls(host)
    described = _tensormaps(host, data_names, symbol_of(func)) if tensormaps else {}
    devices = {gv.name_hint: (gv, fn) for gv, fn in artifact.device_mod.functions.items()}
    missing = sorted(set(devices) - set(calls))
    if missing:
        raise UnsupportedKernelError(f"device kernel(s) {missing} have no launch in the host function")
    launches = [_launch(*devices[name], calls[name], data_names, dtypes, described) for name in calls
                if name in devices]
    return {"params": params, "dynamic_vars": dynamic, "launches": launches}
