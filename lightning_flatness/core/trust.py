"""When the predicted gap can be trusted: the training error/uncertainty ratio.

Eq. 13 predicts the gap from ``Tr(C)/Tr(F) · rank_λ(F) / n`` (``predicted_gap``: the training
trace ratio). Its derivation assumes the model is not over-confident on its training data: as a
model fits its training samples better than its own predictive uncertainty says (over-fitting),
the training trace ratio — an error/uncertainty ratio α* (docs/math.md, "Generalization gap") —
goes to 0 (Prop. 5.4 of the paper) and Eq. 13 under-estimates the gap. The trust score is that
ratio on the training data,

    trust score = α*_train = E‖e(y) − E_p e(ỹ)‖² / E_ỹ∼p ‖e(ỹ) − E_p e(ỹ)‖²,

≈ 1 for a model as uncertain as it is wrong, → 0 for an over-confident one; the estimate is
*trusted* while it is at least :data:`TRUST_THRESHOLD`, its structure is of exact quality
(:data:`EXACT_QUALITY`) and its soft rank is not above the rank the Fisher can have.

The threshold, 0.3, was chosen with ``benchmarks/study_trust.py`` (docs/RESULTS.md, "Predictor
and trust rule"): on its trained grids the training-ratio Eq. 13 of runs with α_train ≥ 0.3 was
within 2× of the observed gap for :data:`TRUSTED_WITHIN_2X` of them. The rule cannot see a fit
that is far from a minimum (a model one to three epochs into training: not over-confident, so
α_train is high, and its gap has not opened yet, so Eq. 13 over-estimates it several-fold); the
study found the Newton decrement ½ gᵀ(F+λI)⁻¹g of the regularized objective above 0.1 nat on
every such fit and below it on every trained one, but :func:`~lightning_flatness.measure` does
not compute it yet. Read the gap of an early epoch as an upper estimate.
"""

from __future__ import annotations

import math

__all__ = [
    "EXACT_QUALITY",
    "TRUSTED_WITHIN_2X",
    "TRUST_THRESHOLD",
    "above_rank_bound",
    "trusted",
    "verdict",
]

#: the training error/uncertainty ratio below which the predicted gap is flagged untrusted
TRUST_THRESHOLD = 0.3

#: how often a trusted ``predicted_gap`` was within 2× of the observed gap on the trained grids
#: of ``benchmarks/study_trust.py`` (docs/RESULTS.md, "Predictor and trust rule"): 14 of 17
#: trusted runs of the grids mlp7, mlp14 and the first five runs of bigmlp7
TRUSTED_WITHIN_2X = "14 of 17 trusted trained runs (docs/RESULTS.md, Predictor and trust rule)"


#: the structures whose soft rank is measured to be within 10% of the exact one (docs/RESULTS.md,
#: "Error against cost"): the others are structured approximations or upper bounds (``kfac``
#: 1.5–2.3×, ``diag`` and ``hutchinson`` 2–6× the exact value) or, at their default budgets,
#: under-count large soft ranks (``lanczos``), so their predicted gap is never trusted
EXACT_QUALITY = ("probe_kernel", "cg", "dense", "gram")


def above_rank_bound(soft_rank: float, rank_bound: float) -> bool:
    """A soft rank the Fisher cannot have: above ``min(P, m·r)`` (beyond round-off)."""
    return math.isfinite(soft_rank) and soft_rank > rank_bound * (1 + 1e-9) + 1e-9


def verdict(score: float, structure: str, soft_rank: float, rank_bound: float) -> float:
    """``trusted`` of a report: :func:`trusted` of the score, and 0.0 whatever the score when
    the structure is not of :data:`EXACT_QUALITY` or the soft rank is above the Fisher's rank
    bound (an impossible value)."""
    value = trusted(score)
    if math.isnan(value):
        return value
    if structure not in EXACT_QUALITY or above_rank_bound(soft_rank, rank_bound):
        return 0.0
    return value


def trusted(score: float, threshold: float = TRUST_THRESHOLD) -> float:
    """1.0 when ``score ≥ threshold``, 0.0 below, NaN when the score is undefined (NaN, e.g. a
    regression, which has no error/uncertainty ratio)."""
    if not math.isfinite(score):
        return math.nan
    return 1.0 if score >= threshold else 0.0
