"""Search spaces: named axes, their product, a validity filter, and a stable fingerprint.

A :class:`SearchSpace` is a list of named axes, each with its candidate values; its
candidates are the product of the axes (the first axis varies slowest, each axis in the order
its values were given) that the user's ``valid(config)`` accepts. A candidate (a *config*) is
a plain ``dict`` from axis name to value, so it travels through ``torch.distributed`` and
into the JSON cache unchanged; values are therefore JSON scalars (``int``, finite ``float``,
``str``, ``bool``, ``None``).

:meth:`SearchSpace.fingerprint` hashes the axes and the valid candidates (not the filter's
code): it is the same in every process and every run for the same space, and changes when an
axis, a value, their order, or what the filter accepts changes. It is part of the autotuner's
cache key, so a cached winner is never taken from another space.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Config", "SearchSpace", "canonical_json", "check_json_value", "json_tree"]

#: A candidate: axis name -> value.
Config = dict

#: Hex digits of a fingerprint (64 bits of SHA-256).
FINGERPRINT_HEX = 16


def canonical_json(value: Any) -> str:
    """``value`` as compact JSON with sorted keys: the text that fingerprints and cache keys
    hash (the same in every process and every run)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def check_json_value(name: str, value: Any) -> Any:
    """Return ``value`` if it is a JSON scalar (``int``, finite ``float``, ``str``, ``bool``,
    ``None``); else ``TypeError`` / ``ValueError`` naming ``name``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return value
    raise TypeError(f"{name} must be an int, float, str, bool or None (a JSON scalar, so that it can be "
                    f"cached and sent between ranks), got {type(value).__name__} {value!r}")


def json_tree(name: str, value: Any) -> Any:
    """``value`` with tuples made lists and integer-likes (numpy) made ints, checked to be JSON
    of scalars, lists and str-keyed mappings; ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{name} keys must be str, got {k!r}")
            out[k] = json_tree(f"{name}[{k!r}]", v)
        return out
    if isinstance(value, (list, tuple)):
        return [json_tree(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if hasattr(value, "__index__") and not isinstance(value, (bool, int)):  # numpy ints, torch.Size items
        return int(value.__index__())
    return check_json_value(name, value)


def _check_axes(axes: Any) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    if not isinstance(axes, Mapping):
        raise TypeError(f"axes must be a mapping from axis name to its values, got {type(axes).__name__}")
    if not axes:
        raise ValueError("axes must name at least one axis, got an empty mapping")
    checked = []
    for name, values in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"axes: axis names must be identifiers (they become keyword arguments), got {name!r}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"axes[{name!r}] must be a sequence of values (list or tuple), got {values!r}")
        if not values:
            raise ValueError(f"axes[{name!r}] has no values")
        values = tuple(check_json_value(f"axes[{name!r}] values", v) for v in values)
        seen = [canonical_json(v) for v in values]
        if len(set(seen)) != len(seen):
            raise ValueError(f"axes[{name!r}] lists a value twice: {list(values)}")
        checked.append((name, values))
    return tuple(checked)


class SearchSpace:
    """The candidates an autotuner tries: the product of named axes, filtered.

    Args:
        axes: axis name -> its values, e.g. ``{"block_m": (64, 128), "num_stages": (3, 4)}``;
            names are identifiers, values JSON scalars, none listed twice.
        valid: ``valid(config) -> bool``: True keeps the candidate (Triton-distributed's
            ``prune_fn``, without the call's arguments: close over the shapes instead). None
            keeps all.
        name: a label for messages and the cache file's entries; not part of the fingerprint.

    Raises:
        TypeError / ValueError: naming ``axes`` or ``valid``; ``ValueError`` too when
            ``valid`` rejects every candidate (nothing to tune).

    Example::

        space = SearchSpace({"block_m": (64, 128), "block_n": (128, 256)},
                            valid=lambda c: c["block_m"] * c["block_n"] <= 128 * 256)
    """

    def __init__(self, axes: Mapping[str, Sequence[Any]], valid: Callable[[dict], bool] | None = None, *,
                 name: str = "space"):
        self._axes = _check_axes(axes)
        if valid is not None and not callable(valid):
            raise TypeError(f"valid must be a callable config -> bool, or None, got {valid!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name
        self._valid = valid
        self._candidates = tuple(c for c in self.product() if self._keep(c))
        if not self._candidates:
            raise ValueError(f"valid rejects all {self.size_unfiltered} candidates of {self!r}: nothing to tune")
        self._fingerprint = hashlib.sha256(canonical_json(
            {"axes": [[n, list(v)] for n, v in self._axes], "candidates": list(self._candidates)}
        ).encode()).hexdigest()[:FINGERPRINT_HEX]

    def _keep(self, config: dict) -> bool:
        if self._valid is None:
            return True
        try:
            keep = self._valid(dict(config))
        except Exception as exc:
            raise ValueError(f"valid raised {type(exc).__name__}: {exc} for candidate {config}") from exc
        if not isinstance(keep, bool):
            raise TypeError(f"valid must return a bool, got {keep!r} for candidate {config}")
        return keep

    @property
    def axes(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """``((name, values), ...)`` in the order given."""
        return self._axes

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, in order: the keys of every candidate."""
        return tuple(n for n, _ in self._axes)

    @property
    def size_unfiltered(self) -> int:
        """Number of combinations before ``valid`` (the product of the axes' lengths)."""
        return math.prod(len(v) for _, v in self._axes)

    def product(self) -> Iterator[dict]:
        """Every combination of the axes' values, unfiltered, first axis slowest."""
        names = self.axis_names
        for values in itertools.product(*(v for _, v in self._axes)):
            yield dict(zip(names, values))

    def candidates(self) -> list[dict]:
        """The valid candidates, in product order (fresh dicts: callers may change them)."""
        return [dict(c) for c in self._candidates]

    def index(self, config: Mapping[str, Any]) -> int:
        """Position of ``config`` among :meth:`candidates`; ``ValueError`` when it is not one."""
        text = canonical_json(dict(config))
        for i, c in enumerate(self._candidates):
            if canonical_json(c) == text:
                return i
        raise ValueError(f"config {dict(config)} is not a candidate of {self!r}")

    def __contains__(self, config: Any) -> bool:
        """Whether ``config`` (a mapping) is one of the valid candidates."""
        if not isinstance(config, Mapping):
            return False
        try:
            self.index(config)
        except (ValueError, TypeError):
            return False
        return True

    def default(self) -> dict:
        """The first valid candidate: what ``mode="off"`` runs, untimed."""
        return dict(self._candidates[0])

    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the axes (names, values, order) and the valid
        candidates: stable across processes and runs, changed by any change of the axes or of
        what ``valid`` accepts."""
        return self._fingerprint

    def __len__(self) -> int:
        """Number of valid candidates."""
        return len(self._candidates)

    def __iter__(self) -> Iterator[dict]:
        """The valid candidates, as :meth:`candidates`."""
        return iter(self.candidates())

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={list(v)}" for n, v in self._axes)
        return f"SearchSpace({self.name!r}: {axes}; {len(self._candidates)} valid)"
