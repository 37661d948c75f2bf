"""When ``FlatnessMonitor`` measures, and with what: the scheduled epochs, the overhead budget's
decision between the exact measurement and the cheap Kronecker fill-in (scaled by the last exact
ratio), the fit-end measurement and summary
(:mod:`lightning_flatness.lightning.budget` decides; this module carries it out).
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_flatness.core.curvature.probe_kernel import FIRST_HALF
from lightning_flatness.core.progress import reporting_progress
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.core.sample_growth import extrapolated_soft_rank
from lightning_flatness.lightning.budget import (
    CHEAP,
    EXACT,
    FILL_IN,
    FILL_IN_SAMPLES,
    SKIP,
    OverheadBudget,
    fills_in,
)
from lightning_flatness.lightning.budget_messages import (
    cost_message,
    measured_line,
    not_exact_message,
)
from lightning_flatness.lightning.calibration import Calibration, fill_in_record
from lightning_flatness.lightning.figures import summary_table
from lightning_flatness.lightning.monitor_logging import MonitorLog
from lightning_flatness.lightning.monitor_measurement import Measurer, all_reduce_of
from lightning_flatness.lightning.monitor_nll import TrainingNll
from lightning_flatness.lightning.monitor_state import FitState, MonitorSettings

__all__ = [
    "ANNOUNCE_SECONDS",
    "PROGRESS_SECONDS",
    "Schedule",
    "announce",
    "rank_zeros",
    "reads_every_epoch",
    "whole_set_soft_rank",
    "quiet_fill_in",
]

#: an exact measurement expected to take longer is announced with one line
ANNOUNCE_SECONDS = 5.0
#: during an exact measurement, one line of progress at most this often (seconds)
PROGRESS_SECONDS = 10.0
#: the subset's calibration with the measurement of its first half, ÷ without it (a half costs
#: at most half as much: its sums grow faster than the samples)
HALF_TOO = 1.5


@contextmanager
def quiet_fill_in() -> Iterator[None]:
    """The fill-in on its sample cap often exceeds the rank bound of that subset; it is a
    tracker, scaled by the last exact ratio and never trusted, so that warning is not said."""
    with warnings.catch_warnings():
        pattern = re.escape(f"structure={FILL_IN!r} reports a soft rank")
        warnings.filterwarnings("ignore", message=pattern)
        yield


def announce(expected: float | None, structure: str, epoch: int) -> None:
    """One line before an exact measurement expected to take more than
    :data:`ANNOUNCE_SECONDS`, so that a long pause is explained."""
    if expected is not None and expected > ANNOUNCE_SECONDS:
        rank_zero_info(
            f"FlatnessMonitor: measuring epoch {epoch} with {structure} "
            f"(about {expected:.0f} s; Ctrl-C stops the fit)"
        )


def reads_every_epoch(trainer: Trainer, log_prefix: str) -> bool:
    """Whether EarlyStopping or ModelCheckpoint monitors one of the monitor's values (those
    under ``log_prefix``: it then needs one at every scheduled epoch)."""
    return any(
        isinstance(callback, (EarlyStopping, ModelCheckpoint))
        and str(getattr(callback, "monitor", None) or "").startswith(log_prefix)
        for callback in trainer.callbacks
    )


def whole_set_soft_rank(
    subset: FlatnessReport, half_soft_rank: float, target: int, parameters: int
) -> tuple[float, float, int]:
    """The soft rank of the ``target`` samples of the whole measured set from a ``subset``
    report and the soft rank of the subset's first half
    (:func:`~lightning_flatness.core.sample_growth.extrapolated_soft_rank`), its rank bound (the
    subset's per sample, at most the ``parameters``), and the samples it stands for."""
    soft_rank = extrapolated_soft_rank(half_soft_rank, subset.soft_rank, subset.num_samples, target)
    bound = min(float(parameters), subset.rank_bound * target / subset.num_samples)
    return soft_rank, bound, target


def rank_zeros(trainer: Trainer, value: object) -> object:
    """Rank 0's ``value`` on every process (decisions taken on each rank's own clock)."""
    if trainer.world_size > 1:
        return trainer.strategy.broadcast(value, src=0)
    return value


def fit_length(trainer: Trainer) -> int | None:
    """The fit's ``max_epochs``, or None for a fit of unknown length."""
    return trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None


class Schedule:
    """When :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` measures, and with
    what: a plain object that owns the fill-in's calibration and what it found the fill-in and
    the subset's measurement cannot do.

    Args:
        settings: the monitor's arguments.
        state: the fit's shared state; this part appends the records and the skipped epochs.
        measurer: runs every measurement.
        budget: the overhead budget: decides, and is charged with every measurement.
        writer: logs each record.
        nll: the training NLL by epoch (the settled test), read here after every epoch.
    """

    def __init__(
        self,
        settings: MonitorSettings,
        state: FitState,
        measurer: Measurer,
        budget: OverheadBudget,
        writer: MonitorLog,
        nll: TrainingNll,
    ) -> None:
        self.settings = settings
        self.state = state
        self.measurer = measurer
        self.budget = budget
        self.writer = writer
        self.nll = nll
        #: exact ÷ fill-in soft rank at the last exact measurement (or on the fill-in's samples)
        self.calibration = Calibration()
        self._fill_in_failed = False
        self._subset_failed = False
        self._cost_told = False

    def start_fit(self) -> None:
        """A new fit: no skipped epoch, no NLL reading, and no calibration (a ratio of one
        fit's weights only)."""
        self.state.skipped = []
        self.calibration = Calibration()
        self.nll.reset()
        self.measurer.forget_samples()

    def read_nll(self, trainer: Trainer, pl_module: LightningModule, epoch: int) -> None:
        """The training NLL after ``epoch`` (-1: before the first) for the settled test, on the
        fill-in's samples (:meth:`Measurer.nll_batches`), unless the monitor is switched off."""
        if self.state.disabled_reason is None:
            batches = partial(self.measurer.nll_batches, trainer)  # read in the forked RNG
            self.nll.record(pl_module, epoch, batches, all_reduce_of(trainer))

    def due(self, trainer: Trainer) -> bool:
        """Whether this epoch is scheduled and not yet measured or skipped."""
        if self.state.disabled_reason is not None:
            return False
        epoch = trainer.current_epoch
        already = epoch in self.state.skipped or any(
            r["epoch"] == epoch for r in self.state.history
        )
        return (epoch + 1) % self.settings.every_n_epochs == 0 and not already

    def _has_fill_in(self) -> bool:
        return not self._fill_in_failed and fills_in(self.state.active_structure)

    def measure_epoch(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A scheduled measurement: exact, the cheap fill-in or none, as the budget allows
        (the same decision on every process)."""
        epochs_done = trainer.current_epoch + 1
        max_epochs = fit_length(trainer)
        last = max_epochs is not None and epochs_done >= max_epochs
        horizon = (epochs_done, max_epochs, last)
        decision = self._decide(trainer, *horizon)
        started = time.perf_counter()
        record = self._budgeted_record(trainer, pl_module, decision, trainer.current_epoch, horizon)
        if record is not None:
            self.nll.settle(record, trainer.current_epoch)
            self._write(trainer, pl_module, record)
        elif decision == SKIP:
            self.state.skipped.append(trainer.current_epoch)
        if decision == EXACT:
            self.budget.exact_seconds = time.perf_counter() - started
            if self.budget.share is not None and not last and self._has_fill_in():
                self._calibrate(trainer, pl_module)
        self.budget.charge(time.perf_counter() - started)
        if decision == EXACT and not self._cost_told:
            self._cost_told = True
            rank_zero_info(
                cost_message(
                    self.budget,
                    self.state.history[-1]["seconds"],
                    epochs_done,
                    self.settings.every_n_epochs,
                    self.state.active_structure,
                )
            )

    def _write(
        self, trainer: Trainer, pl_module: LightningModule, record: dict[str, float]
    ) -> None:
        """Add ``record`` to the history as this epoch's and hand it to the monitor's writer
        (:class:`~lightning_flatness.lightning.monitor_logging.MonitorLog`), with what the
        monitor has added to the training time so far, this measurement included."""
        record["epoch"] = float(trainer.current_epoch)
        self.state.history.append(record)
        seconds = record["seconds"] if math.isfinite(record["seconds"]) else 0.0
        fill_in = bool(record.get("fill_in"))
        report = None if fill_in else self.state.last_report
        self.writer.write(
            trainer,
            pl_module,
            self.state.history,
            overhead=self.budget.overhead(pending=seconds),
            how=self.calibration.describe() if fill_in else self.state.active_structure,
            eigenvalues=report.eigenvalues if report is not None else None,
        )

    def _decide(
        self, trainer: Trainer, epochs_done: int, max_epochs: int | None, last: bool
    ) -> str:
        """The budget's decision (:meth:`OverheadBudget.decide`), rank 0's on every process."""
        since_last = None
        if self.state.history:
            since_last = epochs_done - 1 - int(self.state.history[-1]["epoch"])
        if self.budget.fill_in_samples is None:  # once, when an epoch's time is known
            available = self.measurer.measured_samples()
            chosen = self.budget.choose_fill_in_samples(epochs_done, max_epochs, available)
            self.budget.fill_in_samples = int(rank_zeros(trainer, chosen))
        decision = self.budget.decide(
            epochs_done,
            max_epochs,
            last,
            self._has_fill_in(),
            reads_every_epoch(trainer, self.settings.log_options.prefix),
            since_last=since_last,
        )
        return rank_zeros(trainer, decision)

    def _budgeted_record(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        decision: str,
        epoch: int,
        horizon: tuple[int, int | None, bool],
    ) -> dict[str, float] | None:
        """The record ``decision`` asks for: the exact measurement's, the fill-in's (scaled by
        the last exact ratio, or by the ratio on its own samples, taken when there is none yet,
        at the last epoch and where the fill-in has drifted, if that fits), or None (skipped,
        or the fill-in cannot measure this model)."""
        if decision == EXACT:
            announce(self.budget.exact_seconds, self.state.active_structure, epoch)
            with reporting_progress(
                lambda line: rank_zero_info(f"FlatnessMonitor: {line}"), PROGRESS_SECONDS
            ):
                record = self.measurer.record(trainer, pl_module)
            record.update(fill_in=0.0, calibration=1.0)
            return record
        if decision == CHEAP:
            # the last value again on the subset: the fill-in's ratio drifts over a fit
            again = horizon[2] and self.calibration.samples is not None
            uncalibrated = not math.isfinite(self.calibration.ratio)
            if (uncalibrated or again) and self._subset_fits(trainer, horizon):
                return self._calibrate_on_subset(trainer, pl_module)
            cheap = self._cheap_record(trainer, pl_module)
            if cheap is None:
                return None
            # the ratio taken again where the fill-in has moved far from where it was taken
            if self._recalibrates(trainer, horizon, cheap["soft_rank"]):
                return self._calibrate_on_subset(trainer, pl_module, cheap)
            return fill_in_record(cheap, self.calibration.ratio, self.calibration.rank_bound)
        return None

    def _subset_seconds(self) -> float:
        """The exact structure's cost on the fill-in's samples (and their first half): the last
        such calibration's, or before any the whole set's per sample (an upper estimate: the
        probe kernel's sums grow faster than the samples)."""
        if self.budget.subset_seconds is not None:
            return self.budget.subset_seconds
        samples = self.measurer.measured_samples()
        share = min(FILL_IN_SAMPLES / samples, 1.0) if samples > 0 else 1.0
        # and, below the whole set, its first half for the extrapolation to it
        share *= HALF_TOO if share < 1.0 else 1.0
        return (self.budget.exact_seconds or 0.0) * share

    def _subset_fits(self, trainer: Trainer, horizon: tuple[int, int | None, bool]) -> bool:
        """Whether the exact structure on the fill-in's samples fits beside the fill-in (rank
        0's answer on every process)."""
        if self._subset_failed:
            return False
        fits = self.budget.fits_beside_fill_in(self._subset_seconds(), *horizon)
        return bool(rank_zeros(trainer, fits))

    def _recalibrates(
        self, trainer: Trainer, horizon: tuple[int, int | None, bool], fill_in: float
    ) -> bool:
        """Whether this epoch's fill-in (its own soft rank ``fill_in``) has drifted from where
        its ratio was taken (:meth:`Calibration.drifted`) and the calibration taken again
        leaves a fill-in for every epoch still to come (rank 0's answer on every process)."""
        wanted = not self._subset_failed and not horizon[2] and self.calibration.drifted(fill_in)
        if wanted:
            wanted = self.budget.affords_recalibration(self._subset_seconds(), *horizon[:2])
        wanted = bool(rank_zeros(trainer, wanted))  # on every process, whatever it found
        if wanted:
            self.budget.recalibrated = True
        return wanted

    def _calibrate_on_subset(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        cheap: dict[str, float] | None = None,
    ) -> dict[str, float] | None:
        """Before any exact measurement of the whole set, again at the last epoch, and where
        the fill-in has drifted (:meth:`Calibration.drifted`): the exact structure and the
        fill-in on the fill-in's own samples (its record ``cheap`` when this epoch's has run),
        the exact soft rank extrapolated to the whole set (:meth:`_whole_set_soft_rank`), their
        ratio the calibration, and the fill-in's record scaled by it."""
        started = time.perf_counter()
        try:
            exact = self.measurer.run(trainer, pl_module, limit=FILL_IN_SAMPLES, calibration=True)
            whole = self._whole_set_soft_rank(trainer, pl_module, exact)
        except Exception as error:  # said once; the fill-in goes on unscaled
            self._subset_failed = True
            rank_zero_warn(
                f"FlatnessMonitor: the {self.state.active_structure} measurement of the fill-in's "
                f"samples failed ({type(error).__name__}: {error}); the fill-in is unscaled."
            )
            exact = None
        seconds = time.perf_counter() - started
        self.budget.subset_seconds = rank_zeros(trainer, seconds)
        cheap = cheap if cheap is not None else self._cheap_record(trainer, pl_module)
        if cheap is None:
            return None
        if exact is not None and cheap["soft_rank"] > 0 and math.isfinite(whole[0]):
            self.budget.calibrated = True
            self.calibration = Calibration(
                whole[0] / cheap["soft_rank"],
                float(trainer.current_epoch),
                samples=exact.num_samples,
                rank_bound=whole[1],
                target_samples=whole[2],
                fill_in=cheap["soft_rank"],
            )
        record = fill_in_record(cheap, self.calibration.ratio, self.calibration.rank_bound)
        record["seconds"] += seconds
        return record

    def _whole_set_soft_rank(
        self, trainer: Trainer, pl_module: LightningModule, subset: FlatnessReport
    ) -> tuple[float, float, int]:
        """:func:`whole_set_soft_rank` from the exact structure's ``subset`` report on the
        fill-in's samples, with their first half's soft rank from a formed kernel's own rows or
        else measured."""
        target = self.measurer.measured_samples()
        if not math.isfinite(subset.soft_rank) or subset.num_samples >= target:
            return subset.soft_rank, subset.rank_bound, subset.num_samples
        first_half = subset.blocks.get(FIRST_HALF)
        if first_half is None:
            first_half = self.measurer.run(
                trainer, pl_module, limit=FILL_IN_SAMPLES, half=True, calibration=True
            )
        parameters = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        return whole_set_soft_rank(subset, first_half.soft_rank, target, parameters)

    def _cheap_record(self, trainer: Trainer, pl_module: LightningModule) -> dict | None:
        """The fill-in structure's record, or None (it cannot measure this model: said once,
        and the fill-in is off for the fit); the first one measured again on fewer samples
        where it cost more than its part (:meth:`OverheadBudget.fill_in_too_dear`)."""
        record = self._fill_in_once(trainer, pl_module)
        if record is None or self.budget.fill_in_checked:
            return record
        seconds = float(self.budget.cheap_seconds or 0.0)
        dear = self.budget.fill_in_too_dear(seconds, trainer.current_epoch + 1, fit_length(trainer))
        if not rank_zeros(trainer, dear):  # once per fit; the same samples on every process
            return record
        self.budget.use_fewest_fill_in_samples(rank_zeros(trainer, seconds))
        return self._fill_in_once(trainer, pl_module)

    def _fill_in_once(self, trainer: Trainer, pl_module: LightningModule) -> dict | None:
        """One measurement of the fill-in structure on its samples (:meth:`_cheap_record`)."""
        started = time.perf_counter()
        try:
            with quiet_fill_in():
                report = self.measurer.run(trainer, pl_module, FILL_IN)
        except Exception as error:
            self._fill_in_failed = True
            rank_zero_warn(
                f"FlatnessMonitor: the cheap fill-in structure {FILL_IN!r} cannot measure this "
                f"model ({type(error).__name__}: {error}); between exact measurements nothing "
                "is logged."
            )
            return None
        self.budget.cheap_seconds = time.perf_counter() - started
        return {k: v for k, v in report.as_dict().items() if k != "structure"}

    def _calibrate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The ratio exact ÷ fill-in soft rank on the weights just measured exactly."""
        cheap = self._cheap_record(trainer, pl_module)
        if cheap is not None:
            exact = self.state.history[-1]
            ratio = exact["soft_rank"] / cheap["soft_rank"] if cheap["soft_rank"] else math.nan
            bound = exact.get("rank_bound", math.inf)
            self.calibration = Calibration(
                ratio, float(trainer.current_epoch), None, bound, fill_in=cheap["soft_rank"]
            )

    def finish_fit(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At fit end: the last epoch measured if it was not, the gap figure, and what was
        measured how, said once."""
        last_epoch = trainer.current_epoch - 1 if trainer.current_epoch else 0
        if (
            self.settings.measure_on_fit_end
            and self.state.disabled_reason is None
            and trainer.global_step > 0
            and not any(record["epoch"] >= last_epoch for record in self.state.history)
            and last_epoch not in self.state.skipped  # the budget already said no to it
        ):
            self._fit_end_measurement(trainer, pl_module, last_epoch)
        self.measurer.forget_samples()  # the fill-in's samples are not held beyond the fit
        self.writer.draw_gap_figure(trainer, self.state.history, self.state.active_structure)
        last = self.state.history[-1] if self.state.history else None
        if last is None and self.budget.share is not None and self.state.disabled_reason is None:
            rank_zero_info(
                f"FlatnessMonitor: no measurement fitted overhead_budget={self.budget.share:g} "
                f"of this fit's {self.budget.training_seconds():.1f} s of training, or what "
                f"{self.budget.allowance:g} s leave beside it (one {self.state.active_structure} "
                "measurement: about "
                f"{self.budget.exact_seconds or math.nan:.1f} s). Pass overhead_budget=None "
                "(or a larger share), or measure the trained model with "
                "lightning_flatness.measure()."
            )
        if last is not None and last.get("fill_in") and self.budget.share is not None:
            rank_zero_info(
                not_exact_message(self.budget, self.state.active_structure, self.calibration)
            )
        if last is not None and self.state.disabled_reason is None:
            rank_zero_info(
                measured_line(
                    self.state.history, self.state.skipped, self.state.active_structure, self.budget
                )
            )
        if self.settings.log_options.summary and last is not None and trainer.is_global_zero:
            how = (
                self.calibration.describe() if last.get("fill_in") else self.state.active_structure
            )
            rank_zero_info(summary_table(last, how))

    def _fit_end_measurement(
        self, trainer: Trainer, pl_module: LightningModule, last_epoch: int
    ) -> None:
        """The last epoch was not measured (stopped early, or not scheduled): measure now,
        exact or fill-in as the budget allows, and log it directly to the loggers."""
        horizon = (last_epoch + 1, None, True)
        decision = self._decide(trainer, *horizon)
        started = time.perf_counter()
        record = self._budgeted_record(trainer, pl_module, decision, last_epoch, horizon)
        self.budget.charge(time.perf_counter() - started)
        if record is None:
            if decision == SKIP:
                self.state.skipped.append(last_epoch)
            return
        self.read_nll(trainer, pl_module, last_epoch)  # read at its end unless cut short
        self.nll.settle(record, last_epoch)
        record["epoch"] = float(last_epoch)
        self.state.history.append(record)
        metrics = {
            self.settings.log_options.prefix + k: v for k, v in record.items() if k != "epoch"
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
