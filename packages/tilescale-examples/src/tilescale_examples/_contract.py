"""The machinery behind the call contract of the symmetric ops (docs/architecture.md, "Call
contract"), re-exported by :mod:`tilescale_examples.base`:

* the 0.1.0 spellings that keep working through 0.1.x with an :class:`OldSpellingWarning` (a
  ``FutureWarning``) naming the new one: :func:`accepts_0_1_init` (constructors),
  :func:`accepts_0_1_out` (a positional ``out`` of a call) and :func:`warn_old_spelling`;
* :class:`RecordingAllocator` and :func:`dry_run_heap_bytes`: ``heap_bytes`` of an op is what
  its constructor allocates on a recording allocator, not a formula beside it.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import warnings
from typing import Callable, Optional, Sequence

import torch

from tilescale_examples._checks import DEFAULT_MAX_BLOCKS, check_positive_int

__all__ = ["OldSpellingWarning", "warn_old_spelling", "DryRunKernel", "accepts_0_1_init", "accepts_0_1_out",
           "positional_out",
           "row_shape_0_1", "accepts_0_1_reference", "rank_left_out", "RecordingAllocator",
           "HEAP_ALIGNMENT", "sm_count_of", "dry_run_heap_bytes"]

#: Alignment of every symmetric allocation (bytes): tilescale-core's heap rounds each start up to it.
HEAP_ALIGNMENT = 256


class OldSpellingWarning(FutureWarning):
    """A 0.1.0 spelling of a symmetric op's arguments was used (it works through 0.1.x); the
    message names the new spelling."""


def warn_old_spelling(old: str, new: str) -> None:
    """Warn (:class:`OldSpellingWarning`) that ``old`` is the 0.1.0 spelling of ``new``,
    attributed to the first caller outside :mod:`tilescale_examples`."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tilescale_examples."):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"{old} is the 0.1.0 spelling (it works through 0.1.x); use {new}", OldSpellingWarning,
                  stacklevel=level)


def _missing(name: str, positional: Sequence[str], args: tuple, kwargs: dict) -> bool:
    return name not in kwargs and (name not in positional or positional.index(name) >= len(args))


def accepts_0_1_init(*, positional: Sequence[str] = (), renamed: Optional[dict] = None,
                     defaults: Optional[dict] = None, translate: Optional[Callable] = None):
    """Decorator of an op's ``__init__`` (whose signature is the contract's): calls in the
    0.1.0 spellings still work, each with an :class:`OldSpellingWarning`.

    Args:
        positional: 0.1.0 names of the positional parameters after the contract's positional
            ones (``("world_size",)``): passed positionally, they become keywords.
        renamed: ``{0.1.0 keyword: contract keyword}`` (``{"engine": "algorithm"}``).
        defaults: ``{parameter: 0.1.0 default}`` for parameters the contract requires
            (``{"dtype": torch.float16}``): left out, they take the old default.
        translate: ``translate(owner, args, kwargs) -> (args, kwargs)``, run first, for old
            spellings whose meaning changed (it warns itself).

    ``inspect.signature`` of the class shows the contract's signature (``functools.wraps``)."""
    renamed, defaults = dict(renamed or {}), dict(defaults or {})

    def decorate(init):
        params = list(inspect.signature(init).parameters.values())[1:]
        names = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            owner = type(self).__name__
            if translate is not None:
                args, kwargs = translate(owner, args, kwargs)
            if len(args) > len(names):
                extra, args = args[len(names):], args[:len(names)]
                if len(extra) > len(positional):
                    raise TypeError(f"{owner}() takes {len(names)} positional arguments after self; "
                                    f"pass the others by keyword")
                for name, value in zip(positional, extra):
                    new = renamed.get(name, name)
                    if new in kwargs:
                        raise TypeError(f"{owner}() got multiple values for argument {new!r}")
                    warn_old_spelling(f"{owner}(..., {name}) passed positionally", f"{new}=... (keyword-only)")
                    kwargs[new] = value
            for old, new in renamed.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{owner}() got both {old}= and {new}=; pass {new}= only")
                    warn_old_spelling(f"{owner}({old}=...)", f"{new}=...")
                    kwargs[new] = kwargs.pop(old)
            for name, value in defaults.items():
                if _missing(name, names, args, kwargs):
                    warn_old_spelling(f"{owner}() without {name} (0.1.0 default {value!r})",
                                      f"{name}={value!r}: {name} is required")
                    kwargs[name] = value
            init(self, *args, **kwargs)

        return __init__

    return decorate


