"""The backends of :func:`~lightning_flatness.core.pipeline.run_pipeline`, and the one place that
picks a structure's backend from its options object: layer hooks for ``probe_kernel``
(:class:`~lightning_flatness.core.options.KernelOptions`), ``kfac`` and ``diag``/``diag_mc``
(any differentiable model, and faster than BackPACK's extensions on the paper's models, see
docs/RESULTS.md), ``torch.func`` for ``cg``, ``lanczos`` and ``hutchinson``
(:class:`~lightning_flatness.core.options.MatrixFreeOptions`), BackPACK for ``dense`` and
``gram`` (exact P × P and kernel matrices from its square-root factors). Each backend is given
the options object and the :class:`~lightning_flatness.core.reading.BatchReading` as
``measure()`` received them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor

from lightning_flatness.core.backends.hooks import HookBackend
from lightning_flatness.core.backends.matrix_free import MatrixFreeBackend
from lightning_flatness.core.batches import LogitsModule
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.options import (
    HOOK_STRUCTURES,
    MATRIX_FREE_STRUCTURES,
    StructureOptions,
)
from lightning_flatness.core.pipeline import Backend
from lightning_flatness.core.reading import BatchReading

__all__ = ["HookBackend", "MatrixFreeBackend", "make_backend"]


def make_backend(
    model: LogitsModule,
    options: StructureOptions,
    reading: BatchReading,
    *,
    seed: int,
    all_reduce: Callable[[Tensor], Tensor] | None,
    repeatable_train_batches: Iterable,
    max_samples: int | None,
    shard: tuple[int, int] | None = None,
    decay: ParameterDecay | None = None,
) -> Backend:
    """The backend that measures ``options.structure`` with its validated ``options`` and
    ``reading`` (both handed on as they are; the rest as for ``measure()``; ``decay``:
    per-parameter weight decays, measured by every structure)."""
    structure = options.structure
    if structure in MATRIX_FREE_STRUCTURES:
        return MatrixFreeBackend(
            model,
            options,
            reading,
            seed=seed,
            all_reduce=all_reduce,
            repeatable_train_batches=repeatable_train_batches,
            max_samples=max_samples,
            decay=decay,
            shard=shard,
        )
    if structure in HOOK_STRUCTURES:
        return HookBackend(
            model, options, reading, seed=seed, all_reduce=all_reduce, shard=shard, decay=decay
        )
    # BackPACK is imported only when one of its structures is measured.
    from lightning_flatness.core.backpack.backend import BackpackBackend

    if structure == "gram" and all_reduce is not None:
        from lightning_flatness.core.backpack.gram import NOT_SUMMABLE

        raise ValueError(NOT_SUMMABLE)
    return BackpackBackend(model, options, reading, seed=seed, decay=decay)
