"""The lean launcher: a kernel's launches prepared once, only the changing arguments packed per call.

TileLang's launcher checks and converts every argument of every call (DLPack conversion,
dtype, shape and device checks in the generated host function). An op instance calls the same
kernel with the same persistent buffers (flags, state, symmetric buffers) thousands of times;
only a few arguments change (the caller's input and output). :func:`prepare` does the full
check once, packs the kernel parameters once, and returns a :class:`LeanLaunch` whose call
takes only the changing arguments, checks them cheaply (dtype, shape, contiguity and device as
prepared) and launches with ``cuLaunchKernel`` (cuda-bindings) on the current torch stream::

    launch = tilescale_lang.lean.prepare(kernel, (x, out, flags, state, 4), changing=("x", "out"))
    launch(x2, out2)          # same checks as TileLang's for these two, one driver call

It launches the function of the module TileLang itself loaded (the one whose ``meta_data``
table ``kernel.initialize`` binds), so it shares that module's table and needs no second copy
of the code. Until that module is known (a ``tvm_ffi`` kernel loads it at its first launch),
and for launches it cannot make (a thread-block cluster, a launch attribute it does not know),
it calls ``kernel(*args)`` instead: the same result at TileLang's cost (:attr:`LeanLaunch.lean`
tells which path runs, :attr:`LeanLaunch.why_not` why). An :class:`~tilescale_lang.aot.AotKernel`
is prepared the same way.

Launches are stream-ordered and capturable in CUDA graphs like any ``cuLaunchKernel``.
"""

from __future__ import annotations

import ast
import ctypes
from typing import Any, Sequence

from .aot import launch_info
from .aot.packing import SCALAR_CTYPES, ArgPacker, _compiled, scalar_value

__all__ = ["LeanLaunch", "describe_kernel", "prepare"]

#: Device-function attributes whose meaning the lean launcher reproduces (or that do not
#: affect a launch); a kernel with any other attribute launches through TileLang.
KNOWN_ATTRS = frozenset({
    "target", "tirx.noalias", "tl.non_restrict_params", "tirx.is_global_func", "calling_conv",
    "tirx.kernel_launch_params", "global_symbol", "thread_extent", "dyn_shared_memory_buf",
    "use_cooperative_groups", "cluster_dims", "tl.readonly_param_indices", "tl.smem_alignment_map",
})
#: Launch parameter tags of ``tirx.kernel_launch_params`` the lean launcher understands.
KNOWN_LAUNCH_TAGS = frozenset({"blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y",
                               "threadIdx.z", "tirx.use_dyn_shared_memory"})
_NOT_LOADED = "the kernel's module is not loaded yet (it loads at the first launch)"
#: Dynamic shared memory above this needs ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``.
DEFAULT_SMEM_LIMIT = 48 * 1024


def _unsupported(device_mod: Any) -> str | None:
    """Why the lean launcher cannot launch ``device_mod``'s kernels itself, or None."""
    for gvar, fn in device_mod.functions.items():
        attrs = fn.attrs if fn.attrs is not None else {}
        unknown = sorted(str(k) for k in attrs.keys() if str(k) not in KNOWN_ATTRS)
        if unknown:
            return f"kernel {gvar.name_hint!r} has launch attributes {unknown} the lean launcher does not make"
        tags = sorted(str(t) for t in (attrs["tirx.kernel_launch_params"] if "tirx.kernel_launch_params" in attrs
                                       else []) if str(t) not in KNOWN_LAUNCH_TAGS)
        if tags:
            return f"kernel {gvar.name_hint!r} has launch parameters {tags} the lean launcher does not make"
    return None


def _arch(kernel: Any) -> str:
    target = getattr(kernel, "target", None)
    attrs = getattr(target, "attrs", None)
    if attrs is not None and "arch" in attrs:
        return str(attrs["arch"])
    if isinstance(target, dict) and "arch" in target:
        return str(target["arch"])
    raise ValueError(f"kernel target {target!r} names no CUDA arch (compile with target={{'kind': 'cuda', "
                     "'arch': 'sm_90a'}} or 'auto' on a GPU)")


