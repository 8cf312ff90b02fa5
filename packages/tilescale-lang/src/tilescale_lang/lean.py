"""The lean launcher: a kernel's launches prepared once, only the changing arguments packed per call.

TileLang's launcher checks and converts every argument of every call (DLPack conversion,
dtype, shape and device checks in the generated host function). An op instance calls the same
kernel with the same persistent buffers (flags, state, symmetric buffers) thousands of times;
only a few arguments change (the caller's input and output). :func:`prepare` does the full
check once, packs the kernel parameters once, and returns a :class:`LeanLaunch` whose call
takes only the changing arguments, checks them cheaply (dtype, shape, contiguity and device as
prepared) and launches with ``cuLaunchKernel`` on the current torch stream (every launch of a
call in one call of the :mod:`~tilescale_lang.launch_records` C helper where the machine has a
C compiler, else one ctypes call of the driver per launch)::

    launch = tilescale_lang.lean.prepare(kernel, (x, out, flags, state, 4), changing=("x", "out"))
    launch(x2, out2)          # same checks as TileLang's for these two, one driver call

It launches the function of the module TileLang itself loaded (the one whose ``meta_data``
table ``kernel.initialize`` binds), so it shares that module's table and needs no second copy
of the code. Until that module is known (a ``tvm_ffi`` kernel loads it at its first launch),
and for launches it cannot make (a thread-block cluster, a launch attribute it does not know, a
TMA descriptor over a changing argument), it calls ``kernel(*args)`` instead: the same result at TileLang's cost (:attr:`LeanLaunch.lean`
tells which path runs, :attr:`LeanLaunch.why_not` why). An :class:`~tilescale_lang.aot.AotKernel`
is prepared the same way.

A kernel whose host code encodes tiled TMA descriptors (TileLang's GEMMs) has them encoded
here once, at preparation, with ``cuTensorMapEncodeTiled`` and the arguments TileLang's host
code passes (:mod:`~tilescale_lang.aot.launch_info`): the buffers they describe must stay
where they were prepared, so such a launch is lean only while no changing argument reaches a
descriptor (a frozen launch with nothing changing, the repeated call of the library's GEMMs).

Launches are stream-ordered and capturable in CUDA graphs like any ``cuLaunchKernel``.
"""

from __future__ import annotations

import ast
import ctypes
import logging
from typing import Any, Sequence

from .aot import launch_info
from .aot import packing
from .aot.packing import ArgPacker, _compiled, evaluate, is_float_dtype, scalar_range, scalar_value
from .launch_records import CAPTURING
from .lean_describe import describe_kernel
from .lean_driver import _capture_query_address, _current_stream_getter, _driver_addresses, _driver_calls

__all__ = ["LeanLaunch", "FrozenLaunch", "describe_kernel", "prepare", "freeze"]

log = logging.getLogger("tilescale_lang.lean")
_NOT_LOADED = "the kernel's module is not loaded yet (it loads at the first launch)"
_LOADED_UNSEEN = ("the kernel's module loaded where TileScale could not see it (a kernel launched before TileScale "
                  "tracked it: compiled before the extension loaded)")
#: Dynamic shared memory above this needs ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``.
DEFAULT_SMEM_LIMIT = 48 * 1024


def _names(expr: int | str) -> set[str]:
    if isinstance(expr, int):
        return set()
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)} - {"min", "max"}


def _fixed_vars(params: list[dict], args: Sequence[Any], changing: set[str]) -> dict[str, int]:
    """The symbolic sizes the arguments outside ``changing`` bind (from their shapes)."""
    fixed: dict[str, int] = {}
    for param, value in zip(params, args):
        if param["kind"] == "buffer" and param["name"] not in changing and hasattr(value, "shape"):
            for d, n in zip(param["shape"], value.shape):
                if isinstance(d, str) and d.isidentifier():
                    fixed[d] = int(n)
    return fixed


def _raw_stream(device_index: int) -> int:
    """The current torch stream's handle on ``device_index``."""
    return _current_stream_getter()(device_index)


class _Slot:
    """One changing argument: how to check it and which packed values it writes."""

    __slots__ = ("name", "kind", "dtype", "shape", "contiguous", "strides", "device", "targets", "low", "high",
                 "tl_dtype", "free", "fixed_axes")

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.targets: list[Any] = []  # ctypes values (pointer args; scalars passed as they are)
        self.free: list[tuple[int, str]] = []  # (axis, symbolic variable) bound by this argument at each call
        self.fixed_axes: list[tuple[int, int]] = []  # (axis, size) of the other axes, when ``free``


