"""The :class:`~lightning_flatness.core.statistics.StatisticSums` of a batch from BackPACK's
per-sample quantities (for ``dense`` and ``gram``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from backpack.extensions import (
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
)
from torch import Tensor

from lightning_flatness.core.backpack.extension import ExtendedModel, loss_scale
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.statistics import StatisticSums, output_sums

__all__ = ["SampleStatistics"]


class SampleStatistics:
    """The :class:`StatisticSums` of a batch from BackPACK's per-sample quantities.

    The exact Fisher trace and the per-sample gradients are read from the ``SqrtGGNExact`` rows
    and ``BatchGrad`` gradients the structure (``dense``, ``gram``) computes anyway; only what
    it lacks costs an extension of its own (e.g. for the validation split).

    Args:
        trace_estimator: ``"exact"`` (``DiagGGNExact``) or ``"sampled"`` (``DiagGGNMC`` with one
            label drawn from the model per input: unbiased, one backward vector instead of C).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"`` (the likelihood of the outputs).
        structure_extensions: the BackPACK extensions the curvature structure runs anyway.
    """

    def __init__(
        self,
        trace_estimator: str = "exact",
        loss: str = "cross_entropy",
        structure_extensions: Sequence[object] = (),
    ) -> None:
        self.trace_estimator = trace_estimator
        self.likelihood = get_likelihood(loss)
        # BackPACK's loss module is loss_scale⁻¹ × the NLL (MSELoss(sum) is ‖y − f‖²), so its
        # gradients and its GGN are too.
        self.scale = loss_scale(loss)
        self._own_extensions: list[object] = []
        self.trace_savefield = self._pick_trace_source(structure_extensions)
        self.grad_norm_savefield = self._pick_gradient_source(structure_extensions)

    def _pick_gradient_source(self, structure_extensions: Sequence[object]) -> str:
        """``Σ_i ‖g_i‖²`` from the structure's ``BatchGrad``, else from ``BatchL2Grad``."""
        if any(isinstance(extension, BatchGrad) for extension in structure_extensions):
            return "grad_batch"
        self._own_extensions.append(BatchL2Grad())
        return "batch_l2"

    def _pick_trace_source(self, structure_extensions: Sequence[object]) -> str:
        if self.trace_estimator == "sampled":
            self._own_extensions.append(DiagGGNMC(mc_samples=1))
            return "diag_ggn_mc"
        if any(isinstance(extension, SqrtGGNExact) for extension in structure_extensions):
            return "sqrt_ggn_exact"
        self._own_extensions.append(DiagGGNExact())
        return "diag_ggn_exact"

    def extensions(self) -> list[object]:
        """The extensions to add to the structure's for this pass."""
        return list(self._own_extensions)

    def update(self, model: ExtendedModel, logits: Tensor, targets: Tensor) -> StatisticSums:
        """The sums of one batch (after the BackPACK backward pass of its summed loss);
        ``targets`` as prepared by the likelihood."""
        batch = output_sums(
            self.likelihood, logits, targets, model.last_layer, model.last_layer_input
        )
        per_sample = [getattr(p, self.grad_norm_savefield).detach() for p in model.parameters]
        if self.grad_norm_savefield == "grad_batch":
            grad_norm_sq = sum(g.to(torch.float64).square().sum() for g in per_sample)
        else:  # batch_l2 holds the per-sample ‖g_i‖²
            grad_norm_sq = sum(g.to(torch.float64).sum() for g in per_sample)
        batch.grad_norm_sq = float(grad_norm_sq) * self.scale**2
        quantities = [getattr(p, self.trace_savefield).detach() for p in model.parameters]
        if self.trace_savefield == "sqrt_ggn_exact":
            trace = sum(q.to(torch.float64).square().sum() for q in quantities)
        else:
            trace = sum(q.to(torch.float64).sum() for q in quantities)
        batch.fisher_trace = float(trace) * self.scale
        return batch
