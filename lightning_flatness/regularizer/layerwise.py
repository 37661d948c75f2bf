"""The kernel ``V_b V_bᵀ`` assembled layer by layer from hooks on ``nn.Linear`` and ``nn.Conv2d``
(``backend="layerwise"``): one batched forward and one batched backward with graph.

The layers are the measurement's Kronecker rules (:mod:`lightning_flatness.core.layer_rules`):
their calls are recorded by the same hooks, their patches ``a_t`` and output gradients ``s_t``
come from the same unfolding, and the first use is checked like the ``"rules"`` backend's
(:mod:`lightning_flatness.regularizer.first_use`); only the kernel's assembly is this module's.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    Leaves,
    LogitsModule,
    num_samples,
)
from lightning_flatness.core.layer_rules import KroneckerRule
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.rule_assignment import assign_rules
from lightning_flatness.regularizer.first_use import FirstUseChecks, first_use_error
from lightning_flatness.regularizer.labels import summed_score
from lightning_flatness.regularizer.parameters import (
    constants_of,
)
from lightning_flatness.regularizer.products import gram_product
from lightning_flatness.regularizer.refusals import LayerwiseIncomplete, LayerwiseUnsupported
from lightning_flatness.regularizer.rule_gradients import hooked_logits

__all__ = ["LayerwiseIncomplete", "LayerwiseUnsupported", "layerwise_gram"]


# Kernel entries × positions² above which a multi-position layer materialises its gradients.
_MAX_GHOST_ELEMENTS = 1 << 24

#: model → {selection: None if the layerwise backend applies, else why not}: the one-time check.
_CHECKS = FirstUseChecks()


def _supported(module: nn.Module) -> bool:
    if type(module) is nn.Linear:
        return True
    return (
        type(module) is nn.Conv2d
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _layerwise_rules(model: nn.Module, selected: dict[str, nn.Parameter]) -> list[KroneckerRule]:
    """The Kronecker rules of the layers owning the selected parameters (covering only those);
    raises unless all are the weight or bias of an nn.Linear or nn.Conv2d."""
    _, rules, fallback = assign_rules(model)
    chosen: list[KroneckerRule] = []
    for rule in rules:
        names = {attr: name for attr, name in rule.names.items() if name in selected}
        if not names:
            continue
        if not isinstance(rule, KroneckerRule) or not all(map(_supported, rule.modules)):
            kind = type(rule.module).__name__
            raise LayerwiseUnsupported(
                f"parameter {next(iter(names.values()))!r} belongs to {kind}; the layerwise "
                "backend handles the weight and bias of nn.Linear and nn.Conv2d (groups=1, "
                "zero padding) only."
            )
        rule.names = names
        chosen.append(rule)
    missing = [name for name in fallback if name in selected]
    if missing:
        raise LayerwiseUnsupported(
            f"parameters {missing[:3]} are not the weight or bias of one kind of layer; the "
            "layerwise backend handles nn.Linear and nn.Conv2d (groups=1, zero padding) only."
        )
    return chosen


def _check_batch_first(rules: list[KroneckerRule], batch_size: int) -> None:
    """Raise unless every recorded call took and gave the batch on its first dimension."""
    for rule in rules:
        for call in rule.calls:
            a, z = call.args[0] if call.args else None, call.output
            conv = isinstance(call.module, nn.Conv2d)
            if not isinstance(a, Tensor):
                raise LayerwiseUnsupported(
                    f"a {type(call.module).__name__} was called without a tensor input."
                )
            if a.shape[0] != batch_size or z.shape[0] != batch_size or (conv and a.ndim != 4):
                raise LayerwiseUnsupported(
                    f"a {type(call.module).__name__} was called on a tensor of shape "
                    f"{tuple(a.shape)} whose first dimension is not the batch ({batch_size})."
                )


def _grad_or_zeros(
    output: Tensor, inputs: list[Tensor], create_graph: bool = False, **kwargs: Any
) -> list[Tensor]:
    """``torch.autograd.grad`` with zeros for inputs the output does not depend on."""
    grads = torch.autograd.grad(
        output, inputs, create_graph=create_graph, allow_unused=True, **kwargs
    )
    batched = kwargs.get("is_grads_batched", False)
    leading = (kwargs["grad_outputs"].shape[0],) if batched else ()
    return [
        g if g is not None else x.new_zeros(*leading, *x.shape)
        for g, x in zip(grads, inputs, strict=True)
    ]


def layerwise_gram(
    wrapped: LogitsModule,
    inputs: Leaves,
    mode: Tensor | str,
    selected: dict[str, nn.Parameter],
    generator: torch.Generator | None,
    side: Literal["smaller", "kernel"],
    likelihood: Likelihood,
    scales: dict[str, float] | None = None,
) -> Tensor:
    """The Gram matrix of ``V_b`` from one batched forward and backward (package docstring),
    each selected parameter's part of the rows scaled by ``√scales[name]`` when given."""
    rules = _layerwise_rules(wrapped.model, selected)
    key = (*selected, wrapped.spec, wrapped.logits_fn)
    _CHECKS.settle(
        wrapped.model, key, lambda: first_use_error(wrapped, inputs, rules, [], selected)
    )
    batch_size = num_samples(inputs)
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        constants = constants_of(wrapped.model, selected)
        replaced = {**selected, **constants} if constants else {}
        logits = hooked_logits(wrapped, inputs, rules, replaced)
        _check_batch_first(rules, batch_size)
        likelihood.check_outputs(logits, batch_size)
        used = [rule for rule in rules if rule.calls]
        outputs = [call.output for rule in used for call in rule.calls]
        if isinstance(mode, str) and mode == "exact":
            source, weights = likelihood.sqrt_rows(logits)
            num_classes = source.shape[1]
            basis = torch.eye(num_classes, dtype=source.dtype, device=source.device)
            basis = basis.unsqueeze(1).expand(num_classes, batch_size, num_classes)
            grads = _grad_or_zeros(
                source, outputs, create_graph, grad_outputs=basis, is_grads_batched=True
            )
            # (C, B, ...) → sample-major (B·C, ...), row (i, c) weighted by w_ic (not detached).
            weights = weights.reshape(-1)
            deltas = [
                g.transpose(0, 1).reshape(-1, *g.shape[2:])
                * weights.reshape(-1, *([1] * (g.ndim - 2)))
                for g in grads
            ]
            repeat = num_classes
        else:
            # "sampled": draws from this forward's outputs
            objective = summed_score(likelihood, mode, logits, generator)
            deltas = _grad_or_zeros(objective, outputs, create_graph)
            repeat = 1
        return _assemble_gram(used, deltas, batch_size, repeat, side, scales or {})


