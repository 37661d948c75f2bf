"""``FlatnessMonitor(regularize=...)``: the regularizer callback the monitor adds to the
trainer, given the monitor's λ, n, reading, seed and log prefix where it has none, and the
penalty for manual optimization.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_flatness.core.reading import BatchReading
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.regularizer import SoftRankPenalty

__all__ = ["own_regularizer", "RegularizerOwner"]


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


class RegularizerOwner:
    """The regularizer part of :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor`."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """With ``regularize=True``, add the regularizer callback for the user (once)."""
        if self.regularizer is None or stage != "fit":
            return
        others = [
            c
            for c in trainer.callbacks
            if isinstance(c, SoftRankRegularizer) and c is not self.regularizer
        ]
        if others:
            raise ValueError(
                "FlatnessMonitor(regularize=True) adds a SoftRankRegularizer, and the trainer "
                "already has one: the penalty would be added twice. Pass regularize=False to "
                "the monitor, or drop the SoftRankRegularizer callback."
            )
        if self.regularizer not in trainer.callbacks:
            trainer.callbacks.append(self.regularizer)

    def make_penalty(self) -> SoftRankPenalty:
        """The regularizer's :class:`SoftRankPenalty` (see
        :meth:`SoftRankRegularizer.make_penalty`)."""
        return self._regularizer().make_penalty()

    def penalty(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """The penalty ``h(F_b)/B`` of one batch (without β), for manual optimization::

            loss = loss + beta * monitor.penalty(self, x)
            self.manual_backward(loss)

        With automatic optimization the regularizer adds ``β · penalty`` itself when
        ``regularize=True``; do not add it twice.
        """
        return self._regularizer().penalty(model, inputs)

    def _regularizer(self) -> SoftRankRegularizer:
        if self.regularizer is None:
            raise RuntimeError(
                "FlatnessMonitor(regularize=False) has no penalty; pass regularize=True or use "
                "a SoftRankRegularizer callback."
            )
        return self.regularizer
