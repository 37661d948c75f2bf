"""Per-sample rows of the selected parameters from one hooked forward and the layer rules.

A forward pass under :func:`~lightning_flatness.core.rule_assignment.recording` keeps each
call of the rules' modules with its graph; the gradients of K objectives with respect to the
recorded outputs, passed to the layer rules, give every sample's gradient without a
per-sample pass: ``Σ_t s_t a_tᵀ`` and ``Σ_t s_t`` for the Kronecker layers, the rules' own
per-sample gradients for the others (docs/math.md, "Kronecker factors from layer hooks").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.layer_rules import KroneckerRule, Rule
from lightning_flatness.core.linear_map_terms import weight_rows
from lightning_flatness.core.rule_assignment import recording

__all__ = ["hooked_logits", "hooked_rows", "output_gradients", "per_sample_rows"]

#: the logits → the K objectives whose per-sample gradients are the rows
Objectives = Callable[[Tensor], list[Tensor]]


def hooked_logits(
    wrapped: LogitsModule, leaves: Leaves, rules: list[Rule], replaced: dict[str, Tensor]
) -> Tensor:
    """The logits of one forward (with ``replaced`` parameters, if any) that records every call
    of the rules' modules, inputs kept in the graph."""
    with recording(rules, num_samples(leaves), keep_graph=True, model=wrapped.model):
        return wrapped.call(replaced, leaves) if replaced else wrapped(*leaves)


def output_gradients(
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


def per_sample_rows(
    rules: list[Rule], grads: list[Tensor], samples: slice = slice(None)
) -> dict[str, Tensor]:
    """``{name: (K, n, size)}`` of the ``samples`` from the rules and their calls' output
    gradients (in the order of the calls); a rule whose modules were not called has none."""
    found: dict[str, Tensor] = {}
    start = 0
    for rule in rules:
        count = len(rule.calls)
        mine, start = grads[start : start + count], start + count
        if not mine:
            continue
        if not isinstance(rule, KroneckerRule):
            for name, value in rule.per_sample_gradients(mine).items():
                found[name] = value[:, samples].flatten(2)
            continue
        every_call = rule.output_gradients(mine)
        a, s = rule.patches()[samples], every_call[:, samples]
        for attr, name in rule.names.items():
            if attr != "weight":  # from the calls that add the bias
                found[name] = rule.bias_output_gradients(mine, every_call)[:, samples].sum(2)
                continue
            shape = rule.weight_shape
            rows = weight_rows(a, s, rule.is_embedding, shape)
            if rule.transposed:
                rows = rule.to_weight_layout(rows.unflatten(-1, shape)).flatten(2)
            found[name] = rows
    return found


def hooked_rows(
    wrapped: LogitsModule,
    leaves: Leaves,
    rules: list[Rule],
    taps: list[str],
    objectives_of: Objectives,
    create_graph: bool,
    samples: slice = slice(None),
) -> tuple[dict[str, Tensor], list[Tensor]]:
    """One hooked forward and the K objectives' rows of the ``samples``, ``{name: (K, n,
    size)}``, with the output gradients they came from (the recorded calls', then the taps'),
    zero rows for the parameters of layers that were not called.

    A tapped parameter ``p`` is replaced by ``p`` expanded to the N samples (the same logits
    where the model broadcasts it); the gradient of copy i is sample i's."""
    batch = num_samples(leaves)
    params = dict(wrapped.model.named_parameters())
    copies = {name: params[name].expand(batch, *params[name].shape[1:]) for name in taps}
    logits = hooked_logits(wrapped, leaves, rules, copies)
    objectives = objectives_of(logits)
    outputs = [call.output for rule in rules for call in rule.calls]
    grads = output_gradients(objectives, outputs + list(copies.values()), create_graph)
    found = per_sample_rows(rules, grads[: len(outputs)], samples)
    num_rows = len(range(batch)[samples])
    for rule in rules:  # a layer that was not called: zero rows
        for attr, param in rule.parameters().items():
            if rule.names[attr] not in found:
                found[rule.names[attr]] = param.new_zeros(len(objectives), num_rows, param.numel())
    for name, grad in zip(copies, grads[len(outputs) :], strict=True):
        found[name] = grad[:, samples].flatten(2)
    return found, grads
