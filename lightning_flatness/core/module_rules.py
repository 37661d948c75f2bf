"""Per-sample gradients of a module's parameters through the module's own forward.

:class:`LocalRule` covers any leaf module with parameters: ``torch.func.vmap`` over the samples
of a vector-Jacobian product of the module's forward on its recorded inputs (a backward pass
through that module only). Where the module applies linear maps inside its forward, the rule
also gives their patches and output gradients, like a Kronecker layer's
(docs/math.md, "Kronecker factors from layer hooks"):

- :class:`LocalRule`: a module whose every parameter is the weight or bias of one ``F.linear``
  call (:mod:`lightning_flatness.core.functional_linear`);
- :class:`AttentionRule`: the packed input and the output projection of self-attention
  (:mod:`lightning_flatness.core.attention`);
- :class:`RecurrentRule` (``nn.RNN``/``LSTM``/``GRU``): the step-by-step recursion
  (:mod:`lightning_flatness.core.recurrent`, which ``vmap`` batches where the fused kernel
  cannot), whose gate weights are linear maps at every step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_map

from lightning_flatness.core.attention import (
    is_self_attention,
    projection_maps,
    projection_parameters,
    recorded_projection_maps,
)
from lightning_flatness.core.functional_linear import (
    linear_maps_of_sample,
    linear_output_shapes,
    linear_plan,
)
from lightning_flatness.core.layer_rules import LayerCall, Rule
from lightning_flatness.core.linear_map_terms import CHUNK_ELEMENTS, sample_chunks
from lightning_flatness.core.per_sample import map_samples
from lightning_flatness.core.recurrent import (
    factored_parameters,
    joint_output,
    recurrent_forward,
    unrolls,
)

__all__ = ["AttentionRule", "LocalRule", "RecurrentRule"]


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

        Every covered parameter must be in :meth:`_linear_table`."""
        table = {} if self.unfollowed else self._linear_table()
        return table if table and all(attr in table for attr in self.names) else {}

    def _linear_table(self) -> dict[str, tuple[str, str]]:
        """The module's parameters that are linear maps or their biases. Here: a module whose
        every parameter is the weight or bias of one ``F.linear`` call in its own forward
        (:func:`~lightning_flatness.core.functional_linear.linear_plan`, decided once on one
        sample of the first recorded call)."""
        if self._plan is None and self.calls:
            self._plan = self._linear_plan(self.calls[0])
        return self._plan or {}

    #: a call that :meth:`linear_maps` could not follow was seen: from then on, none is
    #: (a Kronecker block and a diagonal are not summed across batches)
    unfollowed = False
    #: :meth:`factored` of a plain module, once decided
    _plan: dict[str, tuple[str, str]] | None = None

    def _first_sample(self, call: LayerCall) -> tuple[tuple, dict]:
        """The arguments of ``call``'s first sample, with a batch dimension of one."""
        out_dim = 1 if self._sequence_first else 0
        arg_dims, kwarg_dims = self._batch_dims(call, call.output.shape[out_dim])

        def first(value: object, dim: object) -> object:
            return _along(value, dim, lambda t, d: t.narrow(d, 0, 1))

        args = tuple(first(v, d) for v, d in zip(call.args, arg_dims, strict=True))
        return args, {key: first(v, kwarg_dims[key]) for key, v in call.kwargs.items()}

    def _linear_plan(self, call: LayerCall) -> dict[str, tuple[str, str]]:
        if any(True for _ in self.module.children()):
            return {}
        args, kwargs = self._first_sample(call)
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
        with torch.no_grad():  # the taps' shapes, once for the call's samples
            shapes = linear_output_shapes(module, params, *self._first_sample(call), weights)

        def one_sample(args: tuple, kwargs: dict, cotangents: Tensor):
            return linear_maps_of_sample(module, params, args, kwargs, cotangents, shapes, out_dim)

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
        for rows in sample_chunks(batch, per_chunk):
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

    def _linear_table(self) -> dict[str, tuple[str, str]]:
        return projection_parameters(self.module)

    def _follows(self, call: LayerCall) -> bool:
        return is_self_attention(call.args, call.kwargs)

    def _call_maps(self, call: LayerCall, grad: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """Read off the pass where its projections were recorded with their rows' gradients
        (:func:`~lightning_flatness.core.attention.recorded_projection_maps`), else from a
        second run of the module per sample."""
        if call.inner and set(call.inner_grads) == set(call.inner):
            batch = grad.shape[2 if self._sequence_first else 1]
            maps = recorded_projection_maps(call.inner, call.inner_grads, batch)
            if maps is not None:
                return maps
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

    def _linear_table(self) -> dict[str, tuple[str, str]]:
        return factored_parameters(self.module)

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
