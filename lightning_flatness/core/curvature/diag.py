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

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.spectral import spectral_summary

__all__ = ["DiagonalFisher"]


class DiagonalFisher:
    """The spectrum and diagonal TIC of ``diag F`` from the sums over samples of ``F_kk`` and
    ``C_kk`` (``diag_sum`` and ``grad_sq_sum``, flat in parameter order)."""

    def __init__(self, sampled: bool = False) -> None:
        self.name = "diag_mc" if sampled else "diag"
        self.diag_sum: Tensor | None = None
        self.grad_sq_sum: Tensor | None = None

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        diag = (self.diag_sum.to(torch.float64) / num_samples).clamp_min(0.0)
        cov = self.grad_sq_sum.to(torch.float64) / num_samples
        tic = float((cov / (diag + lam)).sum())
        return CurvatureEstimate(spectral_summary(diag, lam), diag, tic_trace=tic)
