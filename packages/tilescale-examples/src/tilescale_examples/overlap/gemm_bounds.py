"""The element-wise error bound a 16-bit GEMM output must meet against a float32 reference,
which every GEMM test and benchmark of the library checks (:func:`count_outside`); re-exported
by :mod:`tilescale_examples.overlap.gemm`."""

from typing import Optional

import torch

__all__ = ["unit_roundoff", "error_bound", "count_outside", "ORDER_SLACK"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff ``u`` of a 16-bit float (half an ulp at 1): ``2**-11`` for float16,
    ``2**-8`` for bfloat16."""
    u = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}.get(dtype)
    if u is None:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
    return u


#: Slack for the float32 accumulation order, relative to the reference's RMS (a wrong element
#: is off by about the RMS; a float32 sum of 8192 products errs by about 1e-6 of it).
ORDER_SLACK = 1e-3


def error_bound(ref: torch.Tensor, dtype: torch.dtype, rounded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Element-wise bound on ``|out - ref|`` for an output of ``dtype`` computed with float32
    accumulation, ``ref`` being the float32 result of the same products:

    ``u * (|ref| + rounded) + ORDER_SLACK * rms(ref)``

    ``u * |ref|``: the output's one rounding to ``dtype``; ``rounded`` (default 0): the sum of
    the magnitudes of intermediate values that were rounded to ``dtype`` before being added
    (the partial products of a reduce-scatter, each rounded once); ``ORDER_SLACK * rms``:
    float32 summation-order differences between the kernel and the reference."""
    ref = ref.float()
    rms = ref.pow(2).mean().sqrt()
    bound = ref.abs() if rounded is None else ref.abs() + rounded
    return unit_roundoff(dtype) * bound + ORDER_SLACK * rms


def count_outside(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                  rounded: Optional[torch.Tensor] = None) -> tuple:
    """``(elements outside error_bound, worst |out - ref| / bound)``; NaN/inf count as outside."""
    err = (out.float() - ref.float()).abs()
    bound = error_bound(ref, dtype, rounded)
    bad = ~(err <= bound)  # NaN compares False
    worst = (err / bound).nan_to_num(float("inf")).max().item() if err.numel() else 0.0
    return int(bad.sum().item()), worst
