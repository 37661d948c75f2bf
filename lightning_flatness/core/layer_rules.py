"""Per-sample gradients of one layer's parameters from its input and its output gradients.

A forward hook records what a layer received; one backward pass per cotangent on the logits (K
of them) gives the gradient of each cotangent's scalar with respect to the layer's output.
From the two, a *rule* knows the per-sample gradient of each of the layer's parameters without
any per-sample backward pass (docs/math.md, "Kronecker factors from layer hooks"). This module
has the layers that are one map each:

- :class:`KroneckerRule` (``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d``, ``nn.Embedding``): the
  layer maps patches ``a_t`` (rows of its input, unfolded convolution patches, one-hot tokens)
  to outputs ``W a_t + b`` at positions ``t``; the per-sample weight gradient is
  ``Σ_t s_t a_tᵀ`` and the bias gradient ``Σ_t s_t``, ``s_t`` the output gradient. It provides
  KFC's Kronecker factors (Grosse & Martens, 2016, Eq. 22) ``A = Σ_t a_t a_tᵀ`` and
  ``G = (1/T) Σ_t s_t s_tᵀ`` and the exact squared norms of the per-sample gradients;
- :class:`NormRule` (BatchNorm with running statistics, LayerNorm, GroupNorm): the affine map
  ``γ ∘ x̂ + β`` of the normalised input ``x̂``; per-sample gradients ``Σ s ∘ x̂`` and ``Σ s``.

The terms a linear map's weight gives from its patches and output gradients (rows, norms,
factors) are in :mod:`lightning_flatness.core.linear_map_terms`. Modules with their own forward
(attention, recurrent layers, anything else) have their rules in
:mod:`lightning_flatness.core.module_rules`; which rule covers which parameter, and the hook
body that records a call, are in :mod:`lightning_flatness.core.rule_assignment`.

Every rule works on tensors shaped ``(K, N, ...)``: K cotangents, N samples.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flatness.core.convolution_terms import (
    grouped_weight_gradients,
    overlap_input_factor,
    overlap_pays,
)
from lightning_flatness.core.linear_map_terms import explicit_gradients_cheaper, sample_chunks

__all__ = [
    "KroneckerRule",
    "LayerCall",
    "NormRule",
    "Rule",
    "is_linear",
    "is_transposed_linear",
]

#: numbers (inputs, output gradients and weight gradients) per grouped weight-gradient
#: convolution: beyond a few MB its time per sample grows (up to 3× at 256 samples)
GROUPED_CHUNK_ELEMENTS = 2**21
#: the fewest output positions at which grouped weight gradients beat the patches' way
GROUPED_MIN_POSITIONS = 32


@dataclass
class LayerCall:
    """One call of a hooked module: its (detached) inputs and the output that autograd follows."""

    module: nn.Module
    args: tuple
    kwargs: dict
    output: Tensor
    #: the module's weight applied outside its forward without its bias
    #: (:mod:`~lightning_flatness.core.outside_calls`): positions of the weight only
    weight_only: bool = False
    #: linear maps applied inside the module's forward, read off the pass
    #: (:class:`~lightning_flatness.core.attention.ProjectionCalls`): ``{map: (input, output)}``
    inner: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    #: the K rows' gradients of :attr:`inner`'s outputs, once the pass has them
    inner_grads: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Rule(ABC):
    """How the per-sample gradients of some parameters are obtained (module docstring).

    Attributes:
        modules: the hooked modules whose calls use the parameters (one, except for weights
            tied across layers of one Kronecker type).
        names: the user's names of the parameters this rule covers, by attribute name.
    """

    modules: list[nn.Module]
    names: dict[str, str]
    calls: list[LayerCall] = field(default_factory=list)
    #: the samples' dimension in the module's input and output (1 for sequence-first inputs)
    batch_dim: int = 0

    #: how the parameters enter the block-diagonal Fisher: "kronecker" or "diagonal"
    kind = "diagonal"

    @property
    def module(self) -> nn.Module:
        """The first of :attr:`modules` (they share the covered parameters)."""
        return self.modules[0]

    def parameters(self) -> dict[str, Tensor]:
        """``{attribute: parameter}`` of the covered parameters (dotted attributes allowed)."""
        own = dict(self.module.named_parameters())
        return {attr: own[attr] for attr in self.names}

    @abstractmethod
    def per_sample_gradients(self, grads: list[Tensor]) -> dict[str, Tensor]:
        """``{user name: (K, N, *shape)}`` from the output gradients ``(K, *output shape)`` of
        each recorded call (only for rules that materialise them)."""


def _positions_first(tensor: Tensor, channel_dim: int) -> Tensor:
    """``(..., C, *spatial)`` → ``(..., T, C)`` with the spatial positions flattened."""
    return tensor.flatten(channel_dim + 1).transpose(-1, -2)


def _conv_padding(module: nn.Conv1d | nn.Conv2d) -> tuple[int, ...]:
    padding = module.padding
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * len(module.kernel_size)
        # "same": symmetric only for odd effective kernel sizes (checked in make_rule)
        return tuple(
            d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size, strict=True)
        )
    return tuple(padding)


def _two_dimensional(
    module: nn.Conv1d | nn.Conv2d, x: Tensor
) -> tuple[Tensor, dict[str, tuple[int, int]]]:
    """A convolution's batch ``x`` (samples first) as (N, C, H, W) and its kernel, stride,
    dilation and padding as 2-D tuples: a one-dimensional convolution as one row."""
    geometry = {
        "kernel": tuple(module.kernel_size),
        "stride": tuple(module.stride),
        "dilation": tuple(module.dilation),
        "padding": _conv_padding(module),
    }
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(-2)
        geometry = {key: (0 if key == "padding" else 1, *value) for key, value in geometry.items()}
    return x, geometry


def _overlap_pays(call: LayerCall, unfolded_anyway: bool) -> bool:
    """Whether a convolution call's input factor comes from its input's shifted overlaps:
    a batched stride-1 convolution for which that costs less than the unfolded patches
    (:func:`~lightning_flatness.core.convolution_terms.overlap_pays`; ``unfolded_anyway``: the
    norms need the patches, so only their product is saved)."""
    module = call.module
    if not isinstance(module, (nn.Conv1d, nn.Conv2d)) or any(s != 1 for s in module.stride):
        return False
    x = call.args[0]
    if x.dim() != len(module.kernel_size) + 2:  # an unbatched call keeps the patches
        return False
    geometry = (tuple(module.kernel_size), tuple(module.dilation), _conv_padding(module))
    return overlap_pays(x, *geometry, unfolded_anyway=unfolded_anyway)


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's attention and MLP projections): ``y = x W + b`` with
    ``W`` of shape (in, out) — a linear layer whose weight is stored transposed. Recognised by
    its class name and its ``nf`` (out) attribute; the coverage check then confirms the rule
    against autograd's gradients, as for every rule."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
        and not any(True for _ in module.children())
    )


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


class KroneckerRule(Rule):
    """``nn.Linear`` (and Hugging Face's transposed ``Conv1D``), ``nn.Conv1d``/``nn.Conv2d``
    (``groups=1``, zero padding) and ``nn.Embedding``: patches ``a`` (N, T, d) and output
    gradients ``s`` (K, N, T, o)."""

    kind = "kronecker"

    @property
    def is_embedding(self) -> bool:
        return isinstance(self.module, nn.Embedding)

    @property
    def weight_shape(self) -> torch.Size:
        """The weight's shape as (out, in, ...): the layout the weight formulas produce."""
        shape = self.parameters()["weight"].shape
        return torch.Size((shape[1], shape[0])) if self.transposed else shape

    @property
    def transposed(self) -> bool:
        """The weight is stored (in, out) (:func:`is_transposed_linear`)."""
        return is_transposed_linear(self.module)

    def to_weight_layout(self, values: Tensor) -> Tensor:
        """``values`` (..., out, in) in the weight's own layout."""
        return values.transpose(-1, -2) if self.transposed else values

    def patches(self) -> Tensor:
        """``a`` (N, T, d) over all recorded calls (several calls: more positions); token
        indices (N, T) for an embedding, with padding positions set to −1."""
        pieces = [
            self._patches(call.module, call.args[0].movedim(self.batch_dim, 0))
            for call in self.calls
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    @staticmethod
    def _patches(module: nn.Module, x: Tensor) -> Tensor:
        if is_linear(module):
            return x.reshape(x.shape[0], -1, x.shape[-1])
        if isinstance(module, nn.Embedding):
            indices = x.reshape(x.shape[0], -1)
            if module.padding_idx is not None:
                indices = indices.masked_fill(indices == module.padding_idx, -1)
            return indices
        x, geometry = _two_dimensional(module, x)
        unfolded = F.unfold(
            x,
            geometry["kernel"],
            dilation=geometry["dilation"],
            padding=geometry["padding"],
            stride=geometry["stride"],
        )
        return unfolded.transpose(1, 2)

    @property
    def from_overlaps(self) -> bool:
        """Every recorded call is a stride-1 convolution whose input factor costs less from
        its input's shifted overlaps than from its unfolded patches (:func:`_overlap_pays`;
        the patches' copy counts only where the norms do not need them either: with
        :attr:`grouped_norms`, which has weighed the overlaps with it)."""
        if self.grouped_norms:
            return True
        return bool(self.calls) and all(_overlap_pays(c, True) for c in self.calls)

    @property
    def grouped_norms(self) -> bool:
        """The squared norms come from grouped weight gradients
        (:meth:`convolution_squared_norms`), so that the layer has no unfolded patches: a
        convolution whose explicit per-sample gradients are the cheaper way to its norms
        (:func:`explicit_gradients_cheaper`), with at least :data:`GROUPED_MIN_POSITIONS`
        output positions (on smaller images a grouped call costs up to 3× the patches' way),
        and whose input factor then costs less from overlaps than from unfolded patches."""
        if not self.calls or not all(_overlap_pays(c, False) for c in self.calls):
            return False
        weight = self.parameters()["weight"]
        positions = sum(math.prod(call.output.shape[2:]) for call in self.calls)
        return positions >= GROUPED_MIN_POSITIONS and explicit_gradients_cheaper(
            weight.shape[0], weight[0].numel(), positions
        )

    def input_factor(self) -> Tensor | None:
        """KFC's ``A = Σ_i Σ_t a_it a_itᵀ`` over all recorded calls from the inputs' shifted
        overlaps (:func:`~lightning_flatness.core.convolution_terms.overlap_input_factor`),
        when every call is a stride-1 convolution for which that costs less than the product
        of the unfolded patches; else None (the patches' product is cheaper)."""
        if not self.from_overlaps:
            return None
        total = None
        for call in self.calls:
            x, geometry = self._convolution_geometry(call)
            found = overlap_input_factor(
                x, geometry["kernel"], geometry["dilation"], geometry["padding"]
            )
            total = found if total is None else total + found
        return total

    def _convolution_geometry(self, call: LayerCall) -> tuple[Tensor, dict]:
        """A convolution call's input as (N, C, H, W) and its 2-D geometry
        (:func:`_two_dimensional`)."""
        return _two_dimensional(call.module, call.args[0].movedim(self.batch_dim, 0))

    def convolution_squared_norms(self, grads: list[Tensor], rows: list[int]) -> Tensor:
        """``Σ_i ‖Σ_t s_kit a_itᵀ‖²`` for the cotangents ``rows`` (len(rows),) of a
        convolution, from each sample's weight gradient computed as a convolution's weight
        gradient with the samples as groups
        (:func:`~lightning_flatness.core.convolution_terms.grouped_weight_gradients`), summed over
        the calls before squaring: no unfolded patches. ``grads`` are the calls' output
        gradients (K, *output shape)."""
        geometries = [self._convolution_geometry(call) for call in self.calls]
        if rows != list(range(grads[0].shape[0])):
            grads = [grad[rows] for grad in grads]
        samples = geometries[0][0].shape[0]
        per_sample = len(rows) * self.parameters()["weight"].numel() + sum(
            x[0].numel() + grad[0].numel() // samples * len(rows)
            for (x, _), grad in zip(geometries, grads, strict=True)
        )
        total = grads[0].new_zeros(len(rows))
        for chunk in sample_chunks(samples, max(1, GROUPED_CHUNK_ELEMENTS // per_sample)):
            summed = None
            for (x, geometry), grad in zip(geometries, grads, strict=True):
                grad = grad.movedim(self.batch_dim + 1, 1)
                if grad.dim() == 4:  # one-dimensional: (K, N, o, L) as one row
                    grad = grad.unsqueeze(-2)
                found = grouped_weight_gradients(x[chunk], grad[:, chunk], **geometry)
                summed = found if summed is None else summed + found
            total += summed.square().sum((0, 2))
        return total

    def output_gradients(self, grads: list[Tensor]) -> Tensor:
        """``s`` (K, N, T, o) over all recorded calls."""
        pieces = []
        for grad in grads:
            grad = grad.movedim(self.batch_dim + 1, 1)
            if is_linear(self.module) or self.is_embedding:
                pieces.append(grad.reshape(grad.shape[0], grad.shape[1], -1, grad.shape[-1]))
            else:
                pieces.append(_positions_first(grad, channel_dim=2))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)

    def bias_output_gradients(self, grads: list[Tensor], every_call: Tensor) -> Tensor:
        """``s`` (K, N, T, o) over the recorded calls that add the bias (every call but the
        weight-only ones, :attr:`LayerCall.weight_only`): ``every_call``, the
        :meth:`output_gradients` of ``grads``, when every call adds it."""
        if not any(call.weight_only for call in self.calls):
            return every_call
        own = [g for g, call in zip(grads, self.calls, strict=True) if not call.weight_only]
        return self.output_gradients(own)

    def per_sample_gradients(self, grads: list[Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError("Kronecker rules never materialise weight gradients.")


class NormRule(Rule):
    """BatchNorm (eval mode, running statistics), LayerNorm and GroupNorm: ``γ ∘ x̂ + β``."""

    def normalised(self, x: Tensor) -> Tensor:
        module = self.module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            shape = (1, -1) + (1,) * (x.dim() - 2)
            mean = module.running_mean.reshape(shape)
            var = module.running_var.reshape(shape)
            return (x - mean) * torch.rsqrt(var + module.eps)
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(x, module.normalized_shape, eps=module.eps)
        return F.group_norm(x, module.num_groups, eps=module.eps)

    def per_sample_gradients(self, grads: list[Tensor]) -> dict[str, Tensor]:
        result: dict[str, Tensor] = {}
        for call, grad in zip(self.calls, grads, strict=True):
            x_hat = self.normalised(call.args[0]).movedim(self.batch_dim, 0)
            grad = grad.movedim(self.batch_dim + 1, 1)
            for attr, name in self.names.items():
                shape = getattr(self.module, attr).shape
                term = grad * x_hat if attr == "weight" else grad
                if isinstance(self.module, nn.LayerNorm):  # sum all but K, N and the normalised
                    dims = tuple(range(2, term.dim() - len(shape)))
                else:  # channels on dim 2 of (K, N, C, ...)
                    dims = tuple(range(3, term.dim()))
                term = term.sum(dims) if dims else term
                result[name] = result[name] + term if name in result else term
        return result
