"""Per-sample statistics that every structure reports, as sums that add up across processes.

Over the samples of one split (train or validation) every backend computes, per batch and from
the same passes that feed its curvature structure (the outputs-only part is :func:`output_sums`,
shared by all; BackPACK's structures add theirs in
:class:`~lightning_flatness.core.backpack.statistics.SampleStatistics`):

- the negative log-likelihood ``Σ_i −log p(y_i | z_i)`` of the model's own likelihood
  (:mod:`lightning_flatness.core.likelihoods`: cross-entropy, independent Bernoulli, or
  ``½‖y_i − f_i‖²`` for regression), unsmoothed and unregularized;
- ``Σ_i ‖g_i‖²`` → ``Tr(C)`` (docs/math.md, "The three matrices": C is uncentered, true labels);
- ``Σ_i Tr(V_iᵀV_i)`` → ``Tr(F)`` (exact, or an unbiased one-sample Monte-Carlo estimate);
- the error (e.g. ``Σ_i ‖onehot(y_i) − p_i‖²``) and the uncertainty (its expectation under the
  model, e.g. ``Σ_i (1 − ‖p_i‖²)``) whose ratio is the error/uncertainty ratio α*
  (docs/math.md, "Generalization gap"), and the correct predictions; NaN for regression;
- the relative flatness of the last linear layer (docs/math.md, "Relative flatness"):
  ``κ = (1/m) Σ_i ‖φ_i‖² · Tr(W Wᵀ Λ_i)``, φ_i its input and ``Λ_i`` the output Fisher;
- the sum of squared per-sample NLLs, for the standard error of the mean NLL (the observed
  gap's noise: :meth:`StatisticSums.squared_error_of_mean`);
- the number of samples.

Only sums are kept, so the numbers do not depend on the batch size, and under data parallelism
the sums are reduced across processes before any ratio is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from lightning_flatness.core.likelihoods import Likelihood

__all__ = ["StatisticSums", "output_sums"]


@dataclass
class StatisticSums:
    """Running sums over samples (all float64 scalars)."""

    count: float = 0.0
    loss: float = 0.0
    grad_norm_sq: float = 0.0
    fisher_trace: float = 0.0
    error: float = 0.0
    uncertainty: float = 0.0
    correct: float = 0.0
    relative_flatness: float = 0.0
    loss_squares: float = 0.0

    def as_tensor(self) -> Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: Tensor) -> StatisticSums:
        return cls(*(float(v) for v in values))

    def __add__(self, other: StatisticSums) -> StatisticSums:
        return StatisticSums.from_tensor(self.as_tensor() + other.as_tensor())

    def mean(self, name: str) -> float:
        """Per-sample mean of the sum ``name``; NaN when there are no samples."""
        return getattr(self, name) / self.count if self.count else math.nan

    def squared_error_of_mean(self) -> float:
        """The squared standard error of the mean NLL, ``s²/m`` with ``s²`` the samples'
        unbiased variance; NaN below two samples."""
        if self.count < 2:
            return math.nan
        variance = (self.loss_squares - self.loss**2 / self.count) / (self.count - 1)
        return max(variance, 0.0) / self.count


def output_sums(
    likelihood: Likelihood,
    logits: Tensor,
    targets: Tensor,
    last_layer: nn.Module | None,
    features: Tensor | None,
) -> StatisticSums:
    """The sums that depend on the outputs only, for one batch (the module docstring's loss,
    error, uncertainty, correct predictions and relative flatness; ``count``).

    Args:
        likelihood: the loss's likelihood.
        logits: the batch's outputs (B, C); used detached, in float64.
        targets: as prepared by ``likelihood.prepare_targets``.
        last_layer / features: the model's last layer (relative flatness when it is an
            ``nn.Linear``) and its input in this forward
            pass (relative flatness is NaN without them, or when that layer does not produce
            the outputs, e.g. a CNN whose class layer is a convolution).
    """
    logits = logits.detach().to(torch.float64)
    targets = targets.to(torch.float64) if targets.is_floating_point() else targets
    scores = likelihood.scores(logits, targets)
    nll = likelihood.nll(logits, targets)
    return StatisticSums(
        count=float(logits.shape[0]),
        loss=float(nll.sum()),
        loss_squares=float(nll.square().sum()),
        error=scores.error,
        uncertainty=scores.uncertainty,
        correct=scores.correct,
        relative_flatness=_relative_flatness_sum(likelihood, logits, last_layer, features),
    )


def _relative_flatness_sum(
    likelihood: Likelihood, logits: Tensor, layer: nn.Module | None, features: Tensor | None
) -> float:
    """``Σ_i ‖φ_i‖² Tr(W Wᵀ Λ_i)`` for the last linear layer (docs/math.md, "Relative
    flatness"), if it produces the outputs; NaN otherwise. O(B·C·d): ``Λ_i`` is never formed."""
    classes = logits.shape[-1]
    if not isinstance(layer, nn.Linear) or features is None or layer.out_features != classes:
        return math.nan
    features = features.to(torch.float64).reshape(logits.shape[0], -1)
    weight = layer.weight.detach().to(torch.float64)
    traces = likelihood.weight_traces(logits, weight)
    return float((features.square().sum(-1) * traces).sum())
