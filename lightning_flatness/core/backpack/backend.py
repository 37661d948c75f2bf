"""The BackPACK backend of ``structure="dense"`` and ``"gram"``.

Per batch one forward and one BackPACK backward pass of the summed loss on a private, extended
copy of the model in eval mode
(:func:`~lightning_flatness.core.backpack.extension.measurement_copy`), under a
forked RNG seeded by ``seed`` (the Monte-Carlo extensions draw from it); the user's model is
never touched. BackPACK needs a graph it can convert into a chain of supported modules; when it
cannot, :class:`~lightning_flatness.core.failures.UnsupportedModelError` names the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_flatness.core.backpack.dense import DEFAULT_MAX_PARAMETERS as DENSE_GUARD
from lightning_flatness.core.backpack.dense import DenseFisher
from lightning_flatness.core.backpack.estimator import CurvatureEstimator
from lightning_flatness.core.backpack.extension import (
    ExtendedModel,
    backward_with,
    extended_loss,
    loss_scale,
    measurement_copy,
    support_loss,
)
from lightning_flatness.core.backpack.gram import DEFAULT_MAX_KERNEL_SIZE as GRAM_GUARD
from lightning_flatness.core.backpack.gram import GramFisher
from lightning_flatness.core.backpack.statistics import SampleStatistics
from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.curvature.base import CurvatureBatch, CurvatureEstimate
from lightning_flatness.core.curvature.newton_decrement import objective_gradient
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import check_finite_loss
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import rng_devices
from lightning_flatness.core.options import DenseOptions, GramOptions
from lightning_flatness.core.pipeline import Backend
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.statistics import StatisticSums

__all__ = ["BACKPACK_STRUCTURES", "BackpackBackend", "make_estimator"]

#: the structures :func:`make_estimator` builds on BackPACK's extensions
BACKPACK_STRUCTURES = ("dense", "gram")


class BackpackBackend(Backend):
    """One of BackPACK's structures (module docstring).

    Args:
        model: the wrapped model.
        options: :class:`~lightning_flatness.core.options.DenseOptions` (``dense``) or
            :class:`~lightning_flatness.core.options.GramOptions` (``gram``): Tr(F) estimator,
            size guard.
        reading: how batches and outputs are read; its ``loss`` names the likelihood.
        seed: seeds the forked RNG of the Monte-Carlo extensions (the sampled trace).
    """

    def __init__(
        self,
        model: LogitsModule,
        options: DenseOptions | GramOptions,
        reading: BatchReading,
        *,
        seed: int,
        decay: ParameterDecay | None = None,
    ) -> None:
        trace_estimator, structure, loss = options.trace_estimator, options.structure, reading.loss
        self.decay = decay
        self.model = model
        self.loss = loss
        self.likelihood = get_likelihood(loss)
        self.loss_fn = extended_loss(loss)
        self.loss_scale = loss_scale(loss)
        self.seed = seed
        self.estimator = make_estimator(structure, options, ggn_scale=loss_scale(loss), decay=decay)
        self.statistics = {
            "training": SampleStatistics(trace_estimator, loss, self.estimator.extensions()),
            "validation": SampleStatistics(trace_estimator, loss),
        }
        self.extended: ExtendedModel | None = None
        #: P, the trainable parameters measured (known once the session has made the copy)
        self.num_parameters = 0
        #: C, the model's outputs (known after the first batch)
        self.num_outputs: int | None = None
        #: the summed per-sample NLL gradients of the training samples (P,), for the Newton
        #: decrement; summed across processes with the curvature state
        self.gradient_sum: Tensor | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=rng_devices(self.model)):
            torch.manual_seed(self.seed)
            self.extended = measurement_copy(self.model)
            self.num_parameters = sum(p.numel() for p in self.extended.parameters)
            device = next(iter(self.extended.parameters)).device
            self.gradient_sum = torch.zeros(self.num_parameters, dtype=torch.float64, device=device)
            try:
                yield
            finally:
                self.extended = None

    def batch(self, inputs: Leaves, targets: Tensor, split: str, index: int) -> StatisticSums:
        statistics = self.statistics[split]
        training = split == "training"
        extensions = statistics.extensions() + (self.estimator.extensions() if training else [])
        support_loss(extensions, self.loss)
        model = self.extended
        logits = model.module(*inputs)
        targets = self.likelihood.prepare_targets(targets, logits)
        self.num_outputs = int(logits.shape[1])
        loss = self.loss_fn(logits, targets)
        check_finite_loss(float(loss.detach()), split, index)
        backward_with(model, loss, extensions, self.estimator.name if training else "statistics")
        if training:
            self.estimator.add(CurvatureBatch(num_samples(inputs), self.num_outputs, model=model))
            # the summed loss's gradient: Σ_i ∇ℓ_i, times the loss's scale to the NLL's
            summed = torch.cat([p.grad.reshape(-1) for p in model.parameters])
            self.gradient_sum += summed.to(torch.float64) * self.loss_scale
        sums = statistics.update(model, logits, targets)
        model.zero_grad()
        return sums

    def summable_states(self) -> list[Tensor]:
        return [*self.estimator.summable_states(), self.gradient_sum]

    def curvature(self, num_samples: int, lam: float) -> CurvatureEstimate:
        """The estimate at ``lam``, with the Newton decrement from the objective's gradient."""
        model = self.extended
        self.estimator.gradient = objective_gradient(
            self.gradient_sum,
            num_samples,
            model.names,
            list(model.parameters),
            self.decay if self.decay is not None else lam,
        )
        return self.estimator.estimate(num_samples, lam)

    def rank_shape(self) -> tuple[int, int]:
        # D^{-1/2} F D^{-1/2} (per-group decay) has the rank of F
        return self.num_parameters, self.num_outputs or 0

    def scales_by_decay(self) -> bool:
        return self.decay is not None


def make_estimator(
    structure: str,
    options: DenseOptions | GramOptions,
    *,
    ggn_scale: float = 1.0,
    decay: ParameterDecay | None = None,
) -> CurvatureEstimator:
    """The BackPACK estimator for ``structure`` (one of :data:`BACKPACK_STRUCTURES`) with its
    ``options`` (their size guard) and the per-group ``decay``."""
    if structure == "dense":
        guard = options.max_parameters
        return DenseFisher(ggn_scale, DENSE_GUARD if guard is None else guard, decay)
    if structure == "gram":
        guard = options.max_kernel_size
        return GramFisher(ggn_scale, GRAM_GUARD if guard is None else guard, decay)
    raise ValueError(f"structure must be one of {BACKPACK_STRUCTURES}, got {structure!r}.")
