"""A differentiable soft-rank (or log-det) penalty on one minibatch: the batched upper bound.

"Flatness After All?", Theorem 6.5 (docs/math.md, "Batched upper bound (Theorem 6.5) — the
regularizer"): for a continuous concave ``h`` with ``h(0) = 0`` and PSD matrices ``X_b``,
``h(Σ_b X_b) ≤ Σ_b h(X_b)`` for the trace function ``h(X) = Σ_k h(μ_k(X))``. Splitting the
training Fisher over the minibatches of an epoch, ``F = Σ_b F_b`` with
``F_b = (1/n) Σ_{i∈b} V_iᵀ V_i`` (n training samples), gives

    h(F)/n ≤ (1/n) Σ_b h(F_b),

and for equal batches of size B the one-batch term ``h(F_b)/B`` is an unbiased estimate of the
right-hand side (its mean over the batches of an epoch *is* the right-hand side). That term is
what :func:`soft_rank_penalty` returns; adding ``β · penalty`` to the training loss minimises an
upper bound on ``β · h(F)/n``.

``h(F_b)`` is computed exactly through the small kernel ``K_b = (1/n) V_b V_bᵀ``, whose nonzero
eigenvalues are those of ``F_b`` (docs/math.md, "Gram trick"; the first step of the proof of
Theorem 6.5). Two functions (docs/math.md, "Spectral functions of F"):

- ``function="soft_rank"``: ``h(μ) = μ/(μ+λ)``, so ``h(F_b) = Tr(K_b (K_b+λI)⁻¹)``;
- ``function="logdet"``: ``h(μ) = ½ log(1 + μ/λ)``, so ``h(F_b) = ½ log det(I + K_b/λ)``. The
  ½ is included, as in :func:`lightning_flatness.core.spectral.logdet_complexity`, so the penalty
  estimates (an upper bound on) the log-det complexity the library reports, divided by n.
  Immer et al. (2023) is the case ``h(x) = log(1 + x)``; the factor only rescales β.

Rows of ``V_b`` (``labels=``):

- ``"exact"``: all C classes, row ``(i, c)`` is ``√p_ic ∇θ log p_ic`` (docs/math.md, "The three
  matrices"), B·C rows, a BC × BC kernel. **p is not detached**: the penalty is the function
  ``θ ↦ h(F_b(θ))/B`` of the exact batch Fisher and its gradient is the true gradient of that
  function, including the dependence of the weights ``√p`` on θ, so central finite
  differences of the returned value agree with ``.backward()``. ``√p`` is evaluated as
  ``exp(½ log p)``, so a probability that underflows to 0 gives a zero, not a NaN, gradient.
- ``"sampled"``: one label ``ĉ_i ~ p_i`` per input from the model's own predictive
  distribution (as BackPACK's ``SqrtGGNMC`` with one sample), row ``∇θ log p_{iĉ_i}``, a B × B
  kernel. ``E_ĉ[∇log p_ĉ ∇log p_ĉᵀ] = Σ_c p_c ∇log p_c ∇log p_cᵀ = V_iᵀV_i``, so the sampled
  ``F̂_b`` is unbiased for ``F_b`` (``h(F̂_b)`` itself is biased low, ``h`` being concave).
  Labels are drawn by inverting the CDF of the detached ``p_i`` at a uniform from a private
  :class:`torch.Generator`: the global RNG stream is never consumed. For fixed labels the
  penalty is again an exact function of θ and its gradient the true gradient of that
  function; the labels' (piecewise constant) dependence on θ is not differentiated, i.e. the
  score-function term of ``∇θ E_ĉ[h(F̂_b)]`` is dropped.

Only the parameters selected by ``params=`` are differentiated (their rows form ``V_b``); the
others enter as constants (detached), so the penalty gives them no gradient at all.

Backends (``backend=``), both exact and returning the same number:

- ``"func"``: per-sample gradients that keep their graph, by :func:`torch.func.vmap` of
  :func:`torch.func.grad` (sampled) or :func:`torch.func.jacrev` (exact) over
  :func:`torch.func.functional_call`, with the model's own ``nn.Parameter`` s as the
  differentiated inputs. Works for any differentiable model; memory ``O(B·C·P)``.
- ``"layerwise"``: for ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``) the per-sample gradient
  of the weight is ``Σ_t δ_it a_itᵀ`` (layer inputs ``a``, output gradients ``δ``, positions
  ``t``), so the kernel is assembled layer by layer from one batched forward and one batched
  backward (``create_graph=True``) — ``(ΔΔᵀ) ⊙ (AAᵀ)`` when a layer sees one position per
  sample — without ever forming the B × P per-sample gradients of wide layers. Per layer the
  cheaper of that and materialising the per-sample gradients is used. Needs every selected
  parameter to be the weight or bias of such a layer and the model to process samples
  independently (which also defines ``V_i``). The first evaluation for a model checks that the
  hooked layers account for the whole batch gradient (a parameter also used outside its
  module's forward would break that).
- ``"auto"`` (default): ``"layerwise"`` when it applies, else ``"func"``.

Either way the smaller of ``V_b V_bᵀ`` and ``V_bᵀ V_b`` is factorised (Cholesky of
``I + K/λ`` in float64), and the trace function has a closed-form gradient
(``∂/∂K Tr(K(K+λI)⁻¹) = λ(K+λI)⁻²``, ``∂/∂K ½ log det(I+K/λ) = ½(K+λI)⁻¹``). The penalty is
differentiable once (its gradient is exact; it cannot be differentiated a second time).
Cost per call: one extra forward and backward (with graph) of the model, the Gram matrix, and
``O(m³)`` float64 work for the ``m × m`` factorisation, ``m = min(B, P)`` for sampled labels
and ``min(B·C, P)`` for exact ones; the latter dominates for exact labels at large B.

Inside the penalty BatchNorm uses its running statistics and Dropout is off (with batch
statistics a sample's output depends on the whole batch, so ``V_i`` is undefined, and a masked
network's Fisher is random): the standard per-sample-gradient practice, said once per model; the
training step itself keeps its modes. BatchNorm without running statistics is refused. Models
must return logits of shape ``(batch, classes)``. Under :func:`torch.no_grad` the penalty is
evaluated without building a graph (for logging).

The module is pure PyTorch (no Lightning); the same call serves a callback and manual
optimisation::

    penalty = SoftRankPenalty(lam=1e-4, num_train_samples=len(train_set), seed=0)
    loss = F.cross_entropy(model(x), y) + beta * penalty(model, x)
    loss.backward()
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.func import grad, jacrev, vmap

from lightning_flatness.core.batches import (
    InputSpec,
    Leaves,
    LogitsFn,
    LogitsModule,
    num_samples,
    unsqueeze_leaves,
)
from lightning_flatness.core.likelihoods import Likelihood, TargetError, get_likelihood
from lightning_flatness.core.model_state import per_sample_modes
from lightning_flatness.core.spectral import check_lam

__all__ = [
    "BACKENDS",
    "FUNCTIONS",
    "LABELS",
    "SoftRankPenalty",
    "fisher_gram",
    "fisher_rows",
    "gram_trace_function",
    "sample_labels",
    "select_parameters",
    "soft_rank_penalty",
]

#: the trace functions ``h`` the penalty supports
FUNCTIONS = ("soft_rank", "logdet")
#: how the rows of ``V_b`` are formed
LABELS = ("sampled", "exact")
#: how the kernel is computed (see the module docstring)
BACKENDS = ("auto", "func", "layerwise")

FunctionName = Literal["soft_rank", "logdet"]
LabelMode = Literal["sampled", "exact"]
Backend = Literal["auto", "func", "layerwise"]
ParamSpec = str | Sequence[str]
LabelSpec = Literal["sampled", "exact"] | Tensor

_LAST_LAYER_TYPES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)
_MAX_NAMES_SHOWN = 20


# --------------------------------------------------------------------------- argument checks


def _check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {name}={value!r}.")
    return value


def _check_inputs(inputs: object) -> tuple[InputSpec, Leaves]:
    """The spec and leaves of a batch's inputs (a tensor, a tuple or a dict of tensors).

    Integer inputs (token ids) are fine: the penalty differentiates the parameters only.
    """
    if not isinstance(inputs, (Tensor, tuple, list, dict)):
        raise TypeError(
            f"inputs must be a tensor, a tuple or a dict of tensors, got {type(inputs).__name__}."
        )
    spec = InputSpec.of(inputs)
    leaves = spec.flatten(inputs)
    if any(t.ndim == 0 for t in leaves) or num_samples(leaves) == 0:
        raise ValueError(
            f"The penalty needs a non-empty batch (batch dimension first), got inputs of shape "
            f"{[tuple(t.shape) for t in leaves]}."
        )
    return spec, leaves


def _check_num_train_samples(num_train_samples: object, batch_size: int) -> int:
    if isinstance(num_train_samples, bool) or not isinstance(num_train_samples, int):
        raise TypeError(
            f"num_train_samples must be an int (the training-set size n), got "
            f"{num_train_samples!r}."
        )
    if num_train_samples < batch_size:
        raise ValueError(
            f"num_train_samples (n = {num_train_samples}) is smaller than the batch size "
            f"(B = {batch_size}). F_b = (1/n) Σ_(i in b) V_iᵀV_i splits the training Fisher over "
            "minibatches of the n training samples, so n ≥ B: pass the size of the whole "
            "training set."
        )
    return num_train_samples


_TOLD_ABOUT_MODES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@contextmanager
def _per_sample_modes(model: object) -> Iterator[nn.Module]:
    """``model`` in eval mode for the block (``model_state.per_sample_modes``), its LayerNorm
    modules computed by :func:`_composite_layer_norm`.

    With batch statistics each output depends on the whole batch, so the per-sample Fisher
    factors ``V_i`` are undefined (and the running statistics must not be updated by the
    penalty's extra forward pass); the Fisher of a randomly masked network is random. So the
    penalty is evaluated as the standard per-sample-gradient practice does, in eval mode (said
    once per model when that changes a BatchNorm, Dropout or attention module); the training
    step itself is unchanged, and every module's mode is restored on exit.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a BatchNorm without running statistics (batch statistics even in eval
            mode).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    batch_statistics = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is None
    ]
    if batch_statistics:
        raise ValueError(
            f"BatchNorm without running statistics ({', '.join(batch_statistics)}, "
            "track_running_stats=False): each output depends on the whole batch even in eval "
            "mode, so the per-sample Fisher factors V_i are undefined. Use "
            "track_running_stats=True, GroupNorm or LayerNorm."
        )
    switched = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if module.training
        and (
            isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.MultiheadAttention))
            or (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
        )
    ]
    if switched and model not in _TOLD_ABOUT_MODES:
        _TOLD_ABOUT_MODES.add(model)
        warnings.warn(
            "The soft-rank penalty evaluates the model in eval mode: BatchNorm on its running "
            f"statistics, Dropout and attention dropout off ({', '.join(switched)}). Per-sample "
            "Fisher factors are undefined with batch statistics and random under dropout. "
            "Training itself is unchanged.",
            UserWarning,
            stacklevel=4,
        )
    norms = [
        m
        for m in model.modules()
        if type(m).forward is nn.LayerNorm.forward and "forward" not in vars(m)
    ]
    try:
        for module in norms:
            module.forward = types.MethodType(_composite_layer_norm, module)
        with per_sample_modes(model):
            yield model
    finally:
        for module in norms:
            del module.forward


