"""When the predicted gap can be trusted: the training error/uncertainty ratio.

Eq. 13 predicts the gap from ``Tr(C)/Tr(F) · rank_λ(F) / n``. Its derivation assumes the model
is not over-confident on its training data: as a model fits its training samples better than
its own predictive uncertainty says (over-fitting), the training trace ratio — an
error/uncertainty ratio α* (docs/math.md, "Generalization gap") — goes to 0 (Prop. 5.4 of the
paper), the soft rank of the Fisher counts directions the data no longer constrain, and the
estimate degrades (Section 5.2). The trust score is that ratio on the training data,

    trust score = α*_train = E‖e(y) − E_p e(ỹ)‖² / E_ỹ∼p ‖e(ỹ) − E_p e(ỹ)‖²,

≈ 1 for a model as uncertain as it is wrong, → 0 for an over-confident one; the estimate is
*trusted* while it is at least :data:`TRUST_THRESHOLD`. The threshold was chosen from a sweep of
trained models, as the value above which Eq. 13 lands within a factor 2 of the measured gap
for most runs (docs/RESULTS.md, "Accuracy of the structures and the trust flag").
"""

from __future__ import annotations

import math

__all__ = ["TRUST_THRESHOLD", "trusted"]

#: the training error/uncertainty ratio below which the predicted gap is flagged untrusted
TRUST_THRESHOLD = 0.5


def trusted(score: float, threshold: float = TRUST_THRESHOLD) -> float:
    """1.0 when ``score ≥ threshold``, 0.0 below, NaN when the score is undefined (NaN, e.g. a
    regression, which has no error/uncertainty ratio)."""
    if not math.isfinite(score):
        return math.nan
    return 1.0 if score >= threshold else 0.0
