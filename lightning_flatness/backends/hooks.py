"""The layer-hook backend of ``structure="kfac"``: any differentiable model, no graph conversion.

Per batch one forward and one backward pass per cotangent row on the live model
(:class:`~lightning_flatness.hooked_pass.HookedPass`), in eval mode with every module's mode
restored, no gradient written and the hooks removed after the measurement; the training
batches feed :class:`~lightning_flatness.curvature.kfac.KFACFisher`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_flatness.batches import Leaves, LogitsModule
from lightning_flatness.curvature.base import CurvatureEstimate
from lightning_flatness.curvature.kfac import KFACFisher
from lightning_flatness.failures import check_finite_loss
from lightning_flatness.hooked_pass import HookedPass
from lightning_flatness.likelihoods import get_likelihood
from lightning_flatness.model_state import left_as_found
from lightning_flatness.pipeline import Backend, model_device_dtype
from lightning_flatness.statistics import StatisticSums, output_sums

__all__ = ["HookBackend"]


class HookBackend(Backend):
    """``kfac`` from layer hooks (module docstring).

    Args:
        model: the wrapped model.
        loss: the likelihood's name.
        kfac_mode / mc_samples / trace_estimator: see :class:`HookedPass`.
        seed: seeds the generator of the sampled labels.
    """

    def __init__(
        self,
        model: LogitsModule,
        *,
        loss: str,
        kfac_mode: str,
        mc_samples: int,
        trace_estimator: str,
        seed: int,
    ) -> None:
        self.model = model
        self.likelihood = get_likelihood(loss)
        self.settings = {
            "kfac_mode": kfac_mode,
            "mc_samples": mc_samples,
            "trace_estimator": trace_estimator,
        }
        self.seed = seed
        self.estimator = KFACFisher()
        self.hooked: HookedPass | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        with left_as_found(self.model):
            device, _ = model_device_dtype(self.model)
            generator = torch.Generator(device=device).manual_seed(int(self.seed) % (2**63))
            self.hooked = HookedPass(
                self.model, self.likelihood, generator=generator, **self.settings
            )
            try:
                yield
            finally:
                self.hooked.close()

    def batch(self, inputs: Leaves, targets: Tensor, split: str, index: int) -> StatisticSums:
        hooked = self.hooked
        logits = hooked.forward(inputs)
        targets = self.likelihood.prepare_targets(targets, logits)
        sums = output_sums(self.likelihood, logits, targets, hooked.last_linear, hooked.features())
        check_finite_loss(sums.loss, split, index)
        training = split == "training"
        terms = hooked.terms(logits, targets, inputs, curvature=training)
        sums.grad_norm_sq, sums.fisher_trace = terms.grad_norm_sq, terms.fisher_trace
        if training:
            self.estimator.add(terms)
        return sums

    def summable_states(self) -> list[Tensor]:
        return self.estimator.summable_states()

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        curvature = self.estimator.estimate(num_samples, lam, self.hooked.names)
        curvature.coverage = self.hooked.coverage()
        return curvature