def _composite_layer_norm(self: nn.LayerNorm, x: Tensor) -> Tensor:
    """``nn.LayerNorm.forward`` from elementary ops, used inside the penalty.

    ``torch.func.vmap`` of a double backward through ``aten::native_layer_norm`` gives wrong
    gradients of the norm's inputs and weights (seen in torch 2.13: a per-sample-gradient norm
    differentiated through it disagrees with finite differences and with a loop over samples;
    tests/test_regularizer.py checks the penalty on LayerNorm models). The same function built
    from mean, variance and rsqrt differentiates correctly.
    """
    dims = tuple(range(-len(self.normalized_shape), 0))
    mean = x.mean(dims, keepdim=True)
    variance = (x - mean).square().mean(dims, keepdim=True)
    out = (x - mean) * torch.rsqrt(variance + self.eps)
    if self.weight is not None:
        out = out * self.weight
    if self.bias is not None:
        out = out + self.bias
    return out


# ----------------------------------------------------------------------- parameter selection


def select_parameters(model: nn.Module, params: ParamSpec = "all") -> dict[str, nn.Parameter]:
    """The trainable parameters the penalty differentiates, keyed as in ``named_parameters()``.

    Args:
        model: the classifier.
        params: ``"all"`` (every parameter with ``requires_grad``), ``"last_layer"`` (the
            parameters of the last ``nn.Linear``/``nn.Bilinear``/convolution in
            ``model.modules()`` order that has trainable parameters), or one or more module
            names from ``model.named_modules()`` (each contributes its parameters, including
            those of its submodules; ``""`` is the whole model).

    Returns:
        ``{parameter name: parameter}`` in ``named_parameters()`` order; the flat parameter
        axis of the rows follows this order.

    Raises:
        ValueError: for unknown module names, or a selection without trainable parameters.
    """
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if isinstance(params, str) and params == "all":
        selected = trainable
    elif isinstance(params, str) and params == "last_layer":
        last = None
        for module_name, module in model.named_modules():
            if isinstance(module, _LAST_LAYER_TYPES) and any(
                p.requires_grad for p in module.parameters(recurse=False)
            ):
                last = module_name
        if last is None:
            raise ValueError(
                'params="last_layer" selects the last nn.Linear or convolution with trainable '
                "parameters, but the model has none; pass module names instead, e.g. "
                f"params={[name for name, _ in model.named_modules() if name][:4]}."
            )
        selected = _parameters_of(model, [last], trainable)
    else:
        names = [params] if isinstance(params, str) else list(params)
        if not names or not all(isinstance(name, str) for name in names):
            raise ValueError(
                f'params must be "all", "last_layer" or a non-empty list of module names, got '
                f"params={params!r}."
            )
        selected = _parameters_of(model, names, trainable)
    if not selected:
        raise ValueError(
            f"params={params!r} selects no trainable parameter (requires_grad=False everywhere "
            "in the selection); the penalty would be a constant."
        )
    return selected


