"""The labels of the rows of ``V_b``: drawn from the model, all classes, or given."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    Leaves,
    LogitsFn,
    LogitsModule,
    num_samples,
)
from lightning_flatness.core.likelihoods import Likelihood, TargetError, get_likelihood
from lightning_flatness.regularizer.arguments import (
    LABELS,
    check_choice,
    check_inputs,
)

__all__ = [
    "chosen_targets",
    "fixed_targets",
    "resolve_labels",
    "sample_labels",
    "score",
    "summed_score",
    "targets_for",
]


def sample_labels(
    model: nn.Module,
    inputs: object,
    generator: torch.Generator,
    *,
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """Draw one target per input from the model's own predictive distribution.

    The detached outputs (float64) are compared with uniforms from ``generator`` (inverse CDF
    for cross-entropy: ``ĉ_i = min{c : Σ_(k≤c) p_ik ≥ u_i}``; one uniform per output for bce;
    Gaussian noise for mse): the global RNG is untouched, and for a generator in a fixed state
    the labels stay fixed under small changes of θ (as finite-difference checks need). The
    penalty draws its labels the same way, so a generator in the same state gives the same
    labels.

    Args:
        model: the model (evaluated once, without gradient).
        inputs: a batch of B inputs (a tensor, a tuple or a dict of tensors).
        generator: the private generator.
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        The draws: int64 labels (B,) for cross-entropy, 0/1 labels (B, C) for bce, the noise
        ``ε = ỹ − z`` (B, C) for mse (see :meth:`Likelihood.draw`).
    """
    spec, leaves = check_inputs(inputs)
    wrapped = LogitsModule(model, spec, logits_fn)
    return targets_for(wrapped, leaves, "sampled", generator, get_likelihood(loss))


def resolve_labels(
    labels: object, generator: torch.Generator | None, batch_size: int
) -> Tensor | str:
    """``"exact"``, ``"sampled"`` (after checking the generator) or a label tensor."""
    if isinstance(labels, str):
        check_choice("labels", labels, LABELS)
        if labels == "sampled" and generator is None:
            raise ValueError(
                'labels="sampled" needs a private torch.Generator (generator=...) so that the '
                "global RNG stream is not consumed; SoftRankPenalty(seed=...) makes one."
            )
        return labels
    if isinstance(labels, Tensor) and not labels.is_complex():
        fixed = labels.reshape(-1) if labels.ndim == 2 and labels.shape[1] == 1 else labels
        if fixed.ndim == 0 or fixed.shape[0] != batch_size:
            raise ValueError(
                f"Got labels of shape {tuple(labels.shape)} for a batch of {batch_size} inputs."
            )
        return fixed
    raise ValueError(f"labels must be one of {LABELS} or a tensor of targets, got {labels!r}.")


def fixed_targets(likelihood: Likelihood, labels: Tensor, logits: Tensor) -> Tensor:
    try:
        return likelihood.prepare_targets(labels.to(logits.device), logits.detach())
    except TargetError as error:
        raise ValueError(f"labels: {error}") from None


def targets_for(
    wrapped: LogitsModule,
    leaves: Leaves,
    mode: Tensor | str,
    generator: torch.Generator | None,
    likelihood: Likelihood,
) -> Tensor:
    """Sampled draws (one forward without gradient) or the fixed targets, checked."""
    with torch.no_grad():
        logits = wrapped(*leaves)
        likelihood.check_outputs(logits, num_samples(leaves))
    return chosen_targets(likelihood, mode, logits, generator)


def chosen_targets(
    likelihood: Likelihood, mode: Tensor | str, logits: Tensor, generator: torch.Generator | None
) -> Tensor:
    """The labels the rows are scored at: draws from ``logits`` (``"sampled"``, by the private
    ``generator``) or the fixed targets, checked."""
    if isinstance(mode, str):  # "sampled"
        assert generator is not None
        return likelihood.draw(logits, generator)
    return fixed_targets(likelihood, mode, logits)


def score(likelihood: Likelihood, mode: Tensor | str, logits: Tensor, chosen: Tensor) -> Tensor:
    """Per-sample objective whose gradient is a row of ``V_b``: the score at a draw, or the
    log-likelihood of fixed targets."""
    if isinstance(mode, str):
        return likelihood.sampled_score(logits, chosen)
    return -likelihood.nll(logits, chosen)


def summed_score(
    likelihood: Likelihood, mode: Tensor | str, logits: Tensor, generator: torch.Generator | None
) -> Tensor:
    """``Σ_i`` of the per-sample objectives (:func:`score`) at this forward's labels
    (:func:`chosen_targets`): its gradient at sample i's outputs gives row i of ``V_b``."""
    return score(
        likelihood, mode, logits, chosen_targets(likelihood, mode, logits, generator)
    ).sum()
