"""The soft rank of the whole training set from two subsets of it (docs/math.md, "The soft rank
grows with the samples measured").

The Fisher of m samples, ``F_m = (1/m) Σ_{i≤m} J_iᵀΛ_iJ_i``, is an unbiased estimate of the whole
set's, but its soft rank is not: ``Tr h(·)`` is concave, so ``E rank_λ(F_m) ≤ rank_λ(F_n)``, and
on the broad spectra of trained networks the gap is large (a BatchNorm ResNet at n = 5,000:
0.48–0.71 of the whole set's soft rank from 1,024 samples, at every stage of a fit). A direction
of curvature μ near λ is resolved only once enough samples carry it, so every doubling of the
samples adds to the soft rank, by an amount that changes slowly from one doubling to the next.
Measured on the first m/2 and all m samples of a subset, the last doubling's increment
``Δ = rank(m) − rank(m/2)`` extrapolates to n:

    rank(n) ≈ rank(m) + Δ · Σ_{k=1}^{t} ρ^k,   t = log₂(n / m)   (continuous in t),

with ρ = :data:`DOUBLING_RATIO`, the ratio of one doubling's increment to the one before.
"""

from __future__ import annotations

import math

__all__ = ["DOUBLING_RATIO", "extrapolated_soft_rank"]

#: one doubling's increment of the soft rank ÷ the one before it: about 0.9 (the paper's MLP at
#: c = 1) to 1.15 (a BatchNorm ResNet of 14,514 parameters at c = 2.5) over several doublings,
#: 0.6 to 1.4 from single ones; 1, the middle, put the whole set's soft rank within −18% to
#: +10% of exact from 1,024 of 4,000–5,000 samples (docs/RESULTS.md, "The fill-in's
#: calibration, extrapolated")
DOUBLING_RATIO = 1.0


def extrapolated_soft_rank(
    half: float, whole: float, samples: int, target_samples: int, ratio: float = DOUBLING_RATIO
) -> float:
    """The soft rank of ``target_samples`` samples from its value ``whole`` on ``samples`` of them
    and ``half`` on the first half of those (module docstring). No growth is extrapolated from a
    decrease (the two values are estimates, and a saturated soft rank stops growing), nor below
    ``samples``; NaN when either value is not finite.

    Args:
        half: the soft rank of the first ``samples // 2`` samples.
        whole: the soft rank of all ``samples``.
        samples: m, the subset's size.
        target_samples: n, the set the extrapolation stands for.
        ratio: ρ, one doubling's increment ÷ the one before (> 0).
    """
    if not (math.isfinite(half) and math.isfinite(whole)):
        return math.nan
    if ratio <= 0:
        raise ValueError(f"ratio={ratio!r} must be > 0: one doubling's increment ÷ the last.")
    if samples < 2 or target_samples <= samples:
        return whole
    doublings = math.log2(target_samples / samples)
    increment = max(whole - half, 0.0)
    if math.isclose(ratio, 1.0):
        return whole + increment * doublings
    return whole + increment * ratio * (1.0 - ratio**doublings) / (1.0 - ratio)
