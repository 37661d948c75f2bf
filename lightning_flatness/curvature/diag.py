"""``structure="diag"`` / ``"diag_mc"``: the Fisher's diagonal, the extreme pinching (Prop. 6.1).

``DiagGGNExact`` gives ``diag F`` exactly; ``DiagGGNMC`` an unbiased estimate from labels sampled
from the model (``mc_samples`` per input). The eigenvalues of the diagonal approximation are the
diagonal entries, so ``rank_λ(diag F) = Σ_k F_kk/(F_kk+λ)`` — an upper bound on ``rank_λ(F)``
(pinching, Prop. 6.1). The regularized TIC uses the diagonal formula
``Σ_k C_kk/(F_kk+λ)`` with ``C_kk = (1/m) Σ_i g_ik²`` from ``SumGradSquared``.
"""

from __future__ import annotations

import torch
from backpack.extensions import DiagGGNExact, DiagGGNMC, SumGradSquared
from torch import Tensor

from lightning_flatness._backpack import ExtendedModel
from lightning_flatness.curvature.base import CurvatureEstimate, CurvatureEstimator
from lightning_flatness.spectral import spectral_summary

__all__ = ["DiagonalFisher"]


class DiagonalFisher(CurvatureEstimator):
    """Diagonal Fisher, exact (``sampled=False``) or Monte-Carlo (``sampled=True``)."""

    def __init__(self, ggn_scale: float = 1.0, sampled: bool = False, mc_samples: int = 1):
        super().__init__(ggn_scale)
        if mc_samples < 1:
            raise ValueError(f"mc_samples must be ≥ 1, got {mc_samples!r}.")
        self.sampled = sampled
        self.mc_samples = mc_samples
        self.name = "diag_mc" if sampled else "diag"
        self.savefield = "diag_ggn_mc" if sampled else "diag_ggn_exact"
        self.diag_sum: Tensor | None = None
        self.grad_sq_sum: Tensor | None = None

    def extensions(self) -> list[object]:
        curvature = DiagGGNMC(mc_samples=self.mc_samples) if self.sampled else DiagGGNExact()
        return [curvature, SumGradSquared()]

    def update(self, model: ExtendedModel, batch_size: int) -> None:
        diag = torch.cat([getattr(p, self.savefield).reshape(-1) for p in model.parameters])
        grad_sq = torch.cat([p.sum_grad_squared.reshape(-1) for p in model.parameters])
        if self.diag_sum is None:
            self.diag_sum = torch.zeros_like(diag, dtype=torch.float64)
            self.grad_sq_sum = torch.zeros_like(grad_sq, dtype=torch.float64)
        self.diag_sum += diag.detach().to(torch.float64)
        self.grad_sq_sum += grad_sq.detach().to(torch.float64)

    def summable_states(self) -> list[Tensor]:
        return [t for t in (self.diag_sum, self.grad_sq_sum) if t is not None]

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        diag = (self.ggn_scale * self.diag_sum / num_samples).clamp_min(0.0)
        tic = float((self.cov_scale * self.grad_sq_sum / num_samples / (diag + lam)).sum())
        return CurvatureEstimate(spectral_summary(diag, lam), diag, tic_trace=tic)
