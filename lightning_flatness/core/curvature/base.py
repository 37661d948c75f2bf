"""What every curvature structure is and returns: the contract of its accumulator, and the
spectral summary of its approximation of F.

Every structure is a :class:`CurvatureAccumulator`, and every one is fed the same way:

- **per-group decay** at construction, ``decay: ParameterDecay | None``
  (:mod:`~lightning_flatness.core.decay`); the structure applies it itself (scaling its terms,
  rows or diagonals by ``λ_j^{-1/2}`` or ``1/λ_j`` and estimating at λ = 1, or, for ``cg``,
  solving with ``F + D``);
- **per-batch data** through one method, :meth:`~CurvatureAccumulator.add`, which every backend
  calls with one :class:`CurvatureBatch` per training batch (or per part of one, where the
  backend makes its passes in parts): the batch's size and number of outputs, and whatever the
  backend has of it — the layer-hook :class:`~lightning_flatness.core.batch_terms.BatchTerms`,
  the BackPACK-extended model after its backward pass, the prepared inputs. Each structure
  reads the fields it needs: ``kfac``, ``diag``/``diag_mc`` and ``probe_kernel`` the terms,
  ``dense`` and ``gram`` the extended model, ``hutchinson`` the inputs (one backward pass of
  its probes on them);
- everything it keeps between batches is a sum over samples, listed by
  :meth:`~CurvatureAccumulator.summable_states` (always a list, empty where nothing sums) and
  summed across processes in place *before* :meth:`~CurvatureAccumulator.estimate` takes any
  eigenvalue (the soft rank is not linear, so averaging per-process soft ranks would be
  wrong); ``estimate(num_samples, lam)`` then gives the :class:`CurvatureEstimate` of the
  Fisher averaged over every process's samples.

The structures that make their own passes over the data (``lanczos``, ``cg``: one per Lanczos
step or conjugate-gradient iteration) fit the same contract rather than a base class that owns
the data loop (as curvlinops' ``CurvatureLinearOperator`` does): their :meth:`add` keeps the
batch's inputs (in memory, or the fingerprint of a batch to be read again) and
:meth:`estimate` passes over what was kept. Owning the loop would move the reading, chunking
and cross-process checks of batches out of the one pipeline
(:func:`~lightning_flatness.core.pipeline.run_pipeline`) for two structures only; with one
``add`` every backend streams every structure the same way.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.spectral import SpectralSummary

if TYPE_CHECKING:
    from lightning_flatness.core.batch_terms import BatchTerms
    from lightning_flatness.core.batches import Leaves

__all__ = ["CurvatureAccumulator", "CurvatureBatch", "CurvatureEstimate"]


@dataclass
class CurvatureBatch:
    """What a backend has of one training batch (or part of one), handed to every structure's
    :meth:`CurvatureAccumulator.add` (module docstring); a field the backend does not have is
    None.

    Attributes:
        size: the batch's samples.
        outputs: C, the model's outputs.
        terms: the layer-hook sums and rows of the batch (layer-hook backend; ``cg``'s
            preconditioner factors in the ``torch.func`` backend), unscaled by decay.
        model: the BackPACK-extended model after the batch's backward pass, its fields on
            ``model.parameters`` (BackPACK backend).
        inputs: the batch's prepared inputs (``torch.func`` backend).
    """

    size: int
    outputs: int = 0
    terms: BatchTerms | None = None
    model: Any = None
    inputs: Leaves | None = None


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
    #: the per-group decays it measures (module docstring), set at construction; None: one λ
    decay: ParameterDecay | None = None

    @abstractmethod
    def add(self, batch: CurvatureBatch) -> None:
        """Take one training batch's data (module docstring): the one way every backend feeds
        every structure."""

    def summable_states(self) -> list[Tensor]:
        """The sums over samples kept between batches, in a fixed order, to be summed across
        processes in place (none by default: a structure that makes its own passes)."""
        return []

    @abstractmethod
    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The estimate for the Fisher averaged over ``num_samples`` samples (all processes'
        states already summed) at weight decay ``lam``."""
