"""The batch kernel ``V_b V_bᵀ``, from whichever assembly applies (``backend=``)."""

from __future__ import annotations

import warnings
import weakref
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    LogitsFn,
    LogitsModule,
    num_samples,
)
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.likelihoods import get_likelihood
from lightning_flatness.regularizer.arguments import (
    BACKENDS,
    Backend,
    LabelSpec,
    ParamSpec,
    check_choice,
    check_inputs,
)
from lightning_flatness.regularizer.func_rows import func_rows
from lightning_flatness.regularizer.labels import (
    resolve_labels,
)
from lightning_flatness.regularizer.layerwise import layerwise_gram
from lightning_flatness.regularizer.modes import (
    penalty_modes,
)
from lightning_flatness.regularizer.parameters import (
    select_parameters,
)
from lightning_flatness.regularizer.products import gram_product
from lightning_flatness.regularizer.refusals import LayerwiseIncomplete, LayerwiseUnsupported
from lightning_flatness.regularizer.rule_rows import rule_rows

__all__ = ["batch_gram", "fisher_gram"]

#: models whose fall-back to ``torch.func`` rows was already said
_SAID: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _say_once(model: nn.Module, message: str) -> None:
    if model not in _SAID:
        _SAID.add(model)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def batch_gram(
    model: nn.Module,
    inputs: object,
    *,
    labels: object,
    params: ParamSpec,
    generator: torch.Generator | None,
    backend: str,
    side: Literal["smaller", "kernel"],
    loss: str,
    logits_fn: LogitsFn | None,
    decay: ParameterDecay | None = None,
) -> Tensor:
    """``V_b V_bᵀ`` (or the smaller ``V_bᵀ V_b``), from the first assembly that applies; with
    ``decay``, parameter j's entries of every row scaled by ``√c_j``, ``c_j = λ*/λ_j``
    (λ* the largest λ_j; docs/math.md, "Per-group weight decay")."""
    spec, leaves = check_inputs(inputs)
    check_choice("backend", backend, BACKENDS)
    likelihood = get_likelihood(loss)
    with penalty_modes(model):
        mode = resolve_labels(labels, generator, num_samples(leaves))
        selected = _decayed(select_parameters(model, params), decay)
        scales = _column_scales(selected, decay)
        wrapped = LogitsModule(model, spec, logits_fn)
        rows = None
        if backend in ("auto", "layerwise"):
            try:
                return layerwise_gram(
                    wrapped, leaves, mode, selected, generator, side, likelihood, scales
                )
            except LayerwiseUnsupported as error:
                if backend == "layerwise":
                    raise ValueError(
                        f"backend='layerwise' cannot handle this model: {error} Use "
                        "backend='rules', 'func' (any differentiable model) or 'auto'."
                    ) from None
        if backend in ("auto", "rules"):
            try:
                rows = rule_rows(wrapped, leaves, mode, selected, generator, likelihood)
            except LayerwiseUnsupported as error:
                if backend == "rules":
                    raise ValueError(
                        f"backend='rules' cannot handle this model: {error} Use "
                        "backend='func' (any differentiable model) or 'auto'."
                    ) from None
                if isinstance(error, LayerwiseIncomplete):
                    _say_once(
                        wrapped.model, f"backend='auto' uses torch.func for this model: {error}"
                    )
        if rows is None:
            rows = func_rows(wrapped, leaves, mode, selected, generator, likelihood)
    if decay is not None:  # √(λ*/λ_j) per entry: λ*^{1/2} D^{-1/2}
        sizes = [p.numel() for p in selected.values()]
        root = decay.column_scale(list(selected), sizes) * decay.representative**0.5
        rows = rows * root.to(dtype=rows.dtype, device=rows.device)
    if side == "smaller" and rows.shape[1] <= rows.shape[0]:
        return gram_product(rows.T)
    return gram_product(rows)


def _decayed(
    selected: dict[str, nn.Parameter], decay: ParameterDecay | None
) -> dict[str, nn.Parameter]:
    """The selected parameters with a positive decay. A group without decay counts every
    direction of ``F_b`` it touches fully, so with it ``h(F_b)`` saturates at the batch's rank
    and has no gradient; without it the penalty is ``h`` of the decayed parameters' block,
    which bounds the part of ``rank_D(F)`` that can change (docs/math.md, "Per-group weight
    decay")."""
    if decay is None:
        return selected
    kept = {name: p for name, p in selected.items() if decay.decays.get(name, 1.0) > 0}
    if not kept:
        raise ValueError(
            "Every selected parameter has weight decay 0, so the batched penalty has nothing "
            "to penalise; select decayed parameters (params=...) or give them a decay."
        )
    return kept


def _column_scales(
    selected: dict[str, nn.Parameter], decay: ParameterDecay | None
) -> dict[str, float] | None:
    """``c_j = λ*/λ_j`` of each selected parameter (None: one λ for all)."""
    if decay is None:
        return None
    return {name: decay.representative * decay.scale(name) for name in selected}


def fisher_gram(
    model: nn.Module,
    inputs: object,
    *,
    labels: LabelSpec = "sampled",
    params: ParamSpec = "all",
    generator: torch.Generator | None = None,
    backend: Backend = "auto",
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """The unscaled kernel ``V_b V_bᵀ`` (``K_b`` times n), differentiable in the parameters.

    Args:
        model: the classifier.
        inputs: the minibatch (B inputs).
        labels: ``"exact"`` (BC × BC, sample-major), ``"sampled"`` (B × B) or B fixed labels.
        params: ``"all"``, ``"last_layer"`` or module names (see :func:`select_parameters`).
        generator: the private generator for ``labels="sampled"``.
        backend: ``"auto"``, ``"func"`` or ``"layerwise"`` (package docstring).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        The M × M kernel in the model's dtype, M = B·C or B.
    """
    return batch_gram(
        model,
        inputs,
        labels=labels,
        params=params,
        generator=generator,
        backend=backend,
        side="kernel",
        loss=loss,
        logits_fn=logits_fn,
    )
