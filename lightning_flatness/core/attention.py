"""The two linear maps inside ``nn.MultiheadAttention``, measured as linear maps.

Self-attention applies its packed input projection ``[q; k; v]_t = W_in x_t + b_in`` and its
output projection ``y_t = W_out o_t + b_out`` at every position ``t``, inside the module's own
forward (not through ``nn.Linear`` calls a hook could see). A sample's gradient of either weight
is ``Σ_t s_t a_tᵀ`` with ``a_t`` what the map was applied to and ``s_t`` the gradient of its
output, and of its bias ``Σ_t s_t`` (docs/math.md, "Kronecker factors from layer hooks"):

- ``s_t`` of both maps are the gradients with respect to zero *taps* added to the biases, one per
  position: each sample runs with a batch dimension of one, where a bias of shape (T, o) is added
  to the T rows of the map's output;
- ``a_t`` is the query ``x_t`` for the input projection, and for the output projection the
  attention output ``o_t``, which the module itself returns when ``W_out = I`` and ``b_out = 0``.

Everything else of the module (masks, ``batch_first``, the heads) is PyTorch's own forward.

In the measurement's hooked pass the two maps are also read off the forward pass itself:
:class:`ProjectionCalls` sees the module's own ``F.linear`` calls of ``W_in`` and ``W_out``
while it runs and records what each was applied to and its output, and the pass's backward
rows then give ``s_t`` of both at once for every sample (:func:`recorded_projection_maps`),
with no second run of the module per sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn import functional as F

__all__ = [
    "ProjectionCalls",
    "is_self_attention",
    "projection_maps",
    "projection_parameters",
    "recorded_projection_maps",
]

#: the module's parameters, by attribute: (linear map, "weight" or "bias")
_PROJECTIONS = {
    "in_proj_weight": ("in_proj", "weight"),
    "in_proj_bias": ("in_proj", "bias"),
    "out_proj.weight": ("out_proj", "weight"),
    "out_proj.bias": ("out_proj", "bias"),
}


def projection_parameters(module: nn.MultiheadAttention) -> dict[str, tuple[str, str]]:
    """``{attribute: (linear map, "weight" or "bias")}`` when the module's projections can be
    measured as linear maps: one packed input projection, both biases, no ``bias_k``/``bias_v``
    and no ``add_zero_attn`` (which change what the projections see); else empty."""
    if (
        not module._qkv_same_embed_dim
        or module.in_proj_bias is None
        or module.out_proj.bias is None
        or module.bias_k is not None
        or module.add_zero_attn
    ):
        return {}
    return dict(_PROJECTIONS)


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> object:
    return args[position] if len(args) > position else kwargs.get(name)


def is_self_attention(args: tuple, kwargs: dict) -> bool:
    """The recorded call's query, key and value are one tensor (views of the same memory with
    the same shape and strides: the inputs are recorded detached, each on its own)."""
    tensors = [
        _argument(args, kwargs, position, name)
        for position, name in enumerate(("query", "key", "value"))
    ]
    if not all(isinstance(t, Tensor) for t in tensors):
        return False
    first = tensors[0]
    return all(
        t.data_ptr() == first.data_ptr() and t.shape == first.shape and t.stride() == first.stride()
        for t in tensors[1:]
    )


def projection_maps(
    module: nn.MultiheadAttention,
    params: dict[str, Tensor],
    args: tuple,
    kwargs: dict,
    cotangents: Tensor,
    sequence_first: bool,
) -> dict[str, tuple[Tensor, Tensor]]:
    """For one sample (its arguments with a batch dimension of one, ``sequence_first`` when
    that dimension is 1) and its cotangents ``(K, *output)``: ``{"in_proj": (a, s),
    "out_proj": (a, s)}`` with ``a`` (1, T, d) and ``s`` (K, T, o), by position."""
    sample_dim = 1 if sequence_first else 0
    # contiguous: the module's in-projection then adds a (T, o) bias to its T rows
    query = _argument(args, kwargs, 0, "query").contiguous()
    # one tensor for all three, so the module takes its packed projection (it tests identity)
    kwargs = {key: value for key, value in kwargs.items() if key not in ("query", "key", "value")}
    args = (query, query, query, *args[3:])
    steps = query.shape[1 - sample_dim]
    width = module.embed_dim
    taps = {
        "in_proj": query.new_zeros(steps, 3 * width),
        "out_proj": query.new_zeros(steps, width),
    }
    identity = torch.eye(width, dtype=query.dtype, device=query.device)

    def output(taps: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        theta = {
            **params,
            "in_proj_bias": params["in_proj_bias"] + taps["in_proj"],
            "out_proj.bias": params["out_proj.bias"] + taps["out_proj"],
        }
        value = functional_call(module, theta, args, kwargs)[0]
        # the output projection's input: the same forward with W_out = I and b_out = 0
        plain = {**theta, "out_proj.weight": identity, "out_proj.bias": taps["out_proj"] * 0}
        attended = functional_call(module, plain, args, kwargs)[0]
        return value.squeeze(sample_dim), attended.squeeze(sample_dim)

    _, pullback, attended = vjp(output, taps, has_aux=True)
    s = vmap(pullback)(cotangents)[0]
    x = query.squeeze(sample_dim)
    return {
        "in_proj": (x.unsqueeze(0), s["in_proj"]),
        "out_proj": (attended.unsqueeze(0), s["out_proj"]),
    }


class ProjectionCalls:
    """Records the ``F.linear`` calls of one ``nn.MultiheadAttention``'s packed input and
    output projections while its forward runs (a context manager around that forward):
    ``{"in_proj": (x, y), "out_proj": (o, y)}`` with the input detached and the output in the
    graph (downstream gets a copy of it, so its gradient is what the rest of the forward does
    with it).

    ``F.multi_head_attention_forward`` hands itself to a ``TorchFunctionMode`` as a whole, so
    the projections it applies inside are invisible to one. It calls them through the name
    ``linear`` of ``torch.nn.functional``, which is therefore wrapped for the block (and
    restored on exit): the wrapper calls the original and records the calls whose weight is
    the module's own ``in_proj_weight`` or ``out_proj.weight`` tensor; every other call passes
    through unchanged. Separate query/key/value projections and cross-attention's split
    weights are not recorded, and a map applied twice leaves no record (it cannot be told
    which call is which)."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.weights = {
            id(module.in_proj_weight): "in_proj",
            id(module.out_proj.weight): "out_proj",
        }
        self.records: dict[str, tuple[Tensor, Tensor]] = {}
        self.repeated: set[str] = set()
        self._original: Callable | None = None

    def __enter__(self) -> ProjectionCalls:
        self._original = F.linear
        F.linear = self._linear
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._original is not None:
            F.linear = self._original
            self._original = None

    def _linear(self, input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        assert self._original is not None
        output = self._original(input, weight, bias)
        name = self.weights.get(id(weight))
        if name is None:
            return output
        if name in self.records:
            self.repeated.add(name)
        self.records[name] = (input.detach(), output)
        return output.clone()

    def complete(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Both maps' records, or none when either is missing or was applied twice."""
        if self.repeated or set(self.records) != {"in_proj", "out_proj"}:
            return {}
        return dict(self.records)


def recorded_projection_maps(
    records: dict[str, tuple[Tensor, Tensor]], grads: dict[str, Tensor], batch: int
) -> dict[str, tuple[Tensor, Tensor]] | None:
    """``{"in_proj": (a (N, T, d), s (K, N, T, o)), "out_proj": ...}`` from the records of
    :class:`ProjectionCalls` and the K rows' gradients of the recorded outputs, or None when
    their shapes are not the ones ``F.multi_head_attention_forward`` gives ``batch`` samples
    (the input projection applied to (T, N, d), the output projection to (T·N, d))."""
    x, _ = records["in_proj"]
    attended, _ = records["out_proj"]
    if x.dim() != 3 or x.shape[1] != batch or attended.dim() != 2:
        return None
    steps = x.shape[0]
    if attended.shape[0] != steps * batch:
        return None
    s_in, s_out = grads["in_proj"], grads["out_proj"]
    rows = s_in.shape[0]
    return {
        "in_proj": (x.movedim(1, 0), s_in.movedim(2, 1)),
        "out_proj": (
            attended.reshape(steps, batch, -1).movedim(1, 0),
            s_out.reshape(rows, steps, batch, -1).movedim(2, 1),
        ),
    }
