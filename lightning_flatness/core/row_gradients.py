"""The gradients of K cotangent rows on the logits: through the graph of one recorded forward
pass (:func:`output_gradients`, for the recorded layer outputs and tapped parameters), or per
sample through the whole model with ``torch.func`` (:func:`whole_model_gradients`, the costly
fallback for parameters no rule covers; :mod:`lightning_flatness.core.hooked_pass`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import vjp, vmap

from lightning_flatness.core.batches import Leaves, LogitsModule, take_rows, unsqueeze_leaves
from lightning_flatness.core.layer_rules import Rule
from lightning_flatness.core.linear_map_terms import CHUNK_ELEMENTS
from lightning_flatness.core.per_sample import map_samples

__all__ = ["call_gradients", "output_gradients", "recorded_outputs", "whole_model_gradients"]


def recorded_outputs(rules: list[Rule]) -> dict[int, Tensor]:
    """Every recorded layer output once (a call can belong to two rules), and the outputs of
    the linear maps recorded inside a call (:attr:`LayerCall.inner`), by ``id``."""
    outputs = {}
    for rule in rules:
        for call in rule.calls:
            outputs[id(call.output)] = call.output
            outputs.update((id(output), output) for _, output in call.inner.values())
    return outputs


def call_gradients(rules: list[Rule], by_output: dict[int, Tensor]) -> dict[int, list[Tensor]]:
    """Each rule's calls' output gradients, by the rule's ``id``, from the gradients of
    :func:`recorded_outputs` (``by_output``); each call's :attr:`LayerCall.inner_grads` is set
    on the way."""
    for rule in rules:
        for call in rule.calls:
            call.inner_grads = {name: by_output[id(out)] for name, (_, out) in call.inner.items()}
    return {id(rule): [by_output[id(call.output)] for call in rule.calls] for rule in rules}


def output_gradients(
    logits: Tensor,
    outputs: list[Tensor],
    cotangents: Tensor,
    retain_graph: bool = False,
) -> list[Tensor]:
    """``∂⟨u_k, z⟩/∂t`` for every tensor ``t`` of ``outputs`` (recorded layer outputs or
    parameters), ``(K, *t.shape)`` each: one backward pass per row ``u_k``, through the
    graph of one forward pass (measured faster than ``is_grads_batched`` on CPU)."""
    if not outputs:
        return []
    per_row = []
    rows = cotangents.shape[0]
    for k in range(rows):
        grads = torch.autograd.grad(
            logits,
            outputs,
            grad_outputs=cotangents[k].to(logits.dtype),
            retain_graph=retain_graph or k + 1 < rows,
            allow_unused=True,
        )
        per_row.append(
            [
                g if g is not None else torch.zeros_like(o)
                for g, o in zip(grads, outputs, strict=True)
            ]
        )
    return [torch.stack(column) for column in zip(*per_row, strict=True)]


def whole_model_gradients(
    model: LogitsModule, names: list[str], inputs: Leaves, cotangents: Tensor
) -> dict[str, Tensor]:
    """Per-sample gradients ``(K, N, *shape)`` of the parameters ``names``: ``torch.func``
    (``vmap`` of a vector-Jacobian product of the whole model, restricted to those
    parameters), a chunk of samples at a time."""
    params = dict(model.model.named_parameters())
    chosen = {name: params[name].detach() for name in names}

    def one_sample(x: Leaves, rows: Tensor) -> dict[str, Tensor]:
        def logits(p: dict[str, Tensor]) -> Tensor:
            return model.call(p, unsqueeze_leaves(x)).squeeze(0)

        _, pullback = vjp(logits, chosen)
        return vmap(pullback)(rows.to(next(iter(chosen.values())).dtype))[0]

    size = sum(p.numel() for p in chosen.values()) * cotangents.shape[0]
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, size))
    pieces = []
    with torch.no_grad():
        for start in range(0, cotangents.shape[1], per_chunk):
            rows = slice(start, min(cotangents.shape[1], start + per_chunk))
            batched = map_samples(one_sample, (0, 1), model.model, out_dims=1)
            pieces.append(batched(take_rows(inputs, rows), cotangents[:, rows]))
    return {name: torch.cat([p[name] for p in pieces], dim=1) for name in names}
