"""Per-sample functions over a batch: ``torch.func.vmap``, or a loop where ``vmap`` cannot follow
the model.

``vmap`` runs a per-sample function once for the whole batch, but it cannot follow Python
control flow that depends on a batched tensor's value (``if mask.any():``, ``.item()``), which
real models have: Hugging Face's attention-mask code, for instance, checks whether any token is
padding. For such a model :func:`map_samples` computes the same per-sample values one sample at
a time (exact, slower), decides so once per model and says so once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["DATA_DEPENDENT_MESSAGE", "is_data_dependent_error", "map_samples"]

DATA_DEPENDENT_MESSAGE = (
    "The model's forward branches on the values of its inputs (a padding-mask check, .item(), "
    "...), which torch.func.vmap cannot follow; per-sample quantities of this model are "
    "computed one sample at a time instead (exact, slower)."
)

#: models whose forward ``vmap`` could not follow (their per-sample functions loop)
_LOOPING: weakref.WeakSet = weakref.WeakSet()


def is_data_dependent_error(error: BaseException) -> bool:
    """Whether ``error`` is ``vmap`` refusing data-dependent control flow or ``.item()``."""
    text = str(error)
    return isinstance(error, RuntimeError) and "vmap" in text and "data-dependent" in text


def map_samples(
    function: Callable[..., Any],
    in_dims: Sequence[int | None],
    model: torch.nn.Module | None = None,
    out_dims: int = 0,
) -> Callable[..., Any]:
    """``vmap(function, in_dims, out_dims)``, falling back to a loop over the samples when the
    model's control flow depends on the data.

    Args:
        function: the per-sample function.
        in_dims: per positional argument, the dimension that holds the samples (of a tensor, or
            of every tensor in a tuple/dict) or None (shared).
        model: the model the function calls; once ``vmap`` fails on it, later calls loop
            directly.
        out_dims: the dimension of every output along which the samples are stacked.
    """
    batched = vmap(function, in_dims=tuple(in_dims), out_dims=out_dims)

    def call(*args: Any) -> Any:
        if model is None or model not in _LOOPING:
            try:
                return batched(*args)
            except RuntimeError as error:
                if not is_data_dependent_error(error):
                    raise
            if model is not None:
                _LOOPING.add(model)
            warnings.warn(DATA_DEPENDENT_MESSAGE, stacklevel=2)
        return _loop(function, in_dims, out_dims, args)

    return call


def _loop(
    function: Callable[..., Any], in_dims: Sequence[int | None], out_dims: int, args: tuple
) -> Any:
    batch = next(
        leaf.shape[dim]
        for arg, dim in zip(args, in_dims, strict=True)
        if dim is not None
        for leaf in tree_leaves(arg)
        if isinstance(leaf, torch.Tensor)
    )
    outputs = []
    for index in range(batch):
        sample_args = tuple(
            arg if dim is None else tree_map(lambda t, i=index, d=dim: t.select(d, i), arg)
            for arg, dim in zip(args, in_dims, strict=True)
        )
        outputs.append(function(*sample_args))
    return tree_map(lambda *values: torch.stack(values, dim=out_dims), *outputs)
