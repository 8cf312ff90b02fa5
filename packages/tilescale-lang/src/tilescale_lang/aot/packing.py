"""Turn a call's arguments into what ``cuLaunchKernel`` takes, from a bundle entry alone.

Everything here but the encoding of TMA descriptors (the driver's ``cuTensorMapEncodeTiled``)
runs without a GPU: it checks each argument against the entry's ``params`` (kind, dtype,
shape), binds the symbolic variables from tensor shapes, evaluates the grid, block and scalar
expressions, and packs each launch's parameter buffer (one ctypes value per kernel parameter,
in the device order, and the ``void*`` array pointing at them).
"""

from __future__ import annotations

import ast
import ctypes
import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ArgPacker", "PackedLaunch", "SCALAR_CTYPES", "TENSORMAP_BYTES", "encode_tensormap", "evaluate",
           "scalar_range", "scalar_value", "tensormap_buffer", "tensormap_fields", "tensormap_value", "value_copy"]

#: ctypes type of a scalar kernel parameter, by TileLang dtype (16-bit floats as their bits).
SCALAR_CTYPES = {
    "bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16, "int32": ctypes.c_int32,
    "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32,
    "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double,
    "float16": ctypes.c_uint16, "bfloat16": ctypes.c_uint16, "handle": ctypes.c_uint64,
}
#: torch dtype names that TileLang spells otherwise.
_DTYPE_ALIASES = {"float8_e4m3fn": "float8_e4m3", "float8_e5m2fnuz": "float8_e5m2", "float8_e4m3fnuz": "float8_e4m3"}

_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
}


