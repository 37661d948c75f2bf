"""What every curvature structure is and returns: the contract of its accumulator, and the
spectral summary of its approximation of F.

Every structure is a :class:`CurvatureAccumulator`. Per batch its backend hands it what it needs
(layer-hook terms, probe rows, BackPACK's fields, kept inputs) through the structure's own
``add``/``update`` method; everything it keeps between batches is a sum over samples, listed by
:meth:`~CurvatureAccumulator.summable_states` and summed across processes in place *before*
:meth:`~CurvatureAccumulator.estimate` takes any eigenvalue (the soft rank is not linear, so
averaging per-process soft ranks would be wrong); ``estimate(num_samples, lam)`` then gives the
:class:`CurvatureEstimate` of the Fisher averaged over every process's samples.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from torch import Tensor

from lightning_flatness.core.spectral import SpectralSummary

__all__ = ["CurvatureAccumulator", "CurvatureEstimate"]


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
        newton_decrement: ``½ gᵀ(F+λI)⁻¹g`` of the regularized objective over the measured set
            (:mod:`~lightning_flatness.core.curvature.newton_decrement`), jackknifed on a
            random structure; NaN where the structure does not compute it.
        newton_decrement_stderr: its standard error (NaN where exact or not computed).
        rank_bound: the largest rank the Fisher being estimated can have, ``min(P, m·r)``
            with r the rank of one sample's output Fisher (C − 1 for softmax, C for bce and
            mse); a soft rank above it is impossible. Every backend sets it
            (:meth:`~lightning_flatness.core.likelihoods.Likelihood.fisher_rank_bound`);
            infinite, so never checked, on an estimate made outside one.
        probe_rows: of a probe-kernel estimate, ``(s, C)``: the rows per sample it used and
            the model's outputs (s = C: the exact rows); None for the other structures.
    """

    summary: SpectralSummary
    eigenvalues: Tensor
    tic_trace: float = math.nan
    blocks: dict[str, SpectralSummary] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)
    rank_bound: float = math.inf
    newton_decrement: float = math.nan
    newton_decrement_stderr: float = math.nan
    probe_rows: tuple[int, int] | None = None


class CurvatureAccumulator(ABC):
    """The one interface of every structure (module docstring)."""

    #: the structure's name, as passed to ``measure(structure=...)``
    name: str = ""
    #: the gradient ``g`` of the regularized objective over every process's samples (in the
    #: estimate's coordinates: times ``D^{-1/2}`` under per-group decay), set by the backend
    #: before :meth:`estimate` on the structures that compute the Newton decrement from it
    gradient: Tensor | None = None

    def summable_states(self) -> list[Tensor]:
        """The sums over samples kept between batches, in a fixed order, to be summed across
        processes in place (none by default: a structure that makes its own passes)."""
        return []

    @abstractmethod
    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The estimate for the Fisher averaged over ``num_samples`` samples (all processes'
        states already summed) at weight decay ``lam``."""
