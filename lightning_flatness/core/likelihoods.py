"""The three output likelihoods the package measures, each stated once.

A loss is the negative log-likelihood of an output distribution ``p(y | z)`` on the logits
``z ∈ ℝ^C`` of one sample. Everything the package computes from a loss goes through one of
these classes (docs/math.md, "Losses"):

==================  ==================================  =================================
``loss=``           ``−log p(y | z)``                   output Fisher ``Λ = E_ỹ[∇_z ∇_zᵀ]``
==================  ==================================  =================================
``cross_entropy``   ``−log softmax(z)_y``               ``diag p − p pᵀ``, ``p = softmax(z)``
``bce``             ``Σ_c −y_c log σ_c −(1−y_c) log     ``diag(σ(1 − σ))``, ``σ = sigmoid(z)``
                    (1−σ_c)`` (independent outputs)
``mse``             ``½‖y − z‖²`` (unit Gaussian)       ``I``
==================  ==================================  =================================

The Fisher is always that of the model's *own* likelihood, ``F = (1/m) Σ_i J_iᵀ Λ_i J_i``; the
targets enter only the loss, its gradients (``Tr(C)``) and the accuracy-like statistics. A
model trained with label smoothing is therefore measured by its plain likelihood: ``F`` and the
reported negative log-likelihood ignore the smoothing (docs/math.md, "Label smoothing").

Accuracy-like statistics, per sample (summed over samples by the callers):

- ``cross_entropy``: ``correct = [argmax z = y]``; error ``‖onehot(y) − p‖²``; uncertainty
  ``1 − ‖p‖²`` (the expected error when ``y`` is drawn from ``p``).
- ``bce``: ``correct`` = the fraction of the C outputs whose thresholded prediction
  ``[z_c > 0]`` equals ``[y_c ≥ ½]`` (per-label accuracy; for one output the binary accuracy);
  error ``‖y − σ‖²``; uncertainty ``Σ_c σ_c(1 − σ_c)`` (again the expected error under ``p``).
- ``mse``: NaN for all three (there is no accuracy of a regressor).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LOSSES",
    "BernoulliLikelihood",
    "CategoricalLikelihood",
    "GaussianLikelihood",
    "Likelihood",
    "OutputCore",
    "TargetError",
    "get_likelihood",
]

LOSSES = ("cross_entropy", "bce", "mse")


class TargetError(ValueError):
    """The targets do not fit the loss (the message names the loss that would fit)."""


@dataclass
class SampleScores:
    """Sums over a batch of the accuracy-like statistics (NaN where they mean nothing)."""

    error: float
    uncertainty: float
    correct: float


@dataclass
class OutputCore:
    """The output Fisher ``Λ_i`` of each sample of a batch and a square root ``A_i``, ``AᵀA = Λ``.

    ``kind`` is the likelihood's name; ``weights`` are ``p`` (cross-entropy), ``σ(1 − σ)``
    (bce) or None (mse). Cross-entropy: ``A = diag √p − √p pᵀ``, so ``A √p = 0`` and row c of
    ``A J`` is ``√p_c ∇θ log p_c``; bce: ``A = diag √(σ(1−σ))``; mse: ``A = I``.

    All methods act on the last axis (C) of tensors shaped (..., B, C).
    """

    kind: str
    weights: Tensor | None

    @classmethod
    def from_logits(cls, logits: Tensor, loss: str) -> OutputCore:
        return get_likelihood(loss).output_core(logits)

    def fisher(self, v: Tensor) -> Tensor:
        """``Λ v``."""
        if self.weights is None:
            return v
        w = self.weights
        if self.kind == "bce":
            return w * v
        return w * v - w * (w * v).sum(-1, keepdim=True)

    def sqrt(self, w: Tensor) -> Tensor:
        """``A w``: output tangents ``J v`` → rows of ``V v``."""
        if self.weights is None:
            return w
        if self.kind == "bce":
            return self.weights.sqrt() * w
        p = self.weights
        root = p.sqrt()
        return root * w - root * (p * w).sum(-1, keepdim=True)

    def sqrt_transpose(self, u: Tensor) -> Tensor:
        """``Aᵀ u``: the cotangent on the logits of ``Σ_c u_c (row c of V)``."""
        if self.weights is None:
            return u
        if self.kind == "bce":
            return self.weights.sqrt() * u
        p = self.weights
        root = p.sqrt()
        return root * u - p * (root * u).sum(-1, keepdim=True)

    def project(self, u: Tensor) -> Tensor:
        """Remove each sample's component in the null space of ``Aᵀ`` (``√p_i`` for
        cross-entropy; nothing for the other two, whose ``A`` is invertible)."""
        if self.weights is None or self.kind == "bce":
            return u
        root = self.weights.sqrt()
        return u - root * (root * u).sum(-1, keepdim=True)

    def diagonal(self, logits: Tensor) -> Tensor:
        """``ζ`` (B, C) of the diagonal-core upper bound ``Σ_c ζ_c ∇z_c ∇z_cᵀ ⪰ F`` (Eq. 8 of
        the Hutchinson-Fisher paper): ``p`` for cross-entropy; for bce and mse ``Λ`` is
        diagonal already, so ``ζ = diag Λ`` and the bound is exact."""
        if self.weights is None:
            return torch.ones_like(logits)
        return self.weights

    def top_eigenpair(self, start: Tensor, iterations: int) -> tuple[Tensor, Tensor]:
        """Largest eigenvalue ``λ_C`` (B,) and unit eigenvector ``v_C`` (B, C) of each ``Λ_i``.

        Cross-entropy: power iteration from the random ``start`` (B, C) (standard Gaussian),
        ``v ← (p∘v − (pᵀv) p)/‖·‖``, then ``λ_C = pᵀ(v∘v) − (pᵀv)²``. bce: the largest
        ``σ_c(1 − σ_c)`` and its unit vector. mse (``Λ = I``): ``λ_C = 1`` and the normalised
        start.
        """
        shape = start.shape
        v = start.to(torch.float64)
        v = v / v.norm(dim=-1, keepdim=True)
        if self.weights is None:
            return v.new_ones(shape[0]), v
        w = self.weights
        if self.kind == "bce":
            value, index = w.max(dim=-1)
            return value, F.one_hot(index, w.shape[-1]).to(w.dtype)
        v = v.to(device=w.device, dtype=w.dtype)
        for _ in range(iterations):
            v = self.fisher(v)
            v = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        value = (w * v.square()).sum(-1) - (w * v).sum(-1).square()
        return value.clamp_min(0.0), v


class Likelihood(ABC):
    """One output likelihood: loss, output Fisher, targets and accuracy-like statistics."""

    name: str = ""
    #: the smallest number of outputs the likelihood accepts
    min_outputs: int = 1

    def sample_rank(self, num_outputs: int) -> int:
        """The largest rank of one sample's output Fisher ``Λ_i``: C (bce, mse); the softmax's
        ``diag p − ppᵀ`` overrides it with C − 1. m samples give a Fisher of rank at most
        ``m`` times this."""
        return int(num_outputs)

    def fisher_rank_bound(self, num_parameters: int, num_samples: int, num_outputs: int) -> float:
        """The largest rank the Fisher of ``num_samples`` samples can have,
        ``min(P, m · sample_rank(C))`` (docs/math.md, "Rank bound")."""
        return float(min(num_parameters, num_samples * self.sample_rank(num_outputs)))

    def check_outputs(self, logits: Tensor, batch_size: int | None = None) -> None:
        """Refuse outputs that are not ``(batch, C)`` with at least :attr:`min_outputs` (and
        ``batch_size`` rows, when given)."""
        shaped = isinstance(logits, Tensor) and logits.dim() == 2
        if not shaped or (batch_size is not None and logits.shape[0] != batch_size):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            batch = "" if batch_size is None else f" for a batch of {batch_size} inputs"
            raise TargetError(
                f"The model's output must be logits of shape (batch, outputs); got {shape}"
                f"{batch}. Pass logits_fn=... to read them from what the model returns."
            )
        if logits.shape[1] < self.min_outputs:
            raise TargetError(
                f"loss={self.name!r} needs at least {self.min_outputs} outputs, the model "
                f"returns {logits.shape[1]}. A single-logit binary classifier uses loss='bce'."
            )

    def check_not_transformed(self, logits: Tensor) -> None:
        """Refuse outputs that are plainly the loss's link already applied (only the softmax's
        can be told apart from logits with certainty; see :class:`CategoricalLikelihood`)."""
        del logits  # sigmoid or identity outputs look like logits: nothing to refuse

    def prepare_targets(self, targets: Tensor, logits: Tensor) -> Tensor:
        """The targets in the form the loss uses (dtype, shape), after checking that the
        outputs (:meth:`check_outputs`) and the targets fit the loss.

        Raises:
            TargetError: naming the outputs' shape, or the targets' dtype/shape and the loss
                that would fit them.
        """
        self.check_outputs(logits)
        return self._prepare_targets(targets, logits)

    @abstractmethod
    def _prepare_targets(self, targets: Tensor, logits: Tensor) -> Tensor:
        """:meth:`prepare_targets` for outputs already checked."""

    @abstractmethod
    def nll(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Per-sample negative log-likelihood ``−log p(y_i | z_i)``, shape (B,), differentiable."""

    @abstractmethod
    def output_core(self, logits: Tensor) -> OutputCore:
        """The output Fisher of each sample (see :class:`OutputCore`)."""

    @abstractmethod
    def fisher_matrices(self, logits: Tensor) -> Tensor:
        """``Λ_i`` as dense (B, C, C) matrices (for small C: exact traces)."""

    @abstractmethod
    def weight_traces(self, logits: Tensor, weight: Tensor) -> Tensor:
        """``Tr(Wᵀ Λ_i W)`` per sample (B,) for a (C, d) matrix ``W``, without forming
        ``Λ_i``: O(B·C·d) (relative flatness at any number of classes)."""

    @abstractmethod
    def scores(self, logits: Tensor, targets: Tensor) -> SampleScores:
        """Error, uncertainty and correct-prediction sums of a batch (module docstring)."""

    #: the noise a draw is made from: ``"uniform"`` [0, 1) or standard ``"gaussian"``
    noise_kind = "uniform"
    #: True when one noise number per sample makes its draw (a class index), else one per output
    noise_per_sample = False

    def draw(self, logits: Tensor, generator: torch.Generator) -> Tensor:
        """One draw per sample from the model's ``p(· | z_i)``, with ``generator`` only (the
        global RNG is never used): a class index (inverse CDF), 0/1 labels (comparison with
        uniforms) or, for the Gaussian, the noise ``ε = ỹ − z``. Draws stay fixed under small
        changes of θ for a generator in a fixed state."""
        shape = (logits.shape[0],) if self.noise_per_sample else tuple(logits.shape)
        draw_noise = torch.randn if self.noise_kind == "gaussian" else torch.rand
        noise = draw_noise(shape, generator=generator, dtype=torch.float64, device=generator.device)
        return self.draw_from(logits, noise)

    @abstractmethod
    def draw_from(self, logits: Tensor, noise: Tensor) -> Tensor:
        """:meth:`draw` from given noise of :attr:`noise_kind`, (B,) or (B, C) (for draws keyed
        by the samples' positions, :mod:`~lightning_flatness.core.positional`)."""

    def sampled_score(self, logits: Tensor, draw: Tensor) -> Tensor:
        """Per-sample ``s_i(θ)`` whose gradient is the score ``∇θ log p(ỹ_i | z_i)`` at the
        draw, so that ``E[∇s ∇sᵀ] = J_iᵀ Λ_i J_i`` and ``∇θ`` of any function of the rows is
        the gradient for fixed draws."""
        return -self.nll(logits, draw)

    @abstractmethod
    def sqrt_rows(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``(s, w)`` (each B, C) such that row c of ``V_i = A_i J_i`` is ``w_ic ∇θ s_ic``.

        Cross-entropy: ``s = log p``, ``w = √p``; bce: ``s = z``, ``w = √(σ(1−σ))``; mse:
        ``s = z``, ``w = 1``. Both keep their graph (the regularizer differentiates ``w``).
        """


def _describe(targets: Tensor) -> str:
    return f"targets of dtype {targets.dtype} and shape {tuple(targets.shape)}"


def _as_output_shape(targets: Tensor, logits: Tensor, name: str) -> Tensor:
    """``(B,)`` targets of a one-output model become ``(B, 1)``; otherwise shapes must match."""
    if targets.dim() == 1 and logits.shape[1] == 1:
        targets = targets.unsqueeze(1)
    if targets.shape != logits.shape:
        raise TargetError(
            f"loss={name!r} needs targets shaped like the outputs {tuple(logits.shape)}; got "
            f"{_describe(targets)}."
            + (
                " Integer class labels go with loss='cross_entropy'."
                if not targets.is_floating_point() and targets.dim() == 1
                else ""
            )
        )
    return targets


class CategoricalLikelihood(Likelihood):
    """Softmax cross-entropy: ``−log p_y``, ``Λ = diag p − p pᵀ``."""

    name = "cross_entropy"
    min_outputs = 2

    def sample_rank(self, num_outputs: int) -> int:
        return max(int(num_outputs) - 1, 0)

    def check_not_transformed(self, logits: Tensor) -> None:
        """Refuse a batch whose every row is non-negative and sums to 1: probabilities, whose
        softmax is not the model's predictive distribution. Log-probabilities (``log_softmax``)
        are logits of the same distribution and pass."""
        values = logits.detach().to(torch.float64)
        if values.shape[0] < 1 or values.shape[1] < 2:
            return
        sums = values.sum(1)
        if bool((values >= 0).all()) and bool(torch.allclose(sums, torch.ones_like(sums))):
            raise TargetError(
                f"The model's outputs look like probabilities (every one of the {values.shape[0]} "
                f"rows is non-negative and sums to 1), but loss='cross_entropy' reads logits: "
                "the measured Fisher and losses would be those of softmax(probabilities). "
                "Return logits (drop the softmax), or pass logits_fn=lambda model, x: "
                "model(x).log() (log-probabilities are valid logits)."
            )

    def _prepare_targets(self, targets: Tensor, logits: Tensor) -> Tensor:
        if targets.is_floating_point() or targets.dtype == torch.bool:
            multi_hot = targets.dim() == 2 and targets.shape == logits.shape
            hint = (
                "multi-hot targets shaped like the outputs mean independent labels: pass "
                "loss='bce' (multi-label classification)"
                if multi_hot
                else "pass loss='mse' for regression targets or loss='bce' for binary/"
                "multi-label 0/1 targets, or cast class indices to torch.long"
            )
            raise TargetError(
                f"loss='cross_entropy' needs integer class indices of shape (batch,); got "
                f"{_describe(targets)}: {hint}."
            )
        targets = targets.reshape(-1) if targets.dim() == 2 and targets.shape[1] == 1 else targets
        if targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
            raise TargetError(
                f"loss='cross_entropy' needs one class index per sample, shape "
                f"({logits.shape[0]},); got {_describe(targets)}."
            )
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= logits.shape[1]):
            raise TargetError(
                f"Class indices must lie in [0, {logits.shape[1]}) for a model with "
                f"{logits.shape[1]} outputs; got values in [{int(targets.min())}, "
                f"{int(targets.max())}] (ignore_index and padding labels are not supported)."
            )
        return targets.to(torch.int64)

    def nll(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits, targets, reduction="none")

    def output_core(self, logits: Tensor) -> OutputCore:
        return OutputCore(self.name, torch.softmax(logits.detach(), dim=-1))

    def fisher_matrices(self, logits: Tensor) -> Tensor:
        p = torch.softmax(logits.detach(), dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    def weight_traces(self, logits: Tensor, weight: Tensor) -> Tensor:
        # Tr(Wᵀ (diag p − p pᵀ) W) = Σ_c p_c ‖w_c‖² − ‖Wᵀ p‖²
        p = torch.softmax(logits.detach(), dim=-1)
        return p @ weight.square().sum(-1) - (p @ weight).square().sum(-1)

    def scores(self, logits: Tensor, targets: Tensor) -> SampleScores:
        p = torch.softmax(logits.detach().to(torch.float64), dim=-1)
        # ‖onehot(y) − p‖² = 1 − 2 p_y + ‖p‖², without the (B, C) one-hot matrix
        squares = p.square().sum(-1)
        p_true = p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return SampleScores(
            error=float((1.0 - 2.0 * p_true + squares).sum()),
            uncertainty=float((1.0 - squares).sum()),
            correct=float((logits.argmax(-1) == targets).sum()),
        )

    noise_per_sample = True

    def draw_from(self, logits: Tensor, noise: Tensor) -> Tensor:
        p = torch.softmax(logits.detach().to(torch.float64), dim=-1)
        uniforms = noise.reshape(-1).to(device=p.device, dtype=torch.float64)
        labels = (p.cumsum(dim=-1) < uniforms.unsqueeze(-1)).sum(dim=-1)
        return labels.clamp_max(p.shape[-1] - 1)

    def sqrt_rows(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        log_p = torch.log_softmax(logits, dim=-1)
        return log_p, torch.exp(0.5 * log_p)  # exp(½ log p): no NaN gradient where p → 0


class BernoulliLikelihood(Likelihood):
    """Independent sigmoid outputs (multi-label, or binary with one logit): ``Λ = diag σ(1−σ)``."""

    name = "bce"

    def _prepare_targets(self, targets: Tensor, logits: Tensor) -> Tensor:
        targets = _as_output_shape(targets, logits, self.name).to(logits.dtype)
        if targets.numel() and (float(targets.min()) < 0 or float(targets.max()) > 1):
            raise TargetError(
                f"loss='bce' needs targets in [0, 1]; got values in [{float(targets.min())}, "
                f"{float(targets.max())}]. Pass loss='mse' for regression targets."
            )
        return targets

    def nll(self, logits: Tensor, targets: Tensor) -> Tensor:
        losses = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        return losses.sum(-1)

    def output_core(self, logits: Tensor) -> OutputCore:
        sigma = torch.sigmoid(logits.detach())
        return OutputCore(self.name, sigma * (1.0 - sigma))

    def fisher_matrices(self, logits: Tensor) -> Tensor:
        sigma = torch.sigmoid(logits.detach())
        return torch.diag_embed(sigma * (1.0 - sigma))

    def weight_traces(self, logits: Tensor, weight: Tensor) -> Tensor:
        sigma = torch.sigmoid(logits.detach())
        return (sigma * (1.0 - sigma)) @ weight.square().sum(-1)

    def scores(self, logits: Tensor, targets: Tensor) -> SampleScores:
        sigma = torch.sigmoid(logits.detach().to(torch.float64))
        y = targets.to(torch.float64)
        hits = ((logits.detach() > 0) == (y >= 0.5)).to(torch.float64).mean(-1)
        return SampleScores(
            error=float((y - sigma).square().sum()),
            uncertainty=float((sigma * (1.0 - sigma)).sum()),
            correct=float(hits.sum()),
        )

    def draw_from(self, logits: Tensor, noise: Tensor) -> Tensor:
        sigma = torch.sigmoid(logits.detach().to(torch.float64))
        uniforms = noise.to(device=sigma.device, dtype=torch.float64)
        return (uniforms < sigma).to(logits.dtype)

    def sqrt_rows(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        # σ(1−σ) = exp(log σ(z) + log σ(−z)), stable for large |z|
        weight = torch.exp(0.5 * (F.logsigmoid(logits) + F.logsigmoid(-logits)))
        return logits, weight


class GaussianLikelihood(Likelihood):
    """Unit-variance Gaussian regression: ``½‖y − z‖²``, ``Λ = I``."""

    name = "mse"

    def _prepare_targets(self, targets: Tensor, logits: Tensor) -> Tensor:
        return _as_output_shape(targets, logits, self.name).to(logits.dtype)

    def nll(self, logits: Tensor, targets: Tensor) -> Tensor:
        return 0.5 * (logits - targets).square().sum(-1)

    def output_core(self, logits: Tensor) -> OutputCore:
        return OutputCore(self.name, None)

    def fisher_matrices(self, logits: Tensor) -> Tensor:
        eye = torch.eye(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        return eye.expand(logits.shape[0], -1, -1)

    def weight_traces(self, logits: Tensor, weight: Tensor) -> Tensor:
        return weight.square().sum().expand(logits.shape[0])

    def scores(self, logits: Tensor, targets: Tensor) -> SampleScores:
        return SampleScores(math.nan, math.nan, math.nan)

    noise_kind = "gaussian"

    def draw_from(self, logits: Tensor, noise: Tensor) -> Tensor:
        return noise.to(device=logits.device, dtype=logits.dtype)

    def sampled_score(self, logits: Tensor, draw: Tensor) -> Tensor:
        # log N(z + ε | z, I) has score Jᵀε; with ε fixed (not ỹ), ε·z is that function of θ.
        return (draw * logits).sum(-1)

    def sqrt_rows(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return logits, torch.ones_like(logits)


_LIKELIHOODS: dict[str, Likelihood] = {
    cls.name: cls() for cls in (CategoricalLikelihood, BernoulliLikelihood, GaussianLikelihood)
}


def get_likelihood(loss: str) -> Likelihood:
    """The likelihood of ``loss`` (one of :data:`LOSSES`)."""
    try:
        return _LIKELIHOODS[loss]
    except (KeyError, TypeError):
        raise ValueError(
            f"loss must be one of {LOSSES} (softmax classification, independent sigmoid "
            f"outputs for multi-label or single-logit binary, Gaussian regression), got {loss!r}."
        ) from None
