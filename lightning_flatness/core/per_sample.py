"""Per-sample functions over a batch: ``torch.func.vmap``, or a loop where ``vmap`` cannot follow
the model.

``vmap`` runs a per-sample function once for the whole batch, but it cannot follow Python
control flow that depends on a batched tensor's value (``if mask.any():``, ``.item()``), which
real models have: Hugging Face's attention-mask code, for instance, checks whether any token is
padding; nor can it batch some kernels (PyTorch's recurrent layers). For such a model
:func:`map_samples` computes the same per-sample values one sample at a time (exact, slower),
decides so once per model and says so once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["LOOPING_MESSAGE", "is_data_dependent_error", "map_samples"]

LOOPING_MESSAGE = (
    "torch.func.vmap cannot batch {model}'s forward over samples ({reason}); its per-sample "
    "quantities are computed one sample at a time instead (exact, slower)."
)

#: models whose forward ``vmap`` could not follow (their per-sample functions loop)
_LOOPING: weakref.WeakSet = weakref.WeakSet()


def is_data_dependent_error(error: BaseException) -> bool:
    """Whether ``error`` is ``vmap`` refusing data-dependent control flow or ``.item()``."""
    text = str(error)
    return isinstance(error, RuntimeError) and "vmap" in text and "data-dependent" in text


def map_samples(
    function: Callable[..., Any],
    in_dims: Sequence[Any],
    model: torch.nn.Module | None = None,
    out_dims: int = 0,
) -> Callable[..., Any]:
    """``vmap(function, in_dims, out_dims)``, falling back to a loop over the samples when
    ``vmap`` cannot batch the model (its control flow depends on the data, or a kernel has no
    batching rule). A loop over samples is always right; an error it raises too propagates.

    Args:
        function: the per-sample function.
        in_dims: per positional argument, the dimension that holds the samples (of a tensor, or
            of every tensor in a tuple/dict), None (shared), or a tuple/dict of these matching
            the argument's structure.
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
                reason = (
                    "its control flow depends on the inputs' values, e.g. a padding-mask check"
                    if is_data_dependent_error(error)
                    else str(error).splitlines()[0][:120]
                )
            if model is not None:
                _LOOPING.add(model)
            name = type(model).__name__ if model is not None else "the model"
            warnings.warn(LOOPING_MESSAGE.format(model=name, reason=reason), stacklevel=2)
        return _loop(function, in_dims, out_dims, args)

    return call


def _select(value: Any, dim: Any, index: int) -> Any:
    """Sample ``index`` of ``value`` along ``dim`` (None: shared; a tuple/dict: per element)."""
    if dim is None:
        return value
    if isinstance(dim, tuple):
        return tuple(_select(v, d, index) for v, d in zip(value, dim, strict=True))
    if isinstance(dim, dict):
        return {key: _select(v, dim[key], index) for key, v in value.items()}
    return tree_map(lambda t: t.select(dim, index) if isinstance(t, torch.Tensor) else t, value)


def _batch_size(value: Any, dim: Any) -> int | None:
    if dim is None:
        return None
    if isinstance(dim, (tuple, dict)):
        pairs = (
            zip(value, dim, strict=True)
            if isinstance(dim, tuple)
            else ((value[key], d) for key, d in dim.items())
        )
        sizes = [_batch_size(v, d) for v, d in pairs]
        return next((size for size in sizes if size is not None), None)
    leaves = [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return leaves[0].shape[dim] if leaves else None


def _loop(function: Callable[..., Any], in_dims: Sequence[Any], out_dims: int, args: tuple) -> Any:
    batch = _batch_size(args, tuple(in_dims))
    outputs = []
    for index in range(batch or 0):
        sample_args = tuple(
            _select(arg, dim, index) for arg, dim in zip(args, in_dims, strict=True)
        )
        outputs.append(function(*sample_args))
    return tree_map(lambda *values: torch.stack(values, dim=out_dims), *outputs)
