"""The compositional soft-rank penalty: the gradient of ``h(F)`` at a running estimate ``F̂``.

"Flatness After All?", Section 6.3 (docs/math.md, "Compositional gradient of h(F)"). The
gradient of the trace function ``h(F) = Σ_k h(μ_k(F))`` is ``∂h(F) = Tr(h'(F) ∂F)``, and ``F``
is an average over the training set, ``F = (1/n) Σ_i V_iᵀ V_i``. Stochastic compositional
gradient descent replaces the outer ``h'(F)`` by ``h'(F̂)`` for a running estimate ``F̂``
(:class:`~lightning_flatness.regularizer.running_fisher.RunningFisher`) and the inner ``F`` by
an unbiased one-batch estimate. Per batch ``b`` of B samples and K Rademacher probes
``ξ_i ∈ {±1}^C``:

    u = Σ_{i∈b} V_iᵀ ξ_i = ∇θ ⟨w ⊙ ξ, s⟩   (one backward pass, w and s of ``sqrt_rows``),
    E_ξ[u uᵀ] = Σ_{i∈b} V_iᵀ V_i,   so   q = uᵀ h'(F̂) u / B   has   E[q] = Tr(h'(F̂) F̃_b),

with ``E_b[F̃_b] = F``. For fixed ``F̂`` and ξ, ``q`` is a function of θ whose gradient is
exact (the probes do not depend on θ; the weights ``w`` are differentiated), and over ξ and
the batches its gradient is an unbiased estimate of ``Tr(h'(F̂) ∂F)``, which is ``∂h(F)`` when
``F̂ = F``. The penalty returned is

    (h(F̂) + q − stopgrad(q)) / n,

whose value is the running ``h(F̂)/n`` (comparable to the batched ``h(F_b)/B``, which bounds
``h(F)/n`` from above) and whose gradient is ``∂q/n``. After ``q`` is formed, the detached
probe gradients update ``F̂``, so the ``F̂`` a step uses does not depend on that step's
probes (on the very first call ``F̂`` is first initialised from them).

BatchNorm modules in training mode keep the statistics of the batch the penalty sees
(``batch_norm="batch"``, the default of :class:`~lightning_flatness.regularizer.SoftRankPenalty`
for this estimator; then ``V_b`` is the square-root Fisher of the whole batch's function, the
network the training step computes), or run on their running statistics (``"running"``).

Cost per call: one forward pass and K backward passes with graph through the model, the
rotations ``Q_Lᵀ U Q_R`` per parameter, the factors' eigen-decompositions every
``refresh_every`` updates, and the backward pass of ``q`` (a double backward), all on at most
``max_samples`` samples of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_flatness.core.batches import Leaves, LogitsModule, num_samples
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.likelihoods import Likelihood
from lightning_flatness.core.model_state import uncompiled
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS
from lightning_flatness.regularizer.modes import penalty_modes
from lightning_flatness.regularizer.parameters import constants_of
from lightning_flatness.regularizer.running_fisher import RunningFisher
from lightning_flatness.regularizer.small_blocks import (
    dense_derivative,
    group_form,
    group_matrix,
    small_block_groups,
)

__all__ = [
    "CompositionalSettings",
    "compositional_penalty",
    "compositional_surrogate",
    "probe_gradients",
    "running_trace_function",
]


def probe_gradients(
    wrapped: LogitsModule,
    leaves: Leaves,
    selected: dict[str, nn.Parameter],
    likelihood: Likelihood,
    generator: torch.Generator,
    probes: int,
) -> dict[str, Tensor]:
    """``u^(k) = Σ_i V_iᵀ ξ_i^(k)`` for K Rademacher probes, differentiable in ``selected``.

    Args:
        wrapped: the model as a function of input leaves (its modes already set).
        leaves: the batch.
        selected: the differentiated parameters; the others enter as constants.
        likelihood: whose output Fisher ``Λ = AᵀA`` the rows ``V_i = A_i J_i`` factor.
        generator: the private generator of the probes.
        probes: K ≥ 1.

    Returns:
        ``{name: (K, *shape)}``, with graph (without one under :func:`torch.no_grad`).
    """
    with_graph = torch.is_grad_enabled()
    constants = constants_of(wrapped.model, selected)
    names = list(selected)
    stacks: dict[str, list[Tensor]] = {name: [] for name in names}
    own = dict(wrapped.model.named_parameters())
    # the model's own parameters, all differentiated: its plain forward builds the same graph
    plain = not constants and all(own.get(name) is p for name, p in selected.items())
    with torch.enable_grad():
        logits = wrapped(*leaves) if plain else wrapped.call({**selected, **constants}, leaves)
        likelihood.check_outputs(logits, num_samples(leaves))
        sources, weights = likelihood.sqrt_rows(logits)
        for index in range(probes):
            signs = torch.randint(0, 2, sources.shape, generator=generator, dtype=torch.int8)
            xi = (2 * signs - 1).to(device=sources.device, dtype=sources.dtype)
            gradients = torch.autograd.grad(
                sources,
                [selected[name] for name in names],
                grad_outputs=xi * weights,
                create_graph=with_graph,
                retain_graph=with_graph or index < probes - 1,
                allow_unused=True,
            )
            for name, gradient in zip(names, gradients, strict=True):
                zero = torch.zeros_like(selected[name])
                stacks[name].append(zero if gradient is None else gradient)
    return {name: torch.stack(stack) for name, stack in stacks.items()}


def _block_lam(lam: float, decay: ParameterDecay | None, key: str) -> float:
    """The λ of one parameter's block: its λ_j under per-group decay, else λ."""
    return lam if decay is None else decay.of(key)


