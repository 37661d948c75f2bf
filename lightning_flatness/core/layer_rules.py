"""Per-sample gradients of one layer's parameters from its input and its output gradients.

A forward hook records what a layer received; one backward pass per cotangent on the logits (K
of them) gives the gradient of each cotangent's scalar with respect to the layer's output.
From the two, a *rule* knows the per-sample gradient of each of the layer's parameters without
any per-sample backward pass (docs/math.md, "Kronecker factors from layer hooks"):

- :class:`KroneckerRule` (``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d``, ``nn.Embedding``): the
  layer maps patches ``a_t`` (rows of its input, unfolded convolution patches, one-hot tokens)
  to outputs ``W a_t + b`` at positions ``t``; the per-sample weight gradient is
  ``Σ_t s_t a_tᵀ`` and the bias gradient ``Σ_t s_t``, ``s_t`` the output gradient. It provides
  KFC's Kronecker factors (Grosse & Martens, 2016, Eq. 22) ``A = Σ_t a_t a_tᵀ`` and
  ``G = (1/T) Σ_t s_t s_tᵀ`` and the exact squared norms of the per-sample gradients;
- :class:`NormRule` (BatchNorm with running statistics, LayerNorm, GroupNorm): the affine map
  ``γ ∘ x̂ + β`` of the normalised input ``x̂``; per-sample gradients ``Σ s ∘ x̂`` and ``Σ s``;
- :class:`LocalRule` (any other leaf module with parameters, and ``nn.MultiheadAttention``):
  per-sample gradients of the module's own forward, ``torch.func.vmap`` of a vector-Jacobian
  product over the samples of the recorded inputs — a backward pass through that module only;
- :class:`RecurrentRule` (``nn.RNN``/``LSTM``/``GRU``): the same through the step-by-step
  recursion (:mod:`lightning_flatness.core.recurrent`, which ``vmap`` batches where the fused
  kernel cannot), and for the gate weights, linear maps at every step, the patches and output
  gradients of a Kronecker layer.

Every rule works on tensors shaped ``(K, N, ...)``: K cotangents, N samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_map

from lightning_flatness.core.attention import (
    is_self_attention,
    projection_maps,
    projection_parameters,
)
from lightning_flatness.core.functional_linear import linear_maps_of_sample, linear_plan
from lightning_flatness.core.per_sample import map_samples
from lightning_flatness.core.recurrent import (
    factored_parameters,
    joint_output,
    packed_joint,
    recurrent_forward,
    split_joint,
    split_packed_joint,
    unrolls,
)

__all__ = [
    "AttentionRule",
    "KroneckerRule",
    "LayerCall",
    "LocalRule",
    "NormRule",
    "RecurrentRule",
    "assign_rules",
    "broadcast_lookup",
    "Rule",
    "is_transposed_linear",
    "make_rule",
    "record_call",
    "weight_rows",
    "weight_square_sums",
]

#: numbers per vectorized chunk when per-sample gradients are materialised
CHUNK_ELEMENTS = 2**24


@dataclass
class LayerCall:
    """One call of a hooked module: its (detached) inputs and the output that autograd follows."""

    module: nn.Module
    args: tuple
    kwargs: dict
    output: Tensor


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


def _is_linear(module: nn.Module) -> bool:
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
        if _is_linear(module):
            return x.reshape(x.shape[0], -1, x.shape[-1])
        if isinstance(module, nn.Embedding):
            indices = x.reshape(x.shape[0], -1)
            if module.padding_idx is not None:
                indices = indices.masked_fill(indices == module.padding_idx, -1)
            return indices
        if isinstance(module, nn.Conv1d):
            x = x.unsqueeze(-2)
            kernel, stride = (1, *module.kernel_size), (1, *module.stride)
            dilation, padding = (1, *module.dilation), (0, *_conv_padding(module))
        else:
            kernel, stride = module.kernel_size, module.stride
            dilation, padding = module.dilation, _conv_padding(module)
        unfolded = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        return unfolded.transpose(1, 2)

    def output_gradients(self, grads: list[Tensor]) -> Tensor:
        """``s`` (K, N, T, o) over all recorded calls."""
        pieces = []
        for grad in grads:
            grad = grad.movedim(self.batch_dim + 1, 1)
            if _is_linear(self.module) or self.is_embedding:
                pieces.append(grad.reshape(grad.shape[0], grad.shape[1], -1, grad.shape[-1]))
            else:
                pieces.append(_positions_first(grad, channel_dim=2))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)

    def per_sample_gradients(self, grads: list[Tensor]) -> dict[str, Tensor]:
        raise NotImplementedError("Kronecker rules never materialise weight gradients.")


def _per_sample_weight_gradients(a: Tensor, s: Tensor) -> Iterator[Tensor]:
    """``Σ_t s_kit a_itᵀ`` for chunks of samples: (chunk, K, o, d) each, one batched matrix
    product per chunk of at most :data:`CHUNK_ELEMENTS` numbers."""
    k, n, t, o = s.shape
    d = a.shape[-1]
    for rows in _chunks(n, max(1, CHUNK_ELEMENTS // (k * o * d))):
        s_rows = s[:, rows].permute(1, 0, 3, 2).reshape(-1, k * o, t)
        yield torch.bmm(s_rows, a[rows]).reshape(-1, k, o, d)


def weight_squared_norms(a: Tensor, s: Tensor, embedding: bool) -> Tensor:
    """``‖Σ_t s_kit a_itᵀ‖²`` summed over samples, per cotangent: (K,).

    One position: ``‖s‖² ‖a‖²``; else the cheaper of the explicit per-sample gradients and the
    position Gram matrices ``Σ_{t,u} (a_t·a_u)(s_t·s_u)`` (always the latter for embeddings,
    where ``a_t·a_u = [token_t = token_u]``).
    """
    k, n, t, o = s.shape
    if embedding:
        same = (a.unsqueeze(-1) == a.unsqueeze(-2)) & (a >= 0).unsqueeze(-1)
        a_gram = same.to(s.dtype)
        return torch.einsum("ntu,kntu->k", a_gram, torch.einsum("knto,knuo->kntu", s, s))
    if t == 1:
        return torch.einsum("kn,n->k", s.square().sum((-1, -2)), a.square().sum((-1, -2)))
    d = a.shape[-1]
    totals = s.new_zeros(k)
    if o * d <= t * (o + d):
        for grads in _per_sample_weight_gradients(a, s):
            totals += grads.square().sum((0, 2, 3))
    else:
        per_chunk = max(1, CHUNK_ELEMENTS // (k * t * t))
        for rows in _chunks(n, per_chunk):
            a_gram = torch.bmm(a[rows], a[rows].transpose(1, 2))
            s_rows = s[:, rows].reshape(-1, t, o)
            s_gram = torch.bmm(s_rows, s_rows.transpose(1, 2)).reshape(k, -1, t, t)
            totals += (s_gram * a_gram).sum((1, 2, 3))
    return totals


def weight_batch_gradient(a: Tensor, s0: Tensor, embedding: bool, shape: torch.Size) -> Tensor:
    """``Σ_i Σ_t s_it a_itᵀ`` for one cotangent ``s0`` (N, T, o), shaped like the weight."""
    if embedding:
        flat_s = s0.reshape(-1, s0.shape[-1])
        flat_a = a.reshape(-1)
        keep = flat_a >= 0
        grad = s0.new_zeros(shape[0], shape[1])
        grad.index_add_(0, flat_a[keep], flat_s[keep])
        return grad
    return torch.einsum("nto,ntd->od", s0, a).reshape(shape)


def weight_rows(a: Tensor, s: Tensor, embedding: bool, shape: torch.Size) -> Tensor:
    """The per-sample weight gradients ``Σ_t s_kit a_itᵀ`` flattened: (K, N, o·d) (for an
    embedding (K, N, V·E): each sample's gradient rows of the tokens it holds)."""
    k, n, t, o = s.shape
    if embedding:
        tokens = a.reshape(n, t)
        keep = (tokens >= 0).reshape(-1)
        samples = torch.arange(n, device=a.device).repeat_interleave(t)
        keys = (samples * shape[0] + tokens.reshape(-1))[keep]
        out = s.new_zeros(k, n * shape[0], o)
        out.index_add_(1, keys, s.reshape(k, n * t, o)[:, keep])
        return out.reshape(k, n, -1)
    if t == 1:
        return torch.einsum("kno,nd->knod", s[:, :, 0], a[:, 0]).reshape(k, n, -1)
    pieces = [grads.transpose(0, 1) for grads in _per_sample_weight_gradients(a, s)]
    return torch.cat(pieces, dim=1).reshape(k, n, -1)


def weight_square_sums(a: Tensor, s: Tensor, embedding: bool, num_rows: int) -> Tensor:
    """``Σ_i (Σ_t s_kit a_itᵀ)²`` entrywise, per cotangent: (K, o, d) (for an embedding
    (K, V, E), the squared per-sample gradient rows of each token).

    One position: ``(s²)ᵀ(a²)``; else per-sample gradients a chunk at a time; for an embedding,
    per-sample sums over the positions of each (sample, token) pair.
    """
    k, n, t, o = s.shape
    if embedding:
        tokens = a.reshape(-1)
        keep = tokens >= 0
        samples = torch.arange(n, device=a.device).repeat_interleave(t)[keep]
        keys, inverse = torch.unique(samples * num_rows + tokens[keep], return_inverse=True)
        grouped = s.new_zeros(k, keys.numel(), o)
        grouped.index_add_(1, inverse, s.reshape(k, n * t, o)[:, keep])
        out = s.new_zeros(k, num_rows, o)
        return out.index_add_(1, keys % num_rows, grouped.square())
    d = a.shape[-1]
    if t == 1:
        return torch.einsum("kno,nd->kod", s[:, :, 0].square(), a[:, 0].square())
    totals = s.new_zeros(k, o, d)
    for grads in _per_sample_weight_gradients(a, s):
        totals += grads.square().sum(0)
    return totals


def kronecker_factors(
    a: Tensor, s: Tensor, embedding: bool, num_rows: int
) -> tuple[Tensor, Tensor]:
    """KFC's sums over samples ``Σ_i Σ_t a aᵀ`` (an index count for embeddings) and
    ``Σ_i (1/T) Σ_k Σ_t s sᵀ`` for the Fisher cotangents ``s`` (K', N, T, o)."""
    t = s.shape[2]
    flat_s = s.reshape(-1, s.shape[-1])
    g = flat_s.T @ flat_s / t
    if embedding:
        flat_a = a.reshape(-1)
        counts = torch.bincount(flat_a[flat_a >= 0], minlength=num_rows)
        return g, counts.to(s.dtype)
    flat_a = a.reshape(-1, a.shape[-1])
    return g, flat_a.T @ flat_a


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


class LocalRule(Rule):
    """Any other module with parameters: ``vmap`` over samples of a vector-Jacobian product of
    the module's own forward (a backward pass through this module only).

    Tensor arguments whose leading size is the batch are split into samples (dimension 1 for
    the query, key and value of an ``nn.MultiheadAttention`` with ``batch_first=False``); the
    module sees each sample with a batch dimension of one.
    """

    @property
    def _sequence_first(self) -> bool:
        """The output carries the samples on dimension 1 (and so do an attention's query, key
        and value, and a recurrent layer's input and state)."""
        return self.batch_dim == 1

    def _batch_dims(self, call: LayerCall, batch: int) -> tuple[tuple, dict]:
        seq_first = self._sequence_first
        attention = isinstance(self.module, nn.MultiheadAttention)

        def dim_of(value: object, position: int | None) -> int | None:
            if not isinstance(value, Tensor):
                return None
            sequence_arg = not attention or (position is not None and position < 3)
            dim = 1 if seq_first and sequence_arg else 0
            if value.dim() > dim and value.shape[dim] == batch:
                return dim
            return None

        arg_dims = tuple(dim_of(v, i) for i, v in enumerate(call.args))
        kwarg_dims = {key: dim_of(v, None) for key, v in call.kwargs.items()}
        return arg_dims, kwarg_dims

    #: the gradients keep their graph to the parameters (the regularizer differentiates them)
    keep_graph = False

    @property
    def factored(self) -> dict[str, tuple[str, str]]:
        """``{attribute: (linear map, "weight" or "bias")}`` for the covered parameters that
        are linear maps inside the module (or their biases), measured from patches and output
        gradients by :meth:`linear_maps`; empty when the module has none it can follow.

        Here: a module whose every parameter is the weight or bias of one ``F.linear`` call in
        its own forward (:func:`~lightning_flatness.core.functional_linear.linear_plan`,
        decided once on one sample of the first recorded call)."""
        if self.unfollowed:
            return {}
        if self._plan is None and self.calls:
            self._plan = self._linear_plan(self.calls[0])
        plan = self._plan or {}
        return plan if plan and all(attr in plan for attr in self.names) else {}

    #: a call that :meth:`linear_maps` could not follow was seen: from then on, none is
    #: (a Kronecker block and a diagonal are not summed across batches)
    unfollowed = False
    #: :meth:`factored` of a plain module, once decided
    _plan: dict[str, tuple[str, str]] | None = None

    def _linear_plan(self, call: LayerCall) -> dict[str, tuple[str, str]]:
        if any(True for _ in self.module.children()):
            return {}
        out_dim = 1 if self._sequence_first else 0
        batch = call.output.shape[out_dim]
        arg_dims, kwarg_dims = self._batch_dims(call, batch)

        def first(value: object, dim: int | None) -> object:
            return value if dim is None else value.narrow(dim, 0, 1)

        args = tuple(first(v, d) for v, d in zip(call.args, arg_dims, strict=True))
        kwargs = {key: first(v, kwarg_dims[key]) for key, v in call.kwargs.items()}
        params = {attr: p.detach() for attr, p in self.module.named_parameters()}
        try:
            with torch.no_grad():
                return linear_plan(self.module, params, args, kwargs)
        except Exception:  # whatever the module does, it keeps its own per-sample gradients
            return {}

    def linear_maps(self, grads: list[Tensor]) -> dict[str, tuple[Tensor, Tensor]] | None:
        """``{linear map: (a (N, T, d), s (K, N, T, o))}`` over all recorded calls (several
        calls: more positions), or None when a call cannot be followed that way."""
        if not self.factored:
            return None
        if not all(self._follows(call) for call in self.calls):
            self.unfollowed = True
            return None
        pieces = [self._call_maps(call, grad) for call, grad in zip(self.calls, grads, strict=True)]
        if len(pieces) == 1:
            return pieces[0]
        return {
            weight: (
                torch.cat([piece[weight][0] for piece in pieces], dim=1),
                torch.cat([piece[weight][1] for piece in pieces], dim=2),
            )
            for weight in pieces[0]
        }

    def _follows(self, call: LayerCall) -> bool:
        """:meth:`_call_maps` can measure ``call``."""
        return True

    def _call_maps(self, call: LayerCall, grad: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """A plain module's ``F.linear`` calls
        (:mod:`~lightning_flatness.core.functional_linear`)."""
        module = self.module
        params = {attr: p.detach() for attr, p in module.named_parameters()}
        weights = sorted({weight for weight, _ in self.factored.values()})
        out_dim = 1 if self._sequence_first else 0

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor):
            return linear_maps_of_sample(module, params, args, kwargs, cotangents, weights, out_dim)

        numel = grad.shape[0] * sum(params[w].shape[0] + params[w].shape[1] for w in weights)
        maps = self._map_samples(call, grad, one_sample, numel * max(grad.shape[2:3] or (1,)))
        return {w: (a[0], s) for w, (a, s) in maps.items()}

    def per_sample_gradients(self, grads: list[Tensor]) -> dict[str, Tensor]:
        maps = None if self.keep_graph else self.linear_maps(grads)
        if maps is not None:  # Σ_t s_t a_tᵀ and Σ_t s_t, exactly
            result = {}
            for attr, name in self.names.items():
                weight, kind = self.factored[attr]
                a, s = maps[weight]
                result[name] = s.sum(2) if kind == "bias" else torch.einsum("knto,ntd->knod", s, a)
            return result
        result: dict[str, Tensor] = {}
        params = {
            attr: p if self.keep_graph else p.detach() for attr, p in self.parameters().items()
        }
        for call, grad in zip(self.calls, grads, strict=True):
            for attr, term in self._call_gradients(call, grad, params).items():
                name = self.names[attr]
                result[name] = result[name] + term if name in result else term
        return result

    def _call_gradients(
        self, call: LayerCall, grad: Tensor, params: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Per-sample gradients ``{attribute: (K, N, *shape)}`` of one recorded call."""
        out_dim = 1 if self._sequence_first else 0

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor) -> dict[str, Tensor]:
            def output(theta: dict[str, Tensor]) -> Tensor:
                if unrolls(self.module, args):  # the fused kernel has no batching rule
                    value = recurrent_forward(self.module, theta, *args, **kwargs)
                else:
                    value = functional_call(self.module, theta, args, kwargs)
                value = value[0] if isinstance(value, tuple) else value
                return value.squeeze(out_dim)

            _, pullback = vjp(output, params)
            return vmap(pullback)(cotangents)[0]

        numel = sum(p.numel() for p in params.values()) * grad.shape[0]
        return self._map_samples(call, grad, one_sample, numel)

    def _map_samples(self, call: LayerCall, grad: Tensor, function, numel: int) -> object:
        """``function(args, kwargs, cotangents)`` of each sample of ``call`` (its arguments
        with a batch dimension of one, its cotangents (K, ...)) mapped over the samples a chunk
        at a time, the outputs stacked along dimension 1; ``numel``: output size per sample."""
        out_dim = 1 if self._sequence_first else 0
        batch = grad.shape[out_dim + 1]
        arg_dims, kwarg_dims = self._batch_dims(call, batch)

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor) -> object:
            args = tuple(
                _along(v, d, Tensor.unsqueeze) for v, d in zip(args, arg_dims, strict=True)
            )
            kwargs = {
                key: _along(v, kwarg_dims[key], Tensor.unsqueeze) for key, v in kwargs.items()
            }
            return function(args, kwargs, cotangents)

        def rows_of(value: object, dim: object, rows: slice) -> object:
            size = rows.stop - rows.start
            return _along(value, dim, lambda t, d: t.narrow(d, rows.start, size))

        sample_grad = grad.movedim(out_dim + 1, 1)
        per_chunk = max(1, CHUNK_ELEMENTS // max(1, numel))
        batched = map_samples(one_sample, (arg_dims, kwarg_dims, 1), self.module, out_dims=1)
        pieces = []
        for rows in _chunks(batch, per_chunk):
            args = tuple(rows_of(v, d, rows) for v, d in zip(call.args, arg_dims, strict=True))
            kwargs = {key: rows_of(v, kwarg_dims[key], rows) for key, v in call.kwargs.items()}
            pieces.append(batched(args, kwargs, sample_grad[:, rows]))
        return tree_map(lambda *parts: torch.cat(parts, dim=1), pieces[0], *pieces[1:])


class AttentionRule(LocalRule):
    """``nn.MultiheadAttention`` with packed projections and biases: per-sample gradients of
    its own forward (:class:`LocalRule`), and, for self-attention (query, key and value the
    same tensor), its input projection ``W_in x_t + b_in`` and output projection
    ``W_out o_t + b_out`` measured as the linear maps they are
    (:func:`~lightning_flatness.core.attention.projection_maps`)."""

    @property
    def factored(self) -> dict[str, tuple[str, str]]:
        table = {} if self.unfollowed else projection_parameters(self.module)
        return table if table and all(attr in table for attr in self.names) else {}

    def _follows(self, call: LayerCall) -> bool:
        return is_self_attention(call.args, call.kwargs)

    def _call_maps(self, call: LayerCall, grad: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        module = self.module
        params = {attr: p.detach() for attr, p in module.named_parameters()}
        seq_first = self._sequence_first

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor):
            return projection_maps(module, params, args, kwargs, cotangents, seq_first)

        width = module.embed_dim * (4 * grad.shape[0] + 2)
        maps = self._map_samples(call, grad, one_sample, width * max(grad.shape[1:3]))
        return {w: (a[0], s) for w, (a, s) in maps.items()}


class RecurrentRule(LocalRule):
    """``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` on a padded or packed batch (recorded padded,
    with its lengths): the recorded output is
    :func:`~lightning_flatness.core.recurrent.joint_output` (each sample's output sequence and
    final states in one row, so a model reading either is followed), and the per-sample
    gradients come from one ``vmap`` of the step-by-step recursion
    (:func:`~lightning_flatness.core.recurrent.recurrent_forward`).

    The gate weights ``W_ih``, ``W_hh`` are linear maps applied at every step: their per-sample
    gradients are ``Σ_t s_t a_tᵀ`` with ``a_t`` what the map was applied to (``x_t``,
    ``h_{t−1}``) and ``s_t`` the gradient of its output, which :meth:`linear_maps` takes from one
    ``vmap`` of the recursion differentiated with respect to zero taps on those outputs. They
    give the exact per-sample gradients and KFC's factors of each gate weight over its steps,
    like a linear layer's over positions (docs/math.md, "Kronecker factors from layer hooks").
    """

    @property
    def factored(self) -> dict[str, tuple[str, str]]:
        table = {} if self.unfollowed else factored_parameters(self.module)
        return table if table and all(attr in table for attr in self.names) else {}

    def _follows(self, call: LayerCall) -> bool:
        return unrolls(self.module, call.args)

    def _call_maps(self, call: LayerCall, grad: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        module = self.module
        weights = sorted({weight for weight, _ in factored_parameters(module).values()})
        params = {attr: p.detach() for attr, p in module.named_parameters(recurse=False)}
        gates = {weight: params[weight].shape[0] for weight in weights}

        first = _batch_first(module, call)

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor):
            x, hx, length = _recurrent_arguments(args, kwargs)
            steps = x.shape[1 if first else 0]
            taps = {w: x.new_zeros(steps, 1, size) for w, size in gates.items()}

            def output(taps: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
                seen: dict[str, Tensor] = {}
                sequence, final = recurrent_forward(
                    module, params, x, hx, length, first, taps=taps, inputs=seen
                )
                applied = {w: v.transpose(0, 1) for w, v in seen.items()}  # (1, T, d)
                return joint_output(module, sequence, final, first).squeeze(0), applied

            _, pullback, applied = vjp(output, taps, has_aux=True)
            s = vmap(pullback)(cotangents)[0]
            return {w: (applied[w], s[w].squeeze(2)) for w in weights}

        width = grad.shape[0] * sum(gates.values()) + sum(params[w].shape[1] for w in weights)
        steps = max(call.args[0].shape[:2])
        maps = self._map_samples(call, grad, one_sample, width * steps)
        return {w: (a[0], s) for w, (a, s) in maps.items()}

    def _call_gradients(
        self, call: LayerCall, grad: Tensor, params: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        if not unrolls(self.module, call.args):
            return super()._call_gradients(call, grad, params)
        module = self.module
        first = _batch_first(module, call)

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor):
            x, hx, length = _recurrent_arguments(args, kwargs)

            def output(theta: dict[str, Tensor]) -> Tensor:
                sequence, final = recurrent_forward(module, theta, x, hx, length, first)
                return joint_output(module, sequence, final, first).squeeze(0)

            _, pullback = vjp(output, params)
            return vmap(pullback)(cotangents)[0]

        numel = sum(p.numel() for p in params.values()) * grad.shape[0]
        return self._map_samples(call, grad, one_sample, numel)

    def _batch_dims(self, call: LayerCall, batch: int) -> tuple[tuple, dict]:
        """The input's samples on dimension 0 (batch first, or a packed batch recorded padded)
        or 1, the states' on 1, the lengths' on 0."""
        if not unrolls(self.module, call.args):
            return super()._batch_dims(call, batch)
        first = _batch_first(self.module, call)

        def state_dim(value: object) -> object:
            return None if value is None else ((1, 1) if isinstance(value, tuple) else 1)

        arg_dims = (0 if first else 1, *(state_dim(v) for v in call.args[1:]))
        kwarg_dims = {
            key: 0 if key == "lengths" else state_dim(v) if key == "hx" else None
            for key, v in call.kwargs.items()
        }
        return arg_dims, kwarg_dims


def _batch_first(module: nn.Module, call: LayerCall) -> bool:
    """A recurrent call's layout: batch first for a packed batch (recorded padded that way)."""
    return True if call.kwargs.get("lengths") is not None else module.batch_first


def _recurrent_arguments(args: tuple, kwargs: dict) -> tuple[Tensor, object, Tensor | None]:
    """A recurrent call's input, state and (packed) lengths, the lengths on the input's
    device."""
    state = args[1] if len(args) > 1 else kwargs.get("hx")
    lengths = kwargs.get("lengths")
    return args[0], state, None if lengths is None else lengths.to(args[0].device)


def _along(value: object, dim: object, apply) -> object:
    """``apply(tensor, dim)`` to ``value`` (a tensor, or a tuple of them with a tuple of
    dimensions, such as an LSTM's state); unchanged where ``dim`` is None."""
    if dim is None:
        return value
    if isinstance(dim, tuple):
        return tuple(_along(v, d, apply) for v, d in zip(value, dim, strict=True))
    return apply(value, dim)


def _chunks(size: int, per_chunk: int) -> Iterator[slice]:
    for start in range(0, size, per_chunk):
        yield slice(start, min(size, start + per_chunk))


_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def _kronecker_ready(module: nn.Module) -> bool:
    if _is_linear(module):
        return True
    if isinstance(module, nn.Embedding):
        return module.max_norm is None and not module.scale_grad_by_freq
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.groups != 1 or module.padding_mode != "zeros":
            return False
        if module.padding == "same":
            return all(
                (d * (k - 1)) % 2 == 0
                for d, k in zip(module.dilation, module.kernel_size, strict=True)
            )
        return True
    return False


_STOCK_FORWARDS = (nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Embedding.forward)


def make_rule(modules: list[nn.Module], names: dict[str, str]) -> Rule | None:
    """The rule for parameters used by ``modules`` (``{attribute: user name}``), or None when
    they must go to the whole-model fallback: shared by modules that are not all stock
    Kronecker layers of one type, used by a module with children (a class token), or by
    BatchNorm without running statistics (samples coupled even in eval mode)."""
    module = modules[0]
    kronecker = all(
        type(m) is type(module)
        and (type(m).forward in _STOCK_FORWARDS or is_transposed_linear(m))
        and _kronecker_ready(m)
        for m in modules
    )
    if kronecker:
        return KroneckerRule(modules, names)
    if len(modules) > 1:
        return None
    if isinstance(module, _NORMS):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is None:
            return None
        return NormRule(modules, names)
    if isinstance(module, (nn.RNN, nn.LSTM, nn.GRU)):
        return RecurrentRule(modules, names)
    if isinstance(module, nn.MultiheadAttention):
        return AttentionRule(modules, names)
    if not any(True for _ in module.children()):
        return LocalRule(modules, names)
    return None


def assign_rules(model: nn.Module) -> tuple[list[str], list[Rule], list[str]]:
    """Trainable parameter names, the rules that cover some of them, and the rest.

    A parameter owned by one module goes to that module's rule; a weight (or bias) shared
    by several layers of one Kronecker type (tied weights) to one rule over all of them,
    whose calls are positions of one layer; anything else to the fallback.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, str] = {}
    attention_parts: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            attention_parts.update(id(m) for m in module.modules() if m is not module)
    for prefix, module in model.named_modules(remove_duplicate=False):
        if id(module) in attention_parts:
            continue
        recurse = isinstance(module, nn.MultiheadAttention)
        for attr, param in module.named_parameters(recurse=recurse, remove_duplicate=False):
            if param.requires_grad:
                places = owners.setdefault(id(param), [])
                if all(module is not owner for owner, _ in places):
                    places.append((module, attr))
                names.setdefault(id(param), f"{prefix}.{attr}" if prefix else attr)
    ordered = [n for n, p in model.named_parameters() if p.requires_grad]
    rules: dict[tuple, Rule] = {}
    fallback: list[str] = []
    for param_id, places in owners.items():
        modules = [module for module, _ in places]
        key = tuple(id(module) for module in modules)
        if key not in rules:
            rule = make_rule(modules, {})
            if rule is None:
                fallback.append(names[param_id])
                continue
            rules[key] = rule
        attrs = {attr for _, attr in places}
        if len(attrs) != 1:
            fallback.append(names[param_id])
            continue
        rules[key].names[attrs.pop()] = names[param_id]
    order = {name: i for i, name in enumerate(ordered)}
    fallback.sort(key=order.__getitem__)
    return ordered, [rule for rule in rules.values() if rule.names], fallback


def broadcast_lookup(module: nn.Module, args: tuple, output: Tensor, batch: int) -> bool:
    """An embedding looked up once for the whole batch: indices and output with a leading
    dimension of one, broadcast over ``batch > 1`` samples downstream."""
    return (
        isinstance(module, nn.Embedding)
        and batch > 1
        and output.dim() >= 2
        and output.shape[0] == 1
        and bool(args)
        and isinstance(args[0], Tensor)
        and args[0].dim() >= 1
        and args[0].shape[0] == 1
    )


def _detach_tree(value: object) -> object:
    """A tensor, or a tuple of tensors (an LSTM's state), detached."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach_tree(v) for v in value)
    return value


def record_call(
    rules: list[Rule],
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    output: object,
    batch: int,
    *,
    keep_graph: bool = False,
) -> object:
    """Record one call of ``module`` for ``rules`` (a forward hook's body) and return what the
    module should return instead: the same values, downstream of the recorded output tensor, so
    the gradient of that tensor is what the rest of the model does with the output.

    - A recurrent layer (:class:`RecurrentRule`) records each sample's output sequence and final
      states as one tensor (:func:`~lightning_flatness.core.recurrent.joint_output`); fed a
      ``PackedSequence``, it records the padded input with its lengths.
    - An embedding looked up once for the batch (Hugging Face's position ids of shape (1, T))
      is expanded to the ``batch`` samples, each with its own output gradient.
    - Downstream code gets a copy, so an in-place op there (``ReLU(inplace=True)``) cannot
      change the recorded tensor.

    Inputs are recorded detached unless ``keep_graph`` (the regularizer differentiates the rows).
    Returns None (output unchanged, nothing recorded) for an output that is not a tensor.
    """
    keep = (lambda value: value) if keep_graph else _detach_tree
    recurrent = any(isinstance(rule, RecurrentRule) for rule in rules)
    packed = recurrent and bool(args) and isinstance(args[0], PackedSequence)
    if packed or (recurrent and unrolls(module, args)):
        kept = {key: keep(value) for key, value in kwargs.items()}
        if packed:  # recorded padded, batch first, with the lengths
            joint, args, kept["lengths"] = packed_joint(module, args, output)
        else:
            joint = joint_output(module, output[0], output[1])
        copy = joint.clone()
        call = LayerCall(module, tuple(keep(a) for a in args), kept, joint)
        for rule in rules:
            rule.calls.append(call)
        if packed:
            return split_packed_joint(module, copy, output)
        return split_joint(module, copy, output[0], output[1])
    tensor = output[0] if isinstance(output, tuple) else output
    if not isinstance(tensor, Tensor):
        return None
    if broadcast_lookup(module, args, tensor, batch):
        tensor = tensor.expand(batch, *tensor.shape[1:])
        args = (args[0].expand(batch, *args[0].shape[1:]), *args[1:])
    copy = tensor.clone()
    call = LayerCall(
        module,
        tuple(keep(a) for a in args),
        {key: keep(value) for key, value in kwargs.items()},
        tensor,
    )
    for rule in rules:
        rule.calls.append(call)
    return (copy, *output[1:]) if isinstance(output, tuple) else copy
