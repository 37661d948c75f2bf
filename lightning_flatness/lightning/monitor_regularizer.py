"""``FlatnessMonitor(regularize=...)``: the regularizer callback the monitor owns (given the
monitor's λ, n, reading, seed and log prefix where it has none), its addition to the trainer
(once), and the error for a penalty asked of a monitor without one.
"""

from __future__ import annotations

from lightning.pytorch import Trainer

from lightning_flatness.core.reading import BatchReading
from lightning_flatness.lightning.regularizer import SoftRankRegularizer

__all__ = ["add_regularizer", "own_regularizer", "required_regularizer"]


def own_regularizer(
    regularize: bool | SoftRankRegularizer,
    lam: float | None,
    num_train_samples: int | None,
    reading: BatchReading,
    seed: int,
    log_prefix: str,
) -> SoftRankRegularizer | None:
    """The regularizer ``regularize`` asks for, given the monitor's λ, n, reading, seed and
    log prefix wherever it leaves them unset."""
    if regularize is False or regularize is None:
        return None
    if regularize is True:
        regularize = SoftRankRegularizer()
    if not isinstance(regularize, SoftRankRegularizer):
        raise ValueError(
            f"`regularize` must be True, False or a SoftRankRegularizer, got {regularize!r}."
        )
    regularize.adopt(
        lam=lam,
        num_train_samples=num_train_samples,
        reading=reading,
        seed=seed,
        log_prefix=log_prefix,
    )
    return regularize


def add_regularizer(trainer: Trainer, regularizer: SoftRankRegularizer) -> None:
    """Add the ``regularizer`` callback the monitor owns to ``trainer`` (once), refusing a
    trainer that already has another one (the penalty would be added twice)."""
    others = [
        c for c in trainer.callbacks if isinstance(c, SoftRankRegularizer) and c is not regularizer
    ]
    if others:
        raise ValueError(
            "FlatnessMonitor(regularize=True) adds a SoftRankRegularizer, and the trainer "
            "already has one: the penalty would be added twice. Pass regularize=False to "
            "the monitor, or drop the SoftRankRegularizer callback."
        )
    if regularizer not in trainer.callbacks:
        trainer.callbacks.append(regularizer)


def required_regularizer(regularizer: SoftRankRegularizer | None) -> SoftRankRegularizer:
    """The monitor's regularizer, or an error saying that ``regularize=False`` has none."""
    if regularizer is None:
        raise RuntimeError(
            "FlatnessMonitor(regularize=False) has no penalty; pass regularize=True or use "
            "a SoftRankRegularizer callback."
        )
    return regularizer
