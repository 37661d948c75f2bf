"""``structure="dense"``: the full P × P Fisher from BackPACK's square-root factors.

``F = (1/m) Σ_i V_iᵀ V_i`` (docs/math.md, "Square-root factor"; ``SqrtGGNExact`` returns the rows of
``V_i``), accumulated batch by batch as a P × P sum, then one float64 eigendecomposition. The
gradient covariance ``C = (1/m) Σ_i g_i g_iᵀ`` is accumulated too, which makes the regularized
TIC ``Tr(C (F+λI)⁻¹)`` exact (docs/math.md, "Generalization gap", baselines).
"""

from __future__ import annotations

import torch
from backpack.extensions import BatchGrad, SqrtGGNExact
from torch import Tensor

from lightning_flatness.core.backpack.estimator import (
    CurvatureEstimator,
    batch_gradients,
    sqrt_factors,
)
from lightning_flatness.core.backpack.extension import ExtendedModel
from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.spectral import psd_eigenvalues, spectral_summary

__all__ = ["DenseFisher", "regularized_tic_trace"]

DEFAULT_MAX_PARAMETERS = 20_000


def regularized_tic_trace(fisher: Tensor, cov: Tensor, lam: float) -> float:
    """``Tr(C (F+λI)⁻¹)`` through a Cholesky solve (no eigenvectors needed)."""
    eye = torch.eye(fisher.shape[0], dtype=fisher.dtype, device=fisher.device)
    factor = torch.linalg.cholesky(fisher + lam * eye)
    return float(torch.cholesky_solve(cov, factor).diagonal().sum())


class DenseFisher(CurvatureEstimator):
    """Exact P × P Fisher; refuses models with more than ``max_parameters`` parameters."""

    name = "dense"

    def __init__(self, ggn_scale: float = 1.0, max_parameters: int = DEFAULT_MAX_PARAMETERS):
        super().__init__(ggn_scale)
        self.max_parameters = max_parameters
        self.fisher_sum: Tensor | None = None
        self.cov_sum: Tensor | None = None

    def check_size(self, num_parameters: int) -> None:
        if num_parameters > self.max_parameters:
            raise StructureTooLargeError(
                f"structure='dense' builds a P × P matrix, and this model has P = "
                f"{num_parameters:,} parameters (guard: dense_max_parameters="
                f"{self.max_parameters:,}). Use structure='gram' (exact, any P, bounded by "
                "samples × classes), 'kfac' or 'diag', or raise dense_max_parameters."
            )

    def extensions(self) -> list[object]:
        return [SqrtGGNExact(), BatchGrad()]

    def update(self, model: ExtendedModel, batch_size: int) -> None:
        factors = self.scaled(sqrt_factors(model, "sqrt_ggn_exact"))
        grads = self.scaled(batch_gradients(model))
        if self.fisher_sum is None:
            self.check_size(factors.shape[1])
            size = factors.shape[1]
            self.fisher_sum = factors.new_zeros(size, size)
            self.cov_sum = factors.new_zeros(size, size)
        self.fisher_sum.addmm_(factors.T, factors)
        self.cov_sum.addmm_(grads.T, grads)

    def summable_states(self) -> list[Tensor]:
        return [t for t in (self.fisher_sum, self.cov_sum) if t is not None]

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        fisher = self.ggn_scale * self.fisher_sum / num_samples
        eigenvalues = psd_eigenvalues(fisher)
        tic = regularized_tic_trace(fisher, self.cov_scale * self.cov_sum / num_samples, lam)
        return CurvatureEstimate(spectral_summary(eigenvalues, lam), eigenvalues, tic_trace=tic)
