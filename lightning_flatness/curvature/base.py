"""The interface every curvature structure implements, and the result it returns.

An estimator streams over batches: after each BackPACK backward pass (per-sample quantities of
a *summed* loss, so every BackPACK output is a sum over the batch's samples) it adds the batch's
contribution to running sums. Those sums are its only state, so under data parallelism they are
summed across processes (:meth:`CurvatureEstimator.summable_states`) *before* any eigenvalue is
taken; averaging per-process soft ranks would be wrong (the soft rank is not linear).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_flatness._backpack import ExtendedModel
from lightning_flatness.spectral import SpectralSummary

__all__ = ["CurvatureEstimate", "CurvatureEstimator", "StructureTooLargeError"]


class StructureTooLargeError(ValueError):
    """The requested structure would need more memory or time than its size guard allows."""


@dataclass
class CurvatureEstimate:
    """Spectral summary of the (approximate) Fisher ``F = (1/m) Σ_i V_iᵀ V_i``.

    Attributes:
        summary: soft rank, rank⁽²⁾, log-det, trace and max eigenvalue of the approximation.
        eigenvalues: its nonzero spectrum (float64), for histograms.
        tic_trace: ``Tr(C (F+λI)⁻¹)`` where the structure supports it, else NaN.
        blocks: per-parameter summaries for block-structured approximations.
        coverage: for block-structured approximations, how each parameter enters
            (``"kronecker"``, ``"exact block"`` or ``"diagonal"``).
    """

    summary: SpectralSummary
    eigenvalues: Tensor
    tic_trace: float = math.nan
    blocks: dict[str, SpectralSummary] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)


class CurvatureEstimator(ABC):
    """Accumulates one structure's sums over batches; see the module docstring."""

    #: structure name, as passed to ``measure(structure=...)``
    name: str = ""

    def __init__(self, ggn_scale: float = 1.0) -> None:
        # BackPACK's GGN of the summed loss; 0.5 turns ‖y − f‖² (MSELoss) into ½‖y − f‖².
        self.ggn_scale = ggn_scale
        # The loss itself carries the same factor, so its gradient products carry its square.
        self.cov_scale = ggn_scale**2

    @abstractmethod
    def extensions(self) -> list[object]:
        """BackPACK extensions this structure reads after each backward pass."""

    @abstractmethod
    def update(self, model: ExtendedModel, batch_size: int) -> None:
        """Add the current batch's contribution (BackPACK fields on ``model.parameters``)."""

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
