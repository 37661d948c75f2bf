"""``structure="dense"``: the full P × P Fisher from BackPACK's square-root factors.

``F = (1/m) Σ_i V_iᵀ V_i`` (docs/math.md, "Square-root factor"; ``SqrtGGNExact`` returns the rows of
``V_i``), accumulated batch by batch as a P × P sum, then one float64 eigendecomposition. The
gradient covariance ``C = (1/m) Σ_i g_i g_iᵀ`` is accumulated too, which makes the regularized
TIC ``Tr(C (F+λI)⁻¹)`` exact (docs/math.md, "Generalization gap", baselines), and so is the
Newton decrement ``½ gᵀ(F+λI)⁻¹g`` given the objective's gradient (docs/math.md, "The Newton
decrement"), from the same Cholesky factor.
"""

from __future__ import annotations

import math

import torch
from backpack.extensions import BatchGrad, SqrtGGNExact
from torch import Tensor

from lightning_flatness.core.backpack.estimator import (
    CurvatureEstimator,
    batch_gradients,
    sqrt_factors,
)
from lightning_flatness.core.curvature.base import CurvatureBatch, CurvatureEstimate
from lightning_flatness.core.curvature.newton_decrement import guarded_decrement, regularized_form
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.spectral import (
    psd_eigenvalues,
    regularized_cholesky,
    spectral_summary,
)

__all__ = ["DenseFisher", "regularized_tic_trace"]

DEFAULT_MAX_PARAMETERS = 20_000


def regularized_tic_trace(
    fisher: Tensor, cov: Tensor, lam: float, factor: Tensor | None = None
) -> float:
    """``Tr(C (F+λI)⁻¹)`` through a Cholesky solve (no eigenvectors needed; ``factor``: the
    Cholesky factor of ``F + λI``, if already computed)."""
    if factor is None:
        factor = regularized_cholesky(fisher, lam)
    return float(torch.cholesky_solve(cov, factor).diagonal().sum())


class DenseFisher(CurvatureEstimator):
    """Exact P × P Fisher; refuses models with more than ``max_parameters`` parameters."""

    name = "dense"

    def __init__(
        self,
        ggn_scale: float = 1.0,
        max_parameters: int = DEFAULT_MAX_PARAMETERS,
        decay: ParameterDecay | None = None,
    ):
        super().__init__(ggn_scale, decay)
        self.max_parameters = max_parameters
        self.fisher_sum: Tensor | None = None
        self.cov_sum: Tensor | None = None

    def check_size(self, num_parameters: int) -> None:
        if num_parameters > self.max_parameters:
            raise StructureTooLargeError(
                f"structure='dense' builds a P × P matrix, and this model has P = "
                f"{num_parameters:,} parameters (guard: DenseOptions.max_parameters="
                f"{self.max_parameters:,}). Use structure='gram' (exact, any P, bounded by "
                "samples × classes), 'kfac' or 'diag', or raise the guard with "
                "structure=DenseOptions(max_parameters=...)."
            )

    def extensions(self) -> list[object]:
        return [SqrtGGNExact(), BatchGrad()]

    def add(self, batch: CurvatureBatch) -> None:
        model = batch.model
        factors = self.scaled(sqrt_factors(model, "sqrt_ggn_exact"), model)
        grads = self.scaled(batch_gradients(model), model)
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
        factor = regularized_cholesky(fisher, lam)
        cov = self.cov_scale * self.cov_sum / num_samples
        tic = regularized_tic_trace(fisher, cov, lam, factor)
        estimate = CurvatureEstimate(spectral_summary(eigenvalues, lam), eigenvalues, tic_trace=tic)
        if self.gradient is not None:
            estimate.newton_decrement = _exact_decrement(fisher, lam, self.gradient, factor)
        return estimate


def _exact_decrement(fisher: Tensor, lam: float, gradient: Tensor, factor=None) -> float:
    """``½ gᵀ(F+λI)⁻¹g`` of the exact Fisher; NaN (with a warning) when the solve fails."""

    def compute(gradient: Tensor) -> tuple[float, float]:
        return 0.5 * regularized_form(fisher, lam, gradient, factor), math.nan

    return guarded_decrement("dense", gradient, compute)[0]
