"""The interface of the BackPACK structures (``dense``, ``gram``) and the fields they read.

An estimator streams over batches: after each BackPACK backward pass (per-sample quantities of
a *summed* loss, so every BackPACK output is a sum over the batch's samples) it adds the batch's
contribution to running sums. Those sums are its only state, so under data parallelism they are
summed across processes (:meth:`CurvatureEstimator.summable_states`) *before* any eigenvalue is
taken; averaging per-process soft ranks would be wrong (the soft rank is not linear).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from lightning_flatness.core.backpack.extension import ExtendedModel
from lightning_flatness.core.curvature.base import (
    CurvatureAccumulator,
    CurvatureBatch,
    CurvatureEstimate,
)
from lightning_flatness.core.decay import ParameterDecay

__all__ = ["CurvatureEstimator", "batch_gradients", "sqrt_factors"]


class CurvatureEstimator(CurvatureAccumulator):
    """Accumulates one structure's sums over batches (the package's
    :class:`~lightning_flatness.core.curvature.base.CurvatureAccumulator`), fed by BackPACK's
    fields after each backward pass (:meth:`add` reads ``batch.model``); see the module
    docstring."""

    def __init__(self, ggn_scale: float = 1.0, decay: ParameterDecay | None = None) -> None:
        # BackPACK's GGN of the summed loss; 0.5 turns ‖y − f‖² (MSELoss) into ½‖y − f‖².
        self.ggn_scale = ggn_scale
        # The loss itself carries the same factor, so its gradient products carry its square.
        self.cov_scale = ggn_scale**2
        #: the per-group decays: rows and gradients are scaled by ``λ_j^{-1/2}`` and the
        #: estimate taken at λ = 1 (docs/math.md, "Per-group weight decay")
        self.decay = decay
        self._column_scale: Tensor | None = None

    def scaled(self, rows: Tensor, model: ExtendedModel) -> Tensor:
        """``rows`` (…, P) of ``model``'s parameters with each parameter's entries scaled by
        ``λ_j^{-1/2}`` under per-group decay (as they are without)."""
        if self.decay is None:
            return rows
        if self._column_scale is None:
            sizes = [p.numel() for p in model.parameters]
            self._column_scale = self.decay.column_scale(model.names, sizes)
        return rows * self._column_scale.to(device=rows.device, dtype=rows.dtype)

    @abstractmethod
    def extensions(self) -> list[object]:
        """BackPACK extensions this structure reads after each backward pass."""

    @abstractmethod
    def add(self, batch: CurvatureBatch) -> None:
        """Add the current batch's contribution (BackPACK fields on
        ``batch.model.parameters``)."""

    @abstractmethod
    def summable_states(self) -> list[Tensor]:
        """The running sums, to be summed across processes in place."""

    @abstractmethod
    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The spectral summary of ``F`` averaged over ``num_samples`` samples."""


def sqrt_factors(model: ExtendedModel, savefield: str) -> Tensor:
    """Stack BackPACK's square-root GGN factors into ``(N·C, P)`` rows, float64."""
    pieces = [getattr(p, savefield) for p in model.parameters]
    classes, batch = pieces[0].shape[:2]
    flat = torch.cat([piece.reshape(classes, batch, -1) for piece in pieces], dim=-1)
    return flat.transpose(0, 1).reshape(batch * classes, -1).to(torch.float64)


def batch_gradients(model: ExtendedModel) -> Tensor:
    """Per-sample gradients ``(N, P)`` of the summed loss from BackPACK's ``BatchGrad``."""
    pieces = [p.grad_batch for p in model.parameters]
    return torch.cat([piece.reshape(piece.shape[0], -1) for piece in pieces], dim=1).to(
        torch.float64
    )
