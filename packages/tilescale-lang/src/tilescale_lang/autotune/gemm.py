"""The ready-made search space of the library's GEMM (``tilescale_examples.overlap.gemm``).

That GEMM's tile program is ``GemmTiles(block_m, block_n, block_k, num_stages, threads)``
(``T.Pipelined`` TMA loads of ``block_m x block_k`` and ``block_k x block_n`` tiles into
shared memory, ``num_stages`` deep, WGMMA into a ``block_m x block_n`` float32 fragment;
``threads`` compute threads, a multiple of 128, plus TileLang's producer warpgroup). Every
dimension must be a multiple of its tile. :func:`gemm_space` spans those five axes, so
``GemmTiles(**config)`` builds a candidate's tiles. More axes are added only when asked
for, for kernels that read them: ``swizzle`` (the panel size of TileLang's
``T.use_swizzle`` block rasterisation, 0 for none), ``pipeline`` (``"sync"``: TileLang's
pipelined mainloop; ``"async"``: one WGMMA group kept in flight, at least 2 stages),
``warp_policy`` (how the compute warpgroups split a tile: ``"square"``, TileLang's default;
``"row"``: whole rows each, one ``m64n256`` WGMMA per ``k16`` on a ``128 x 256`` tile;
``"column"``) and ``persistent`` (a persistent tile loop instead of one block per tile).

:func:`gemm_rejection` says why a config cannot run at a shape (the space's validity filter):
a dimension not a multiple of its tile, threads not whole warpgroups or over the block limit,
the pipeline's shared memory over the device's per-block limit, a WGMMA tile that the
warpgroups cannot split, or an accumulator fragment over the register budget. It is a
conservative guard: a candidate TileLang still cannot compile is skipped and reported by the
tuner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tilescale_core.interface import check_non_negative_int, check_positive_int

from .space import SearchSpace

__all__ = ["GEMM_TILE_AXES", "GEMM_DEFAULTS", "GEMM_PIPELINES", "GEMM_WARP_POLICIES", "HOPPER_SMEM_BYTES", "MAX_ACC_REGS", "dtype_bytes",
           "gemm_shared_bytes", "gemm_rejection", "gemm_space"]

#: The axes :class:`~tilescale_examples.overlap.gemm.GemmTiles` takes, in its field order.
GEMM_TILE_AXES = ("block_m", "block_n", "block_k", "num_stages", "threads")
#: The values :func:`gemm_space` tries per axis unless told otherwise.
GEMM_DEFAULTS = {
    "block_m": (64, 128, 256),
    "block_n": (128, 224, 256),
    "block_k": (64, 128),
    "num_stages": (2, 3, 4),
    "threads": (128, 256),
}
#: The values a ``pipeline`` axis may hold.
GEMM_PIPELINES = ("sync", "async")
#: The values a ``warp_policy`` axis may hold.
GEMM_WARP_POLICIES = ("square", "row", "column")
#: Dynamic shared memory one block may use on Hopper (H100/H200), in bytes (227 KiB).
HOPPER_SMEM_BYTES = 232448
#: float32 accumulator registers per compute thread above which a tile is refused (the
#: hardware limit is 255 registers per thread, addresses and loop state included).
MAX_ACC_REGS = 128
#: Rows of one WGMMA instruction: each compute warpgroup owns a multiple of 64 rows, or the
#: warpgroups split the columns in multiples of 8.
_WGMMA_M, _WGMMA_N = 64, 8
#: Producer warpgroup TileLang adds, and the CUDA limit of threads per block.
_PRODUCER, _MAX_BLOCK_THREADS = 128, 1024

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "float8_e4m3": 1, "int8": 1}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or TileLang's name: ``"bfloat16"``,
    ``"float16"``, ``"float32"``, the float8 kinds, ``"int8"``); ``ValueError`` naming
    ``dtype`` otherwise."""
    text = str(dtype).removeprefix("torch.")
    if text not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)} (or the torch dtype), got {dtype!r}")
    return _DTYPE_BYTES[text]


def gemm_shared_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, dtype: Any = "bfloat16") -> int:
    """Shared memory of one block of the pipelined GEMM, in bytes: ``num_stages`` buffers of an
    ``a`` tile ``(block_m, block_k)`` and a ``b`` tile ``(block_k, block_n)`` of ``dtype``
    (:func:`dtype_bytes`)."""
    return num_stages * (block_m * block_k + block_k * block_n) * dtype_bytes(dtype)