def describe_kernel(kernel: Any) -> dict[str, Any]:
    """The launch metadata of a compiled TileLang ``kernel``, in the shape of an AOT bundle
    entry (:mod:`tilescale_lang.aot.launch_info`): ``id``, ``params``, ``dynamic_vars``,
    ``launches`` and ``unsupported`` (why the lean launcher cannot launch it itself, or None).

    The PrimFunc is lowered again (the kernel keeps only compiled modules; no nvcc:
    milliseconds for the library's kernels), for the kernel's arch and pass configs.

    Raises:
        launch_info.UnsupportedKernelError: a device kernel takes an argument the metadata
            cannot describe (a TMA descriptor built on the host at each call).
    """
    func = kernel.prim_func
    artifact = launch_info.lower(func, _arch(kernel), dict(getattr(kernel, "pass_configs", None) or {}))
    info = launch_info.describe(func, artifact)
    return {"id": launch_info.symbol_of(func), **info, "unsupported": _unsupported(artifact.device_mod)}


def _names(expr: int | str) -> set[str]:
    if isinstance(expr, int):
        return set()
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)} - {"min", "max"}


def _raw_stream(device_index: int) -> int:
    import torch

    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch's own launchers use
    if getter is not None:
        return int(getter(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


class _Slot:
    """One changing argument: how to check it and which packed values it writes."""

    __slots__ = ("name", "kind", "dtype", "shape", "contiguous", "strides", "device", "targets", "low", "high",
                 "tl_dtype")

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.targets: list[Any] = []  # ctypes values (pointer args; scalars passed as they are)


class LeanLaunch:
    """A kernel with its persistent arguments packed (see the module docstring); made by
    :func:`prepare`.

    Attributes:
        kernel: the TileLang ``JITKernel`` or :class:`~tilescale_lang.aot.AotKernel`.
        changing: the names of the arguments a call takes, in call order.
        positions: their positions among the kernel's parameters.
        lean: whether calls launch through ``cuLaunchKernel`` here (False until the kernel's
            module is known, or for a launch this launcher does not make).
        why_not: why calls go through ``kernel(*args)``, or None when :attr:`lean`.
    """

    def __init__(self, kernel: Any, args: Sequence[Any], changing: Sequence[str]):
        from .aot.loader import AotKernel

        self.kernel = kernel
        self._aot = isinstance(kernel, AotKernel)
        try:
            info = kernel.entry if self._aot else describe_kernel(kernel)
        except launch_info.UnsupportedKernelError as exc:  # e.g. TMA descriptors: TileLang's launcher makes them
            params, dynamic = launch_info.parameters(kernel.prim_func)
            info = {"id": launch_info.symbol_of(kernel.prim_func), "params": params, "dynamic_vars": dynamic,
                    "launches": [], "unsupported": str(exc)}
        launches = kernel.packer.launches if self._aot else info["launches"]
        self._name = info["id"]
        packer = ArgPacker({"id": self._name, "params": info["params"], "dynamic_vars": info["dynamic_vars"],
                            "archs": {"lean": {"launches": launches}}}, "lean")
        args = tuple(args)
        env, pointers = packer.bind(args)  # every check TileLang's launcher makes, once, naming the argument
        packer.check_device(args)
        index = {p["name"]: i for i, p in enumerate(info["params"])}
        names = list(index)
        changing = tuple(names[c] if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < len(names) else c
                         for c in changing)
        unknown = [c for c in changing if c not in index]
        if unknown or len(set(changing)) != len(changing):
            raise ValueError(f"{self._name}: changing must name distinct parameters of {list(index)}, got "
                             f"{list(changing)}")
        self.changing = changing
        self._args = list(args)
        self.positions = tuple(index[c] for c in changing)
        self._env = env
        self._device = next((v.get_device() for v in args if hasattr(v, "get_device") and getattr(v, "is_cuda", False)),
                            None)
        self._slots = [self._slot(info["params"][index[c]], args[index[c]]) for c in changing]
        self._launches = self._pack(launches, pointers, env)
        self._functions: list[Any] | None = None
        self._streams: dict[int, Any] = {}
        self.why_not: str | None = None if self._aot else info.get("unsupported")
        if self.why_not is None and any(launch["cluster"] for launch in launches):
            self.why_not = "a thread-block cluster launch (made by TileLang's launcher)"
        if self.why_not is None:
            self.why_not = _NOT_LOADED
            if not self._aot:  # an AOT kernel loads its module at the first call
                from . import metadata

                self._resolve()
                if self._functions is None:
                    metadata.install_module_hook()
                    metadata.track_kernel(kernel)  # the first launch reports the module

    # ---------------------------------------------------------------- preparation
    def _slot(self, param: dict, example: Any) -> _Slot:
        """A changing argument's checks; a tensor's symbolic sizes stay those of ``example``."""
        slot = _Slot(param["name"], param["kind"])
        if param["kind"] == "buffer":
            if isinstance(example, int):
                raise TypeError(f"{self._name}: changing argument {param['name']!r} must be prepared with a tensor "
                                "(its dtype, shape and device are what later calls are checked against), not an address")
            slot.dtype, slot.shape = example.dtype, tuple(example.shape)
            # TileLang records a contiguous buffer's strides: a contiguous example means "contiguous"
            # (torch's test, which lets a size-1 axis have any stride, as TileLang's launcher does)
            slot.contiguous = param["strides"] is None or bool(example.is_contiguous())
            slot.strides = None if slot.contiguous else tuple(example.stride())
            slot.device = self._device
        else:
            ctype = SCALAR_CTYPES[param["dtype"]]
            slot.tl_dtype = param["dtype"]
            bits = 8 * ctypes.sizeof(ctype)
            signed = not param["dtype"].startswith(("uint", "handle", "bool"))
            slot.low, slot.high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        return slot

    def _pack(self, launches: list[dict], pointers: dict[str, int], env: dict[str, Any]) -> list[list]:
        """Per launch: ``[grid, block, smem, cooperative, values, params, recompute]``; pointer
        values of changing buffers are registered with their slots, expressions over changing
        scalars recomputed per call."""
        changing_scalars = {s.name for s in self._slots if s.kind == "scalar"}
        by_name = {s.name: s for s in self._slots}
        packed = []
        for launch in launches:
            values, recompute = [], []
            for i, arg in enumerate(launch["args"]):
                if arg["kind"] == "pointer":
                    value = ctypes.c_uint64(pointers[arg["param"]])
                    if arg["param"] in by_name:
                        by_name[arg["param"]].targets.append(value)
                else:
                    where = f"{self._name}: {launch['symbol']} argument {i}"
                    value = scalar_value(arg["dtype"], _compiled(str(arg["value"]))(env) if isinstance(arg["value"], str)
                                         else arg["value"], where)
                    if _names(arg["value"]) & changing_scalars:
                        recompute.append((value, _compiled(arg["value"]), arg["dtype"], where))
                values.append(value)
            params = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
            grid = [_compiled(str(g))(env) if isinstance(g, str) else g for g in launch["grid"]]
            block = [_compiled(str(b))(env) if isinstance(b, str) else b for b in launch["block"]]
            if min(grid + block) < 1:
                raise ValueError(f"{self._name}: {launch['symbol']} has an empty launch (grid {grid}, block {block})")
            dims = [(axis, _compiled(e)) for axis, e in enumerate(list(launch["grid"]) + list(launch["block"]))
                    if isinstance(e, str) and _names(e) & changing_scalars]
            packed.append([launch["symbol"], grid + block, int(launch["dynamic_smem"]), bool(launch.get("cooperative")),
                           values, params, recompute, dims])
        return packed

    def _resolve(self) -> None:
        """Find the kernel functions in the loaded module (once it is known)."""
        from tilescale_core import driver

        if self._aot:
            if self.kernel.entry["table"]["needed"] and self.kernel._table is None:
                return  # launch through the AOT kernel: it raises KernelNotInitializedError
            self.kernel.load()
            self._functions = [self.kernel._functions[launch[0]] for launch in self._launches]
            return
        from . import metadata

        modules = metadata.modules(self.kernel)
        if len(modules) != 1:
            return
        drv = driver.driver_module()
        module = drv.CUmodule(modules[0])
        functions = []
        for launch in self._launches:
            fn = driver.call("cuModuleGetFunction", module, launch[0].encode())
            if launch[2] > DEFAULT_SMEM_LIMIT:
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.call("cuFuncSetAttribute", fn, attr, launch[2])
            functions.append(fn)
        self._functions = functions
        self.why_not = None

    # ---------------------------------------------------------------- calls
    @property
    def lean(self) -> bool:
        """Whether calls launch through ``cuLaunchKernel`` here (see the class docstring)."""
        return self._functions is not None

    def _check(self, slot: _Slot, value: Any) -> None:
        """The full check, with messages, for a value the fast test refused."""
        where = f"{self._name}: argument {slot.name!r}"
        if slot.kind == "scalar":
            scalar_value(slot.tl_dtype, value, where)
            return
        if not hasattr(value, "data_ptr"):
            raise TypeError(f"{where} must be a tensor, got {type(value).__name__}")
        if value.dtype != slot.dtype:
            raise TypeError(f"{where} must have dtype {slot.dtype}, got {value.dtype}")
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"{where} must have shape {list(slot.shape)} (as prepared), got {list(value.shape)}")
        if slot.contiguous and not value.is_contiguous():
            raise ValueError(f"{where} must be contiguous")
        if not slot.contiguous and tuple(value.stride()) != slot.strides:
            raise ValueError(f"{where} must have strides {list(slot.strides)} (as prepared), got {list(value.stride())}")
        if slot.device is not None and (not getattr(value, "is_cuda", False) or value.get_device() != slot.device):
            raise ValueError(f"{where} must be on cuda:{slot.device} (as prepared), got {value.device}")

    def __call__(self, *values: Any, stream: int | None = None) -> None:
        """Launch with ``values`` for the :attr:`changing` arguments (in that order), on
        ``stream`` (a raw CUDA stream handle; default the current torch stream of the
        prepared device).

        Raises:
            TypeError / ValueError: a value that does not fit what was prepared, naming it.
            tilescale_core.CudaError: the launch failed.
        """
        slots = self._slots
        if len(values) != len(slots):
            raise TypeError(f"{self._name}: takes the changing arguments {list(self.changing)}, got {len(values)} values")
        for slot, value in zip(slots, values):
            if slot.kind == "buffer":
                if not (value.dtype is slot.dtype and value.shape == slot.shape and (
                        value.is_contiguous() if slot.contiguous else value.stride() == slot.strides)
                        and (slot.device is None or value.get_device() == slot.device)):
                    self._check(slot, value)
                ptr = value.data_ptr()
                for target in slot.targets:
                    target.value = ptr
            else:
                if isinstance(value, bool) or not isinstance(value, int) or not slot.low <= value <= slot.high:
                    if slot.tl_dtype.startswith(("float", "bfloat")):
                        scalar_value(slot.tl_dtype, value, slot.name)
                    else:
                        self._check(slot, value)
                self._env[slot.name] = value
        if self._functions is None:
            self._through_kernel(values, stream)
            return
        self._launch(stream)

    def _through_kernel(self, values: tuple, stream: int | None) -> None:
        """A call through ``kernel(*args)`` (see :attr:`why_not`); afterwards the lean path
        is taken when the module has become known."""
        for i, value in zip(self.positions, values):
            self._args[i] = value
        if self._aot:
            self.kernel(*self._args, stream=stream)
        elif stream is None:
            self.kernel(*self._args)
        else:
            import torch

            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                self.kernel(*self._args)
        if self.why_not == _NOT_LOADED:
            self._resolve()

    def _launch(self, stream: int | None) -> None:
        from tilescale_core import driver

        drv = driver.driver_module()
        if stream is None:
            stream = _raw_stream(self._device if self._device is not None else 0)
        handle = self._streams.get(stream)
        if handle is None:
            if len(self._streams) >= 64:
                self._streams.clear()
            handle = self._streams[stream] = drv.CUstream(stream)
        env = self._env
        for fn, (symbol, dims, smem, cooperative, _values, params, recompute, dyn) in zip(self._functions, self._launches):
            for value, expr, dtype, where in recompute:
                value.value = scalar_value(dtype, expr(env), where).value
            for axis, expr in dyn:
                dims[axis] = expr(env)
            if cooperative:
                err, = drv.cuLaunchCooperativeKernel(fn, *dims, smem, handle, ctypes.addressof(params))
            else:
                err, = drv.cuLaunchKernel(fn, *dims, smem, handle, ctypes.addressof(params), 0)
            if err != drv.CUresult.CUDA_SUCCESS:
                driver.check((err,), f"cuLaunchKernel({symbol})")


def prepare(kernel: Any, args: Sequence[Any], changing: Sequence[str] = ()) -> LeanLaunch:
    """A :class:`LeanLaunch` of ``kernel`` with ``args`` (every PrimFunc parameter, in order:
    the persistent buffers and scalars as they will stay, an example of each changing one).

    Args:
        kernel: a compiled TileLang ``JITKernel`` (``tvm_ffi`` backend) or an
            :class:`~tilescale_lang.aot.AotKernel`.
        args: the full argument list, checked here as TileLang's launcher checks it.
        changing: the parameters a call passes, by name or position (tensors keep the
            prepared dtype, shape, contiguity and device; scalars stay in their dtype's range).

    Raises:
        TypeError / ValueError: an argument that does not fit the kernel, or ``changing``
            naming no parameter, naming it.
        launch_info.UnsupportedKernelError: a kernel argument built on the host per call.
    """
    return LeanLaunch(kernel, args, changing)
