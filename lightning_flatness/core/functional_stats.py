"""A ``torch.func`` view of a classifier, and the per-sample statistics computed through it.

This is the BackPACK-free counterpart of :mod:`lightning_flatness.core.backpack.extension` and
:mod:`lightning_flatness.core.statistics` for the matrix-free structures: it needs nothing of the
model but a differentiable ``forward``, so LayerNorm, attention, custom modules that use their
own ``nn.Parameter`` functionally and shared weights all work.

- :class:`FunctionalModel`: the logits ``z(θ, x)`` as a function of the trainable parameters
  (``torch.func.functional_call``), with Jacobian-vector products ``J v`` and vector-Jacobian
  products ``Jᵀ u``, each batched over a block of vectors (``vmap``). Buffers are private
  copies, so nothing a forward pass writes reaches the user's model.
- :class:`~lightning_flatness.core.likelihoods.OutputCore`: the Fisher of the output distribution,
  ``Λ = AᵀA`` (docs/math.md, "The three matrices", "Losses"); then
  ``F = (1/m) Σ_i J_iᵀ Λ_i J_i`` and ``V_i = A_i J_i``.
- :func:`batch_statistics`: the :class:`StatisticSums` of one batch, exact sums over its samples
  (so they do not depend on how samples are batched), with ``Tr(F)`` either exact from per-sample
  Jacobians or the unbiased Hutchinson estimate ``‖∂h/∂θ‖²`` of fim_bounds_hutchinson.txt, Eq. 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.func import grad, jacrev, jvp, vjp, vmap

from lightning_flatness.core.batches import Leaves, LogitsModule, take_rows, unsqueeze_leaves
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.hook_recorder import HookRecorder
from lightning_flatness.core.last_layer import last_layer
from lightning_flatness.core.likelihoods import LOSSES, OutputCore, get_likelihood
from lightning_flatness.core.per_sample import map_samples
from lightning_flatness.core.statistics import StatisticSums, output_sums

__all__ = [
    "LOSSES",
    "FunctionalModel",
    "batch_statistics",
    "probe_vectors",
    "resolve_trace_estimator",
]


def probe_vectors(shape: tuple[int, ...], generator: torch.Generator, dtype, device, kind: str):
    """Independent Rademacher (±1) or standard Gaussian entries, drawn from ``generator``."""
    if kind == "rademacher":
        bits = torch.randint(0, 2, shape, generator=generator, device=generator.device)
        return (2 * bits - 1).to(device=device, dtype=dtype)
    if kind == "gaussian":
        values = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
        return values.to(device)
    raise ValueError(f"probe distribution must be 'rademacher' or 'gaussian', got {kind!r}.")


class FunctionalModel:
    """The logits of ``model`` (a :class:`LogitsModule`) as a pure function of its trainable
    parameters, keyed by the user model's own names.

    Parameters with ``requires_grad=False`` are constants, like buffers. Parameters are used
    detached (never modified, no ``.grad`` is ever written); buffers are cloned once, so
    in-place updates in ``forward`` touch only the clones. Evaluate in the mode the model is in
    (the caller switches it to eval mode and back).

    Attributes:
        names: trainable parameter names, in ``named_parameters()`` order (shared weights once).
        num_parameters: P, the length of a flat parameter vector.
        last_layer: the model's last layer (:func:`~lightning_flatness.core.last_layer.last_layer`).
    """

    def __init__(self, model: LogitsModule) -> None:
        named = dict(model.model.named_parameters())
        self.module = model
        #: the user's module (the one a per-sample fallback is remembered for)
        self.user_module = getattr(model, "model", model)
        self.params = {name: p.detach() for name, p in named.items() if p.requires_grad}
        if not self.params:
            raise ValueError(
                "The model has no trainable parameters; there is no Fisher to measure."
            )
        self.constants = {name: p.detach() for name, p in named.items() if not p.requires_grad}
        self.constants.update({name: b.detach().clone() for name, b in model.model.named_buffers()})
        self.names = list(self.params)
        self.shapes = [p.shape for p in self.params.values()]
        self.sizes = [p.numel() for p in self.params.values()]
        self.num_parameters = sum(self.sizes)
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.last_layer = last_layer(model.model)

    def logits(self, params: dict[str, Tensor], inputs: Leaves) -> Tensor:
        """``z(θ, x)`` for a batch of inputs, with ``params`` in place of the trainable ones."""
        return self.module.call({**params, **self.constants}, inputs)

    def decay_diagonal(self, decay: ParameterDecay) -> Tensor:
        """``D``: the per-group decay ``λ_j`` of every entry of the flat parameters (float64,
        on the model's device)."""
        return decay.diagonal(self.names, self.sizes).to(self.device)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of a ``(..., P)`` block of flat vectors as ``{name: (..., *shape)}``."""
        pieces = flat.split(self.sizes, dim=-1)
        return {
            name: piece.reshape(*flat.shape[:-1], *shape)
            for name, piece, shape in zip(self.names, pieces, self.shapes, strict=True)
        }

    def accumulate(self, buffer: Tensor, per_param: dict[str, Tensor]) -> Tensor:
        """``buffer += flatten(per_param)`` in place, through views (no (…, P) temporary)."""
        for name, view in self.unflatten(buffer).items():
            view.add_(per_param[name])
        return buffer

    def jvp(self, inputs: Leaves, vectors: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``z`` (B, C) and ``J v`` (K, B, C) for each row ``v`` of ``vectors`` (K, P).

        One forward pass for ``z`` and forward-mode tangents for the K vectors (``vmap``).
        """

        def logits(params: dict[str, Tensor]) -> Tensor:
            return self.logits(params, inputs)

        def single(tangent: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            return jvp(logits, (self.params,), (tangent,))

        tangents = self.unflatten(vectors.to(self.dtype))
        primal, products = vmap(single, out_dims=(None, 0))(tangents)
        return primal.detach(), products

    def vjp(self, inputs: Leaves) -> tuple[Tensor, Callable[[Tensor], dict[str, Tensor]]]:
        """Logits ``z`` (B, C) and a function mapping cotangents (K, B, C) to ``Jᵀ u``
        (``{name: (K, *shape)}``; see :meth:`accumulate` to add them to a flat buffer).

        One forward pass that keeps its graph; each call of the function is one backward pass
        batched over the K cotangents (``vmap``).
        """
        primal, pullback = vjp(lambda params: self.logits(params, inputs), self.params)

        def backward(cotangents: Tensor) -> dict[str, Tensor]:
            return vmap(pullback)(cotangents.to(primal.dtype))[0]

        return primal.detach(), backward

    def per_sample_gradients(self, inputs: Leaves, targets: Tensor, loss: str) -> dict[str, Tensor]:
        """Per-sample gradients ``{name: (B, *shape)}`` of ``−log p(y_i | z_i)``."""
        likelihood = get_likelihood(loss)

        def sample_loss(params: dict[str, Tensor], x: Leaves, y: Tensor) -> Tensor:
            output = self.logits(params, unsqueeze_leaves(x))
            return likelihood.nll(output, y.unsqueeze(0)).squeeze(0)

        per_sample = map_samples(grad(sample_loss), (None, 0, 0), self.user_module)
        return per_sample(self.params, inputs, targets)

    def per_sample_jacobians(self, inputs: Leaves) -> dict[str, Tensor]:
        """Jacobians ``J_i = ∂z(x_i)/∂θ`` as ``{name: (B, C, *shape)}``."""

        def sample_logits(params: dict[str, Tensor], x: Leaves) -> Tensor:
            return self.logits(params, unsqueeze_leaves(x)).squeeze(0)

        return map_samples(jacrev(sample_logits), (None, 0), self.user_module)(self.params, inputs)

    @contextmanager
    def capture_last_layer_input(self) -> Iterator[list[Tensor]]:
        """Record the input of :attr:`last_layer` during the forward passes in this block.

        The hook is removed on exit, so the model is left as found.
        """
        with HookRecorder() as hooks:
            yield hooks.last_layer_inputs(self.last_layer)


def resolve_trace_estimator(
    trace_estimator: str, num_outputs: int, num_parameters: int, chunk_elements: int
) -> str:
    """``"auto"`` → ``"exact"`` when one sample's Jacobian (C × P) fits in ``chunk_elements``."""
    if trace_estimator != "auto":
        return trace_estimator
    return "exact" if num_outputs * num_parameters <= chunk_elements else "sampled"


def _chunks(size: int, per_chunk: int) -> Iterator[slice]:
    for start in range(0, size, per_chunk):
        yield slice(start, min(size, start + per_chunk))


def batch_statistics(
    model: FunctionalModel,
    inputs: Leaves,
    targets: Tensor,
    *,
    loss: str,
    trace_estimator: str,
    generator: torch.Generator,
    chunk_elements: int,
    grad_sq_sum: Tensor | None = None,
    grad_sum: Tensor | None = None,
) -> tuple[StatisticSums, Tensor]:
    """The :class:`StatisticSums` of one batch and its logits (float64).

    All sums are over the batch's samples (docs/math.md, "The three matrices", "Losses",
    "Generalization gap", "Relative flatness"), for the likelihood ``loss``:

    - ``loss``: ``Σ_i −log p(y_i | z_i)``;
    - ``grad_norm_sq``: ``Σ_i ‖g_i‖²`` from per-sample gradients (→ Tr(C));
    - ``fisher_trace``: ``Σ_i Tr(J_iᵀ Λ_i J_i)``, exact from per-sample Jacobians, or
      (``"sampled"``) the unbiased ``‖J_iᵀ A_iᵀ ξ_i‖²`` summed over samples, one Rademacher ξ
      per sample and output (the Hutchinson-Fisher paper, Eq. 2);
    - ``error``, ``uncertainty``, ``correct`` (:meth:`Likelihood.scores`; NaN for regression);
    - ``relative_flatness``: ``Σ_i ‖φ_i‖² Tr(W Wᵀ Λ_i)`` for the last ``nn.Linear`` if it produces
      the outputs (NaN otherwise).

    ``targets`` are the batch's raw targets; they are checked against the logits here.
    Per-sample gradients and Jacobians are computed ``chunk_elements`` numbers at a time. When
    ``grad_sq_sum`` (P,) is given, ``Σ_i g_i∘g_i`` is added to it (the diagonal of C, for the TIC);
    when ``grad_sum`` (P,) is, ``Σ_i g_i`` (the objective's gradient, for the Newton decrement).
    """
    likelihood = get_likelihood(loss)
    with torch.no_grad(), model.capture_last_layer_input() as captured:
        logits = model.logits(model.params, inputs)
    targets = likelihood.prepare_targets(targets, logits)
    batch, classes = logits.shape
    features = captured[-1] if captured else None
    sums = output_sums(likelihood, logits, targets, model.last_layer, features)
    logits64 = logits.detach().to(torch.float64)
    if not math.isfinite(sums.loss):
        return sums, logits64
    num_params = model.num_parameters
    for rows in _chunks(batch, max(1, chunk_elements // num_params)):
        grads = model.per_sample_gradients(take_rows(inputs, rows), targets[rows], loss)
        sums.grad_norm_sq += _squared_norm(grads.values())
        if grad_sq_sum is not None:
            for name, view in model.unflatten(grad_sq_sum).items():
                for row in grads[name]:
                    view.addcmul_(row, row)
        if grad_sum is not None:
            for name, view in model.unflatten(grad_sum).items():
                view += grads[name].sum(0).to(view.dtype)
    if trace_estimator == "exact":  # C·P small: the (B, C, C) output Fisher is too
        core64 = likelihood.fisher_matrices(logits64)
        for rows in _chunks(batch, max(1, chunk_elements // (num_params * classes))):
            jacobians = model.per_sample_jacobians(take_rows(inputs, rows)).values()
            gram = sum(torch.einsum("nc...,nd...->ncd", j, j).to(torch.float64) for j in jacobians)
            sums.fisher_trace += float((core64[rows] * gram).sum())
    else:
        primal, backward = model.vjp(inputs)
        core = OutputCore.from_logits(primal, loss)
        xi = probe_vectors(
            (1, batch, classes), generator, primal.dtype, primal.device, "rademacher"
        )
        sums.fisher_trace = _squared_norm(backward(core.sqrt_transpose(xi)).values())
    return sums, logits64


def _squared_norm(tensors: Iterable[Tensor]) -> float:
    """``Σ ‖t‖²`` without temporaries (a dot product per tensor, summed in float64)."""
    return sum(float(torch.dot(t.reshape(-1), t.reshape(-1))) for t in tensors)
