"""The batches a fit draws from an iterable (streaming) dataset, kept for the measurement.

A map-style dataset lets the monitor read a fixed subset by index without touching the user's
sampler or iterator. A stream has no indices: opening a second iterator of the user's
``IterableDataset`` advances whatever state it keeps (an epoch counter, a shuffle seed, a file
cursor) and changes the fit. So for a stream the monitor never iterates the loader itself; it
keeps references to the batches the training (or validation) loop has already drawn this epoch,
up to a sample budget, and measures the current weights on them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["DEFAULT_STREAM_SAMPLES", "StreamBuffer", "leading_size"]

#: samples kept per epoch from a stream when ``max_samples`` is None (a stream may not end)
DEFAULT_STREAM_SAMPLES = 10_000


def leading_size(batch: Any) -> int:
    """The leading size of the first tensor in ``batch`` (its sample count, for the budget)."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def _detached(batch: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, batch)


class StreamBuffer:
    """The batches of the current epoch, whole batches until ``max_samples`` are held.

    The tensors are the loop's own (detached, not copied): a batch the user's code changes in
    place after its training step is measured as changed.
    """

    def __init__(self, max_samples: int | None) -> None:
        self.max_samples = DEFAULT_STREAM_SAMPLES if max_samples is None else int(max_samples)
        self.batches: list[Any] = []
        self.num_samples = 0

    def reset(self) -> None:
        """Forget the last epoch's batches."""
        self.batches = []
        self.num_samples = 0

    @property
    def full(self) -> bool:
        return self.num_samples >= self.max_samples

    def add(self, batch: Any) -> None:
        """Keep ``batch`` unless the budget is already reached."""
        if self.full:
            return
        self.batches.append(_detached(batch))
        self.num_samples += leading_size(batch)
