"""How the ops launch their kernels: through a lean launcher (:mod:`tilescale_lang.lean`) per
kernel and shape of the changing arguments, prepared at the first call."""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["launch"]

#: Prepared launchers an instance keeps at most (shapes of the changing arguments x kernels).
MAX_PREPARED = 8


def _key(value: Any) -> Any:
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def launch(prepared: dict, kernel: Any, args: tuple, changing: Sequence[int]) -> None:
    """Launch ``kernel`` with ``args`` (every parameter, in order) on the current stream.

    ``prepared`` is the calling instance's cache. A launcher is prepared (one full check of
    every argument) at the first call with these shapes of the ``changing`` arguments; later
    calls pack only those, after checking that every other argument is the prepared one (a
    tensor's address, a scalar's value); when one is not, the launcher is prepared again.
    Until the kernel's module is loaded (its first launch) the call goes through TileLang's
    launcher, and so does every call of a kernel that is not a ``tvm_ffi`` JITKernel
    (another execution backend, or a test's stand-in).
    """
    if getattr(kernel, "execution_backend", None) != "tvm_ffi":
        kernel(*args)
        return
    from tilescale_lang.lean import prepare

    key = (id(kernel), tuple(args[i].shape if isinstance(args[i], torch.Tensor) else None for i in changing))
    entry = prepared.get(key)
    if entry is None or entry[0].kernel is not kernel or not all(_key(args[i]) == fixed for i, fixed in entry[1]):
        if len(prepared) >= MAX_PREPARED:
            prepared.clear()
        lean = prepare(kernel, args, changing)
        entry = prepared[key] = (lean, [(i, _key(a)) for i, a in enumerate(args) if i not in lean.positions])
    entry[0](*[args[i] for i in changing])
