"""The mean negative log-likelihood of a model on some batches, by one forward pass.

:func:`mean_nll` is the ``train_nll`` of a :class:`~lightning_flatness.FlatnessReport` without
the curvature: the same batch reader (:mod:`lightning_flatness.core.batches`), the same
likelihood (:mod:`lightning_flatness.core.likelihoods`) and the same per-sample sums
(:func:`~lightning_flatness.core.statistics.output_sums`), evaluated as :func:`measure` evaluates
the model (eval mode with every module's mode restored, the global RNG forked, a
``torch.compile`` wrapper measured as the module it compiles), without gradients. The monitor
reads it every epoch to tell whether the training loss has settled
(:mod:`lightning_flatness.core.trust`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    LogitsFn,
    UnpackBatch,
    prepared_batches,
    wrap_for_batches,
)
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.core.model_state import per_sample_modes, rng_devices, uncompiled
from lightning_flatness.core.pipeline import model_device_dtype
from lightning_flatness.core.statistics import StatisticSums, output_sums

__all__ = ["mean_nll"]


def _summed_nll(
    model: nn.Module,
    batches: Iterable,
    loss: str,
    unpack_batch: UnpackBatch | None,
    logits_fn: LogitsFn | None,
) -> StatisticSums:
    """The summed NLL and sample count of ``batches`` (the model already in eval mode)."""
    likelihood = get_likelihood(loss)
    device, dtype = model_device_dtype(model)
    wrapped, stream, _ = wrap_for_batches(model, batches, unpack_batch, logits_fn)
    sums = StatisticSums()
    with uncompiled(wrapped):
        prepared = prepared_batches(stream, None, device, dtype, unpack_batch, wrapped.spec)
        for _, inputs, targets in prepared:
            logits = wrapped(*inputs)
            prepared_targets = likelihood.prepare_targets(targets, logits)
            batch = output_sums(likelihood, logits, prepared_targets, None, None)
            sums.count += batch.count
            sums.loss += batch.loss
    return sums


def mean_nll(
    model: nn.Module,
    batches: Iterable,
    *,
    loss: str = "cross_entropy",
    unpack_batch: UnpackBatch | None = None,
    logits_fn: LogitsFn | None = None,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> float:
    """The per-sample mean NLL of ``model``'s own likelihood ``loss`` on ``batches``.

    Plain (no label smoothing, no regularizer), in float64, as :func:`measure` computes
    ``train_nll``. Nothing of the model's state changes: eval mode for the pass and every
    module's mode restored, no gradient, the global RNG forked (reading ``batches`` included:
    a dataset that draws augmentations does not advance the user's streams). Under data
    parallelism ``all_reduce`` sums the NLL and the count across processes (every process calls
    it, with or without samples), so all return the same mean.

    Returns:
        The mean NLL; NaN without samples.
    """
    with (
        torch.random.fork_rng(devices=rng_devices(model)),
        torch.inference_mode(False),
        torch.no_grad(),
        per_sample_modes(model),
    ):
        sums = _summed_nll(model, batches, loss, unpack_batch, logits_fn)
    totals = torch.tensor([sums.loss, sums.count], dtype=torch.float64)
    if all_reduce is not None:
        device = next(model.parameters()).device
        totals = all_reduce(totals.to(device)).cpu()
    loss_sum, count = (float(v) for v in totals)
    return loss_sum / count if count else float("nan")
