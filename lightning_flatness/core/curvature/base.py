"""What every curvature structure returns: the spectral summary of its approximation of F.

Every backend reduces its running sums across processes *before* it builds this (the soft rank
is not linear, so averaging per-process soft ranks would be wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

from lightning_flatness.core.spectral import SpectralSummary

__all__ = ["CurvatureEstimate"]


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
        rank_bound: the largest rank the Fisher being estimated can have, ``min(P, m·r)``
            with r the rank of one sample's output Fisher (C − 1 for softmax, C for bce and
            mse); a soft rank above it is impossible. Infinite where the structure does not know.
    """

    summary: SpectralSummary
    eigenvalues: Tensor
    tic_trace: float = math.nan
    blocks: dict[str, SpectralSummary] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)
    rank_bound: float = math.inf