class LeanLaunch:
    """A kernel with its persistent arguments packed (see the module docstring); made by
    :func:`prepare`.

    Attributes:
        kernel: the TileLang ``JITKernel`` or :class:`~tilescale_lang.aot.AotKernel`.
        changing: the names of the arguments a call takes, in call order.
        positions: their positions among the kernel's parameters.
        sized_positions: positions of the other (prepared) tensors whose shapes bind
            symbolic sizes: a caller reusing this launcher with other tensors there must
            prepare again when their shapes differ.
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
        fixed = _fixed_vars(info["params"], args, set(changing))
        self.sized_positions = tuple(
            i for i, p in enumerate(info["params"]) if p["kind"] == "buffer" and p["name"] not in changing
            and any(isinstance(d, str) for d in p["shape"]))
        self._slots = [self._slot(info["params"][index[c]], args[index[c]], fixed) for c in changing]
        self._moving_descriptor: str | None = None  # a TMA descriptor over a changing argument (_pack)
        self._launches = self._pack(launches, pointers, env)
        self._functions: list[Any] | None = None  # CUfunction handles (ints), in launch order
        self._records: Any = None  # launch_records.LaunchRecord array, once the functions are known
        self._failed = ctypes.c_int(-1)  # the C helper's index of a failed launch
        self._failed_ref = ctypes.byref(self._failed)
        self.why_not: str | None = None if self._aot else info.get("unsupported")
        if self.why_not is None:
            self.why_not = self._moving_descriptor
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
    def _slot(self, param: dict, example: Any, fixed: dict[str, int]) -> _Slot:
        """A changing argument's checks. A tensor's symbolic sizes that no fixed argument
        binds (``fixed``) are bound at each call (the launch recomputed from them); the
        others stay those of ``example``."""
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
            shape = param["shape"]
            if slot.contiguous and all(isinstance(d, int) or d.isidentifier() for d in shape):
                slot.free = [(axis, d) for axis, d in enumerate(shape) if isinstance(d, str) and d not in fixed]
                slot.fixed_axes = [(axis, int(n)) for axis, n in enumerate(slot.shape) if (axis, shape[axis]) not in
                                   slot.free]
        else:
            slot.tl_dtype = param["dtype"]
            slot.low, slot.high = scalar_range(param["dtype"])
        return slot

    def _pack(self, launches: list[dict], pointers: dict[str, int], env: dict[str, Any]) -> list[list]:
        """Per launch: ``[symbol, grid + block, smem, cooperative, values, params, recompute,
        dims, params address]``; pointer values of changing buffers are registered with their
        slots; ``recompute`` (scalar arguments: ``(value, expression, dtype, name, low,
        high)``, the range of an integer dtype or None) and ``dims`` (grid or block extents)
        are the expressions over changing scalars and sizes, evaluated again at each call."""
        changing_scalars = {s.name for s in self._slots if s.kind == "scalar"} | {
            name for s in self._slots for _, name in s.free}
        by_name = {s.name: s for s in self._slots}
        packed = []
        for launch in launches:
            values, recompute = [], []
            for i, arg in enumerate(launch["args"]):
                if arg["kind"] == "pointer":
                    value = ctypes.c_uint64(pointers[arg["param"]])
                    if arg["param"] in by_name:
                        by_name[arg["param"]].targets.append(value)
                elif arg["kind"] == "tensormap":
                    value = self._descriptor(arg, pointers, env, by_name, changing_scalars)
                else:
                    where = f"{self._name}: {launch['symbol']} argument {i}"
                    value = scalar_value(arg["dtype"], evaluate(arg["value"], env), where)
                    if _names(arg["value"]) & changing_scalars:
                        low, high = (None, None) if is_float_dtype(arg["dtype"]) else scalar_range(arg["dtype"])
                        recompute.append((value, _compiled(arg["value"]), arg["dtype"], where, low, high))
                values.append(value)
            params = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
            grid = [evaluate(g, env) for g in launch["grid"]]
            block = [evaluate(b, env) for b in launch["block"]]
            if min(grid + block) < 1:
                raise ValueError(f"{self._name}: {launch['symbol']} has an empty launch (grid {grid}, block {block})")
            dims = [(axis, _compiled(e)) for axis, e in enumerate(list(launch["grid"]) + list(launch["block"]))
                    if isinstance(e, str) and _names(e) & changing_scalars]
            packed.append([launch["symbol"], grid + block, int(launch["dynamic_smem"]), bool(launch.get("cooperative")),
                           values, params, recompute, dims, ctypes.addressof(params)])
        return packed

    def _descriptor(self, arg: dict, pointers: dict[str, int], env: dict[str, Any], by_name: dict,
                    changing_scalars: set[str]) -> Any:
        """A ``tensormap`` argument's descriptor, encoded now (:func:`~tilescale_lang.aot.packing.tensormap_value`);
        over a changing buffer, or with a size a changing argument binds, a zeroed placeholder and
        :attr:`why_not` says why calls take TileLang's launcher (which encodes it at each call)."""
        names = set().union(*(_names(e) for key in ("dims", "strides", "box", "element_strides") for e in arg[key]))
        if arg["param"] in by_name or names & changing_scalars:
            self._moving_descriptor = (f"a TMA descriptor over changing argument {arg['param']!r} (encoded by "
                                       "TileLang's launcher at each call)")
            return packing.tensormap_buffer()
        return packing.tensormap_value(arg, pointers[arg["param"]], env)

    def _resolve(self) -> None:
        """Find the kernel functions in the loaded module (once it is known)."""
        from tilescale_core import driver

        if self._aot:
            if self.kernel.entry["table"]["needed"] and self.kernel._table is None:
                return  # launch through the AOT kernel: it raises KernelNotInitializedError
            self.kernel.load()
            self._functions = [int(self.kernel._functions[launch[0]]) for launch in self._launches]
            self._records = self._make_records()
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
            functions.append(int(fn))
        self._functions = functions
        self._records = self._make_records()
        self.why_not = None

    def _make_records(self) -> Any:
        """The launches as :mod:`~tilescale_lang.launch_records` records (launched by its C
        helper in one call), or None where the helper or the driver's entry points are not
        there (each launch then calls the driver through ctypes)."""
        from . import launch_records

        run = launch_records.helper()
        entry = _driver_addresses()
        if run is None or any(entry[1 if launch[3] else 0] is None for launch in self._launches):
            return None
        records = launch_records.make_records(len(self._launches))
        for record, fn, (_, dims, smem, cooperative, _v, _p, _r, _d, address) in zip(records, self._functions,
                                                                                        self._launches):
            record.launch, record.function = entry[1 if cooperative else 0], fn
            record.dims[:] = dims
            record.shared_bytes, record.cooperative, record.params = smem, int(cooperative), address
        self._run, self._records_address = run, ctypes.addressof(records)
        # nothing to recompute per call (no changing scalar or size reaches an argument or the grid)
        self._records_static = not any(launch[6] or launch[7] for launch in self._launches)
        return records

    def frozen(self) -> FrozenLaunch | None:
        """This launcher's launches with the argument values of its last call (or of
        :func:`prepare`), copied into a :class:`FrozenLaunch` (later calls of this launcher
        do not change it); None where calls do not launch through the launch records' C
        helper (not :attr:`lean` yet, or no helper), or where the driver gives no
        ``cuStreamIsCapturing`` (a frozen launch never launches into a capture)."""
        if self._functions is None or self._records is None:
            return None
        query = _capture_query_address()
        return None if query is None else FrozenLaunch(self, query)

    # ---------------------------------------------------------------- calls
    @property
    def lean(self) -> bool:
        """Whether calls launch through ``cuLaunchKernel`` here (see the class docstring)."""
        return self._functions is not None

    def _bind_free(self, slot: _Slot, value: Any, bound: dict[str, int], check: bool = True) -> dict[str, int]:
        """Check a tensor whose shape binds symbolic sizes (``check``: also its dtype,
        contiguity and device); returns ``bound`` with them."""
        shape = getattr(value, "shape", None)
        if not (shape is not None and len(shape) == len(slot.shape) and all(shape[a] == n for a, n in slot.fixed_axes)
                and (not check or getattr(value, "dtype", None) is slot.dtype and value.is_contiguous()
                     and (slot.device is None or value.get_device() == slot.device))):
            self._check(slot, value, free=True)
        for axis, name in slot.free:
            have = int(shape[axis])
            if bound.setdefault(name, have) != have:
                raise ValueError(f"{self._name}: argument {slot.name!r} shape[{axis}] is {have} but {name} is "
                                 f"{bound[name]} from an earlier argument of this call")
        return bound

    def _check(self, slot: _Slot, value: Any, free: bool = False) -> None:
        """The full check, with messages, for a value the fast test refused."""
        where = f"{self._name}: argument {slot.name!r}"
        if slot.kind == "scalar":
            scalar_value(slot.tl_dtype, value, where)
            return
        if not hasattr(value, "data_ptr"):
            raise TypeError(f"{where} must be a tensor, got {type(value).__name__}")
        if value.dtype != slot.dtype:
            raise TypeError(f"{where} must have dtype {slot.dtype}, got {value.dtype}")
        shape = tuple(value.shape)
        if free:
            want = [dict(slot.free).get(a, n) for a, n in enumerate(slot.shape)]
            if len(shape) != len(want) or any(shape[a] != n for a, n in slot.fixed_axes):
                raise ValueError(f"{where} must have shape {want}, got {list(shape)}")
        elif shape != slot.shape:
            raise ValueError(f"{where} must have shape {list(slot.shape)} (as prepared), got {list(shape)}")
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
        self._call(values, stream, check=True)

    def trusted(self, *values: Any, stream: int | None = None) -> None:
        """:meth:`__call__` for a caller that has checked the tensors' dtype, contiguity and
        device itself (an op checking its inputs): only their shapes are checked (and bind
        the symbolic sizes), and scalars' ranges."""
        self._call(values, stream, check=False)

    def _call(self, values: tuple, stream: int | None, check: bool) -> None:
        self._fill(values, check)
        if self._functions is None:
            self._through_kernel(values, stream)
        else:
            self._launch(stream)

    def _fill(self, values: tuple, check: bool) -> None:
        """Check ``values`` (``check``: fully, else shapes and ranges) and write them into the
        packed parameters."""
        slots = self._slots
        if len(values) != len(slots):
            raise TypeError(f"{self._name}: takes the changing arguments {list(self.changing)}, got {len(values)} values")
        bound: dict[str, int] | None = None
        for slot, value in zip(slots, values):
            if slot.kind == "buffer":
                if slot.free:
                    bound = self._bind_free(slot, value, {} if bound is None else bound, check)
                elif not (value.shape == slot.shape and (not check or value.dtype is slot.dtype and (
                        value.is_contiguous() if slot.contiguous else value.stride() == slot.strides)
                        and (slot.device is None or value.get_device() == slot.device))):
                    self._check(slot, value)
                ptr = value.data_ptr()
                for target in slot.targets:
                    target.value = ptr
            else:
                if isinstance(value, bool) or not isinstance(value, int) or not slot.low <= value <= slot.high:
                    self._check(slot, value)  # floats, and the message for a bad value
                self._env[slot.name] = value
        if bound:
            self._env.update(bound)

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
            if self._functions is None and not self._aot:  # launched, tracked, and still no module known
                from . import metadata

                count = len(metadata.modules(self.kernel))
                self.why_not = _LOADED_UNSEEN if not count else (
                    f"the kernel's module is loaded in {count} CUDA contexts (the lean launcher launches in one)")

    def _launch(self, stream: int | None) -> None:
        """The launches on ``stream`` (default the current torch stream): the scalars and
        grid extents that depend on changing arguments recomputed, then one call of the C
        helper for them all (:attr:`_records`), else one ctypes call of the driver each."""
        if stream is None:
            stream = _raw_stream(self._device if self._device is not None else 0)
        records = self._records
        if records is None or not self._records_static:  # records with nothing to recompute: no loop
            self._recompute_and_launch(stream, records)
        if records is not None:
            err = self._run(self._records_address, len(records), stream, self._failed_ref)
            if err:
                _launch_failed(err, self._launches[self._failed.value][0])

    def _recompute_and_launch(self, stream: int, records: Any) -> None:
        """Per launch: the scalars and grid extents that depend on changing arguments
        recomputed (into ``records`` too, when given); without ``records``, the launch itself,
        one ctypes call of the driver."""
        env = self._env
        calls = _driver_calls() if records is None else None
        for i, (fn, (symbol, dims, smem, cooperative, _values, _params, recompute, dyn, address)) in enumerate(zip(
                self._functions, self._launches)):
            for value, expr, dtype, where, low, high in recompute:
                v = expr(env)
                if low is not None and type(v) is int and low <= v <= high:
                    value.value = v  # an int in range: stored as it is (the common case, no new ctypes object)
                else:
                    value.value = scalar_value(dtype, v, where).value
            for axis, expr in dyn:
                dims[axis] = expr(env)
                if dims[axis] < 1:
                    raise ValueError(f"{self._name}: {symbol} would launch an empty grid {dims[:3]} (block {dims[3:]})")
                if records is not None:
                    records[i].dims[axis] = dims[axis]
            if records is None:
                err = calls[1 if cooperative else 0](fn, *dims, smem, stream, address)
                if err:
                    _launch_failed(err, symbol)


