"""Leaving the user's model as found while a measurement evaluates it.

:func:`left_as_found` is the context every structure that evaluates the live model (rather than
a private copy) runs in: eval mode (Dropout off, BatchNorm on its running statistics), gradients
enabled, the global RNG forked, PyTorch's fused attention kernels off (the encoder layers' fast
path and the flash kernel of ``scaled_dot_product_attention`` have no forward-mode derivative
and no batching rule; the plain "math" kernel computes the same attention; so does oneDNN's
fused recurrent kernel, switched off alike), and every module's
mode restored on exit. :func:`uncompiled` swaps ``torch.compile`` wrappers for the modules they
compile, so a compiled model is measured as the module it is: the same numbers as uncompiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "left_as_found",
    "original_module",
    "per_sample_modes",
    "rng_devices",
    "uncompiled",
]


def rng_devices(model: nn.Module) -> list[int]:
    """The CUDA devices whose RNG a measurement of ``model`` must fork."""
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _compiled_original(module: nn.Module) -> nn.Module | None:
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else None


@contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """Every ``torch.compile`` wrapper among ``model``'s descendants replaced, for the block,
    by the module it compiles (restored on exit). The root itself is not replaced: unwrap it
    with :func:`original_module`."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        stack = [model]
        while stack:
            parent = stack.pop()
            for name, child in list(parent._modules.items()):
                if child is None:
                    continue
                original = _compiled_original(child)
                if original is not None:
                    parent._modules[name] = original
                    swapped.append((parent, name, child))
                    child = original
                stack.append(child)
        yield
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def original_module(model: nn.Module) -> nn.Module:
    """``model``, or the module a ``torch.compile`` wrapper ``model`` compiles."""
    return _compiled_original(model) or model


@contextmanager
def per_sample_modes(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (BatchNorm on its running statistics, Dropout off, attention
    without dropout), PyTorch's fused attention kernels off and, in a model with recurrent
    layers, its oneDNN (mkldnn) kernels too (the fused recurrent kernel has no forward-mode
    derivative; the native one computes the same recurrence), for the block; every module's
    mode restored on exit. Under it each sample's output depends on that sample alone and is
    deterministic, so per-sample gradients and Fisher factors are defined."""
    modes = [(module, module.training) for module in model.modules()]
    fast_path = torch.backends.mha.get_fastpath_enabled()
    onednn = torch.backends.mkldnn.enabled
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            torch.backends.mha.set_fastpath_enabled(False)
            if any(isinstance(module, nn.RNNBase) for module, _ in modes):
                torch.backends.mkldnn.enabled = False
            model.eval()
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        torch.backends.mkldnn.enabled = onednn
        for module, mode in modes:
            module.training = mode


@contextmanager
def left_as_found(model: nn.Module) -> Iterator[None]:
    """The measurement context of the module docstring: :func:`per_sample_modes`, gradients
    enabled, the global RNG forked."""
    with (
        torch.random.fork_rng(devices=rng_devices(model)),
        torch.inference_mode(False),
        torch.enable_grad(),
        per_sample_modes(model),
    ):
        yield
