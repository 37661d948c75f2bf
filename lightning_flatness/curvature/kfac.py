"""``structure="kfac"``: per-layer Kronecker factors, ``F_l ≈ G_l ⊗ A_l`` (paper Section 6).

BackPACK's ``KFLR`` (exact loss Hessian, ``kfac_mode="exact"``) or ``KFAC`` (one sampled label
per input, ``kfac_mode="sampled"``) returns, for the summed loss of a batch of N samples, the
output-side factor ``G`` summed over samples and the input-side factor ``A`` averaged over
samples (a bias has ``G`` only). Both are turned into sums over samples and accumulated over
batches, so with m samples in all ``A = (1/m) Σ_i a_i a_iᵀ`` and ``G = (1/m) Σ_i G_i`` — the
same numbers for any batch size.

Convolutions follow KFC (Grosse & Martens, 2016, Eq. 22): ``A = E[Σ_t u_t u_tᵀ]`` and
``G = (1/T) E[Σ_t s_t s_tᵀ]`` over the T output positions; BackPACK's ``G`` is a plain sum over
positions, so it is divided by T here (without it the trace of a conv block is off by ≈ T).

The spectrum of ``G ⊗ A`` is all products ``g_j a_i`` (see
:func:`~lightning_flatness.spectral.kron_summary`): two small eigendecompositions per layer,
never a P × P matrix. Linear and Conv layers are
supported, biases included (as their own ``G`` block).
"""

from __future__ import annotations

import torch
from backpack.extensions import KFAC, KFLR
from torch import Tensor

from lightning_flatness._backpack import ExtendedModel
from lightning_flatness.curvature.base import CurvatureEstimate, CurvatureEstimator
from lightning_flatness.spectral import (
    kron_eigenvalues,
    kron_summary,
    psd_eigenvalues,
    sum_summaries,
)

__all__ = ["KFACFisher"]


class KFACFisher(CurvatureEstimator):
    """Kronecker-factored per-layer Fisher (exact KFLR or sampled KFAC factors)."""

    name = "kfac"

    def __init__(self, ggn_scale: float = 1.0, mode: str = "exact", mc_samples: int = 1):
        super().__init__(ggn_scale)
        if mode not in ("exact", "sampled"):
            raise ValueError(f"kfac_mode must be 'exact' or 'sampled', got {mode!r}.")
        if mc_samples < 1:
            raise ValueError(f"mc_samples must be ≥ 1, got {mc_samples!r}.")
        self.mode = mode
        self.mc_samples = mc_samples
        self.savefield = "kflr" if mode == "exact" else "kfac"
        self.factor_sums: dict[str, list[Tensor]] = {}

    def extensions(self) -> list[object]:
        return [KFLR()] if self.mode == "exact" else [KFAC(mc_samples=self.mc_samples)]

    def update(self, model: ExtendedModel, batch_size: int) -> None:
        positions = model.output_positions
        for name, param in zip(model.names, model.parameters, strict=True):
            factors = getattr(param, self.savefield)
            if factors is None:
                raise RuntimeError(f"BackPACK computed no Kronecker factors for {name!r}.")
            output_side = factors[0].detach().to(torch.float64) / positions.get(id(param), 1)
            sums = [output_side]
            if len(factors) == 2:  # input side: a mean over the batch → a sum
                sums.append(factors[1].detach().to(torch.float64) * batch_size)
            if name not in self.factor_sums:
                self.factor_sums[name] = [torch.zeros_like(s) for s in sums]
            for total, term in zip(self.factor_sums[name], sums, strict=True):
                total += term

    def summable_states(self) -> list[Tensor]:
        return [factor for factors in self.factor_sums.values() for factor in factors]

    def factor_eigenvalues(self, num_samples: int) -> dict[str, list[Tensor]]:
        """Eigenvalues of each parameter's (G, A) factors of ``F = (1/m) Σ`` ."""
        result = {}
        for name, sums in self.factor_sums.items():
            scales = [self.ggn_scale / num_samples] + [1.0 / num_samples] * (len(sums) - 1)
            result[name] = [
                psd_eigenvalues(total * scale) for total, scale in zip(sums, scales, strict=True)
            ]
        return result

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        eigen = self.factor_eigenvalues(num_samples)
        blocks = {name: kron_summary(values, lam) for name, values in eigen.items()}
        spectrum = torch.cat([kron_eigenvalues(values) for values in eigen.values()])
        return CurvatureEstimate(sum_summaries(blocks.values()), spectrum, blocks=blocks)