class FrozenLaunch:
    """A kernel's launches with every argument fixed, or all but the addresses of some
    buffers: one call of the launch records' C helper
    (:mod:`~tilescale_lang.launch_records`) on the current stream, and nothing else.

    Made by :meth:`LeanLaunch.frozen` (or :func:`freeze`), it holds its own copies of the
    packed parameters (the tensors' addresses as integers, never the tensors) and of the
    records, and the kernel (whose module owns the functions). The changing buffers of the
    launcher it was frozen from (:attr:`LeanLaunch.changing`, buffers only) may be given new
    addresses at each launch; nothing else changes. A caller that launches it again must
    know that the memory at those addresses is laid out as the frozen arguments were (the
    repeated-call path of the library's ops checks each tensor's shape, strides, dtype and
    address first). Stream-ordered like any launch, but never captured: on a stream that is
    capturing a CUDA graph it launches nothing and says so (its fixed arguments, the heap
    table bound at its launch among them, are an eager call's; the helper asks the driver's
    ``cuStreamIsCapturing`` in the same C call).
    """

    __slots__ = ("kernel", "_run", "_call", "_call_ref", "_device", "_keep", "_stream_of", "_symbols", "_targets")

    def __init__(self, launch: LeanLaunch, capture_query: int):
        from . import launch_records

        scalars = [slot.name for slot in launch._slots if slot.kind != "buffer"]
        if scalars:
            raise ValueError(f"{launch._name}: a frozen launch changes buffer addresses only, not the scalars "
                             f"{scalars}")
        self.kernel = launch.kernel
        records = launch_records.make_records(len(launch._records))
        keep, copies = [records], {}  # the records point at the parameter arrays, which point at the values
        for record, source, entry in zip(records, launch._records, launch._launches):
            values = [packing.value_copy(v) for v in entry[4]]
            copies.update((id(v), c) for v, c in zip(entry[4], values))
            params = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
            keep.append((values, params))
            record.launch, record.function, record.dims[:] = source.launch, source.function, source.dims[:]
            record.shared_bytes, record.cooperative, record.params = (source.shared_bytes, source.cooperative,
                                                                      ctypes.addressof(params))
        self._targets = [[copies[id(v)] for v in slot.targets] for slot in launch._slots]
        self._call = launch_records.LaunchCall(records=ctypes.addressof(records), n=len(records), failed=-1,
                                               is_capturing=capture_query)
        self._call_ref, self._run, self._keep = ctypes.byref(self._call), launch_records.call_helper(), keep
        self._device = launch._device if launch._device is not None else 0
        self._stream_of = _current_stream_getter()
        self._symbols = [entry[0] for entry in launch._launches]

    def __call__(self, *addresses: int, stream: int | None = None) -> bool:
        """Launch on ``stream`` (a raw CUDA stream handle; default the current torch stream
        of the frozen launch's device), with ``addresses`` (ints, in the order of the
        launcher's changing buffers; none: the addresses of the last launch) for the changing
        buffers. Returns True; False, with nothing launched, where the stream is capturing a
        CUDA graph (the caller takes a path that knows about captures).

        Raises:
            tilescale_core.CudaError: the launch failed.
        """
        for targets, address in zip(self._targets, addresses):
            for value in targets:
                value.value = address
        call = self._call
        call.stream = self._stream_of(self._device) if stream is None else stream
        err = self._run(self._call_ref)
        if err:
            if err == CAPTURING:
                return False
            _launch_failed(err, self._symbols[call.failed])
        return True


