"""Linear layers a module applies with ``F.linear`` in its own ``forward``, measured as linear maps.

A custom module that owns a weight and calls ``F.linear(x, self.weight, self.bias)`` is an
``nn.Linear`` a forward hook cannot see. A :class:`~torch.overrides.TorchFunctionMode` can: while
one sample of the module runs (batch dimension one), :class:`LinearCalls` sees every
``F.linear`` call whose weight is one of the module's parameters, records its input ``a`` and
adds a zero *tap* to its output, whose gradient is the output gradient ``s``. The weight's
per-sample gradient is then ``Σ_t s_t a_tᵀ`` and its bias's ``Σ_t s_t``, over the rows ``t`` of
the call (docs/math.md, "Kronecker factors from layer hooks").

:func:`linear_plan` decides once, on one sample, which parameters this covers: every parameter
of the module must be the weight of exactly one such call, or the bias of one; otherwise the
module keeps the per-sample gradients of its own forward.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode

__all__ = ["LinearCalls", "linear_maps_of_sample", "linear_output_shapes", "linear_plan"]


class LinearCalls(TorchFunctionMode):
    """Sees the ``F.linear`` calls whose weight is one of ``weights`` (``{id: attribute}``):
    records each one's input and bias, and adds ``taps[attribute]`` to its output if given."""

    def __init__(self, weights: dict[int, str], taps: dict[str, Tensor] | None = None) -> None:
        super().__init__()
        self.weights = weights
        self.taps = taps
        #: per weight attribute, each call's (input, output shape, id of the bias or None)
        self.calls: dict[str, list[tuple[Tensor, tuple, int | None]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            attr = self.weights.get(id(weight))
            if attr is not None:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                output = func(*args, **kwargs)
                self.calls.setdefault(attr, []).append(
                    (args[0], tuple(output.shape), None if bias is None else id(bias))
                )
                return output + self.taps[attr] if self.taps is not None else output
        return func(*args, **kwargs)


def linear_plan(
    module: nn.Module, params: dict[str, Tensor], args: tuple, kwargs: dict
) -> dict[str, tuple[str, str]]:
    """``{attribute: (weight attribute, "weight" or "bias")}`` covering every parameter of
    ``module`` (run once on ``args``, one sample), or empty when some parameter is not the
    weight of exactly one 2-D ``F.linear`` call nor the bias of one."""
    weights = [attr for attr, p in params.items() if p.dim() == 2]
    mode = _seen_calls(module, params, args, kwargs, weights)
    ids = {id(p): attr for attr, p in params.items()}
    plan: dict[str, tuple[str, str]] = {}
    for attr, calls in mode.calls.items():
        if len(calls) != 1:
            return {}
        _, _, bias = calls[0]
        plan[attr] = (attr, "weight")
        if bias is not None:
            if bias not in ids:  # a bias that is no parameter of the module
                return {}
            plan[ids[bias]] = (attr, "bias")
    return plan if set(plan) == set(params) else {}


def _seen_calls(
    module: nn.Module, params: dict[str, Tensor], args: tuple, kwargs: dict, weights: list[str]
) -> LinearCalls:
    """The ``F.linear`` calls of ``weights`` in one run of the module on ``args``."""
    mode = LinearCalls({id(params[attr]): attr for attr in weights})
    with mode:
        functional_call(module, params, args, kwargs)
    return mode


def linear_output_shapes(
    module: nn.Module, params: dict[str, Tensor], args: tuple, kwargs: dict, weights: list[str]
) -> dict[str, tuple]:
    """The output shape of each weight's ``F.linear`` call on one sample ``args`` (the same for
    every sample of a recorded call: the taps :func:`linear_maps_of_sample` adds)."""
    mode = _seen_calls(module, params, args, kwargs, weights)
    return {attr: mode.calls[attr][0][1] for attr in weights}


def linear_maps_of_sample(
    module: nn.Module,
    params: dict[str, Tensor],
    args: tuple,
    kwargs: dict,
    cotangents: Tensor,
    shapes: dict[str, tuple],
    sample_dim: int,
) -> dict[str, tuple[Tensor, Tensor]]:
    """For one sample (batch dimension one at ``sample_dim`` of the output) and its cotangents
    ``(K, *output)``: ``{weight: (a (1, T, d), s (K, T, o))}``, the rows of each call, given
    each call's output shape (:func:`linear_output_shapes`)."""
    weights = list(shapes)
    ids = {id(params[attr]): attr for attr in weights}
    taps = {attr: params[attr].new_zeros(shape) for attr, shape in shapes.items()}

    def output(taps: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        mode = LinearCalls(ids, taps)
        with mode:
            value = functional_call(module, params, args, kwargs)
        value = value[0] if isinstance(value, tuple) else value
        inputs = {attr: mode.calls[attr][0][0] for attr in weights}
        return value.squeeze(sample_dim), inputs

    _, pullback, inputs = vjp(output, taps, has_aux=True)
    s = vmap(pullback)(cotangents)[0]
    return {
        attr: (
            inputs[attr].reshape(1, -1, inputs[attr].shape[-1]),
            s[attr].reshape(s[attr].shape[0], -1, s[attr].shape[-1]),
        )
        for attr in weights
    }
