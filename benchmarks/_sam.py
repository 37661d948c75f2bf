"""Sharpness-aware minimisation (Foret et al., 2021) as one optimizer step, for the benchmarks.

One SAM step with base optimizer ``optimizer`` (Adam in the benchmarks) and radius ρ:

1. g = ∇L(θ) on the minibatch (``loss_fn`` is the data loss; a coupled weight decay stays in
   the base optimizer, as in the usual SAM implementations);
2. ε = ρ g / ‖g‖, the norm taken over all parameters together;
3. g_SAM = ∇L(θ + ε) on the same minibatch;
4. θ is restored exactly (from a copy, not by subtracting ε) and the base optimizer steps
   with g_SAM, adding its weight decay λθ at the unperturbed θ.

BatchNorm: the first pass updates the running statistics as a plain step does; the second
(perturbed) pass uses batch statistics but its running-statistics update is undone
(:func:`frozen_batchnorm_statistics`), the standard SAM practice, so the running statistics the
model is evaluated with see each batch once, at the unperturbed weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["frozen_batchnorm_statistics", "sam_step"]


@contextmanager
def frozen_batchnorm_statistics(model: nn.Module) -> Iterator[None]:
    """Undo, on exit, every change to the BatchNorm buffers of ``model`` made inside the block.

    The running mean, running variance and batch counter of every BatchNorm module are copied
    on entry and written back on exit; the forward passes inside still use batch statistics
    in train mode.

    Args:
        model: the network (any module; models without BatchNorm are left as they are).
    """
    saved: list[tuple[Tensor, Tensor]] = []
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked):
                if buffer is not None:
                    saved.append((buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)


def sam_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], Tensor],
    rho: float,
) -> float:
    """One SAM step (module docstring) on the minibatch that ``loss_fn`` evaluates.

    Args:
        model: the network, in train mode; its parameters are those of ``optimizer``.
        optimizer: the base optimizer (its weight decay applies at the unperturbed θ).
        loss_fn: evaluates the data loss of the minibatch at the current parameters (called
            twice: at θ and at θ + ε).
        rho: ρ > 0, the radius of the perturbation.

    Returns:
        The loss at the unperturbed parameters (the first pass), as a float.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    originals = [p.detach().clone() for p in params]
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        scale = rho / (norm + 1e-12)
        for p in params:
            p.add_(p.grad, alpha=float(scale))
    optimizer.zero_grad(set_to_none=True)
    with frozen_batchnorm_statistics(model):
        loss_fn().backward()
    with torch.no_grad():
        for p, original in zip(params, originals, strict=True):
            p.copy_(original)
    optimizer.step()
    return float(loss.detach())
