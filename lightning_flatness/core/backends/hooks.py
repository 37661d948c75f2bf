"""The layer-hook backend of ``kfac``, ``diag`` and ``diag_mc``: any differentiable model.

Per batch one forward and one backward pass per cotangent row on the live model
(:class:`~lightning_flatness.core.hooked_pass.HookedPass`), in eval mode with every module's mode
restored, no gradient written and the hooks removed after the measurement; the training
batches feed :class:`~lightning_flatness.core.curvature.kfac.KFACFisher` (``kfac``) or the exact
(``diag``) or sampled-label (``diag_mc``) diagonals of F and C, whose spectrum and diagonal TIC
:class:`~lightning_flatness.core.curvature.diag.DiagonalFisher` computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_flatness.core.batches import Leaves, LogitsModule
from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.diag import DiagonalFisher
from lightning_flatness.core.curvature.kfac import KFACFisher
from lightning_flatness.core.failures import check_finite_loss
from lightning_flatness.core.hooked_pass import HookedPass
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import left_as_found
from lightning_flatness.core.options import DiagOptions, KFACOptions
from lightning_flatness.core.pipeline import Backend, model_device_dtype
from lightning_flatness.core.statistics import StatisticSums, output_sums

__all__ = ["HookBackend"]


class HookBackend(Backend):
    """``kfac``, ``diag`` or ``diag_mc`` from layer hooks (module docstring).

    Args:
        model: the wrapped model.
        structure: ``"kfac"``, ``"diag"`` or ``"diag_mc"``.
        options: its :class:`~lightning_flatness.core.options.KFACOptions` or
            :class:`~lightning_flatness.core.options.DiagOptions` (``diag`` uses the exact
            rows, ``diag_mc`` ``mc_samples`` sampled ones).
        loss: the likelihood's name.
        seed: seeds the generator of the sampled labels.
    """

    def __init__(
        self,
        model: LogitsModule,
        structure: str,
        options: KFACOptions | DiagOptions,
        *,
        loss: str,
        seed: int,
    ) -> None:
        self.model = model
        self.structure = structure
        self.likelihood = get_likelihood(loss)
        if isinstance(options, KFACOptions):
            rows = options.kfac_mode
        else:
            rows = "sampled" if options.sampled else "exact"
        self.settings = {
            "kfac_mode": rows,
            "mc_samples": options.mc_samples,
            "trace_estimator": options.trace_estimator,
            "structure": "kfac" if structure == "kfac" else "diag",
        }
        self.seed = seed
        self.estimator = KFACFisher() if structure == "kfac" else None
        self.diagonals: dict[str, dict[str, Tensor]] = {"fisher": {}, "cov": {}}
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
        sums = output_sums(self.likelihood, logits, targets, hooked.last_layer, hooked.features())
        check_finite_loss(sums.loss, split, index)
        training = split == "training"
        terms = hooked.terms(logits, targets, inputs, curvature=training)
        sums.grad_norm_sq, sums.fisher_trace = terms.grad_norm_sq, terms.fisher_trace
        if training and self.estimator is not None:
            self.estimator.add(terms)
        elif training:
            for kind, source in (("fisher", terms.diagonal), ("cov", terms.cov_diagonal)):
                store = self.diagonals[kind]
                for name, value in source.items():
                    store[name] = store[name] + value if name in store else value.clone()
        return sums

    def summable_states(self) -> list[Tensor]:
        if self.estimator is not None:
            return self.estimator.summable_states()
        order = self.hooked.names
        return [store[name] for store in self.diagonals.values() for name in order if name in store]

    def estimate(self, num_samples: int, lam: float) -> CurvatureEstimate:
        names = self.hooked.names
        if self.estimator is not None:
            curvature = self.estimator.estimate(num_samples, lam, names)
        else:
            diagonal = DiagonalFisher(sampled=self.structure == "diag_mc")
            fisher, cov = self.diagonals["fisher"], self.diagonals["cov"]
            diagonal.diag_sum = torch.cat([fisher[n].reshape(-1) for n in names])
            diagonal.grad_sq_sum = torch.cat([cov[n].reshape(-1) for n in names])
            curvature = diagonal.estimate(num_samples, lam)
        curvature.coverage = self.hooked.coverage()
        return curvature
