"""The training inputs that ``lanczos`` and ``cg`` pass over again, once per Lanczos step or
conjugate-gradient iteration (:mod:`lightning_flatness.core.backends.matrix_free`), split into
chunks of samples whose batched products fit in ``chunk_elements``.

With ``cache=True`` the prepared inputs are kept in memory (:class:`CachedInputs`); with
``cache=False`` the training batches are read again for every pass (:class:`ReiteratedInputs`),
which must then yield the same samples in the same order, checked by each batch's sample count
and input sum (:func:`fingerprint`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from lightning_flatness.core.batches import (
    Leaves,
    UnpackBatch,
    num_samples,
    prepared_batches,
    split_leaves,
)
from lightning_flatness.core.failures import MeasurementError
from lightning_flatness.core.functional_stats import FunctionalModel
from lightning_flatness.core.options import MatrixFreeOptions

__all__ = [
    "CachedInputs",
    "Chunker",
    "ReiteratedInputs",
    "activation_elements_per_sample",
    "fingerprint",
    "same_fingerprints",
]


def _prepared(
    batches: Iterable,
    max_samples: int | None,
    model: FunctionalModel,
    unpack_batch: UnpackBatch | None,
) -> Iterator[tuple[int, Leaves, Tensor]]:
    """``(index, inputs, targets)`` on the model's device/dtype, truncated at ``max_samples``."""
    return prepared_batches(
        batches, max_samples, model.device, model.dtype, unpack_batch, model.module.spec
    )


def activation_elements_per_sample(model: FunctionalModel, inputs: Leaves) -> float:
    """Numbers autograd saves per sample in a forward pass (difference of 2 and 1 samples)."""
    counts = []
    params = {name: p.detach().requires_grad_() for name, p in model.params.items()}
    for size in (1, 2):
        saved = [0]

        def pack(tensor: Tensor, saved: list[int] = saved) -> Tensor:
            saved[0] += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.logits(
                params, tuple(t[:1].expand(size, *t.shape[1:]).contiguous() for t in inputs)
            )
        counts.append(saved[0])
    return max(1.0, float(counts[1] - counts[0]))


class Chunker:
    """Splits batches into chunks of samples for the batched products of ``vectors`` vectors.

    Unless ``chunk_size`` is given, a chunk holds as many samples as keep the activations of
    one batched product, ``(vectors + 1) × chunk × (saved numbers per sample)``, within
    ``chunk_elements``.
    """

    def __init__(self, model: FunctionalModel, options: MatrixFreeOptions, vectors: int):
        self.model, self.options, self.vectors = model, options, vectors
        self.size: int | None = options.chunk_size

    def split(self, inputs: Leaves) -> list[Leaves]:
        if self.size is None:
            per_sample = activation_elements_per_sample(self.model, inputs)
            budget = self.options.chunk_elements / ((self.vectors + 1) * per_sample)
            self.size = max(1, int(budget))
        return split_leaves(inputs, self.size)


class CachedInputs:
    """This process's prepared training inputs, kept for the Lanczos passes."""

    def __init__(self, chunker: Chunker) -> None:
        self.chunker = chunker
        self.batches: list[Leaves] = []
        self.num_samples = 0

    def add(self, inputs: Leaves) -> None:
        self.batches.append(inputs)
        self.num_samples += num_samples(inputs)

    def _batches(self) -> Iterator[Leaves]:
        yield from self.batches

    def chunks(self, with_rows: bool = False) -> Iterator:
        """Chunks of inputs (and, with ``with_rows``, their rows in this process's sample axis)."""
        offset = 0
        for inputs in self._batches():
            for piece in self.chunker.split(inputs):
                size = num_samples(piece)
                rows = slice(offset, offset + size)
                offset += size
                yield (piece, rows) if with_rows else piece


class ReiteratedInputs(CachedInputs):
    """Iterates ``train_batches`` again for every pass (``cache=False``), checking each pass
    yields the same samples in the same order (count and per-batch input sums): :meth:`add`
    keeps only each batch's fingerprint."""

    def __init__(
        self,
        chunker: Chunker,
        batches: Iterable,
        max_samples: int | None,
        model: FunctionalModel,
        unpack_batch: UnpackBatch | None,
    ) -> None:
        super().__init__(chunker)
        self.source, self.max_samples, self.model = batches, max_samples, model
        self.unpack_batch = unpack_batch
        self.fingerprints: list[tuple[int, float]] = []

    def add(self, inputs: Leaves) -> None:
        self.fingerprints.append(fingerprint(inputs))
        self.num_samples += num_samples(inputs)

    def _batches(self) -> Iterator[Leaves]:
        seen = []
        source = _prepared(self.source, self.max_samples, self.model, self.unpack_batch)
        for _, inputs, _ in source:
            seen.append(fingerprint(inputs))
            yield inputs
        if not same_fingerprints(seen, self.fingerprints):
            raise MeasurementError(
                "train_batches yielded different samples on a later pass (shuffling, random "
                "augmentation or a one-shot iterator). structure='lanczos' makes one pass per "
                "Lanczos step over the same samples: pass a deterministic loader or keep "
                "MatrixFreeOptions.cache=True."
            )


def fingerprint(inputs: Leaves) -> tuple[int, float]:
    """``(samples, sum of every input number)`` of one batch, in float64."""
    return num_samples(inputs), sum(float(t.detach().to(torch.float64).sum()) for t in inputs)


def same_fingerprints(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Whether two passes saw the same batches: equal counts, sums equal to round-off."""
    return len(a) == len(b) and all(
        n == m and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
        for (n, x), (m, y) in zip(a, b, strict=True)
    )
