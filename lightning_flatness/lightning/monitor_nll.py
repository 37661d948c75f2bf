"""The monitor's settled test: the training NLL after every epoch, read once per epoch on the
fixed subset the fill-in is calibrated on, and its relative drop over the epoch a record was
measured at, which untrusts the record while the model is still descending
(:mod:`lightning_flatness.core.trust`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn

from lightning_flatness.core.model_state import rng_devices
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.training_nll import mean_nll
from lightning_flatness.core.trust import nll_drop, settled_verdict
from lightning_flatness.lightning.budget import OverheadBudget

__all__ = ["TrainingNll"]


class TrainingNll:
    """The training NLL by epoch (``by_epoch``; -1: before the first epoch), a plain object.

    Args:
        reading: how batches and outputs are read (the likelihood the NLL is of).
        budget: the fit's overhead budget, charged with every reading's time.
    """

    def __init__(self, reading: BatchReading, budget: OverheadBudget) -> None:
        self.reading = reading
        self.budget = budget
        self.by_epoch: dict[int, float] = {}
        self._failed = False

    def reset(self) -> None:
        """A new fit: no readings yet."""
        self.by_epoch = {}

    def record(
        self,
        pl_module: LightningModule,
        epoch: int,
        batches: Callable[[], Iterable],
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """The training NLL after ``epoch``, once per epoch, on ``batches()`` (the fixed
        subset the fill-in is calibrated on): one forward pass that changes nothing (eval mode,
        no gradient, the RNG forked; :func:`mean_nll`), the same on every process
        (``all_reduce``), its time charged to the budget (and kept as its per-epoch cost). NaN
        (said once) if it fails."""
        if epoch in self.by_epoch:
            return
        started = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=rng_devices(pl_module)):
                read = batches()
            value = mean_nll(pl_module, read, **self.reading.as_kwargs(), all_reduce=all_reduce)
        except Exception as error:  # a metric must never stop training
            if not self._failed:
                rank_zero_warn(
                    f"FlatnessMonitor: the training NLL after epoch {epoch} could not be read "
                    f"({type(error).__name__}: {error}); the predicted gap is not trusted "
                    "where it is missing."
                )
            self._failed = True
            value = math.nan
        self.by_epoch[epoch] = value
        seconds = time.perf_counter() - started
        self.budget.charge(seconds)
        self.budget.per_epoch_seconds = seconds  # kept for the epochs still to come

    def settle(self, record: dict[str, float], epoch: int) -> None:
        """Add ``nll_drop`` (the training NLL's relative drop over ``epoch``) to ``record`` and
        set its ``trusted`` to 0 unless that drop shows the model settled
        (:func:`~lightning_flatness.core.trust.settled_verdict`)."""
        drop = nll_drop(self.by_epoch.get(epoch - 1, math.nan), self.by_epoch.get(epoch, math.nan))
        record["nll_drop"] = drop
        record["trusted"] = settled_verdict(record.get("trusted", math.nan), drop)
