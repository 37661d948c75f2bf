"""The predicted generalization gap: Eq. 13 of "Flatness After All?" and the headline the
library logs (docs/math.md, "The headline predicted gap").

Eq. 13 predicts the gap from the soft rank and a trace ratio ``α = Tr(C)/Tr(F)``::

    Eq. 13 = α · rank_λ(F) / n.

The headline, ``predicted_gap``, is the value users compare across runs and epochs::

    predicted_gap = α_val · rank_λ(F) / (n + rank_λ(F)),

with ``α_val`` the held-out trace ratio wherever held-out data is given (the training one,
labelled so, where not). It agrees with Eq. 13 to first order in ``rank_λ(F)/n`` — the regime
the paper's asymptotics assume — and saturates at ``α`` where the soft rank reaches ``n`` and
beyond, which weakly regularized models reach (``rank_λ(F)/n`` of 0.5–1.5). The training ratio
goes to 0 on a model that over-fits (Prop. 5.4), so only the held-out one orders over-fit runs
as their gaps; the chosen form and what each candidate reached are in docs/RESULTS.md, "The
headline that ranks".
"""

from __future__ import annotations

import math

__all__ = ["eq13", "headline_gap", "rank_share", "predicted_test_nll"]


def eq13(trace_ratio: float, soft_rank: float, n: int) -> float:
    """Eq. 13: ``trace_ratio · soft_rank / n``."""
    return trace_ratio * soft_rank / n


def rank_share(soft_rank: float, n: int) -> float:
    """``rank_λ(F) / (n + rank_λ(F))``: ``rank_λ(F)/n`` to first order, at most 1."""
    return soft_rank / (n + soft_rank) if soft_rank >= 0 else math.nan


def headline_gap(ratio_val: float, ratio_train: float, soft_rank: float, n: int) -> float:
    """The headline predicted gap: the held-out trace ratio times :func:`rank_share`, or the
    training trace ratio where the held-out one is undefined (no held-out data)."""
    ratio = ratio_val if math.isfinite(ratio_val) else ratio_train
    return ratio * rank_share(soft_rank, n)


def predicted_test_nll(train_nll: float, predicted_gap: float) -> float:
    """The test NLL the headline predicts: the training NLL plus the predicted gap."""
    return train_nll + predicted_gap