def _parameters_of(
    model: nn.Module, names: Sequence[str], trainable: dict[str, nn.Parameter]
) -> dict[str, nn.Parameter]:
    modules = dict(model.named_modules())
    unknown = [name for name in names if name not in modules]
    if unknown:
        available = [name for name in modules if name]
        shown = ", ".join(repr(name) for name in available[:_MAX_NAMES_SHOWN])
        more = f", … ({len(available)} in all)" if len(available) > _MAX_NAMES_SHOWN else ""
        raise ValueError(
            f"Unknown module name(s) {unknown} in params; the model's modules "
            f"(model.named_modules()) are: {shown}{more}."
        )
    wanted: set[str] = set()
    for name in names:
        prefix = f"{name}." if name else ""
        wanted.update(key for key in trainable if key.startswith(prefix))
    return {key: p for key, p in trainable.items() if key in wanted}


def _constants(model: nn.Module, selected: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """Detached copies of the trainable parameters that are not differentiated."""
    return {
        name: p.detach()
        for name, p in model.named_parameters()
        if p.requires_grad and name not in selected
    }


# ------------------------------------------------------------------------------------ labels


def sample_labels(
    model: nn.Module,
    inputs: object,
    generator: torch.Generator,
    *,
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """Draw one target per input from the model's own predictive distribution.

    The detached outputs (float64) are compared with uniforms from ``generator`` (inverse CDF
    for cross-entropy: ``ĉ_i = min{c : Σ_(k≤c) p_ik ≥ u_i}``; one uniform per output for bce;
    Gaussian noise for mse): the global RNG is untouched, and for a generator in a fixed state
    the labels stay fixed under small changes of θ (as finite-difference checks need). The
    penalty draws its labels the same way, so a generator in the same state gives the same
    labels.

    Args:
        model: the model (evaluated once, without gradient).
        inputs: a batch of B inputs (a tensor, a tuple or a dict of tensors).
        generator: the private generator.
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        The draws: int64 labels (B,) for cross-entropy, 0/1 labels (B, C) for bce, the noise
        ``ε = ỹ − z`` (B, C) for mse (see :meth:`Likelihood.draw`).
    """
    spec, leaves = _check_inputs(inputs)
    wrapped = LogitsModule(model, spec, logits_fn)
    return _targets_for(wrapped, leaves, "sampled", generator, get_likelihood(loss))


def _resolve_labels(
    labels: object, generator: torch.Generator | None, batch_size: int
) -> Tensor | str:
    """``"exact"``, ``"sampled"`` (after checking the generator) or a label tensor."""
    if isinstance(labels, str):
        _check_choice("labels", labels, LABELS)
        if labels == "sampled" and generator is None:
            raise ValueError(
                'labels="sampled" needs a private torch.Generator (generator=...) so that the '
                "global RNG stream is not consumed; SoftRankPenalty(seed=...) makes one."
            )
        return labels
    if isinstance(labels, Tensor) and not labels.is_complex():
        fixed = labels.reshape(-1) if labels.ndim == 2 and labels.shape[1] == 1 else labels
        if fixed.ndim == 0 or fixed.shape[0] != batch_size:
            raise ValueError(
                f"Got labels of shape {tuple(labels.shape)} for a batch of {batch_size} inputs."
            )
        return fixed
    raise ValueError(f"labels must be one of {LABELS} or a tensor of targets, got {labels!r}.")


def _fixed_targets(likelihood: Likelihood, labels: Tensor, logits: Tensor) -> Tensor:
    try:
        return likelihood.prepare_targets(labels.to(logits.device), logits.detach())
    except TargetError as error:
        raise ValueError(f"labels: {error}") from None


# ------------------------------------------------------------------------- torch.func backend


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
    spec, leaves = _check_inputs(inputs)
    with _per_sample_modes(model):
        mode = _resolve_labels(labels, generator, num_samples(leaves))
        wrapped = LogitsModule(model, spec, logits_fn)
        selected = select_parameters(model, params)
        return _func_rows(wrapped, leaves, mode, selected, generator, get_likelihood(loss))


def _targets_for(
    wrapped: LogitsModule,
    leaves: Leaves,
    mode: Tensor | str,
    generator: torch.Generator | None,
    likelihood: Likelihood,
) -> Tensor:
    """Sampled draws (one forward without gradient) or the fixed targets, checked."""
    with torch.no_grad():
        logits = wrapped(*leaves)
        likelihood.check_outputs(logits, num_samples(leaves))
    if isinstance(mode, str):  # "sampled"
        assert generator is not None
        return likelihood.draw(logits, generator)
    return _fixed_targets(likelihood, mode, logits)


def _score(likelihood: Likelihood, mode: Tensor | str, logits: Tensor, chosen: Tensor) -> Tensor:
    """Per-sample objective whose gradient is a row of ``V_b``: the score at a draw, or the
    log-likelihood of fixed targets."""
    if isinstance(mode, str):
        return likelihood.sampled_score(logits, chosen)
    return -likelihood.nll(logits, chosen)


def _func_rows(
    wrapped: LogitsModule,
    leaves: Leaves,
    mode: Tensor | str,
    selected: dict[str, nn.Parameter],
    generator: torch.Generator | None,
    likelihood: Likelihood,
) -> Tensor:
    constants = _constants(wrapped.model, selected)
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

        rows = vmap(weighted_jacobian, in_dims=(None, 0))(selected, leaves)
        return rows.reshape(-1, rows.shape[-1])

    chosen = _targets_for(wrapped, leaves, mode, generator, likelihood)

    def log_prob_at(theta: dict[str, Tensor], x: Leaves, target: Tensor) -> Tensor:
        return _score(likelihood, mode, logits_of(theta, x), target.unsqueeze(0)).squeeze(0)

    grads = vmap(grad(log_prob_at), in_dims=(None, 0, 0))(selected, leaves, chosen)
    return torch.cat([g.reshape(batch_size, -1) for g in grads.values()], dim=-1)


# ------------------------------------------------------------------------ layerwise backend

# Kernel entries × positions² above which a multi-position layer materialises its gradients.
_MAX_GHOST_ELEMENTS = 1 << 24
# model → {selection: None if the layerwise backend applies, else why not}: the one-time check.
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], Exception | None]] = (
    weakref.WeakKeyDictionary()
)