def _compile_node(node: ast.AST, text: str) -> Callable[[dict], int]:
    if isinstance(node, ast.Expression):
        return _compile_node(node.body, text)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        value = node.value
        return lambda env: value
    if isinstance(node, ast.Name):
        name = node.id
        return lambda env: env[name]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        op, a, b = _OPS[type(node.op)], _compile_node(node.left, text), _compile_node(node.right, text)
        return lambda env: op(a(env), b(env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _compile_node(node.operand, text)
        return lambda env: -inner(env)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max")
            and len(node.args) == 2 and not node.keywords):
        fn = min if node.func.id == "min" else max
        a, b = _compile_node(node.args[0], text), _compile_node(node.args[1], text)
        return lambda env: fn(a(env), b(env))
    raise ValueError(f"launch expression {text!r}: {ast.dump(node)} is outside + - * // % min max")


@functools.lru_cache(maxsize=256)
def _compiled(text: str) -> Callable[[dict], int]:
    return _compile_node(ast.parse(text, mode="eval"), text)


def evaluate(expr: int | str, env: dict[str, int]) -> int:
    """The value of a launch expression (an int, or text from
    :func:`tilescale_lang.aot.launch_info.expr_text`) with the variables in ``env``.

    Raises:
        KeyError: a variable not in ``env``.
        ValueError: an operation outside ``+ - * // % min max``.
    """
    if isinstance(expr, int):
        return expr
    return _compiled(expr)(env)


def is_float_dtype(dtype: str) -> bool:
    """Whether a scalar parameter of ``dtype`` takes a float (else an int)."""
    return dtype.startswith("float") or dtype == "bfloat16"


def scalar_range(dtype: str) -> tuple[int, int]:
    """``(low, high)``: the ints a scalar parameter of integer ``dtype`` holds."""
    bits = 8 * ctypes.sizeof(SCALAR_CTYPES[dtype])
    if dtype == "bool":
        return 0, 1
    if dtype.startswith(("uint", "handle")):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def scalar_value(dtype: str, value: Any, name: str) -> Any:
    """``value`` as the ctypes object a kernel parameter of ``dtype`` takes.

    Raises:
        TypeError: not a number of that kind (an int for integer types), naming ``name``.
        ValueError: out of the type's range, naming ``name``.
    """
    ctype = SCALAR_CTYPES.get(dtype)
    if ctype is None:
        raise TypeError(f"{name}: scalar dtype {dtype!r} has no packing (known: {sorted(SCALAR_CTYPES)})")
    if is_float_dtype(dtype):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number ({dtype}), got {type(value).__name__}")
        if dtype == "float16":
            return ctype(struct.unpack("<H", struct.pack("<e", float(value)))[0])
        if dtype == "bfloat16":
            return ctype(struct.unpack("<I", struct.pack("<f", float(value)))[0] >> 16)
        return ctype(float(value))
    if not isinstance(value, int):
        raise TypeError(f"{name} must be an int ({dtype}), got {type(value).__name__}")
    low, high = scalar_range(dtype)
    if not low <= int(value) <= high:
        raise ValueError(f"{name}={value} is out of the range of {dtype} [{low}, {high}]")
    return ctype(int(value))


#: Bytes of a ``CUtensorMap`` (a TMA descriptor), passed to a kernel by value; 64-byte aligned.
TENSORMAP_BYTES = 128
_TENSORMAP_ALIGN = 64


def tensormap_buffer() -> Any:
    """A zeroed ``c_uint64 * 16`` (:data:`TENSORMAP_BYTES`) at a 64-byte aligned address (a
    ``CUtensorMap``'s alignment)."""
    raw = (ctypes.c_uint8 * (TENSORMAP_BYTES + _TENSORMAP_ALIGN))()
    offset = -ctypes.addressof(raw) % _TENSORMAP_ALIGN
    return (ctypes.c_uint64 * (TENSORMAP_BYTES // 8)).from_buffer(raw, offset)  # keeps ``raw`` alive


def value_copy(value: Any) -> Any:
    """A new ctypes object holding ``value``'s bytes (a scalar, or a descriptor from
    :func:`tensormap_value`, copied to an aligned buffer of its own)."""
    if isinstance(value, ctypes.Array):
        copy = tensormap_buffer()
        ctypes.memmove(copy, value, ctypes.sizeof(value))
        return copy
    return type(value)(value.value)


def tensormap_fields(arg: dict[str, Any], address: int, env: dict[str, Any]) -> tuple:
    """The arguments of ``cuTensorMapEncodeTiled`` for a ``tensormap`` launch argument
    (:mod:`~tilescale_lang.aot.launch_info`) over a buffer at ``address``, its expressions
    evaluated with ``env``: ``(data_type, rank, address, dims, strides, box,
    element_strides, interleave, swizzle, l2_promotion, oob_fill)``; ``strides`` without the
    first (the element size), as the driver takes them and TileLang's runtime passes them."""
    dims, strides, box, elements = ([evaluate(e, env) for e in arg[key]]
                                    for key in ("dims", "strides", "box", "element_strides"))
    return (arg["data_type"], arg["rank"], address, dims, strides[1:], box, elements, arg["interleave"],
            arg["swizzle"], arg["l2_promotion"], arg["oob_fill"])


def encode_tensormap(data_type: int, rank: int, address: int, dims: list, strides: list, box: list,
                     elements: list, interleave: int, swizzle: int, l2_promotion: int, oob_fill: int) -> bytes:
    """The 128 bytes of the ``CUtensorMap`` that ``cuTensorMapEncodeTiled`` encodes from these
    arguments (:func:`tensormap_fields`; the driver's enum values as ints). Needs the CUDA
    driver; raises :class:`tilescale_core.CudaError` where it refuses them."""
    from tilescale_core import driver

    drv = driver.driver_module()
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t  # cuda-bindings takes these, not ints, in the lists
    tensor_map = driver.call("cuTensorMapEncodeTiled", drv.CUtensorMapDataType(data_type), rank, address,
                             [u64(d) for d in dims], [u64(s) for s in strides], [u32(b) for b in box],
                             [u32(e) for e in elements], drv.CUtensorMapInterleave(interleave),
                             drv.CUtensorMapSwizzle(swizzle), drv.CUtensorMapL2promotion(l2_promotion),
                             drv.CUtensorMapFloatOOBfill(oob_fill))
    return ctypes.string_at(tensor_map.getPtr(), TENSORMAP_BYTES)


def tensormap_value(arg: dict[str, Any], address: int, env: dict[str, Any], encode: Callable[..., bytes] | None = None):
    """The kernel parameter of a ``tensormap`` launch argument over a buffer at ``address``:
    its descriptor (``encode``, default :func:`encode_tensormap`, of :func:`tensormap_fields`)
    in a 64-byte aligned ``c_uint64 * 16``."""
    data = (encode or encode_tensormap)(*tensormap_fields(arg, address, env))
    if len(data) != TENSORMAP_BYTES:
        raise ValueError(f"a TMA descriptor has {TENSORMAP_BYTES} bytes, the encoder gave {len(data)}")
    value = tensormap_buffer()
    ctypes.memmove(value, data, TENSORMAP_BYTES)
    return value


def _dtype_of(obj: Any) -> str | None:
    dtype = getattr(obj, "dtype", None)
    if dtype is None:
        return None
    text = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)


@dataclass
class PackedLaunch:
    """One kernel launch ready for ``cuLaunchKernel``: ``symbol``, ``grid`` and ``block``
    ``(x, y, z)``, ``dynamic_smem`` bytes, ``cluster`` ``(x, y, z)`` or None, ``cooperative``,
    ``values`` (the ctypes parameter values, kept alive here) and ``params`` (the ``void*``
    array; :attr:`address` is what ``kernelParams`` takes)."""

    symbol: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int
    cluster: tuple[int, int, int] | None
    cooperative: bool
    values: list[Any]
    params: Any

    @property
    def address(self) -> int:
        """Address of the ``void*`` parameter array (``kernelParams`` of ``cuLaunchKernel``)."""
        return ctypes.addressof(self.params)

    def raw(self) -> list[bytes]:
        """The bytes of every parameter value, in the device order (what the kernel receives)."""
        return [ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v)) for v in self.values]


