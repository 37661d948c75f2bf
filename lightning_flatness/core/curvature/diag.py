"""``structure="diag"`` / ``"diag_mc"``: the Fisher's diagonal, the extreme pinching (Prop. 6.1).

The layer-hook backend (:mod:`lightning_flatness.core.backends.hooks`) sums, over samples, the
squared per-sample gradients of the exact Fisher rows (``diag``: ``diag F`` exactly) or of
``mc_samples`` labels drawn from the model (``diag_mc``: an unbiased estimate), and of the
true-label gradients (``C_kk``). The eigenvalues of the diagonal approximation are the
diagonal entries, so ``rank_λ(diag F) = Σ_k F_kk/(F_kk+λ)`` — an upper bound on ``rank_λ(F)``
(pinching, Prop. 6.1). The regularized TIC uses the diagonal formula ``Σ_k C_kk/(F_kk+λ)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_flatness.core.batch_terms import scale_terms
from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.spectral import spectral_summary

__all__ = ["DiagonalFisher"]


class DiagonalFisher(CurvatureAccumulator):
    """The spectrum and diagonal TIC of ``diag F`` from the sums over samples of ``F_kk`` and
    ``C_kk`` of every parameter (:meth:`add`), flattened in ``order``; under per-group
    ``decay`` both scaled by ``1/λ_j``, to be summarised at λ = 1."""

    def __init__(
        self, order: list[str], sampled: bool = False, decay: ParameterDecay | None = None
    ) -> None:
        self.name = "diag_mc" if sampled else "diag"
        self.decay = decay
        self.order = order
        self.sums: dict[str, dict[str, Tensor]] = {"fisher": {}, "cov": {}}

    def add(self, batch: CurvatureBatch) -> None:
        """Add one batch's squared per-sample gradients (Fisher rows and true labels) from its
        layer-hook ``terms``."""
        terms = scale_terms(batch.terms, self.decay)
        for kind, source in (("fisher", terms.diagonal), ("cov", terms.cov_diagonal)):
            store = self.sums[kind]
            for name, value in source.items():
                store[name] = store[name] + value if name in store else value.clone()

    def summable_states(self) -> list[Tensor]:
        return [s[name] for s in self.sums.values() for name in self.order if name in s]

    def _flat(self, kind: str) -> Tensor:
        store = self.sums[kind]
        return torch.cat([store[name].reshape(-1) for name in self.order if name in store])

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        diag = (self._flat("fisher").to(torch.float64) / num_samples).clamp_min(0.0)
        cov = self._flat("cov").to(torch.float64) / num_samples
        tic = float((cov / (diag + lam)).sum())
        return CurvatureEstimate(spectral_summary(diag, lam), diag, tic_trace=tic)
