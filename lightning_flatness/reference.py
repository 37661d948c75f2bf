"""Dense autograd references for the Fisher, the gradient covariance and the per-layer blocks.

These are the slow, obviously-correct definitions every estimator in the package is tested
against (float64, tiny models). They use :mod:`torch.func` on a functional view of the model,
so they work for any differentiable model and never touch the model's state: parameters are
passed in explicitly and the model is evaluated in whatever mode it is in (call ``.eval()``
first, as :func:`lightning_flatness.measure` does).

Definitions (MATH.md, "The three matrices"; "Flatness After All?", Section 2.3), over the m
samples given, with parameters flattened in ``model.named_parameters()`` order:

- ``V_i`` (C × P): row c is ``√p_ic ∇θ log p_ic`` — the square-root factor of the Fisher;
- ``F = (1/m) Σ_i V_iᵀ V_i = (1/m) Σ_i J_iᵀ (diag p_i − p_i p_iᵀ) J_i``;
- ``C = (1/m) Σ_i g_i g_iᵀ``, ``g_i = ∇θ (−log p_{i,y_i})`` (true labels, uncentered).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

__all__ = [
    "dense_fisher",
    "dense_gradient_covariance",
    "parameter_blocks",
    "per_sample_gradients",
    "per_sample_jacobians",
    "per_sample_sqrt_fisher",
]


def _trainable(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def _flatten_rows(per_param: dict[str, Tensor], leading: int) -> Tensor:
    """Concatenate per-parameter tensors with ``leading`` batch dims along a flat P axis."""
    return torch.cat([t.reshape(*t.shape[:leading], -1) for t in per_param.values()], dim=-1)


def per_sample_jacobians(model: nn.Module, inputs: Tensor) -> Tensor:
    """Output Jacobians ``J_i = ∂z(x_i)/∂θ`` of shape (m, C, P); for Gaussian regression
    ``F = (1/m) Σ_i J_iᵀ J_i``."""
    params = _trainable(model)

    def outputs(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(model, theta, (x.unsqueeze(0),)).squeeze(0)

    return _flatten_rows(vmap(jacrev(outputs), in_dims=(None, 0))(params, inputs), leading=2)


def per_sample_sqrt_fisher(model: nn.Module, inputs: Tensor) -> Tensor:
    """Square-root Fisher factors ``V`` of shape (m, C, P): ``V[i, c] = √p_ic ∇θ log p_ic``."""
    params = _trainable(model)

    def log_probs(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        logits = functional_call(model, theta, (x.unsqueeze(0),)).squeeze(0)
        return torch.log_softmax(logits, dim=-1)

    def one_sample(x: Tensor) -> Tensor:
        grads = jacrev(log_probs)(params, x)  # {name: (C, *shape)}
        probs = log_probs(params, x).exp().detach()
        return probs.sqrt().unsqueeze(-1) * _flatten_rows(grads, leading=1)

    return vmap(one_sample)(inputs)


def per_sample_gradients(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample gradients (m, P) of the cross-entropy ``−log p_{y_i}`` at the true labels."""
    params = _trainable(model)

    def loss(theta: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(model, theta, (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))

    grads = vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, inputs, targets)
    return _flatten_rows(grads, leading=1)


def dense_fisher(model: nn.Module, inputs: Tensor) -> Tensor:
    """The P × P Fisher ``F = (1/m) Σ_i V_iᵀ V_i`` over the m rows of ``inputs``."""
    factors = per_sample_sqrt_fisher(model, inputs)
    flat = factors.reshape(-1, factors.shape[-1])
    return flat.T @ flat / inputs.shape[0]


def dense_gradient_covariance(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """The P × P uncentered gradient covariance ``C = (1/m) Σ_i g_i g_iᵀ``."""
    grads = per_sample_gradients(model, inputs, targets)
    return grads.T @ grads / inputs.shape[0]


def parameter_blocks(model: nn.Module) -> list[tuple[str, slice]]:
    """Name and slice of the flat parameter axis for each trainable parameter, in order."""
    blocks, start = [], 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            blocks.append((name, slice(start, start + p.numel())))
            start += p.numel()
    return blocks
