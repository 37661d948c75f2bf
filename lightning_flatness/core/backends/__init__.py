"""The backends of :func:`~lightning_flatness.core.pipeline.run_pipeline`, and the one place that
picks a structure's backend: layer hooks for ``kfac``, ``diag`` and ``diag_mc`` (any
differentiable model, and faster than BackPACK's extensions on the paper's models, see
docs/RESULTS.md), ``torch.func`` for ``lanczos`` and ``hutchinson``, BackPACK for ``dense`` and
``gram`` (exact P × P and kernel matrices from its square-root factors)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from torch import Tensor

from lightning_flatness.core.backends.hooks import HookBackend
from lightning_flatness.core.backends.matrix_free import MATRIX_FREE_STRUCTURES, MatrixFreeBackend
from lightning_flatness.core.batches import LogitsModule, UnpackBatch
from lightning_flatness.core.pipeline import Backend

__all__ = ["HookBackend", "MatrixFreeBackend", "make_backend"]


def make_backend(
    structure: str,
    model: LogitsModule,
    *,
    loss: str,
    kfac_mode: str,
    mc_samples: int,
    trace_estimator: str | None,
    seed: int,
    all_reduce: Callable[[Tensor], Tensor] | None,
    matrix_free_options: Mapping[str, object] | None,
    unpack_batch: UnpackBatch | None,
    repeatable_train_batches: Iterable,
    max_samples: int | None,
    dense_max_parameters: int | None,
    gram_max_kernel_size: int | None,
) -> Backend:
    """The backend that measures ``structure`` (arguments as for ``measure()``)."""
    if structure in MATRIX_FREE_STRUCTURES:
        options = {
            **({"trace_estimator": trace_estimator} if trace_estimator else {}),
            **(matrix_free_options or {}),
        }
        return MatrixFreeBackend(
            model,
            structure,
            loss=loss,
            seed=seed,
            all_reduce=all_reduce,
            options=options,
            unpack_batch=unpack_batch,
            repeatable_train_batches=repeatable_train_batches,
            max_samples=max_samples,
        )
    if structure in ("kfac", "diag", "diag_mc"):
        return HookBackend(
            model,
            structure,
            loss=loss,
            kfac_mode=kfac_mode,
            mc_samples=mc_samples,
            trace_estimator=trace_estimator or "exact",
            seed=seed,
        )
    # BackPACK is imported only when one of its structures is measured.
    from lightning_flatness.core.backpack.backend import BackpackBackend

    return BackpackBackend(
        model,
        structure,
        loss=loss,
        trace_estimator=trace_estimator or "exact",
        seed=seed,
        dense_max_parameters=dense_max_parameters,
        gram_max_kernel_size=gram_max_kernel_size,
    )