def _layer_matrices(
    rules: list[KroneckerRule], deltas: list[Tensor]
) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """Per rule, its patches ``A`` (B, T, k) and output gradients ``Δ`` (M, T, o) over all its
    calls (``deltas``: (M, *output shape) per call, in the order of the calls), and ``Δ`` over
    the calls that add the bias (None: every call adds it, so it is the same ``Δ``); the
    per-sample weight gradient of row m is ``Σ_t Δ_mt A_{i(m)t}ᵀ``."""
    matrices, start = [], 0
    for rule in rules:
        mine = [d.unsqueeze(0) for d in deltas[start : start + len(rule.calls)]]
        start += len(rule.calls)
        every_call = rule.output_gradients(mine)
        bias = rule.bias_output_gradients(mine, every_call) if "bias" in rule.names else every_call
        matrices.append((rule.patches(), every_call[0], None if bias is every_call else bias[0]))
    return matrices


def _assemble_gram(
    rules: list[KroneckerRule],
    deltas: list[Tensor],
    batch_size: int,
    repeat: int,
    side: Literal["smaller", "kernel"],
    scales: dict[str, float],
) -> Tensor:
    """``V_b V_bᵀ`` (M × M, M = B·repeat) or, when smaller and allowed, ``V_bᵀ V_b``; each
    parameter's kernel term times ``scales[name]`` (its rows times the root)."""
    num_rows = batch_size * repeat
    matrices = _layer_matrices(rules, deltas)
    num_params = sum(
        (d.shape[-1] * a.shape[-1] if "weight" in rule.names else 0)
        + (d.shape[-1] if "bias" in rule.names else 0)
        for rule, (a, d, _) in zip(rules, matrices, strict=True)
    )

    def expand_rows(a: Tensor) -> Tensor:
        return a if repeat == 1 else a.repeat_interleave(repeat, dim=0)

    def expand_kernel(k: Tensor) -> Tensor:
        if repeat == 1:
            return k
        return k.repeat_interleave(repeat, dim=0).repeat_interleave(repeat, dim=1)

    materialize_all = side == "smaller" and num_params <= num_rows
    kernel: Tensor | None = None
    rows: list[Tensor] = []
    for rule, (a, d, own_bias) in zip(rules, matrices, strict=True):
        positions, fan_in, fan_out = a.shape[1], a.shape[2], d.shape[2]
        d_bias = d if own_bias is None else own_bias
        bias_scale = scales.get(rule.names.get("bias", ""), 1.0)
        #: a one-position layer whose bias every call adds: (G_Δ ∘ G_A)·c_w + G_Δ·c_b is
        #: G_Δ ∘ (c_w G_A + c_b), one kernel term for both (the input extended by a constant 1)
        merged = False
        if "weight" in rule.names:
            weight_scale = scales.get(rule.names["weight"], 1.0)
            materialized_cost = num_rows * fan_in * fan_out * (positions + num_rows)
            ghost_cost = num_rows**2 * positions**2 * (fan_out + 1) + batch_size**2 * (
                positions**2 * fan_in
            )
            ghost = not materialize_all and (
                positions == 1
                or (
                    ghost_cost < materialized_cost
                    and num_rows**2 * positions**2 <= _MAX_GHOST_ELEMENTS
                )
            )
            merged = ghost and positions == 1 and "bias" in rule.names and own_bias is None
            if merged:  # the scales inside the term
                inputs = expand_kernel(gram_product(a[:, 0]))
                inputs = (inputs * weight_scale if weight_scale != 1.0 else inputs) + bias_scale
                part = gram_product(d[:, 0]) * inputs
            elif ghost and positions == 1:
                part = gram_product(d[:, 0]) * expand_kernel(gram_product(a[:, 0]))
            elif ghost:
                inner_a = expand_kernel(torch.einsum("itk,jsk->ijts", a, a).flatten(2))
                inner_d = torch.einsum("ito,jso->ijts", d, d).flatten(2)
                part = (inner_a * inner_d).sum(dim=-1)
            else:
                part = None
                flat = torch.bmm(d.transpose(1, 2), expand_rows(a)).reshape(num_rows, -1)
                rows.append(flat * weight_scale**0.5 if weight_scale != 1.0 else flat)
            if part is not None:
                part = part * weight_scale if weight_scale != 1.0 and not merged else part
                kernel = part if kernel is None else kernel + part
        if "bias" in rule.names and not merged:
            summed = d_bias.sum(dim=1)
            rows.append(summed * bias_scale**0.5 if bias_scale != 1.0 else summed)
    if materialize_all:
        flat = torch.cat(rows, dim=1)
        return gram_product(flat.T)
    for flat in rows:  # one product per piece: no copy into a (M × P) matrix
        kernel = gram_product(flat) if kernel is None else kernel + gram_product(flat)
    assert kernel is not None
    return kernel
