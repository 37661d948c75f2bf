"""The modes the penalty evaluates a model in: eval mode, LayerNorm from elementary ops."""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_flatness.core.model_state import per_sample_modes

__all__ = ["penalty_modes"]


_TOLD_ABOUT_MODES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@contextmanager
def penalty_modes(model: object, batch_norm: str = "running") -> Iterator[nn.Module]:
    """``model`` in eval mode for the block (``model_state.per_sample_modes``), its LayerNorm
    modules computed by :func:`_composite_layer_norm`.

    With batch statistics each output depends on the whole batch, so the per-sample Fisher
    factors ``V_i`` are undefined (and the running statistics must not be updated by the
    penalty's extra forward pass); the Fisher of a randomly masked network is random. So the
    penalty is evaluated as the standard per-sample-gradient practice does, in eval mode (said
    once per model when that changes a BatchNorm, Dropout or attention module); the training
    step itself is unchanged, and every module's mode is restored on exit.

    ``batch_norm="batch"`` (the compositional estimator, which needs no per-sample rows) keeps
    every BatchNorm that is in training mode on the statistics of the batch it sees, as the
    training step computes it, with its running statistics neither used nor updated. A penalty
    on the running-statistics network while the data loss trains the batch-statistics one lets
    the optimizer shrink the penalised Fisher by letting the two networks drift apart
    (docs/RESULTS.md, regularizer effect).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a BatchNorm without running statistics (batch statistics even in eval
            mode) with ``batch_norm="running"``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    on_batch = [
        module
        for module in model.modules()
        if batch_norm == "batch"
        and isinstance(module, nn.modules.batchnorm._BatchNorm)
        and module.training
    ]
    batch_statistics = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        and module.running_mean is None
        and module not in on_batch
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
        and module not in on_batch
        and (
            isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.MultiheadAttention))
            or (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
        )
    ]
    if switched and model not in _TOLD_ABOUT_MODES:
        _TOLD_ABOUT_MODES.add(model)
        norm = (
            "BatchNorm in training mode keeps the statistics of the penalty's batch (its "
            "running statistics untouched), other BatchNorm on running statistics"
            if batch_norm == "batch"
            else "BatchNorm on its running statistics"
        )
        warnings.warn(
            f"The soft-rank penalty evaluates the model in eval mode: {norm}, Dropout and "
            f"attention dropout off ({', '.join(switched)}). Per-sample Fisher factors are "
            "undefined with batch statistics and random under dropout. Training itself is "
            "unchanged.",
            UserWarning,
            stacklevel=4,
        )
    norms = [
        m
        for m in model.modules()
        if type(m).forward is nn.LayerNorm.forward and "forward" not in vars(m)
    ]
    tracking = [(module, module.track_running_stats) for module in on_batch]
    try:
        for module in norms:
            module.forward = types.MethodType(_composite_layer_norm, module)
        with per_sample_modes(model):
            for module in on_batch:  # batch statistics, running ones neither read nor written
                module.train()
                module.track_running_stats = False
            yield model
    finally:
        for module, tracked in tracking:
            module.track_running_stats = tracked
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