def freeze(kernel: Any, args: Sequence[Any], changing: Sequence[Any] = ()) -> FrozenLaunch | None:
    """The launches of ``kernel`` with ``args`` (every parameter, in order, checked once as
    TileLang's launcher checks them) as a :class:`FrozenLaunch` whose ``changing`` buffers
    (names or positions, as :func:`prepare` takes them) may move at each launch, or None
    where that cannot be made: not a ``tvm_ffi`` JITKernel, its module not loaded yet (it
    loads at its first launch), a launch the lean launcher does not make, or no C helper
    (:meth:`LeanLaunch.frozen`). The first call for a kernel lowers it for its launch metadata
    (:func:`describe_kernel`: kept in TileLang's cache directory, so once per machine).

    Raises:
        TypeError / ValueError: an argument that does not fit the kernel, or ``changing``
            naming a scalar or no parameter, naming it.
    """
    if getattr(kernel, "execution_backend", None) != "tvm_ffi":
        return None
    return LeanLaunch(kernel, args, changing).frozen()


def _launch_failed(err: int, symbol: str) -> None:
    """Raise the driver's error ``err`` of the launch of ``symbol``."""
    from tilescale_core import driver

    driver.check((driver.driver_module().CUresult(err),), f"cuLaunchKernel({symbol})")


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
