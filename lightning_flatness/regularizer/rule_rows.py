"""The rows of ``V_b`` from the measurement's layer rules, with their graph (``backend="rules"``).

The layer rules (:mod:`lightning_flatness.core.layer_rules`, ``module_rules``) turn what a
forward hook recorded
(a layer's input) and one backward pass to the layer outputs into per-sample gradients:
``Σ_t s_t a_tᵀ`` and ``Σ_t s_t`` for linear maps, convolutions, embeddings and Hugging Face's
``Conv1D``; ``Σ s ∘ x̂`` and ``Σ s`` for normalisation layers. Here the inputs are recorded
with their graph and the output gradients ``s`` are taken with ``create_graph=True``, so the
rows, and the kernel ``V_b V_bᵀ`` built from them, are differentiable in θ: one batched forward
and one batched backward (C of them for ``labels="exact"``), and no per-sample pass through
the model. This covers the transformers whose mask code ``vmap`` cannot follow (GPT-2, BERT,
DistilBERT), which the ``torch.func`` rows would otherwise compute one sample at a time.

Attention and recurrent layers take their per-sample gradients from a ``vmap`` of their own
vector-Jacobian product, kept in the graph. A parameter of shape ``(1, ...)`` outside any layer
(a class token, a position embedding added in ``forward``) is replaced by N stacked copies,
whose gradients are the per-sample ones. A selection with a parameter none of these covers, or
a model whose layers see the samples on another axis (sequence-first stacks), is refused with
:class:`~lightning_flatness.regularizer.refusals.LayerwiseIncomplete`; the first use on a model
checks the rules' rows of one sample against plain autograd
(:mod:`lightning_flatness.regularizer.first_use`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.layer_rules import Rule
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.module_rules import LocalRule, RecurrentRule
from lightning_flatness.core.rule_assignment import assign_rules
from lightning_flatness.regularizer.first_use import FirstUseChecks, first_use_error
from lightning_flatness.regularizer.labels import summed_score
from lightning_flatness.regularizer.refusals import LayerwiseIncomplete
from lightning_flatness.regularizer.rule_gradients import hooked_rows

__all__ = ["rule_rows"]

#: model → {selection: None when the rules' rows were checked right, else why not}
_CHECKS = FirstUseChecks()


def _rules_for(model: nn.Module, selected: dict[str, nn.Parameter]) -> tuple[list[Rule], list[str]]:
    """The rules covering the selected parameters, and the selected parameters of shape
    ``(1, ...)`` outside any layer (a class token, a position embedding added in ``forward``),
    taken as N stacked copies; raises unless every selected parameter is one or the other."""
    _, rules, fallback = assign_rules(model)
    chosen = [rule for rule in rules if set(rule.names.values()) & set(selected)]
    for rule in chosen:
        if isinstance(rule, LocalRule):  # attention, recurrent layers: vmap with graph
            rule.keep_graph = True
            sequence_first = isinstance(rule.module, (nn.MultiheadAttention, nn.RNNBase)) and (
                not rule.module.batch_first
            )
            rule.batch_dim = 1 if sequence_first and not isinstance(rule, RecurrentRule) else 0
    covered = {name for rule in chosen for name in rule.names.values()}
    taps = [
        name
        for name in fallback
        if name in selected and selected[name].dim() >= 2 and selected[name].shape[0] == 1
    ]
    missing = [name for name in selected if name not in covered and name not in taps]
    if missing:
        raise LayerwiseIncomplete(
            f"parameters {missing[:3]} are not all inside linear, convolution, embedding or "
            "normalisation layers."
        )
    for rule in chosen:  # the rows of unselected parameters are not needed
        rule.names = {attr: name for attr, name in rule.names.items() if name in selected}
    return chosen, taps


def rule_rows(
    wrapped: LogitsModule,
    leaves: Leaves,
    mode: Tensor | str,
    selected: dict[str, nn.Parameter],
    generator: torch.Generator | None,
    likelihood: Likelihood,
) -> Tensor:
    """The rows of ``V_b``, (B·C, P_sel) sample-major for ``"exact"`` or (B, P_sel), selected
    parameters flattened in their order, differentiable in them (module docstring)."""
    key = tuple(selected)
    _CHECKS.raise_if_refused(wrapped.model, key)  # not even the rules are assigned again
    try:
        rules, taps = _rules_for(wrapped.model, selected)
    except LayerwiseIncomplete as error:
        _CHECKS.refuse(wrapped.model, key, error)
        raise
    _CHECKS.settle(  # first use: one sample's rows against autograd
        wrapped.model, key, lambda: first_use_error(wrapped, leaves, rules, taps, selected)
    )
    batch = num_samples(leaves)
    create_graph = torch.is_grad_enabled()
    weights: Tensor | None = None

    def objectives_of(logits: Tensor) -> list[Tensor]:
        nonlocal weights
        likelihood.check_outputs(logits, batch)
        if isinstance(mode, str) and mode == "exact":
            source, weights = likelihood.sqrt_rows(logits)
            return [source[:, c].sum() for c in range(source.shape[1])]
        # "sampled": drawn from this forward's outputs
        return [summed_score(likelihood, mode, logits, generator)]

    with torch.enable_grad():
        found, _ = hooked_rows(wrapped, leaves, rules, taps, objectives_of, create_graph)
    rows = torch.cat([found[name] for name in selected], dim=-1)  # (K, N, P_sel)
    if weights is None:
        return rows[0]
    # row (i, c) = w_ic ∇θ s_ic, sample-major
    return (rows.transpose(0, 1) * weights.unsqueeze(-1)).reshape(-1, rows.shape[-1])