class _KnownGradient(torch.autograd.Function):
    """A scalar whose gradient with respect to each input is a given tensor: ``value``, with
    ``∂value/∂inputs[j] = directions[j]``. The quadratic form's gradient ``2 h'(F̂) u`` is
    formed without a graph, so the penalty's backward pass does not retrace the rotations."""

    @staticmethod
    def forward(ctx, value: Tensor, directions: list[Tensor], *inputs: Tensor) -> Tensor:
        ctx.directions = directions
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        wanted = ctx.needs_input_grad[2:]
        pairs = zip(ctx.directions, wanted, strict=True)
        return (None, None, *(grad.to(d.dtype) * d if want else None for d, want in pairs))


def _quadratic_form(
    running: RunningFisher,
    gradients: dict[str, Tensor],
    lam: float,
    name: str,
    decay: ParameterDecay | None = None,
) -> Tensor:
    """``Σ_k u^(k)ᵀ h'(F̂) u^(k)``, float64, differentiable in the gradients, each block at its
    own λ_j under ``decay``.

    Per block, with ``r = Q_Lᵀ U Q_R`` the coordinates in the eigenbasis and ``w = h'(μ)`` the
    derivative at the eigenvalues: the form is ``Σ w ⊙ r²`` and its gradient in ``U`` is
    ``2 Q_L (w ⊙ r) Q_Rᵀ``. Both are computed here without a graph (the rotations run in the
    gradients' dtype, the sum in float64); small blocks take dense matrices instead, several at
    a time (:mod:`~lightning_flatness.regularizer.small_blocks`). :class:`_KnownGradient` hands
    the gradient to the probe gradients' own graph.
    """
    derivative = TRACE_FUNCTIONS[name].derivative
    spectra = dict(running.spectra())
    groups, others = small_block_groups({key: block.shape for key, block in running.blocks.items()})
    total = torch.zeros((), dtype=torch.float64)
    keys, directions = [], []
    with torch.no_grad():
        for group in groups:
            lams = tuple(_block_lam(lam, decay, key) for key in group)
            matrix = spectra[group[0]].cached(
                ("dense group", name, tuple(group), lams),
                lambda _, group=group, lams=lams: group_matrix(
                    [
                        dense_derivative(spectra[key], running.blocks[key].shape, derivative, lam_j)
                        for key, lam_j in zip(group, lams, strict=True)
                    ]
                ),
            )
            value, pieces = group_form([gradients[key] for key in group], matrix)
            total = total.to(value.device) + value
            keys += group
            directions += pieces
        for key in others:
            spectrum, lam_j, gradient = spectra[key], _block_lam(lam, decay, key), gradients[key]
            rotated = spectrum.rotate(running.blocks[key].as_matrix(gradient))
            place = (rotated.device, rotated.dtype)
            weights = spectrum.cached(
                ("derivative", name, lam_j, *place),
                lambda values, place=place, lam_j=lam_j: derivative(values, lam_j).to(*place),
            )
            weighted = weights * rotated
            total = total.to(rotated.device) + (weighted * rotated).sum(dtype=torch.float64)
            keys.append(key)
            directions.append(2 * spectrum.rotate_back(weighted).reshape(gradient.shape))
    if not torch.is_grad_enabled():
        return total
    return _KnownGradient.apply(total, directions, *(gradients[key] for key in keys))


