"""Delete-one-group jackknife of a spectral summary: bias correction and standard error.

A random estimate ``F̂`` averaged over K independent groups of probes is unbiased for ``F``, but
every concave trace function is biased low on it: ``E h(F̂) ≤ h(F)``, by a term that falls like
``1/K`` (docs/math.md, "Exact-quality soft rank without the P × P Fisher"). With the summary
``h(F̂)`` of all groups and the summaries ``h(F̂₋ₖ)`` of the estimates that leave group k out,

    corrected = K·h(F̂) − (K−1)·mean_k h(F̂₋ₖ),
    stderr    = √((K−1)/K · Σ_k (h(F̂₋ₖ) − mean_k h(F̂₋ₖ))²),

which removes the ``O(1/K)`` term of the bias (Quenouille's jackknife; with K = 2 it is
Richardson's extrapolation ``2h(F̂) − h(F̂_half)``). The trace, linear in ``F̂``, is unbiased and
left as it is; so is the largest eigenvalue, which is not smooth. A convex function of ``F̂``
(the Newton decrement ``½ gᵀ(F̂+λI)⁻¹g``) is biased high by such a term, removed the same way
(:func:`jackknife_value`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple

import torch

from lightning_flatness.core.spectral import SpectralSummary

__all__ = ["UNCORRECTED_FIELDS", "jackknife", "jackknife_value"]

#: summary fields the jackknife leaves as they are: the trace (linear) and max_eig (not smooth)
UNCORRECTED_FIELDS = ("trace", "max_eig")
_UNCORRECTED = [list(SpectralSummary.__dataclass_fields__).index(f) for f in UNCORRECTED_FIELDS]


def jackknife(
    plain: SpectralSummary, leave_outs: Sequence[SpectralSummary]
) -> tuple[SpectralSummary, SpectralSummary]:
    """The bias-corrected summary and its standard errors (module docstring).

    With fewer than two groups there is nothing to leave out: ``plain`` and NaN errors.
    """
    num = len(leave_outs)
    if num < 2:
        return plain, SpectralSummary(*([math.nan] * 5))
    values = torch.tensor([astuple(s) for s in leave_outs], dtype=torch.float64)
    spread = ((num - 1) / num * (values - values.mean(0)).square().sum(0)).sqrt()
    full = torch.tensor(astuple(plain), dtype=torch.float64)
    corrected = num * full - (num - 1) * values.mean(0)
    corrected[_UNCORRECTED] = full[_UNCORRECTED]
    return SpectralSummary(*(float(v) for v in corrected)), SpectralSummary(
        *(float(v) for v in spread)
    )


def jackknife_value(plain: float, leave_outs: Sequence[float]) -> tuple[float, float]:
    """The corrected value and standard error of one smooth function of ``F̂`` (the module
    docstring's formulas); with fewer than two groups ``plain`` and NaN."""
    num = len(leave_outs)
    if num < 2:
        return plain, math.nan
    values = torch.tensor([float(v) for v in leave_outs], dtype=torch.float64)
    spread = math.sqrt((num - 1) / num * float((values - values.mean()).square().sum()))
    return num * plain - (num - 1) * float(values.mean()), spread
