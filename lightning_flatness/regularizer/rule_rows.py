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
:class:`~lightning_flatness.regularizer.layerwise.LayerwiseIncomplete`; the first use on a model
checks the rules' rows of one sample against plain autograd.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.layer_rules import KroneckerRule, Rule, weight_rows
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.module_rules import LocalRule, RecurrentRule
from lightning_flatness.core.rule_assignment import assign_rules, record_call
from lightning_flatness.regularizer.labels import fixed_targets, score
from lightning_flatness.regularizer.layerwise import LayerwiseIncomplete

__all__ = ["rule_rows"]

#: model → {selection: None when the rules' rows were checked right, else why not}
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], Exception | None]] = (
    weakref.WeakKeyDictionary()
)


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


@contextmanager
def _recording(rules: list[Rule], batch: int) -> Iterator[None]:
    """Forward hooks that record each call of the rules' modules, with its graph."""

    def hook_for(owners: list[Rule]):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: object):
            return record_call(owners, module, args, kwargs, output, batch, keep_graph=True)

        return record

    by_module: dict[int, tuple[nn.Module, list[Rule]]] = {}
    for rule in rules:
        rule.calls.clear()
        for module in rule.modules:
            by_module.setdefault(id(module), (module, []))[1].append(rule)
    handles = [
        module.register_forward_hook(hook_for(owners), with_kwargs=True)
        for module, owners in by_module.values()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _output_gradients(
    objectives: list[Tensor], outputs: list[Tensor], create_graph: bool
) -> list[Tensor]:
    """``(K, *shape)`` per output: the gradient of each of the K objectives."""
    columns = []
    for k, objective in enumerate(objectives):
        grads = torch.autograd.grad(
            objective,
            outputs,
            retain_graph=create_graph or k + 1 < len(objectives),
            create_graph=create_graph,
            allow_unused=True,
        )
        pairs = zip(grads, outputs, strict=True)
        columns.append([g if g is not None else torch.zeros_like(o) for g, o in pairs])
    return [torch.stack(column) for column in zip(*columns, strict=True)]


def _per_sample(rules: list[Rule], grads: list[Tensor]) -> dict[str, Tensor]:
    """``{name: (K, N, size)}`` from the rules and their calls' output gradients."""
    found: dict[str, Tensor] = {}
    start = 0
    for rule in rules:
        count = len(rule.calls)
        mine, start = grads[start : start + count], start + count
        if not isinstance(rule, KroneckerRule):
            for name, value in rule.per_sample_gradients(mine).items():
                found[name] = value.flatten(2)
            continue
        a, s = rule.patches(), rule.output_gradients(mine)
        for attr, name in rule.names.items():
            if attr != "weight":
                found[name] = s.sum(2)
                continue
            shape = rule.weight_shape
            rows = weight_rows(a, s, rule.is_embedding, shape)
            if rule.transposed:
                rows = rule.to_weight_layout(rows.unflatten(-1, shape)).flatten(2)
            found[name] = rows
    return found


def _rows(
    wrapped: LogitsModule,
    leaves: Leaves,
    rules: list[Rule],
    taps: list[str],
    objectives_of,
    create_graph: bool,
) -> dict[str, Tensor]:
    """One hooked forward and the K objectives' per-sample rows, ``{name: (K, N, size)}``.
    A tapped parameter ``p`` is replaced by ``p`` expanded to the N samples (the same logits
    where the model broadcasts it); the gradient of copy i is sample i's."""
    batch = num_samples(leaves)
    params = dict(wrapped.model.named_parameters())
    copies = {name: params[name].expand(batch, *params[name].shape[1:]) for name in taps}
    with _recording(rules, batch):
        logits = wrapped.call(copies, leaves) if copies else wrapped(*leaves)
    objectives = objectives_of(logits)
    outputs = [call.output for rule in rules for call in rule.calls]
    grads = _output_gradients(objectives, outputs + list(copies.values()), create_graph)
    found = _per_sample(rules, grads[: len(outputs)])
    for name, grad in zip(copies, grads[len(outputs) :], strict=True):
        found[name] = grad.flatten(2)
    return found


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
    # None: the rules' rows were checked right; an error: refused, for good
    known = _CHECKED.setdefault(wrapped.model, {})
    key = tuple(selected)
    if known.get(key) is not None:  # refused before: not even the rules are assigned again
        raise known[key]
    try:
        rules, taps = _rules_for(wrapped.model, selected)
    except LayerwiseIncomplete as error:
        known[key] = error
        raise
    if key not in known:  # first use: one sample's rows against autograd
        known[key] = _first_use_error(wrapped, leaves, rules, taps, selected, likelihood)
        if known[key] is not None:
            raise known[key]
    batch = num_samples(leaves)
    create_graph = torch.is_grad_enabled()
    weights: Tensor | None = None

    def objectives_of(logits: Tensor) -> list[Tensor]:
        nonlocal weights
        likelihood.check_outputs(logits, batch)
        if isinstance(mode, str) and mode == "exact":
            source, weights = likelihood.sqrt_rows(logits)
            return [source[:, c].sum() for c in range(source.shape[1])]
        if isinstance(mode, str):  # "sampled": drawn from this forward's outputs
            assert generator is not None
            chosen = likelihood.draw(logits, generator)
        else:
            chosen = fixed_targets(likelihood, mode, logits)
        return [score(likelihood, mode, logits, chosen).sum()]

    with torch.enable_grad():
        found = _rows(wrapped, leaves, rules, taps, objectives_of, create_graph)
    rows = torch.cat([found[name] for name in selected], dim=-1)  # (K, N, P_sel)
    if weights is None:
        return rows[0]
    # row (i, c) = w_ic ∇θ s_ic, sample-major
    return (rows.transpose(0, 1) * weights.unsqueeze(-1)).reshape(-1, rows.shape[-1])


def _first_use_error(
    wrapped: LogitsModule,
    leaves: Leaves,
    rules: list[Rule],
    taps: list[str],
    selected: dict[str, nn.Parameter],
    likelihood: Likelihood,
) -> LayerwiseIncomplete | None:
    """The rows of one sample against autograd of that sample's objective alone (a parameter
    used outside its layer, or samples mixed by the model, show up as a difference)."""
    batch = num_samples(leaves)
    sample = batch - 1

    def one_sample(logits: Tensor) -> list[Tensor]:
        weight = torch.zeros_like(logits)
        weight[sample] = torch.linspace(0.5, 1.5, logits.shape[-1], dtype=logits.dtype)
        return [(logits * weight).sum()]

    with torch.enable_grad():
        try:
            found = _rows(wrapped, leaves, rules, taps, one_sample, create_graph=False)
        except (RuntimeError, IndexError) as error:  # e.g. a layer's samples on another axis
            return LayerwiseIncomplete(f"the layer rules cannot follow this model ({error}).")
        objective = one_sample(wrapped(*leaves))[0]
        expected = torch.autograd.grad(objective, list(selected.values()), allow_unused=True)
    misplaced = [name for name, rows in found.items() if rows.shape[1] != batch]
    if misplaced:
        return LayerwiseIncomplete(
            f"the samples of {misplaced[0]!r}'s layer are not on its first axis (a "
            "sequence-first layer)."
        )
    for (name, param), grad in zip(selected.items(), expected, strict=True):
        truth = torch.zeros_like(param) if grad is None else grad
        rows = found[name][0].detach()
        others = rows.clone()
        others[sample] = 0
        error = float((rows[sample] - truth.reshape(-1)).norm()) + float(others.norm())
        if error > 1e-4 * float(truth.norm()) + 1e-8:
            return LayerwiseIncomplete(
                f"the layer rules do not give sample-wise gradients of {name!r} (it is used "
                "outside its layer's forward, or the model mixes samples)."
            )
    return None
