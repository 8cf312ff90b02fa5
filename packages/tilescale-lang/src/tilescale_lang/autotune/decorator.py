"""``@autotune(...)``: the decorator form of :func:`~tilescale_lang.autotune.tuner.tune`, in
the shape of Triton-distributed's ``triton_dist.tune.autotune(config_space, key_fn,
prune_fn)``.

The decorated function takes the problem's arguments plus one keyword per axis of the space
and returns its output; the wrapper takes the problem's arguments (and ``autotune_pg=``, the
process group, as in Triton-distributed), tunes once per key, and calls the function with the
winner. Each key is tuned once per process. Differences from Triton-distributed are listed in ``docs/autotune.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from .space import SearchSpace, canonical_json, json_tree
from .tuner import TuneResult, tune

__all__ = ["Autotuned", "autotune"]


class Autotuned:
    """A function with its tuner: call it like the function, without the axes' keywords.

    Attributes:
        fn: the decorated function, ``fn(*args, **config, **kwargs) -> output``.
        results: ``{(key_fn's key as JSON, space fingerprint, id(autotune_pg)): TuneResult}``
            of the keys tuned (or found in the cache) so far in this process: a key found
            here is neither tuned nor looked up again (no exchange; the ranks make the same
            calls in the same order, so they all find it or all miss it).
    """

    def __init__(self, fn: Callable[..., Any], space: SearchSpace | Callable[..., SearchSpace], *,
                 key_fn: Callable[..., Mapping[str, Any]], name: str | None, reference_fn: Callable[..., Any] | None,
                 check: Callable[..., bool] | None, options: dict):
        if not callable(fn):
            raise TypeError(f"autotune decorates a callable, got {fn!r}")
        if not (isinstance(space, SearchSpace) or callable(space)):
            raise TypeError(f"space must be a SearchSpace or a callable (*args, **kwargs) -> SearchSpace, "
                            f"got {space!r}")
        if not callable(key_fn):
            raise TypeError(f"key_fn must be a callable (*args, **kwargs) -> {{'dtype': ..., 'shapes': ...}}, "
                            f"got {key_fn!r}")
        if (reference_fn is None) == (check is None):
            raise ValueError("pass exactly one of reference_fn (*args, **kwargs) -> expected output and "
                             "check (output, *args, **kwargs) -> bool")
        self.fn, self._space, self._key_fn = fn, space, key_fn
        self._name = name or f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        self._reference_fn, self._check, self._options = reference_fn, check, options
        self.results: dict[tuple, TuneResult] = {}
        functools.update_wrapper(self, fn)

    def _space_for(self, args: tuple, kwargs: dict) -> SearchSpace:
        space = self._space if isinstance(self._space, SearchSpace) else self._space(*args, **kwargs)
        if not isinstance(space, SearchSpace):
            raise TypeError(f"space(*args, **kwargs) must return a SearchSpace, got {type(space).__name__}")
        clash = sorted(set(space.axis_names) & set(kwargs))
        if clash:
            raise ValueError(f"keyword arguments {clash} are axes of the search space: the tuner sets them")
        return space

    def tune(self, *args: Any, autotune_pg: Any = None, **kwargs: Any) -> TuneResult:
        """Tune (or read the cache) for these arguments without the final call; a collective
        over ``autotune_pg`` like :func:`~tilescale_lang.autotune.tuner.tune`."""
        space = self._space_for(args, kwargs)
        key = self._key_fn(*args, **kwargs)
        fields_ok = isinstance(key, Mapping) and {"dtype", "shapes"} <= set(key) <= {"dtype", "shapes", "extra"}
        if not fields_ok:
            raise ValueError(f"key_fn must return a mapping with 'dtype' and 'shapes' (and optionally 'extra'), "
                             f"got {key!r}")
        fields = {k: str(v) if k == "dtype" else v for k, v in key.items()}
        memo = (canonical_json(json_tree("key_fn()", fields)), space.fingerprint(), id(autotune_pg))
        if memo in self.results:
            return self.results[memo]
        fn = self.fn

        def build(config: dict) -> Callable[[], Any]:
            return functools.partial(fn, *args, **config, **kwargs)

        if self._check is not None:
            verify = {"check": lambda out: self._check(out, *args, **kwargs)}
        else:
            verify = {"reference": lambda: self._reference_fn(*args, **kwargs)}
        result = tune(space, build, name=self._name, dtype=key["dtype"], shapes=key["shapes"],
                      extra=key.get("extra"), group=autotune_pg, **verify, **self._options)
        self.results[memo] = result
        return result

    def __call__(self, *args: Any, autotune_pg: Any = None, **kwargs: Any) -> Any:
        """``fn(*args, **winner, **kwargs)``; the first call with a new key tunes (a
        collective over ``autotune_pg``: every rank makes the same calls in the same order)."""
        result = self.tune(*args, autotune_pg=autotune_pg, **kwargs)
        return self.fn(*args, **result.config, **kwargs)


def autotune(space: SearchSpace | Callable[..., SearchSpace], *, key_fn: Callable[..., Mapping[str, Any]],
             name: str | None = None, reference_fn: Callable[..., Any] | None = None,
             check: Callable[..., bool] | None = None, **options: Any) -> Callable[[Callable[..., Any]], Autotuned]:
    """Decorator: tune ``fn(*args, **config, **kwargs)`` over ``space`` per key.

    Args:
        space: a :class:`SearchSpace`, or ``space(*args, **kwargs) -> SearchSpace`` (a space
            that depends on the shapes, e.g. :func:`~tilescale_lang.autotune.gemm.gemm_space`).
        key_fn: ``key_fn(*args, **kwargs) -> {"dtype": ..., "shapes": ..., "extra": ...}``
            (``extra`` optional): the key fields of :func:`~tilescale_lang.autotune.tuner.tune`.
        name: the cache file's name (default: the function's module and qualified name).
        reference_fn: ``reference_fn(*args, **kwargs)``: the expected output.
        check: instead, ``check(output, *args, **kwargs) -> bool``.
        **options: passed to :func:`~tilescale_lang.autotune.tuner.tune`: ``policy``,
            ``mode``, ``timer``, ``cache_dir``, ``rtol``, ``atol``, ``environment``.

    A key is tuned (or read from the disk cache, one exchange) on its first call in a process
    and remembered on the wrapper (:attr:`Autotuned.results`) for the calls after it.
    """
    allowed = {"policy", "mode", "timer", "cache_dir", "rtol", "atol", "environment"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"autotune got unexpected keyword arguments {unknown}; it takes {sorted(allowed)}")

    def wrap(fn: Callable[..., Any]) -> Autotuned:
        return Autotuned(fn, space, key_fn=key_fn, name=name, reference_fn=reference_fn, check=check,
                         options=options)

    return wrap

