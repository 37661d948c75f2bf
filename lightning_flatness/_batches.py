"""The one place that turns user batches into measurement inputs (shared by all structures)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["prepared_batches"]


def prepared_batches(
    batches: Iterable,
    max_samples: int | None,
    device: torch.device,
    dtype: torch.dtype,
    loss: str,
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """``(index, inputs, targets)`` of ``(inputs, targets, ...)`` batches, on the model's device
    and floating dtype, truncated after ``max_samples`` samples in all; empty batches skipped.

    Regression targets (``loss="mse"``) take the model's dtype; tensors created under
    ``torch.inference_mode`` are cloned so autograd can use them.
    """
    seen = 0
    for index, batch in enumerate(batches):
        if max_samples is not None and seen >= max_samples:
            break
        inputs, targets = batch[0], batch[1]
        if max_samples is not None:
            inputs, targets = inputs[: max_samples - seen], targets[: max_samples - seen]
        if inputs.shape[0] == 0:
            continue
        inputs = inputs.to(device=device, dtype=dtype if inputs.is_floating_point() else None)
        targets = targets.to(device=device, dtype=dtype if loss == "mse" else None)
        if inputs.is_inference():
            inputs, targets = inputs.clone(), targets.clone()
        seen += inputs.shape[0]
        yield index, inputs, targets