def running_trace_function(
    running: RunningFisher, lam: float, name: str, decay: ParameterDecay | None = None
) -> float:
    """``h(F̂) = Σ h(μ)`` over the eigenvalues of the running estimate, each block at its own
    λ_j under ``decay``."""
    value = TRACE_FUNCTIONS[name].value
    total = 0.0
    for key, spectrum in running.spectra():
        lam_j = _block_lam(lam, decay, key)
        total += float(
            spectrum.cached(
                ("value", name, lam_j), lambda values, lam_j=lam_j: value(values, lam_j).sum()
            )
        )
    return total


@dataclass(frozen=True)
class CompositionalSettings:
    """The fixed options of a compositional penalty.

    Attributes:
        lam: λ > 0 (per-group decay: the largest λ_j).
        decay: the per-group decays (each block of ``F̂`` at its own λ_j), or None.
        num_train_samples: n.
        function: ``"soft_rank"`` or ``"logdet"``.
        likelihood: the likelihood whose Fisher is penalised.
        probes: K ≥ 1 probes per call.
        batch_norm: ``"batch"`` (BatchNorm in training mode on the batch's statistics, as in
            the training step) or ``"running"`` (eval mode), see :func:`penalty_modes`.
    """

    lam: float
    num_train_samples: int
    function: str
    likelihood: Likelihood
    probes: int = 1
    batch_norm: str = "batch"
    decay: ParameterDecay | None = None


def _probe_quadratic(
    wrapped: LogitsModule,
    leaves: Leaves,
    selected: dict[str, nn.Parameter],
    running: RunningFisher,
    generator: torch.Generator,
    settings: CompositionalSettings,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``q = Σ_k u^(k)ᵀ h'(F̂) u^(k) / (B K)`` with its graph, and the probe gradients."""
    model = wrapped.model
    with penalty_modes(model, settings.batch_norm), uncompiled(model):
        gradients = probe_gradients(
            wrapped, leaves, selected, settings.likelihood, generator, settings.probes
        )
    if running.is_empty:
        running.update(gradients, num_samples(leaves))
    quadratic = _quadratic_form(running, gradients, settings.lam, settings.function, settings.decay)
    return quadratic / (num_samples(leaves) * settings.probes), gradients


def compositional_surrogate(
    wrapped: LogitsModule,
    leaves: Leaves,
    selected: dict[str, nn.Parameter],
    running: RunningFisher,
    generator: torch.Generator,
    settings: CompositionalSettings,
) -> Tensor:
    """``q/n``, the function of θ whose gradient the compositional penalty returns, for the
    probes the generator draws next; ``F̂`` is left as it is (initialised if it has no
    update). ``E_ξ[q] = Tr(h'(F̂) F̃_b)`` (module docstring). Arguments as for
    :func:`compositional_penalty`."""
    quadratic, _ = _probe_quadratic(wrapped, leaves, selected, running, generator, settings)
    return (quadratic / settings.num_train_samples).to(next(iter(selected.values())).dtype)


def compositional_penalty(
    wrapped: LogitsModule,
    leaves: Leaves,
    selected: dict[str, nn.Parameter],
    running: RunningFisher,
    generator: torch.Generator,
    settings: CompositionalSettings,
) -> Tensor:
    """``(h(F̂) + q − stopgrad q)/n`` for one batch (module docstring), then ``F̂`` updated.

    Args:
        wrapped: the model as a function of the batch's input leaves (evaluated in the
            penalty's modes, see :func:`penalty_modes`).
        leaves: the batch's input leaves.
        selected: the differentiated parameters.
        running: the running estimate ``F̂`` of these parameters.
        generator: the probes' private generator.
        settings: λ, n, the trace function, the likelihood, the probes and the BatchNorm rule.

    Returns:
        A scalar in the parameters' dtype. Under :func:`torch.no_grad` it is ``h(F̂)/n``, and
        nothing is computed or updated.
    """
    dtype = next(iter(selected.values())).dtype
    lam, function = settings.lam, settings.function
    if not torch.is_grad_enabled():
        if running.is_empty:
            raise RuntimeError(
                "The compositional penalty has no running Fisher yet: call it once with "
                "gradients enabled (a training step) before evaluating it under torch.no_grad."
            )
        value = running_trace_function(running, lam, function, settings.decay)
        value /= settings.num_train_samples
        return torch.tensor(value, dtype=dtype)
    first = running.is_empty
    quadratic, gradients = _probe_quadratic(wrapped, leaves, selected, running, generator, settings)
    value = running_trace_function(running, lam, function, settings.decay)
    if not first:
        running.update(gradients, num_samples(leaves))
    return ((value + quadratic - quadratic.detach()) / settings.num_train_samples).to(dtype)
