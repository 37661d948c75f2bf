"""The rows of ``V_b`` as per-sample gradients with their graph, from ``torch.func``
(``backend="func"``, any differentiable model)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import grad, jacrev

from lightning_flatness.core.batches import (
    Leaves,
    LogitsFn,
    LogitsModule,
    num_samples,
    unsqueeze_leaves,
)
from lightning_flatness.core.likelihoods import Likelihood, get_likelihood
from lightning_flatness.core.per_sample import map_samples
from lightning_flatness.regularizer.arguments import (
    LabelSpec,
    ParamSpec,
    check_inputs,
)
from lightning_flatness.regularizer.labels import (
    resolve_labels,
    score,
    targets_for,
)
from lightning_flatness.regularizer.modes import (
    penalty_modes,
)
from lightning_flatness.regularizer.parameters import (
    constants_of,
    select_parameters,
)

__all__ = ["fisher_rows", "func_rows"]


def fisher_rows(
    model: nn.Module,
    inputs: object,
    *,
    labels: LabelSpec = "sampled",
    params: ParamSpec = "all",
    generator: torch.Generator | None = None,
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """The rows of ``V_b`` as per-sample gradients that keep their graph (``torch.func``).

    Args:
        model: the model; its logits (batch, outputs) are read with ``logits_fn``.
        inputs: a batch of B inputs (batch dimension first): a tensor, tuple or dict of tensors.
        labels: ``"exact"`` for the B·C rows of ``V_i = A_i J_i`` (sample-major: row
            ``i·C + c``; for cross-entropy ``√p_ic ∇θ log p_ic``), ``"sampled"`` for the B rows
            ``∇θ log p(ỹ_i | z_i)`` with ``ỹ_i`` drawn as in :func:`sample_labels`, or a tensor
            of B targets to use instead.
        params: the parameters to differentiate (see :func:`select_parameters`).
        generator: the private generator for ``labels="sampled"``.
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"`` (the likelihood whose Fisher it is).
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        The rows, (B·C, P_sel) or (B, P_sel), parameters flattened in ``named_parameters()``
        order; differentiable with respect to the selected parameters.
    """
    spec, leaves = check_inputs(inputs)
    with penalty_modes(model):
        mode = resolve_labels(labels, generator, num_samples(leaves))
        wrapped = LogitsModule(model, spec, logits_fn)
        selected = select_parameters(model, params)
        return func_rows(wrapped, leaves, mode, selected, generator, get_likelihood(loss))


def func_rows(
    wrapped: LogitsModule,
    leaves: Leaves,
    mode: Tensor | str,
    selected: dict[str, nn.Parameter],
    generator: torch.Generator | None,
    likelihood: Likelihood,
) -> Tensor:
    constants = constants_of(wrapped.model, selected)
    batch_size = num_samples(leaves)

    def logits_of(theta: dict[str, Tensor], x: Leaves) -> Tensor:
        logits = wrapped.call({**theta, **constants}, unsqueeze_leaves(x))
        likelihood.check_outputs(logits, 1)
        return logits

    if isinstance(mode, str) and mode == "exact":

        def with_aux(theta: dict[str, Tensor], x: Leaves) -> tuple[Tensor, Tensor]:
            return likelihood.sqrt_rows(logits_of(theta, x).squeeze(0))  # (rows source, w)

        def weighted_jacobian(theta: dict[str, Tensor], x: Leaves) -> Tensor:
            jac, weight = jacrev(with_aux, has_aux=True)(theta, x)
            flat = torch.cat([j.reshape(j.shape[0], -1) for j in jac.values()], dim=-1)
            return weight.unsqueeze(-1) * flat  # row c of V_i = A_i J_i: w_c ∇θ s_c

        rows = map_samples(weighted_jacobian, (None, 0), wrapped.model)(selected, leaves)
        return rows.reshape(-1, rows.shape[-1])

    chosen = targets_for(wrapped, leaves, mode, generator, likelihood)

    def log_prob_at(theta: dict[str, Tensor], x: Leaves, target: Tensor) -> Tensor:
        return score(likelihood, mode, logits_of(theta, x), target.unsqueeze(0)).squeeze(0)

    per_sample = map_samples(grad(log_prob_at), (None, 0, 0), wrapped.model)
    grads = per_sample(selected, leaves, chosen)
    return torch.cat([g.reshape(batch_size, -1) for g in grads.values()], dim=-1)