def row_shape_0_1(owner: str, args: tuple, kwargs: dict) -> tuple:
    """``translate`` of :func:`accepts_0_1_init` for the ops whose input holds one row per
    rank (AllToAll, ReduceScatter): in 0.1.0 their shape argument was the row
    (``shard_shape``); ``shape`` is now the whole input ``(world_size, *row)``. A
    ``shard_shape=`` keyword, or a positional shape that is not ``(world_size, *row)``, is
    taken as the 0.1.0 row (with a warning)."""
    from tilescale_examples._checks import check_shape

    allocator = args[0] if args else kwargs.get("allocator")
    world = args[3] if len(args) > 3 else kwargs.get("world_size")  # positional: 0.1.0 as well
    world = getattr(allocator, "num_ranks", None) if world is None else world
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        world = None  # the constructor's checks name the bad argument
    if "shard_shape" in kwargs:
        if "shape" in kwargs or len(args) > 1:
            raise TypeError(f"{owner}() got both shard_shape= and shape=; pass shape=(world_size, *row) only")
        row = check_shape(kwargs.pop("shard_shape"), "shard_shape")
        if world is not None:
            warn_old_spelling(f"{owner}(shard_shape={row})", f"shape=(world_size, *shard_shape) = {(world, *row)}")
            kwargs["shape"] = (world, *row)
        else:
            kwargs["shape"] = row
    elif len(args) > 1 and world is not None:
        try:
            dims = check_shape(args[1])
        except (TypeError, ValueError):
            return args, kwargs
        if len(dims) < 2 or dims[0] != world:
            warn_old_spelling(f"{owner}(allocator, {args[1]!r}, ...) with the row shape",
                              f"shape=(world_size, *row) = {(world, *dims)}")
            args = (args[0], (world, *dims)) + tuple(args[2:])
    return args, kwargs


def accepts_0_1_out(inputs: int):
    """Decorator of an op's ``__call__(self, <inputs inputs>, *out_0_1, out=None)`` whose
    body starts with ``if out_0_1: out = positional_out(self, inputs, out_0_1, out)``:
    ``out`` passed positionally (0.1.0) still works, with an
    :class:`OldSpellingWarning`. The decorator only hides ``out_0_1`` from the signature
    (``inspect.signature``, ``help``, the docs) and adds no call of its own, so a call in the
    contract's spelling pays nothing for the old one (the ops' repeated calls take a few
    microseconds of host time: docs/launch.md).

    Raises:
        TypeError: at decoration, a ``__call__`` without ``*out_0_1`` right after its
            ``inputs`` inputs.
    """

    def decorate(call):
        signature = inspect.signature(call)
        params = list(signature.parameters.values())
        legacy = params[inputs + 1] if len(params) > inputs + 1 else None
        if legacy is None or legacy.name != "out_0_1" or legacy.kind is not inspect.Parameter.VAR_POSITIONAL:
            raise TypeError(f"accepts_0_1_out({inputs}): {call.__qualname__} must take {inputs} input(s), then "
                            "*out_0_1")
        call.__signature__ = signature.replace(parameters=[p for p in params if p is not legacy])
        return call

    return decorate


def positional_out(op, inputs: int, positional: tuple, out):
    """The ``out`` of a call of ``op`` (decorated with :func:`accepts_0_1_out`) that passed
    the arguments ``positional`` after its ``inputs`` inputs (one: ``out`` in the 0.1.0
    spelling, which warns) and ``out`` by keyword (None if not).

    Raises:
        TypeError: both given, or more than one extra positional argument.
    """
    if out is not None or len(positional) != 1:
        raise TypeError(f"{type(op).__name__}() takes {inputs} input(s) and out= by keyword")
    warn_old_spelling(f"{type(op).__name__}(..., out) passed positionally", "out=... (keyword-only)")
    return positional[0]