class _LayerwiseUnsupported(ValueError):
    """The selection or the model is outside what the layerwise backend handles."""


class _LayerwiseIncomplete(_LayerwiseUnsupported):
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
                raise _LayerwiseUnsupported(
                    f"parameter {by_id[id(p)]!r} belongs to {type(module).__name__} "
                    f"{module_name!r}; the layerwise backend handles the weight and bias of "
                    "nn.Linear and nn.Conv2d (groups=1, zero padding) only."
                )
            layer = layers.setdefault(id(module), _Layer(module_name, module))
            setattr(layer, pname, True)
            covered.add(by_id[id(p)])
    missing = sorted(set(selected) - covered)
    if missing:
        raise _LayerwiseUnsupported(f"parameters {missing} are not owned by any module.")
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
                raise _LayerwiseUnsupported(f"module {layer.name!r} has a non-tensor signature.")
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
        constants = _constants(wrapped.model, selected)
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
                raise _LayerwiseUnsupported(
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
        except _LayerwiseUnsupported as error:
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
) -> _LayerwiseUnsupported | None:
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
            return _LayerwiseIncomplete(
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


def _layerwise_gram(
    wrapped: LogitsModule,
    inputs: Leaves,
    mode: Tensor | str,
    selected: dict[str, nn.Parameter],
    generator: torch.Generator | None,
    side: Literal["smaller", "kernel"],
    likelihood: Likelihood,
) -> Tensor:
    """The Gram matrix of ``V_b`` from one batched forward and backward (module docstring)."""
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
                chosen = _fixed_targets(likelihood, mode, logits)
            objective = _score(likelihood, mode, logits, chosen).sum()
            deltas = _grad_or_zeros(objective, outputs, create_graph)
            repeat = 1
        return _assemble_gram(used, deltas, batch_size, repeat, side)


def _assemble_gram(
    layers: list[_Layer],
    deltas: list[Tensor],
    batch_size: int,
    repeat: int,
    side: Literal["smaller", "kernel"],
) -> Tensor:
    """``V_b V_bᵀ`` (M × M, M = B·repeat) or, when smaller and allowed, ``V_bᵀ V_b``."""
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
        if layer.weight:
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
                part = _gram(d[:, 0]) * expand_kernel(_gram(a[:, 0]))
            elif ghost:
                inner_a = expand_kernel(torch.einsum("itk,jsk->ijts", a, a).flatten(2))
                inner_d = torch.einsum("ito,jso->ijts", d, d).flatten(2)
                part = (inner_a * inner_d).sum(dim=-1)
            else:
                part = None
                rows.append(torch.bmm(d.transpose(1, 2), expand_rows(a)).reshape(num_rows, -1))
            if part is not None:
                kernel = part if kernel is None else kernel + part
        if layer.bias:
            rows.append(d.sum(dim=1))
    if materialize_all:
        flat = torch.cat(rows, dim=1)
        return _gram(flat.T)
    for flat in rows:  # one product per piece: no copy into a (M × P) matrix
        kernel = _gram(flat) if kernel is None else kernel + _gram(flat)
    assert kernel is not None
    return kernel


# ------------------------------------------------------------------------ the trace function


class _Gram(torch.autograd.Function):
    """``R ↦ R Rᵀ`` with the one-product backward ``(G + Gᵀ) R`` (autograd would use two)."""

    @staticmethod
    def forward(ctx: FunctionCtx, rows: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        return rows @ rows.mT

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        (rows,) = ctx.saved_tensors
        return (grad_output + grad_output.mT) @ rows


def _gram(rows: Tensor) -> Tensor:
    """``rows @ rowsᵀ``, differentiable once (the penalty's gradient is all that is needed)."""
    return _Gram.apply(rows) if rows.requires_grad else rows @ rows.mT


class _TraceFunction(torch.autograd.Function):
    """``Σ h(μ)`` of ``c · G`` (G PSD, float64) with its closed-form gradient in ``G``."""

    @staticmethod
    def forward(ctx: FunctionCtx, gram: Tensor, coefficient: float, logdet: bool) -> Tensor:
        size = gram.shape[0]
        system = torch.eye(size, dtype=gram.dtype, device=gram.device) + coefficient * gram
        factor, info = torch.linalg.cholesky_ex(0.5 * (system + system.mT))
        if int(info) != 0:
            raise FloatingPointError(
                "I + K/λ is not positive definite: the per-sample gradients contain NaN/inf or "
                "overflow. Check the model's outputs and the learning rate."
            )
        ctx.coefficient = coefficient  # type: ignore[attr-defined]
        ctx.logdet = logdet  # type: ignore[attr-defined]
        if logdet:  # ½ log det(I + cG) = Σ log L_kk
            ctx.save_for_backward(factor)
            return torch.log(torch.diagonal(factor)).sum()
        inverse = torch.cholesky_inverse(factor)  # Tr(cG (I + cG)⁻¹) = size − Tr((I + cG)⁻¹)
        ctx.save_for_backward(inverse)
        return size - torch.diagonal(inverse).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (saved,) = ctx.saved_tensors
        if ctx.logdet:  # ∂/∂G ½ log det(I + cG) = ½ c (I + cG)⁻¹
            gradient = (0.5 * ctx.coefficient) * torch.cholesky_inverse(saved)
        else:  # ∂/∂G [size − Tr((I + cG)⁻¹)] = c (I + cG)⁻²
            gradient = ctx.coefficient * (saved @ saved)
        return grad_output * gradient, None, None


def gram_trace_function(
    gram: Tensor, *, lam: float, scale: float = 1.0, function: FunctionName = "soft_rank"
) -> Tensor:
    """Differentiable ``Σ_k h(μ_k)`` over the eigenvalues ``μ_k`` of ``scale · gram``.

    With ``A = I + scale · gram / λ = LLᵀ`` (Cholesky, float64): the soft rank is
    ``Σ μ/(μ+λ) = Tr(I − A⁻¹)`` and the log-det complexity ``½ Σ log(1 + μ/λ) = Σ_k log L_kk``
    (docs/math.md, "Spectral functions of F"). Since ``h(0) = 0``, ``VVᵀ`` and ``VᵀV`` give the same
    value (the first step of the proof of Theorem 6.5). The gradient is closed-form
    (``λ(K+λI)⁻²`` and ``½(K+λI)⁻¹`` in ``K = scale · gram``); it is not twice differentiable.

    Args:
        gram: a symmetric PSD matrix, e.g. ``V_b V_bᵀ``.
        lam: λ > 0.
        scale: positive factor in front of ``gram`` (``1/n`` for ``F_b``).
        function: ``"soft_rank"`` or ``"logdet"`` (with the ½).

    Returns:
        A float64 scalar.
    """
    lam = check_lam(lam)
    _check_choice("function", function, FUNCTIONS)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be a square matrix, got shape {tuple(gram.shape)}.")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}.")
    return _TraceFunction.apply(gram.to(torch.float64), float(scale) / lam, function == "logdet")


# ----------------------------------------------------------------------------- the penalty


def _batch_gram(
    model: nn.Module,
    inputs: object,
    *,
    labels: object,
    params: ParamSpec,
    generator: torch.Generator | None,
    backend: str,
    side: Literal["smaller", "kernel"],
    loss: str,
    logits_fn: LogitsFn | None,
) -> Tensor:
    spec, leaves = _check_inputs(inputs)
    _check_choice("backend", backend, BACKENDS)
    likelihood = get_likelihood(loss)
    with _per_sample_modes(model):
        mode = _resolve_labels(labels, generator, num_samples(leaves))
        selected = select_parameters(model, params)
        wrapped = LogitsModule(model, spec, logits_fn)
        if backend != "func":
            try:
                return _layerwise_gram(wrapped, leaves, mode, selected, generator, side, likelihood)
            except _LayerwiseUnsupported as error:
                if backend == "layerwise":
                    raise ValueError(
                        f"backend='layerwise' cannot handle this model: {error} Use "
                        "backend='func' (any differentiable model) or 'auto'."
                    ) from None
                if isinstance(error, _LayerwiseIncomplete):
                    warnings.warn(
                        f"backend='auto' uses torch.func for this model: {error}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        rows = _func_rows(wrapped, leaves, mode, selected, generator, likelihood)
    if side == "smaller" and rows.shape[1] <= rows.shape[0]:
        return _gram(rows.T)
    return _gram(rows)


def fisher_gram(
    model: nn.Module,
    inputs: object,
    *,
    labels: LabelSpec = "sampled",
    params: ParamSpec = "all",
    generator: torch.Generator | None = None,
    backend: Backend = "auto",
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """The unscaled kernel ``V_b V_bᵀ`` (``K_b`` times n), differentiable in the parameters.

    Args:
        model: the classifier.
        inputs: the minibatch (B inputs).
        labels: ``"exact"`` (BC × BC, sample-major), ``"sampled"`` (B × B) or B fixed labels.
        params: ``"all"``, ``"last_layer"`` or module names (see :func:`select_parameters`).
        generator: the private generator for ``labels="sampled"``.
        backend: ``"auto"``, ``"func"`` or ``"layerwise"`` (module docstring).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        The M × M kernel in the model's dtype, M = B·C or B.
    """
    return _batch_gram(
        model,
        inputs,
        labels=labels,
        params=params,
        generator=generator,
        backend=backend,
        side="kernel",
        loss=loss,
        logits_fn=logits_fn,
    )


def soft_rank_penalty(
    model: nn.Module,
    inputs: object,
    *,
    lam: float,
    num_train_samples: int,
    function: FunctionName = "soft_rank",
    labels: LabelMode = "sampled",
    params: ParamSpec = "all",
    generator: torch.Generator | None = None,
    backend: Backend = "auto",
    loss: str = "cross_entropy",
    logits_fn: LogitsFn | None = None,
) -> Tensor:
    """The one-batch estimate ``h(F_b)/B`` of the Theorem 6.5 bound ``(1/n) Σ_b h(F_b)``.

    ``F_b = (1/n) Σ_{i∈b} V_iᵀ V_i``; ``h(F_b)`` is computed exactly through the kernel
    ``K_b = (1/n) V_b V_bᵀ`` (docs/math.md, "Batched upper bound (Theorem 6.5) — the regularizer").
    Add ``β ·`` this to the training loss; ``.backward()`` reaches the selected parameters.

    Args:
        model: the classifier, returning logits (batch, classes); BatchNorm is evaluated on
            its running statistics and Dropout switched off inside the penalty (said once).
        inputs: the training minibatch (B inputs); targets are not needed.
        lam: λ > 0, the coupled L2 weight decay (docs/math.md, "Setting").
        num_train_samples: n, the training-set size (n ≥ B).
        function: ``"soft_rank"`` (``h(μ) = μ/(μ+λ)``) or ``"logdet"``
            (``h(μ) = ½ log(1 + μ/λ)``, with the ½ of
            :func:`~lightning_flatness.core.spectral.logdet_complexity`).
        labels: ``"sampled"`` (one label per input from the model's ``p``; B × B kernel) or
            ``"exact"`` (all classes weighted by ``√p``, p not detached; BC × BC kernel).
        params: ``"all"``, ``"last_layer"`` or module names (see :func:`select_parameters`);
            the other parameters are constants.
        generator: private generator for ``labels="sampled"`` (required then; the global RNG
            is never used).
        backend: ``"auto"``, ``"func"`` or ``"layerwise"`` (module docstring).
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``: the likelihood whose Fisher is
            penalised (rows of ``V_i = A_i J_i``, see :mod:`lightning_flatness.core.likelihoods`).
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).

    Returns:
        A scalar in the model's dtype, differentiable in the selected parameters.

    Raises:
        ValueError: for λ ≤ 0, n < B, an empty batch, unknown options or module names,
            BatchNorm without running statistics.
        TypeError: for inputs that are not a tensor, a tuple or a dict of tensors.
    """
    lam = check_lam(lam)
    _check_choice("function", function, FUNCTIONS)
    _check_choice("labels", labels, LABELS)
    _, leaves = _check_inputs(inputs)
    batch_size = num_samples(leaves)
    num_train_samples = _check_num_train_samples(num_train_samples, batch_size)
    gram = _batch_gram(
        model,
        inputs,
        labels=labels,
        params=params,
        generator=generator,
        backend=backend,
        side="smaller",
        loss=loss,
        logits_fn=logits_fn,
    )
    value = gram_trace_function(gram, lam=lam, scale=1.0 / num_train_samples, function=function)
    return (value / batch_size).to(gram.dtype)


class SoftRankPenalty:
    """Configured :func:`soft_rank_penalty`, owning a private generator for sampled labels.

    Example::

        penalty = SoftRankPenalty(lam=1e-4, num_train_samples=50_000, seed=0)
        loss = cross_entropy(model(x), y) + beta * penalty(model, x)

    Args:
        lam: λ > 0, the coupled L2 weight decay.
        num_train_samples: n, the training-set size.
        function: ``"soft_rank"`` or ``"logdet"`` (log-det complexity with the ½).
        labels: ``"sampled"`` (B × B kernel) or ``"exact"`` (BC × BC kernel).
        params: ``"all"``, ``"last_layer"`` or module names.
        backend: ``"auto"``, ``"func"`` or ``"layerwise"``.
        loss: ``"cross_entropy"``, ``"bce"`` or ``"mse"``.
        logits_fn: ``(model, inputs) -> logits`` (default: call the model, read its logits).
        generator: generator for the sampled labels; default: a new CPU generator seeded with
            ``seed``. Never the global one, so enabling the penalty leaves the training RNG
            stream (shuffling, dropout, initialisation) unchanged.
        seed: seed of the default generator.
    """

    def __init__(
        self,
        *,
        lam: float,
        num_train_samples: int,
        function: FunctionName = "soft_rank",
        labels: LabelMode = "sampled",
        params: ParamSpec = "all",
        backend: Backend = "auto",
        loss: str = "cross_entropy",
        logits_fn: LogitsFn | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> None:
        self.lam = check_lam(lam)
        self.loss = get_likelihood(loss).name
        self.logits_fn = logits_fn
        if (
            isinstance(num_train_samples, bool)
            or not isinstance(num_train_samples, int)
            or num_train_samples < 1
        ):
            raise ValueError(
                f"num_train_samples must be a positive int (the training-set size n), got "
                f"{num_train_samples!r}."
            )
        self.num_train_samples = num_train_samples
        self.function = _check_choice("function", function, FUNCTIONS)
        self.labels = _check_choice("labels", labels, LABELS)
        self.backend = _check_choice("backend", backend, BACKENDS)
        if isinstance(params, str):
            self.params: ParamSpec = params
        elif isinstance(params, Sequence) and params and all(isinstance(p, str) for p in params):
            self.params = tuple(params)
        else:
            raise ValueError(
                f'params must be "all", "last_layer" or module names, got params={params!r}.'
            )
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
        self.generator = generator

    def state_dict(self) -> dict[str, Tensor]:
        """The generator state, so that a resumed run draws the same labels."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore the generator state saved by :meth:`state_dict`."""
        self.generator.set_state(state["generator"])

    def __call__(self, model: nn.Module, inputs: object) -> Tensor:
        """``h(F_b)/B`` for the minibatch ``inputs`` (see :func:`soft_rank_penalty`)."""
        return soft_rank_penalty(
            model,
            inputs,
            lam=self.lam,
            num_train_samples=self.num_train_samples,
            function=self.function,  # type: ignore[arg-type]
            labels=self.labels,  # type: ignore[arg-type]
            params=self.params,
            generator=self.generator if self.labels == "sampled" else None,
            backend=self.backend,  # type: ignore[arg-type]
            loss=self.loss,
            logits_fn=self.logits_fn,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lam={self.lam!r}, num_train_samples="
            f"{self.num_train_samples}, function={self.function!r}, labels={self.labels!r}, "
            f"params={self.params!r}, backend={self.backend!r}, loss={self.loss!r})"
        )
