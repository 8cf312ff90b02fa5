"""How the ops launch their kernels: through a lean launcher (:mod:`tilescale_lang.lean`) per
kernel, prepared at the first call."""

from __future__ import annotations

from operator import is_
from typing import Any, Sequence

import torch

__all__ = ["launch", "prepared_launch", "kept_view"]

#: Prepared launchers an instance keeps at most (one per kernel it launches).
MAX_PREPARED = 8


def _key(value: Any) -> Any:
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _sized_key(value: Any) -> Any:
    return (value.data_ptr(), value.shape) if isinstance(value, torch.Tensor) else value


def launch(prepared: dict, kernel: Any, args: tuple, changing: Sequence[int]) -> None:
    """Launch ``kernel`` with ``args`` (every parameter, in order) on the current stream.

    ``prepared`` is the calling instance's cache. A launcher is prepared (one full check of
    every argument) at the first call; later calls pack only the ``changing`` arguments (their
    symbolic sizes may change from call to call; their dtype, contiguity and device are the
    calling op's checks: :meth:`~tilescale_lang.lean.LeanLaunch.trusted`), after checking that
    every other argument is the prepared one (the same object, or a tensor with the same
    address, and shape where it sizes the kernel; a scalar's value); when one is not, the
    launcher is prepared again. Until the kernel's module is
    loaded (its first launch) the call goes through TileLang's launcher, and so does every
    call of a kernel that is not a ``tvm_ffi`` JITKernel (another execution backend, or a
    test's stand-in).
    """
    if getattr(kernel, "execution_backend", None) != "tvm_ffi":
        kernel(*args)
        return
    entry = prepared.get(id(kernel))
    if entry is not None and (entry[0].kernel is not kernel or not (
            all(map(is_, map(args.__getitem__, entry[1]), entry[2]))  # the same objects (C-level loops)
            or all(key(args[i]) == fixed for i, key, fixed in entry[3]))):
        entry = None
    if entry is None:
        from tilescale_lang.lean import prepare  # here: the steady-state call pays no import statement

        if len(prepared) >= MAX_PREPARED:
            prepared.clear()
        lean = prepare(kernel, args, changing)
        fixed = [i for i in range(len(args)) if i not in lean.positions]
        keys = [(i, _sized_key if i in lean.sized_positions else _key) for i in fixed]
        entry = prepared[id(kernel)] = (lean, fixed, [args[i] for i in fixed],
                                        [(i, key, key(args[i])) for i, key in keys])
    entry[0].trusted(*map(args.__getitem__, changing))  # the op checked its tensors before


def prepared_launch(prepared: dict, kernel: Any):
    """The lean launcher (:class:`~tilescale_lang.lean.LeanLaunch`) that :func:`launch`
    prepared for ``kernel`` in the instance cache ``prepared``; ``KeyError`` naming the kernel
    when none was (no call yet, or not a ``tvm_ffi`` kernel)."""
    entry = prepared.get(id(kernel))
    if entry is None:
        raise KeyError(f"no lean launcher prepared for kernel {getattr(kernel, 'name', kernel)!r}: call the op once "
                       "with lean_launch = True first")
    return entry[0]


def kept_view(op: Any, attr: str, tensor: torch.Tensor, make) -> Any:
    """``make(tensor)`` (a view an op's kernel takes), kept in ``op``'s attribute ``attr`` for
    the next call that passes the same tensor (the same object at the same address): building
    a view costs host time at every call. The op lists ``attr`` in its ``_BUFFERS``
    (``close()`` drops it)."""
    kept = op.__dict__.get(attr)
    if kept is not None and kept[0] is tensor and kept[1] == tensor.data_ptr():
        return kept[2]
    view = make(tensor)
    setattr(op, attr, (tensor, tensor.data_ptr(), view))
    return view