def accepts_0_1_reference(old: str, translate: Callable):
    """Decorator of a module-level ``torch_reference(inputs, rank)``: ``translate(*args,
    **kwargs)`` returns ``(inputs, rank)`` for a 0.1.0 call form (spelled ``old`` in the
    warning), None for the contract's; the decorated function is the op's
    ``torch_reference`` staticmethod, whose signature it shows."""

    def decorate(reference):
        @functools.wraps(reference)
        def torch_reference(*args, **kwargs):
            legacy = translate(*args, **kwargs)
            if legacy is None:
                return reference(*args, **kwargs)
            warn_old_spelling(old, "torch_reference(inputs, rank)")
            return reference(*legacy)

        torch_reference.__name__ = torch_reference.__qualname__ = "torch_reference"
        return torch_reference

    return decorate


def rank_left_out(*args, **kwargs):
    """The 0.1.0 ``torch_reference(inputs)`` of the ops whose result is the same on every
    rank: ``(inputs, 0)``; None for any other form."""
    if len(args) == 1 and not kwargs:
        return args[0], 0
    if not args and set(kwargs) == {"inputs"}:
        return kwargs["inputs"], 0
    return None


class RecordingAllocator:
    """A stand-in allocator for dry runs of a constructor: every symmetric allocation is
    recorded (``records``: ``(nbytes, alignment)``, as tilescale-core's heap would place it)
    and answered with a ``meta`` tensor, so nothing touches a device and no memory is used.

    The op under construction sees ``dry_run``: it compiles nothing, binds no table, probes
    no device and waits for no peer. ``sm_count`` stands in for the device's SM count (the
    default grid cap, which sizes the flags)."""

    dry_run = True
    closed = False

    def __init__(self, num_ranks: int, rank: int = 0, sm_count: int = DEFAULT_MAX_BLOCKS):
        self.num_ranks = check_positive_int("world_size", num_ranks)
        self.local_rank = rank
        self.sm_count = check_positive_int("sm_count", sm_count)
        self.device = torch.device("meta")
        self.table = ()
        self.records: list = []
        #: What the op would compile: ``(build, target, pass_configs)``, ``build()`` giving the
        #: ``T.prim_func`` (:func:`~tilescale_examples.testing.precompile.precompile_op` compiles them).
        self.builds: list = []

    def record_build(self, build, target, pass_configs) -> "DryRunKernel":
        """Record a kernel the op would compile (its dry-run compile); the stand-in kernel."""
        self.builds.append((build, target, pass_configs))
        return DryRunKernel()

    def tensor(self, shape, dtype, return_peers: bool = False):
        """Record an allocation of ``shape`` x ``dtype``; a meta tensor (one per rank with
        ``return_peers``)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.records.append((max(nbytes, 1), HEAP_ALIGNMENT))
        local = torch.empty(shape, dtype=dtype, device="meta")
        return [local] * self.num_ranks if return_peers else local

    _allocate_tensor = tensor

    @property
    def heap_bytes(self) -> int:
        """Heap bytes the recorded allocations take, each rounded up to its alignment: an
        upper bound of what they use on a heap whose next allocation starts aligned, exact
        up to the last allocation's rounding."""
        return sum(-(-n // a) * a for n, a in self.records)


class DryRunKernel:
    """What a dry run (:class:`RecordingAllocator`) gets instead of a compiled kernel."""

    def initialize(self, allocator=None, stream=None):
        return self


def sm_count_of(device) -> int:
    """SM count of ``device`` (None: the current CUDA device), or :data:`DEFAULT_MAX_BLOCKS`
    where there is no CUDA device (the grid cap the ops then use)."""
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_MAX_BLOCKS
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_MAX_BLOCKS
    return torch.cuda.get_device_properties(device).multi_processor_count


def dry_run_heap_bytes(cls, args: tuple, kwargs: dict, world_size: int, sm_count: int) -> int:
    """Heap bytes per rank of ``cls(allocator, *args, world_size=world_size, **kwargs)``: the
    constructor run on a :class:`RecordingAllocator` of ``world_size`` ranks."""
    allocator = RecordingAllocator(world_size, sm_count=sm_count)
    cls(allocator, *args, world_size=world_size, **kwargs)
    return allocator.heap_bytes
