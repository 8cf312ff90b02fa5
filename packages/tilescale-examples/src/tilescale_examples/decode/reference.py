"""The torch reference of :class:`~tilescale_examples.decode.allreduce_norm.AllReduceResidualRMSNorm`
(float32, from every rank's call arguments), its FP8 quantiser, and :func:`compare`, the
comparison the tests and the benchmark make: ``residual_out`` bit for bit, ``y`` within
``eps(dtype) * |y|`` (one to two units in the last place), the FP8 scales within
:data:`SCALE_RTOL`.

``y`` and the scales cannot match bit for bit: the kernel adds a row's ``h^2`` in another order
than torch and its ``rsqrt`` is the hardware's approximation (a few float32 ulps); rounding that
float32 ``y`` to the output dtype then gives the same value or a neighbour.

Re-exported by :mod:`tilescale_examples.decode.allreduce_norm`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from tilescale_examples.decode.norm_kernel import FP8_BLOCK, FP8_MAX, FP8_MODES, FP8_TORCH_DTYPE

__all__ = ["scales_shape", "quantize_fp8", "torch_reference", "compare", "SCALE_RTOL", "FP8_ULP"]

#: Relative tolerance of the FP8 scales (float32: the row's sum and ``rsqrt`` differ by a few ulps).
SCALE_RTOL = 1e-4
#: Relative spacing of float8 e4m3 values (3 mantissa bits), and its smallest subnormal.
FP8_ULP, FP8_TINY = 2.0 ** -3, 2.0 ** -9


def scales_shape(tokens: int, hidden: int, fp8: str) -> Tuple[int, int]:
    """Shape of the scales of ``fp8`` mode: ``(tokens, 1)`` (``per_token``) or ``(tokens,
    hidden // 128)`` (``per_block``)."""
    return (tokens, 1) if fp8 == "per_token" else (tokens, hidden // FP8_BLOCK)


def quantize_fp8(y: torch.Tensor, fp8: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y_fp8, scales)`` of float32 ``y`` (``(tokens, hidden)``): ``scale = amax / 448`` per
    token (``"per_token"``, scales ``(tokens, 1)``) or per 128 channels of a token
    (``"per_block"``, scales ``(tokens, hidden / 128)``), ``y_fp8 = e4m3(clamp(y / scale,
    -448, 448))``, 0 where the scale is 0."""
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be one of {FP8_MODES}, got {fp8!r}")
    tokens, hidden = y.shape
    groups = y.view(tokens, -1, hidden if fp8 == "per_token" else FP8_BLOCK)
    scales = groups.abs().amax(-1, keepdim=True) / FP8_MAX
    q = torch.where(scales > 0, groups / scales, torch.zeros_like(groups)).clamp(-FP8_MAX, FP8_MAX)
    return q.view(tokens, hidden).to(FP8_TORCH_DTYPE), scales.view(tokens, -1)


def torch_reference(inputs: Sequence[tuple], rank: int, *, eps: float = 1e-6, fp8: Optional[str] = None) -> tuple:
    """What a call returns on ``rank``, with torch in float32: ``inputs[p] = (x_p, residual_p,
    weight_p)``, rank ``p``'s call arguments; returns ``(y, residual_out)`` or, with ``fp8``,
    ``(y_fp8, scales, residual_out)`` (see the module docstring). ``residual_out`` is the
    kernel's bit for bit; ``y`` and the scales agree up to float32 rounding."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("inputs must hold one (x, residual, weight) per rank, got none")
    if not 0 <= rank < len(inputs):
        raise ValueError(f"rank must be in [0, {len(inputs)}), got {rank}")
    _, residual, weight = inputs[rank]
    total = inputs[0][0].float()
    for x, _, _ in inputs[1:]:
        total = total + x.float()
    h = (total + residual.float()).to(residual.dtype)
    hf = h.float()
    rs = torch.rsqrt((hf * hf).mean(-1, keepdim=True) + eps)
    y = (hf * weight.float()) * rs
    if fp8 is None:
        return y.to(residual.dtype), h
    return (*quantize_fp8(y, fp8), h)


def _ulp_mismatches(got: torch.Tensor, want: torch.Tensor, rel: float, tiny: float) -> int:
    """Elements of ``got`` farther than ``rel * |want| + tiny`` (at least one ulp for ``rel``
    the format's epsilon) from ``want``, NaNs included."""
    g, w = got.float(), want.float()
    ok = (g - w).abs() <= rel * w.abs() + tiny
    return int((~ok).sum())


def compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str = "") -> list:
    """Failure messages (empty when it matches) of a call's result ``got`` against
    :func:`torch_reference`'s ``want`` (both ``(y, residual_out)`` or ``(y_fp8, scales,
    residual_out)``): ``residual_out`` bit for bit, ``y`` within ``eps(dtype) * |want| +
    1e-6`` (one to two ulps), FP8 values within ``2**-3 * |want| + 2**-9`` (e4m3's) and scales within
    :data:`SCALE_RTOL`."""
    got, want = list(got), list(want)
    bad = []
    h, wh = got[-1], want[-1]
    if not torch.equal(h.view(torch.int16), wh.view(torch.int16)):
        bad.append(f"{what} residual_out: {int((h.view(torch.int16) != wh.view(torch.int16)).sum())} elements differ")
    if len(got) == 2:
        n = _ulp_mismatches(got[0], want[0], torch.finfo(want[0].dtype).eps, 1e-6)
        if n:
            bad.append(f"{what} y: {n} elements off by more than one ulp")  # (the tolerance's floor)
        return bad
    n = _ulp_mismatches(got[0], want[0], FP8_ULP, FP8_TINY)
    if n:
        bad.append(f"{what} y_fp8: {n} elements off by more than one e4m3 ulp")
    n = _ulp_mismatches(got[1], want[1], SCALE_RTOL, 0.0)
    if n:
        bad.append(f"{what} scales: {n} off by more than {SCALE_RTOL} relative")
    return bad
