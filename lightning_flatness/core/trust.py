"""When the predicted gap can be trusted: the training error/uncertainty ratio.

Eq. 13 predicts the gap from ``Tr(C)/Tr(F) · rank_λ(F) / n``. Its derivation assumes the model
is not over-confident on its training data: as a model fits its training samples better than
its own predictive uncertainty says (over-fitting), the training trace ratio — an
error/uncertainty ratio α* (docs/math.md, "Generalization gap") — goes to 0 (Prop. 5.4 of the
paper), the soft rank of the Fisher counts directions the data no longer constrain, and the
estimate degrades (Section 5.2). The trust score is that ratio on the training data,

    trust score = α*_train = E‖e(y) − E_p e(ỹ)‖² / E_ỹ∼p ‖e(ỹ) − E_p e(ỹ)‖²,

≈ 1 for a model as uncertain as it is wrong, → 0 for an over-confident one; the estimate is
*trusted* while it is at least :data:`TRUST_THRESHOLD`, its structure is of exact quality
(:data:`EXACT_QUALITY`) and its soft rank is not above the rank the Fisher can have. The
threshold was chosen from a sweep of trained models, as the value above which Eq. 13 lands
within a factor 2 of the measured gap for most runs (docs/RESULTS.md, "Accuracy of the
structures and the trust flag").
"""

from __future__ import annotations

import math

__all__ = ["EXACT_QUALITY", "TRUST_THRESHOLD", "above_rank_bound", "trusted", "verdict"]

#: the training error/uncertainty ratio below which the predicted gap is flagged untrusted
TRUST_THRESHOLD = 0.5


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
