"""``structure="gram"``: the exact nonzero spectrum of F for any number of parameters.

The nonzero eigenvalues of ``F_m = (1/m) Σ_{i≤m} V_iᵀ V_i = (1/m) VᵀV`` are those of the
(mC × mC) kernel ``K = (1/m) V Vᵀ`` (docs/math.md, "Gram trick"), so the cost is bounded by
samples × classes, not by P. Whichever of ``VᵀV`` (P × P) and ``VVᵀ`` (mC × mC) is smaller is
diagonalised. The rows of ``V`` are kept, so the size guard is on ``mC``.

The regularized TIC is exact too, by the push-through identity
``(F+λI)⁻¹ = (1/λ)(I − Ṽᵀ(K+λI)⁻¹Ṽ)`` with ``Ṽ = V/√m``:
``Tr(C(F+λI)⁻¹) = (1/λ)(Tr C − Tr(G̃ Ṽᵀ (K+λI)⁻¹ Ṽ G̃ᵀ))``, ``G̃`` the per-sample gradients / √m;
and so is the Newton decrement given the objective's gradient g,
``½ gᵀ(F+λI)⁻¹g = (‖g‖² − (Ṽg)ᵀ(K+λI)⁻¹(Ṽg)) / (2λ)`` (docs/math.md, "The Newton decrement").
"""

from __future__ import annotations

import math

import torch
from backpack.extensions import BatchGrad, SqrtGGNExact
from torch import Tensor

from lightning_flatness.core.backpack.dense import regularized_tic_trace
from lightning_flatness.core.backpack.estimator import (
    CurvatureEstimator,
    batch_gradients,
    sqrt_factors,
)
from lightning_flatness.core.curvature.base import CurvatureBatch, CurvatureEstimate
from lightning_flatness.core.curvature.newton_decrement import (
    guarded_decrement,
    regularized_form,
    woodbury_form,
)
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import StructureTooLargeError
from lightning_flatness.core.spectral import psd_eigenvalues, spectral_summary

__all__ = ["GramFisher"]

DEFAULT_MAX_KERNEL_SIZE = 8_192


#: why ``gram`` is refused across processes, and what to use instead
NOT_SUMMABLE = (
    "structure='gram' keeps per-sample rows, which do not sum across processes; under DDP use "
    "structure='dense', 'kfac', 'diag' or 'diag_mc' (or 'auto': the probe kernel)."
)


class GramFisher(CurvatureEstimator):
    """Exact spectrum through the (mC × mC) kernel; refuses ``mC > max_kernel_size``."""

    name = "gram"

    def __init__(
        self,
        ggn_scale: float = 1.0,
        max_kernel_size: int = DEFAULT_MAX_KERNEL_SIZE,
        decay: ParameterDecay | None = None,
    ):
        super().__init__(ggn_scale, decay)
        self.max_kernel_size = max_kernel_size
        self.rows: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.num_rows = 0

    def extensions(self) -> list[object]:
        return [SqrtGGNExact(), BatchGrad()]

    def add(self, batch: CurvatureBatch) -> None:
        model, batch_size = batch.model, batch.size
        factors = self.scaled(sqrt_factors(model, "sqrt_ggn_exact"), model)
        self.num_rows += factors.shape[0]
        if self.num_rows > self.max_kernel_size:
            raise StructureTooLargeError(
                f"structure='gram' needs a (samples × classes)² kernel; {self.num_rows:,} rows "
                f"exceed GramOptions.max_kernel_size={self.max_kernel_size:,}. Pass max_samples="
                f"{self.max_kernel_size // max(1, factors.shape[0] // batch_size):,} or fewer, "
                "use structure='dense' when P is small, 'kfac' or 'diag', or raise the guard."
            )
        self.rows.append(factors)
        self.grads.append(self.scaled(batch_gradients(model), model))

    def summable_states(self) -> list[Tensor]:
        """None: the per-sample rows do not sum across processes (the backend refuses
        ``gram`` under data parallelism, :data:`NOT_SUMMABLE`)."""
        return []

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        scaled = torch.cat(self.rows) * (self.ggn_scale / num_samples) ** 0.5
        grads = torch.cat(self.grads) * (self.cov_scale / num_samples) ** 0.5
        num_rows, num_params = scaled.shape
        if num_params <= num_rows:
            fisher = scaled.T @ scaled
            eigenvalues = psd_eigenvalues(fisher)
            tic = regularized_tic_trace(fisher, grads.T @ grads, lam)
        else:
            kernel = scaled @ scaled.T
            eigenvalues = psd_eigenvalues(kernel)
            cross = scaled @ grads.T  # (mC × m)
            regularized = kernel + lam * torch.eye(num_rows, dtype=kernel.dtype)
            solved = torch.linalg.solve(regularized, cross)
            tic = float((grads.square().sum() - (cross * solved).sum()) / lam)
        estimate = CurvatureEstimate(spectral_summary(eigenvalues, lam), eigenvalues, tic_trace=tic)
        if self.gradient is not None:
            estimate.newton_decrement = self._decrement(scaled, lam)
        return estimate

    def _decrement(self, scaled: Tensor, lam: float) -> float:
        """``½ gᵀ(ṼᵀṼ + λI)⁻¹g`` on the smaller side (module docstring); NaN (with a warning)
        when the solve fails."""

        def compute(gradient: Tensor) -> tuple[float, float]:
            gradient = gradient.to(scaled)
            if scaled.shape[1] <= scaled.shape[0]:
                return 0.5 * regularized_form(scaled.T @ scaled, lam, gradient), math.nan
            norm_sq = float(gradient.square().sum())
            form = woodbury_form(scaled @ scaled.T, lam, scaled @ gradient, norm_sq, 1)
            return 0.5 * form, math.nan

        return guarded_decrement("gram", self.gradient, compute)[0]
