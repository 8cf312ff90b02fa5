"""The module-level ``T.macro`` machinery of the library's kernels: :data:`T`, :func:`macro`
and :class:`Scope`.

Importing this module does not import TileLang: :data:`T` imports ``tilelang.language`` at its
first use and :func:`macro` makes its ``T.macro`` at its first call, both during a kernel build.
"""

# (no `from __future__ import annotations`: TileLang reads the macros' annotations)

import functools
import types

__all__ = ["T", "macro", "Scope", "variable"]


class _TileLang:
    """``tilelang.language``, imported at the first attribute read (a kernel build)."""

    def __getattr__(self, name):
        import tilelang.language

        return getattr(tilelang.language, name)


#: The TileLang language namespace of the module-level macros.
T = _TileLang()


class macro:  # noqa: N801 (used like T.macro)
    """``T.macro(func)`` for a module-level function, made at the first call, so that defining
    it does not import TileLang."""

    def __init__(self, func):
        functools.update_wrapper(self, func)
        self._func = func
        self._macro = None

    def __call__(self, *args, **kwargs):
        if self._macro is None:
            self._macro = T.macro(self._func)
        return self._macro(*args, **kwargs)


def variable(value):
    """A macro argument that is an ``alloc_var``: the variable itself rather than a load of it
    (a macro binds each argument to a copy, ``int64_t epoch_1 = epoch;``; the variable keeps
    the generated code's name, and a macro may assign it)."""
    buffer = getattr(value, "buffer", None)
    if buffer is not None and hasattr(value, "indices") and buffer.scope() == "local.var":
        return buffer
    return value


class Scope(types.SimpleNamespace):
    """The names a kernel's macros share: sizes (ints, dtypes, the run-time dimensions), the
    kernel's parameters, its buffers, its thread ids and its variables.

    A macro unpacks what it uses into locals of the same names (``lane, wcnt = k.lane,
    k.wcnt``): TileLang names a TIR variable or buffer after the Python name it is bound to, so
    the same names keep the generated code what it was when the kernel was one function. An
    ``alloc_var`` passed in is kept as the variable itself (not its value), so a macro that
    unpacks it can assign it; a macro returns the variables it creates for later steps as
    ``k.extend(name=variable, ...)`` (a macro's ``return`` would pass their values).
    """

    def __init__(self, **names):
        super().__init__(**{name: variable(value) for name, value in names.items()})

    def extend(self, **names) -> "Scope":
        """A scope with this one's names and ``names``."""
        return Scope(**{**vars(self), **names})
