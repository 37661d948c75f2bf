"""The kernel ``V_b V_bᵀ`` assembled layer by layer from hooks on ``nn.Linear`` and ``nn.Conv2d``
(``backend="layerwise"``): one batched forward and one batched backward with graph."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flatness.core.batches import (
    Leaves,
    LogitsModule,
    num_samples,
)
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.regularizer.labels import (
    fixed_targets,
    score,
)
from lightning_flatness.regularizer.parameters import (
    constants_of,
)
from lightning_flatness.regularizer.products import gram_product

__all__ = ["LayerwiseIncomplete", "LayerwiseUnsupported", "layerwise_gram"]


# Kernel entries × positions² above which a multi-position layer materialises its gradients.
_MAX_GHOST_ELEMENTS = 1 << 24

# model → {selection: None if the layerwise backend applies, else why not}: the one-time check.
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], Exception | None]] = (
    weakref.WeakKeyDictionary()
)


class LayerwiseUnsupported(ValueError):
    """The selection or the model is outside what the layerwise backend handles."""


class LayerwiseIncomplete(LayerwiseUnsupported):
    """The hooks do not see every use of a selected parameter."""


@dataclass
class _Layer:
    """A module owning selected parameters, and what its forward hook recorded."""

    name: str
    module: nn.Module
    weight: bool = False
    bias: bool = False
    inputs: list[Tensor] | None = None
    outputs: list[Tensor] | None = None


def _supported(module: nn.Module) -> bool:
    if type(module) is nn.Linear:
        return True
    return (
        type(module) is nn.Conv2d
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _layerwise_layers(model: nn.Module, selected: dict[str, nn.Parameter]) -> list[_Layer]:
    """The modules owning the selected parameters; raises unless all are Linear/Conv2d."""
    by_id = {id(p): name for name, p in selected.items()}
    covered: set[str] = set()
    layers: dict[int, _Layer] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is None or id(p) not in by_id:
                continue
            if not _supported(module) or pname not in ("weight", "bias"):
                raise LayerwiseUnsupported(
                    f"parameter {by_id[id(p)]!r} belongs to {type(module).__name__} "
                    f"{module_name!r}; the layerwise backend handles the weight and bias of "
                    "nn.Linear and nn.Conv2d (groups=1, zero padding) only."
                )
            layer = layers.setdefault(id(module), _Layer(module_name, module))
            setattr(layer, pname, True)
            covered.add(by_id[id(p)])
    missing = sorted(set(selected) - covered)
    if missing:
        raise LayerwiseUnsupported(f"parameters {missing} are not owned by any module.")
    return list(layers.values())


def _hooked_forward(
    wrapped: LogitsModule,
    inputs: Leaves,
    layers: list[_Layer],
    selected: dict[str, nn.Parameter],
    likelihood: Likelihood,
) -> Tensor:
    """Forward pass recording each layer's input ``a`` and output ``z`` at every call."""

    def make_hook(layer: _Layer) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
                raise LayerwiseUnsupported(f"module {layer.name!r} has a non-tensor signature.")
            assert layer.inputs is not None and layer.outputs is not None
            layer.inputs.append(args[0])
            layer.outputs.append(output)
            # A fresh tensor downstream: an in-place op after the layer must not alter ``z``.
            return output + 0

        return hook

    for layer in layers:
        layer.inputs, layer.outputs = [], []
    handles = [layer.module.register_forward_hook(make_hook(layer)) for layer in layers]
    try:
        constants = constants_of(wrapped.model, selected)
        logits = wrapped.call({**selected, **constants}, inputs) if constants else wrapped(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    batch_size = num_samples(inputs)
    for layer in layers:
        assert layer.inputs is not None and layer.outputs is not None
        for a, z in zip(layer.inputs, layer.outputs, strict=True):
            conv = isinstance(layer.module, nn.Conv2d)
            if a.shape[0] != batch_size or z.shape[0] != batch_size or (conv and a.ndim != 4):
                raise LayerwiseUnsupported(
                    f"module {layer.name!r} was called on a tensor of shape {tuple(a.shape)} "
                    f"whose first dimension is not the batch ({batch_size})."
                )
    likelihood.check_outputs(logits, batch_size)
    return logits


def _layer_matrices(layer: _Layer, deltas: list[Tensor], batch_size: int) -> tuple[Tensor, Tensor]:
    """Layer inputs ``A`` (B, T, k) and output gradients ``Δ`` (M, T, o), uses concatenated.

    ``T`` counts the positions (convolution patches, extra Linear dimensions) of all calls of
    the layer; the per-sample weight gradient of row m is ``Σ_t Δ_mt A_{i(m)t}ᵀ``.
    """
    assert layer.inputs is not None
    inputs, outputs = [], []
    for a, d in zip(layer.inputs, deltas, strict=True):
        if isinstance(layer.module, nn.Conv2d):
            module = layer.module
            patches = F.unfold(
                a, module.kernel_size, module.dilation, module.padding, module.stride
            )
            inputs.append(patches.transpose(1, 2))
            outputs.append(d.reshape(d.shape[0], d.shape[1], -1).transpose(1, 2))
        else:
            inputs.append(a.reshape(batch_size, -1, a.shape[-1]))
            outputs.append(d.reshape(d.shape[0], -1, d.shape[-1]))
    if len(inputs) == 1:
        return inputs[0], outputs[0]
    return torch.cat(inputs, dim=1), torch.cat(outputs, dim=1)


def _check_layerwise(
    wrapped: LogitsModule,
    inputs: Leaves,
    layers: list[_Layer],
    selected: dict[str, nn.Parameter],
    likelihood: Likelihood,
) -> None:
    """Check once per model and selection that the hooks see every use of the parameters.

    The batch gradient of a test objective must equal the sum of the per-use terms
    ``Σ_t Δ_t A_tᵀ`` the layerwise kernel is built from; a parameter also used outside its
    module's forward (e.g. ``F.linear(x, self.fc.weight)``) breaks the equality. The verdict
    (or the reason the layers cannot be hooked) is cached per model and selection.
    """
    cache = _CHECKED.setdefault(wrapped.model, {})
    key = (*selected, wrapped.spec, wrapped.logits_fn)
    if key not in cache:
        try:
            cache[key] = _first_use_check(wrapped, inputs, layers, selected, likelihood)
        except LayerwiseUnsupported as error:
            cache[key] = error
        finally:
            for layer in layers:
                layer.inputs, layer.outputs = None, None
    verdict = cache[key]
    if verdict is not None:  # a fresh instance: re-raising one object would grow its traceback
        raise type(verdict)(str(verdict))


def _first_use_check(
    wrapped: LogitsModule,
    inputs: Leaves,
    layers: list[_Layer],
    selected: dict[str, nn.Parameter],
    likelihood: Likelihood,
) -> LayerwiseUnsupported | None:
    with torch.enable_grad():
        logits = _hooked_forward(wrapped, inputs, layers, selected, likelihood)
        used = [layer for layer in layers if layer.outputs]
        outputs = [z for layer in used for z in layer.outputs or []]
        names = list(selected)
        objective = 0.5 * logits.square().sum()
        grads = _grad_or_zeros(objective, outputs + [selected[name] for name in names])
    grads = [g.detach() for g in grads]
    actual = dict(zip(names, grads[len(outputs) :], strict=True))
    rebuilt = {name: torch.zeros_like(p.detach()) for name, p in selected.items()}
    by_module = {id(p): name for name, p in selected.items()}
    start = 0
    for layer in used:
        layer.inputs = [a.detach() for a in layer.inputs or []]
        count = len(layer.outputs or [])
        a, d = _layer_matrices(layer, grads[start : start + count], num_samples(inputs))
        start += count
        weight, bias = layer.module.weight, layer.module.bias
        if layer.weight:
            total = torch.einsum("mto,mtk->ok", d, a)
            rebuilt[by_module[id(weight)]] += total.reshape(weight.shape)
        if layer.bias and bias is not None:
            rebuilt[by_module[id(bias)]] += d.sum(dim=(0, 1))
    for name in names:
        error = float((rebuilt[name] - actual[name]).norm())
        if error > 1e-3 * float(actual[name].norm()) + 1e-6 * (1.0 + float(rebuilt[name].norm())):
            return LayerwiseIncomplete(
                f"the hooked Linear/Conv2d layers do not account for the whole gradient of "
                f"{name!r}: it is also used outside its module's forward."
            )
    return None


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
    layers = _layerwise_layers(wrapped.model, selected)
    _check_layerwise(wrapped, inputs, layers, selected, likelihood)
    batch_size = num_samples(inputs)
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        logits = _hooked_forward(wrapped, inputs, layers, selected, likelihood)
        used = [layer for layer in layers if layer.outputs]
        outputs = [z for layer in used for z in layer.outputs or []]
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
            if isinstance(mode, str):  # "sampled": draws from this forward's outputs
                assert generator is not None
                chosen = likelihood.draw(logits, generator)
            else:
                chosen = fixed_targets(likelihood, mode, logits)
            objective = score(likelihood, mode, logits, chosen).sum()
            deltas = _grad_or_zeros(objective, outputs, create_graph)
            repeat = 1
        by_id = {id(p): (scales or {}).get(name, 1.0) for name, p in selected.items()}
        return _assemble_gram(used, deltas, batch_size, repeat, side, by_id)


def _assemble_gram(
    layers: list[_Layer],
    deltas: list[Tensor],
    batch_size: int,
    repeat: int,
    side: Literal["smaller", "kernel"],
    scales: dict[int, float],
) -> Tensor:
    """``V_b V_bᵀ`` (M × M, M = B·repeat) or, when smaller and allowed, ``V_bᵀ V_b``; each
    parameter's kernel term times ``scales[id(parameter)]`` (its rows times the root)."""
    num_rows = batch_size * repeat
    matrices, start = [], 0
    for layer in layers:
        count = len(layer.outputs or [])
        matrices.append(_layer_matrices(layer, deltas[start : start + count], batch_size))
        start += count
        layer.inputs, layer.outputs = None, None
    num_params = sum(
        (d.shape[-1] * a.shape[-1] if layer.weight else 0) + (d.shape[-1] if layer.bias else 0)
        for layer, (a, d) in zip(layers, matrices, strict=True)
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
    for layer, (a, d) in zip(layers, matrices, strict=True):
        positions, fan_in, fan_out = a.shape[1], a.shape[2], d.shape[2]
        module = layer.module
        if layer.weight:
            weight_scale = scales.get(id(module.weight), 1.0)
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
            if ghost and positions == 1:
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
                part = part * weight_scale if weight_scale != 1.0 else part
                kernel = part if kernel is None else kernel + part
        if layer.bias:
            bias_scale = scales.get(id(module.bias), 1.0)
            summed = d.sum(dim=1)
            rows.append(summed * bias_scale**0.5 if bias_scale != 1.0 else summed)
    if materialize_all:
        flat = torch.cat(rows, dim=1)
        return gram_product(flat.T)
    for flat in rows:  # one product per piece: no copy into a (M × P) matrix
        kernel = gram_product(flat) if kernel is None else kernel + gram_product(flat)
    assert kernel is not None
    return kernel
