"""Dense autograd references for the Fisher, the gradient covariance and the per-layer blocks.

These are the slow, obviously-correct definitions every estimator in the package is tested
against (float64, tiny models). They use :mod:`torch.func` on a functional view of the model,
so they work for any differentiable model and never touch the model's state: parameters are
passed in explicitly and the model is evaluated in whatever mode it is in (call ``.eval()``
first, as :func:`lightning_flatness.core.measure` does).

Definitions (docs/math.md, "The three matrices", "Losses"; "Flatness After All?", Section 2.3),
over the m samples given, with parameters flattened in ``model.named_parameters()`` order, for
the likelihood ``loss`` (``"cross_entropy"``, ``"bce"`` or ``"mse"``):

- ``V_i`` (C × P): the square-root factor of the Fisher; for cross-entropy row c is
  ``√p_ic ∇θ log p_ic``, for bce ``√(σ_ic(1 − σ_ic)) ∇θ z_ic``, for mse ``∇θ z_ic``;
- ``F = (1/m) Σ_i V_iᵀ V_i = (1/m) Σ_i J_iᵀ Λ_i J_i``;
- ``C = (1/m) Σ_i g_i g_iᵀ``, ``g_i = ∇θ (−log p(y_i | z_i))`` (true targets, uncentered).

These are written independently of :mod:`lightning_flatness.core.likelihoods` (the closed forms of
each loss are spelled out here), so that a mistake there shows up as a disagreement.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from lightning_flatness.core.per_sample import map_samples

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


def _one_sample_args(x: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """One sample's input(s) with a batch dimension of one: the model's positional arguments
    (a tuple of inputs for a model of several, e.g. token ids and an attention mask)."""
    if isinstance(x, tuple):
        return tuple(t.unsqueeze(0) for t in x)
    return (x.unsqueeze(0),)


def _flatten_rows(per_param: dict[str, Tensor], leading: int) -> Tensor:
    """Concatenate per-parameter tensors with ``leading`` batch dims along a flat P axis."""
    return torch.cat([t.reshape(*t.shape[:leading], -1) for t in per_param.values()], dim=-1)


def per_sample_jacobians(model: nn.Module, inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
    """Output Jacobians ``J_i = ∂z(x_i)/∂θ`` of shape (m, C, P); for Gaussian regression
    ``F = (1/m) Σ_i J_iᵀ J_i``."""
    params = _trainable(model)

    def outputs(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(model, theta, _one_sample_args(x)).squeeze(0)

    jacobians = map_samples(jacrev(outputs), (None, 0), model)(params, inputs)
    return _flatten_rows(jacobians, leading=2)


def per_sample_sqrt_fisher(
    model: nn.Module, inputs: Tensor | tuple[Tensor, ...], loss: str = "cross_entropy"
) -> Tensor:
    """Square-root Fisher factors ``V`` of shape (m, C, P) (module docstring)."""
    params = _trainable(model)

    def logits_of(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(model, theta, _one_sample_args(x)).squeeze(0)

    def log_probs(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.log_softmax(logits_of(theta, x), dim=-1)

    def one_sample(x: Tensor) -> Tensor:
        if loss == "cross_entropy":
            grads = jacrev(log_probs)(params, x)  # {name: (C, *shape)}
            weights = log_probs(params, x).exp().detach().sqrt()
        elif loss in ("bce", "mse"):
            grads = jacrev(logits_of)(params, x)
            sigma = torch.sigmoid(logits_of(params, x)).detach()
            weights = (sigma * (1 - sigma)).sqrt() if loss == "bce" else torch.ones_like(sigma)
        else:
            raise ValueError(f"unknown loss {loss!r}")
        return weights.unsqueeze(-1) * _flatten_rows(grads, leading=1)

    return map_samples(one_sample, (0,), model)(inputs)


def _sample_loss(loss: str, logits: Tensor, target: Tensor) -> Tensor:
    """``−log p(y | z)`` of one sample from its closed form."""
    if loss == "cross_entropy":
        return -torch.log_softmax(logits, dim=-1).gather(0, target.reshape(1)).squeeze(0)
    if loss == "bce":  # −y log σ(z) − (1 − y) log(1 − σ(z)), summed over the outputs
        log_sigma = torch.nn.functional.logsigmoid(logits)
        log_one_minus = torch.nn.functional.logsigmoid(-logits)
        return -(target * log_sigma + (1 - target) * log_one_minus).sum()
    if loss == "mse":
        return 0.5 * (target - logits).square().sum()
    raise ValueError(f"unknown loss {loss!r}")


def per_sample_gradients(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    targets: Tensor,
    loss: str = "cross_entropy",
) -> Tensor:
    """Per-sample gradients (m, P) of ``−log p(y_i | z_i)`` at the true targets."""
    params = _trainable(model)

    def sample_loss(theta: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(model, theta, _one_sample_args(x)).squeeze(0)
        return _sample_loss(loss, logits, y)

    per_sample = map_samples(torch.func.grad(sample_loss), (None, 0, 0), model)
    grads = per_sample(params, inputs, targets)
    return _flatten_rows(grads, leading=1)


def dense_fisher(
    model: nn.Module, inputs: Tensor | tuple[Tensor, ...], loss: str = "cross_entropy"
) -> Tensor:
    """The P × P Fisher ``F = (1/m) Σ_i V_iᵀ V_i`` over the m rows of ``inputs``."""
    factors = per_sample_sqrt_fisher(model, inputs, loss)
    flat = factors.reshape(-1, factors.shape[-1])
    return flat.T @ flat / factors.shape[0]


def dense_gradient_covariance(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    targets: Tensor,
    loss: str = "cross_entropy",
) -> Tensor:
    """The P × P uncentered gradient covariance ``C = (1/m) Σ_i g_i g_iᵀ``."""
    grads = per_sample_gradients(model, inputs, targets, loss)
    return grads.T @ grads / grads.shape[0]


def parameter_blocks(model: nn.Module) -> list[tuple[str, slice]]:
    """Name and slice of the flat parameter axis for each trainable parameter, in order."""
    blocks, start = [], 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            blocks.append((name, slice(start, start + p.numel())))
            start += p.numel()
    return blocks