class ArgPacker:
    """Checks and packs the arguments of one bundle entry (``entry`` from the manifest) for
    the launches of ``arch``.

    Call it with the PrimFunc's arguments in order: a tensor (anything with ``data_ptr()``;
    its ``dtype`` and ``shape`` are checked when it has them) or an int device address for a
    buffer, a Python number for a scalar.
    """

    def __init__(self, entry: dict[str, Any], arch: str):
        self.entry = entry
        self.name = entry["id"]
        self.params = entry["params"]
        self.launches = entry["archs"][arch]["launches"]
        self.dynamic = {d["param"]: [] for d in entry["dynamic_vars"]}
        for d in entry["dynamic_vars"]:
            self.dynamic[d["param"]].append(d)

    def _bind_buffer(self, param: dict, value: Any, env: dict[str, int]) -> int:
        where = f"{self.name}: argument {param['name']!r}"
        if isinstance(value, int) and not isinstance(value, bool):
            if param["name"] in self.dynamic:
                raise TypeError(f"{where} sizes a symbolic dimension; pass a tensor (its shape gives "
                                f"{[d['name'] for d in self.dynamic[param['name']]]}), not an address")
            return value
        if not hasattr(value, "data_ptr"):
            raise TypeError(f"{where} must be a tensor (with data_ptr()) or an int device address, "
                            f"got {type(value).__name__}")
        dtype = _dtype_of(value)
        if dtype is not None and dtype != param["dtype"]:
            raise TypeError(f"{where} must have dtype {param['dtype']}, got {dtype}")
        shape = getattr(value, "shape", None)
        if shape is not None:
            self._check_dims(where, "shape", param["shape"], list(shape), env)
            if param["strides"] is not None and hasattr(value, "stride"):
                # a size-1 axis has any stride (torch gives slices of one row other strides)
                strides = [w if int(n) == 1 else int(h) for w, h, n in zip(param["strides"], value.stride(), shape)]
                self._check_dims(where, "strides", param["strides"], strides, env)
            elif param["strides"] is None and hasattr(value, "is_contiguous") and not value.is_contiguous():
                raise ValueError(f"{where} must be contiguous")
        return int(value.data_ptr())

    @staticmethod
    def _check_dims(where: str, what: str, expected: list, got: list, env: dict[str, int]) -> None:
        if len(expected) != len(got):
            raise ValueError(f"{where} must have {len(expected)} dimensions ({what} {expected}), got {got}")
        for axis, (want, have) in enumerate(zip(expected, got)):
            have = int(have)
            if isinstance(want, str) and want.isidentifier():
                if env.setdefault(want, have) != have:
                    raise ValueError(f"{where} {what}[{axis}] is {have} but {want} is {env[want]} from an earlier argument")
            elif isinstance(want, int) and want != have:
                raise ValueError(f"{where} must have {what} {expected}, got {got} (axis {axis})")

    def check_device(self, args: tuple) -> None:
        """Raise ValueError, naming the argument, for a buffer given as a tensor that is not
        on a CUDA device (a tensor without ``is_cuda`` passes)."""
        for param, value in zip(self.params, args):
            if param["kind"] == "buffer" and getattr(value, "is_cuda", True) is False:
                raise ValueError(f"{self.name}: argument {param['name']!r} must be a CUDA tensor, got one on "
                                 f"{getattr(value, 'device', 'the host')}")

    def bind(self, args: tuple) -> tuple[dict[str, int], dict[str, int]]:
        """Check ``args`` and return ``(env, pointers)``: the scalar and symbolic variable values,
        and each buffer parameter's device address.

        Raises:
            TypeError: wrong number or kind of arguments, or a dtype mismatch, naming the argument.
            ValueError: a shape mismatch or a scalar out of range, naming the argument.
        """
        if len(args) != len(self.params):
            names = [p["name"] for p in self.params]
            raise TypeError(f"{self.name} takes {len(self.params)} arguments {names}, got {len(args)}")
        env: dict[str, Any] = {}
        pointers: dict[str, int] = {}
        for param, value in zip(self.params, args):
            if param["kind"] == "buffer":
                pointers[param["name"]] = self._bind_buffer(param, value, env)
            else:
                scalar_value(param["dtype"], value, f"{self.name}: argument {param['name']!r}")  # checks only
                env[param["name"]] = value
        return env, pointers

    def pack(self, *args: Any) -> list[PackedLaunch]:
        """The launches of one call with ``args`` (the PrimFunc's parameters, in order)."""
        env, pointers = self.bind(args)
        out = []
        for launch in self.launches:
            values = []
            for i, arg in enumerate(launch["args"]):
                if arg["kind"] == "pointer":
                    values.append(ctypes.c_uint64(pointers[arg["param"]]))
                elif arg["kind"] == "tensormap":  # encoded for this call's buffer (needs the driver)
                    values.append(tensormap_value(arg, pointers[arg["param"]], env))
                else:
                    where = f"{self.name}: {launch['symbol']} argument {i}"
                    values.append(scalar_value(arg["dtype"], evaluate(arg["value"], env), where))
            params = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
            grid = tuple(evaluate(g, env) for g in launch["grid"])
            block = tuple(evaluate(b, env) for b in launch["block"])
            if min(grid + block) < 1:
                raise ValueError(f"{self.name}: {launch['symbol']} has an empty launch (grid {grid}, block {block})")
            cluster = tuple(launch["cluster"]) if launch.get("cluster") else None
            out.append(PackedLaunch(launch["symbol"], grid, block, int(launch["dynamic_smem"]), cluster,
                                    bool(launch.get("cooperative")), values, params))
        return out