def _split_rejection(bm: int, bn: int, threads: int) -> str | None:
    groups = threads // 128
    if bm % _WGMMA_M:
        return f"block_m={bm} is not a multiple of {_WGMMA_M} (one WGMMA's rows)"
    rows_split = (bm // _WGMMA_M) % groups == 0
    cols_split = bn % (groups * _WGMMA_N) == 0
    if not (rows_split or cols_split):
        return f"{groups} warpgroups cannot split a {bm} x {bn} tile"
    if bm * bn // threads > MAX_ACC_REGS:
        return f"a {bm} x {bn} float32 accumulator needs {bm * bn // threads} registers per thread (> {MAX_ACC_REGS})"
    return None


def gemm_rejection(config: dict, m: int, n: int, k: int, dtype: Any = "bfloat16", *,
                   smem_bytes: int = HOPPER_SMEM_BYTES) -> str | None:
    """Why ``config`` cannot run the GEMM ``(m, k) @ (k, n)`` of ``dtype``, or None if it can.

    Args:
        config: a candidate with at least the :data:`GEMM_TILE_AXES`.
        m, n, k: the GEMM's dimensions (elements).
        dtype: the operands' dtype (:func:`dtype_bytes`).
        smem_bytes: dynamic shared memory a block may use, in bytes.
    """
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    stages, threads = config["num_stages"], config["threads"]
    for dim, size, tile, value in (("m", m, "block_m", bm), ("n", n, "block_n", bn), ("k", k, "block_k", bk)):
        if size % value:
            return f"{dim}={size} is not a multiple of {tile}={value}"
    if threads % 128 or threads + _PRODUCER > _MAX_BLOCK_THREADS:
        return f"threads={threads} is not whole warpgroups within {_MAX_BLOCK_THREADS - _PRODUCER}"
    if config.get("pipeline", "sync") == "async" and stages < 2:
        return "the async pipeline needs at least 2 stages"
    smem = gemm_shared_bytes(bm, bn, bk, stages, dtype)
    if smem > smem_bytes:
        return f"{stages} stages of {bm}x{bk} + {bk}x{bn} tiles need {smem} bytes of shared memory (> {smem_bytes})"
    return _split_rejection(bm, bn, threads)


def _axis(name: str, values: Sequence[int] | None) -> tuple[int, ...]:
    values = _axis_values(name, GEMM_DEFAULTS[name] if values is None else values)
    return tuple(check_positive_int(f"{name} values", v) for v in values)


def _check_choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be among {choices}, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def gemm_space(m: int, n: int, k: int, dtype: Any = "bfloat16", *,
               block_m: Sequence[int] | None = None, block_n: Sequence[int] | None = None,
               block_k: Sequence[int] | None = None, num_stages: Sequence[int] | None = None,
               threads: Sequence[int] | None = None, swizzle: Sequence[int] | None = None,
               pipeline: Sequence[str] | None = None, warp_policy: Sequence[str] | None = None,
               persistent: Sequence[bool] | None = None, smem_bytes: int = HOPPER_SMEM_BYTES,
               valid: Callable[[dict], bool] | None = None) -> SearchSpace:
    """The search space of the library's GEMM ``C (m, n) = A (m, k) @ B (k, n)``.

    Args:
        m, n, k: the GEMM's dimensions (elements; for AllGatherGEMM ``m`` is the rows one
            kernel computes, for GemmReduceScatter likewise).
        dtype: the operands' dtype (sizes the shared memory check).
        block_m, block_n, block_k, num_stages, threads: the values to try per axis (default
            :data:`GEMM_DEFAULTS`).
        swizzle: panel sizes for ``T.use_swizzle`` (0: none); the axis is added only when
            given, for kernels that read ``config["swizzle"]``.
        pipeline: mainloop pipelines to try (:data:`GEMM_PIPELINES`); added only when given.
        warp_policy: warpgroup splits to try (:data:`GEMM_WARP_POLICIES`); likewise.
        persistent: ``(False, True)`` adds a ``persistent`` axis likewise.
        smem_bytes: the device's shared memory per block, in bytes (default Hopper's).
        valid: a further filter, ``valid(config) -> bool``, after :func:`gemm_rejection`.

    Raises:
        ValueError: naming the argument (a dimension not a positive int, an empty axis), or
            when no candidate fits the shape.
    """
    m, n, k = (check_positive_int(name, v) for name, v in (("m", m), ("n", n), ("k", k)))
    smem_bytes = check_positive_int("smem_bytes", smem_bytes)
    dtype_bytes(dtype)
    if valid is not None and not callable(valid):
        raise TypeError(f"valid must be a callable config -> bool, or None, got {valid!r}")
    given = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_stages": num_stages,
             "threads": threads}
    axes: dict[str, tuple] = {name: _axis(name, given[name]) for name in GEMM_TILE_AXES}
    if swizzle is not None:
        axes["swizzle"] = tuple(check_non_negative_int("swizzle values", v) for v in _axis_values("swizzle", swizzle))
    if pipeline is not None:
        axes["pipeline"] = tuple(_check_choice("pipeline values", v, GEMM_PIPELINES)
                                 for v in _axis_values("pipeline", pipeline))
    if warp_policy is not None:
        axes["warp_policy"] = tuple(_check_choice("warp_policy values", v, GEMM_WARP_POLICIES)
                                    for v in _axis_values("warp_policy", warp_policy))
    if persistent is not None:
        axes["persistent"] = tuple(_check_bool("persistent values", v) for v in _axis_values("persistent", persistent))

    reasons: list[str] = []

    def fits(config: dict) -> bool:
        reason = gemm_rejection(config, m, n, k, dtype, smem_bytes=smem_bytes)
        if reason is not None:
            reasons.append(reason)
            return False
        return True if valid is None else valid(config)

    try:
        return SearchSpace(axes, fits, name=f"gemm {m}x{n}x{k} {str(dtype).removeprefix('torch.')}")
    except ValueError as exc:
        if not str(exc).startswith("valid rejects all"):
            raise
        why = "; ".join(sorted(set(reasons))[:4]) or "the valid filter rejected every tile"
        raise ValueError(f"no GEMM tile of the space fits m={m}, n={n}, k={k} ({why})") from None


def _axis_values(name: str, values: Any) -> Sequence:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name} must be a non-empty sequence, got {values!r}")
    return values
