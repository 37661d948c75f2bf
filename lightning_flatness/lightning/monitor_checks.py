"""What ``FlatnessMonitor`` does once, when training starts: λ and n, ``structure="auto"``
resolved, one real batch read as every measurement will read it, and the structure tried on it
(the trial, whose time predicts a measurement's). A configuration the monitor cannot measure
stops the fit here with one message naming the fix, or (``strict=False``) switches the monitor
off; BackPACK's structures switch to ``lanczos`` where BackPACK cannot follow the model.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_flatness.core.curvature.stored_rows import keeps_rows, quadrature_seconds
from lightning_flatness.core.defaults import (
    AUTO,
    choose_across_processes,
    kernel_rows,
    row_width,
)
from lightning_flatness.core.failures import (
    MeasurementError,
)
from lightning_flatness.core.measure import check_batch
from lightning_flatness.core.options import KernelOptions
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.lightning.budget import (
    FILL_IN,
    FILL_IN_SAMPLES,
    OverheadBudget,
    fills_in,
)
from lightning_flatness.lightning.monitor_measurement import (
    Measurer,
    all_reduce_of,
    monitor_options,
    tensor_numbers,
)
from lightning_flatness.lightning.monitor_schedule import quiet_fill_in
from lightning_flatness.lightning.monitor_state import FitState, MonitorSettings
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.lightning.trainer_facts import (
    all_dataloaders,
    first_dataloader,
    is_sized,
    resolve_missing,
)
from lightning_flatness.lightning.trial import TRIAL_SAMPLES, trial_settings

__all__ = ["FitStart", "cost_line", "predicted_exact_seconds"]


def cost_line(times: dict[int, float]) -> tuple[float, float]:
    """(fixed seconds, seconds per sample) through two timed sample counts (one: all of it per
    sample). A recurrent model's per-sample loop makes the fill-in many epochs; a small MLP's
    is mostly the fixed part."""
    sizes = sorted(times)
    if len(sizes) == 1:
        return 0.0, times[sizes[0]] / sizes[0]
    small, large = sizes[0], sizes[-1]
    per_sample = max(times[large] - times[small], 0.0) / (large - small)
    return max(times[small] - small * per_sample, 0.0), per_sample


def predicted_exact_seconds(times: dict[int, float], samples: int) -> float:
    """The first exact measurement's predicted cost on ``samples``: the lower of the two timed
    runs' costs per sample, scaled (a run's fixed part makes either an upper estimate of the
    pass; on a small model the fixed part is most of a run of 8 samples: the zoo's ResNet took
    0.027 s on 8 and 0.058 s on 32, 13 s and 7 s scaled to 4,000, where the measurement costs
    1.5 s), and never below the larger run's own time. Not the line through both: the larger
    run may have taken a costlier path that then does not grow with the samples (the probe
    kernel's P × P sums and eigendecomposition, once the rows outnumber the parameters: the
    paper's MLP measured 0.16 s on 8 samples, 1.3 s on 32, and 1.5 s on 400, which the line
    put at 19 s), and where both runs are mostly their fixed part, the line's slope is the
    timings' noise (the ladder's ResNet: 0.142 s on 8, 0.147 s on 32)."""
    sizes = sorted(times)
    small, large = sizes[0], sizes[-1]
    per_sample = min(times[small] / small, times[large] / large)
    return max(times[large], per_sample * samples)


class FitStart:
    """What :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` does once, when
    training starts: a plain object that owns what the checks found (the first batch, its
    sample count) until the trial has run.

    Args:
        settings: the monitor's arguments.
        state: the fit's shared state; this part sets λ and n, the structure ``"auto"``
            chooses (and its sketch factor), the numbers per sample, and ``disabled_reason``
            when it switches the monitor off.
        measurer: runs the checks' and the trial's measurements.
        budget: the overhead budget, charged with the checks and given the trial's times.
        regularizer: the regularizer the monitor added, switched off with the monitor.
    """

    def __init__(
        self,
        settings: MonitorSettings,
        state: FitState,
        measurer: Measurer,
        budget: OverheadBudget,
        regularizer: SoftRankRegularizer | None = None,
    ) -> None:
        self.settings = settings
        self.regularizer = regularizer
        self.state = state
        self.measurer = measurer
        self.budget = budget
        self._checked = False
        #: a stream's first training batch is checked when the loop draws it
        self._check_on_first_batch = False
        #: the training batch the checks read, for the trial measurement
        self._first_batch: Any = None
        #: the samples of the batch the trial measures
        self.trial_samples = 0

    def resolve(self, trainer: Trainer) -> None:
        """λ from the optimizers and n from the training dataloader, if not yet read."""
        resolve_missing(self.state, trainer, given=self.settings)

    def start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Once per monitor, when its first fit's training starts: the configuration read on
        one real batch, ``"auto"`` resolved, and the timed trial; every part of it charged to
        the budget."""
        if self._checked:
            return
        self._checked = True
        checking = time.perf_counter()
        self._check_configuration(trainer, pl_module)
        if self.settings.structure == AUTO and self.state.disabled_reason is None:
            self.choose_structure(trainer, pl_module)
        self.budget.charge(time.perf_counter() - checking)  # the checks; the trial below
        self.timed_trial(trainer, pl_module, self._first_batch)
        self._first_batch = None

    def choose_structure(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve ``structure="auto"`` once, for this model and the samples measured, and say
        which structure was chosen and why
        (:func:`~lightning_flatness.core.defaults.choose_structure`)."""
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        samples = self.state.resolved_num_train_samples
        cap = self.settings.max_samples
        loader = first_dataloader(trainer.train_dataloader)
        if loader is not None and not is_sized(loader):
            cap = self.measurer.stream_samples()
        if samples is not None and cap is not None:
            samples = min(samples, cap)
        # the rows measure() takes for that many samples
        options = kernel_rows(monitor_options("probe_kernel"), samples)
        on_cpu = pl_module.device.type == "cpu"  # processes of one machine share its memory
        choice = choose_across_processes(
            trainable,
            samples,
            options,
            device=pl_module.device,
            all_reduce=all_reduce_of(trainer),
            world=trainer.world_size,
            sharing=trainer.num_devices if on_cpu else 1,
        )
        self.state.active_structure = choice.structure
        self.state.sketch_factor = choice.sketch_factor
        rank_zero_info(f"FlatnessMonitor: structure='auto' measures {choice.reason}.")

    def _check_configuration(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Read one real training (and validation) batch as every measurement will; for a
        stream, the first batch the training loop draws (:meth:`on_train_batch_start`).

        Raises (``strict=True``) or warns once and switches the monitor off (``strict=False``)
        when the batch, the model's output or the targets cannot be measured.
        """
        val_loaders = all_dataloaders(trainer.val_dataloaders) if self.settings.use_val else []
        if len(val_loaders) > 1:
            rank_zero_info(
                f"FlatnessMonitor: {len(val_loaders)} validation dataloaders; the held-out "
                f"numbers use dataloader {self.settings.val_dataloader_idx} (val_dataloader)."
            )
        train_loader = first_dataloader(trainer.train_dataloader)
        if train_loader is not None and not is_sized(train_loader):
            self._check_on_first_batch = True
            rank_zero_info(
                "FlatnessMonitor: the training data is a stream (an IterableDataset); the "
                f"monitor measures the first {self.measurer.stream_samples():,} samples "
                "the training loop draws in each measured epoch and never iterates the stream "
                "itself (max_samples sets the number)."
            )
        splits = [] if self._check_on_first_batch else [("training", trainer.train_dataloader)]
        if val_loaders:
            splits.append(("validation", val_loaders))
        try:
            for split, loaders in splits:
                batch = next(iter(self.measurer.batches(trainer, loaders, split)), None)
                if batch is not None:
                    samples, _ = self._check_batch(pl_module, batch)
                    if split == "training":
                        self.trial_samples = samples
                        self.state.sample_numbers = tensor_numbers(batch) / max(samples, 1)
                if split == "training":
                    self._first_batch = batch
        except Exception as error:
            self.refuse(pl_module, error)

    def _check_batch(self, pl_module: LightningModule, batch: Any) -> tuple[int, int]:
        return check_batch(pl_module, batch, self.settings.reading)

    def refuse(self, pl_module: LightningModule, error: Exception) -> None:
        """Raise (``strict=True``), or warn once and switch the monitor off."""
        message = (
            f"FlatnessMonitor cannot measure {type(pl_module).__name__} "
            f"({type(error).__name__}): {error}"
        )
        if self.settings.strict:
            raise ValueError(message) from error
        self.state.disabled_reason = str(error)
        if self.regularizer is not None:
            self.regularizer.disabled = True
        rank_zero_warn(f"{message} The monitor is switched off for this fit (strict=False).")

    def read_stream_batch(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """A training batch the loop drew from a stream: checked (with the trial) if it is the
        fit's first, then kept for this epoch's measurement."""
        loader = first_dataloader(trainer.train_dataloader)
        if loader is None or is_sized(loader) or self.state.disabled_reason is not None:
            return
        if self._check_on_first_batch:
            self._check_on_first_batch = False
            try:
                self.trial_samples, _ = self._check_batch(pl_module, batch)
            except Exception as error:
                self.refuse(pl_module, error)
                return
            self.timed_trial(trainer, pl_module, batch)
            if self.state.disabled_reason is not None:
                return
        self.measurer.keep_training_batch(batch)

    def timed_trial(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """The fit-start trial, charged to the budget. The trial's structure is timed once more
        on a quarter of its samples, to predict the first exact measurement's cost
        (:func:`predicted_exact_seconds`: the budget's decisions, and the line announcing a long
        one); with a budget the fill-in is timed on both sample counts too, and so is its
        calibration on its samples where the whole set is larger than they are."""
        started = time.perf_counter()
        self._trial(trainer, pl_module, batch)
        seconds = time.perf_counter() - started
        self.budget.charge(seconds)
        if self.state.disabled_reason is not None:
            return
        started = time.perf_counter()
        samples = self.measurer.measured_samples()
        world = max(trainer.world_size, 1)  # each process measures (and is timed on) its share
        arguments, work = trial_settings(self.measurer.arguments(self.state.active_structure))
        trial_samples = max(min(self.trial_samples, TRIAL_SAMPLES), 1)
        times = self._timed_runs(pl_module, batch, arguments, trial_samples, seconds)
        if times is not None:
            quadrature = self.quadrature_seconds(pl_module, samples, trainer.world_size)
            share = math.ceil(samples / world)
            self.budget.predict_exact(work * predicted_exact_seconds(times, share) + quadrature)
        if self.budget.share is not None and fills_in(self.state.active_structure):
            fill_in_samples = min(samples, FILL_IN_SAMPLES)
            val_samples = min(self.settings.max_val_samples or FILL_IN_SAMPLES, FILL_IN_SAMPLES)
            val_samples = val_samples if self.settings.use_val else 0
            arguments = self.measurer.arguments(FILL_IN)
            line = self._cost_line(pl_module, batch, arguments, trial_samples)
            if line is not None:  # per sample of the fill-in's subset: with its held-out ones
                fixed, per_sample = line
                per_subset_sample = per_sample * (1 + val_samples / fill_in_samples) / world
                self.budget.fill_in_line = (fixed, per_subset_sample)
                self.budget.cheap_seconds = fixed + per_subset_sample * fill_in_samples
            if samples > FILL_IN_SAMPLES:  # the fill-in will be calibrated on its samples
                arguments = self.measurer.calibration_arguments()
                share = math.ceil((FILL_IN_SAMPLES + val_samples) / world)
                subset = self._line_seconds(pl_module, batch, arguments, trial_samples, share)
                if subset is not None:
                    self.budget.subset_seconds = subset
        self.budget.charge(time.perf_counter() - started)

    def quadrature_seconds(self, pl_module: LightningModule, samples: int, world: int) -> float:
        """The stored-row quadrature's predicted seconds when the probe kernel will take that
        path on ``samples`` (P above its P × P guard, the rows above a formed kernel's or
        spread over ``world`` > 1 processes, each running on its share), which the trial on a
        few samples does not run; else 0."""
        if self.state.active_structure != "probe_kernel":
            return 0.0
        chosen = self.settings.structure_options
        options = chosen if isinstance(chosen, KernelOptions) else KernelOptions()
        options = kernel_rows(options, samples)  # as measure() settles them for m samples
        parameters = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        rows = math.ceil(samples / world) * options.probes
        spread = world > 1 and parameters > options.max_parameters
        guards = {"max_parameters": options.max_parameters, "side": options.side}
        if not spread and not keeps_rows(
            parameters, rows, max_kernel_size=options.max_kernel_size, **guards
        ):
            return 0.0
        width = row_width(parameters, options, self.state.sketch_factor)
        return quadrature_seconds(
            rows,
            width,
            groups=options.groups,
            probes=options.slq_probes,
            steps=options.slq_steps,
            sketch_groups=options.sketch_groups if width < parameters else 0,
            device=pl_module.device,
        )

    def _line_seconds(
        self,
        pl_module: LightningModule,
        batch: Any,
        arguments: dict[str, Any],
        trial_samples: int,
        samples: int,
    ) -> float | None:
        """The predicted seconds of a measurement with ``arguments`` on ``samples``: the
        straight line (:func:`cost_line`) through its trial runs (:meth:`_timed_runs`); None
        when it cannot measure this model."""
        line = self._cost_line(pl_module, batch, arguments, trial_samples)
        if line is None:
            return None
        fixed, per_sample = line
        return fixed + per_sample * samples

    def _cost_line(
        self, pl_module: LightningModule, batch: Any, arguments: dict[str, Any], samples: int
    ) -> tuple[float, float] | None:
        """(fixed seconds, seconds per sample) of a measurement with ``arguments``: the
        straight line (:func:`cost_line`) through its trial runs on ``samples`` and a quarter of
        them (:meth:`_timed_runs`); None when it cannot measure this model."""
        times = self._timed_runs(pl_module, batch, arguments, samples)
        return None if times is None else cost_line(times)

    def _timed_runs(
        self,
        pl_module: LightningModule,
        batch: Any,
        arguments: dict[str, Any],
        samples: int,
        seconds: float | None = None,
    ) -> dict[int, float] | None:
        """Seconds of measurements with ``arguments`` on a quarter of the trial batch's
        ``samples`` and on all of them (``seconds``: that one's, when it has just run); None
        when it cannot measure this model (found out when it runs)."""
        times = {}
        for size in sorted({max(samples // 4, 1), samples}):
            if size == samples and seconds is not None:
                times[size] = seconds
                continue
            started = time.perf_counter()
            try:
                with quiet_fill_in():
                    run = {**arguments, "max_samples": size}
                    self.measurer.call(pl_module, [batch], None, arguments=run)
            except Exception:
                return None
            times[size] = time.perf_counter() - started
        return times

    def _trial(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """Measure one real training batch with the structure every epoch will use, once at
        fit start: a structure that cannot measure this model fails here, once, instead of
        logging NaN every epoch (a BackPACK structure it cannot convert switches to
        ``lanczos`` here, and says so). A numerical failure (a NaN loss) is left to
        the epochs; under DDP every process refuses if any one does."""
        disabled = self.state.disabled_reason is not None
        error = None if disabled or batch is None else self._trial_error(pl_module, batch)
        reduce = all_reduce_of(trainer)
        if reduce is not None:  # every process takes part, so all decide alike
            failed = int(reduce(torch.tensor([float(error is not None or disabled)])).item())
            if failed and error is None and not disabled:
                error = RuntimeError(
                    f"the structure failed at fit start on {failed} other process(es); see "
                    "their messages"
                )
        if error is not None:
            self.refuse(pl_module, error)

    def _trial_error(self, pl_module: LightningModule, batch: Any) -> Exception | None:
        """What stops the structure on ``batch``, or None (numerical failures included)."""

        def run() -> FlatnessReport:
            arguments, _ = trial_settings(self.measurer.arguments(self.state.active_structure))
            return self.measurer.call(pl_module, [batch], None, arguments=arguments)

        try:
            self.measurer.with_fallback(run)
        except (MeasurementError, FloatingPointError):  # NaN on this batch: not the structure
            return None
        except Exception as error:
            return RuntimeError(
                f"structure={self.state.active_structure!r} failed on a real training batch "
                f"({type(error).__name__}: {error}); pick another structure "
                "(FlatnessMonitor(structure=...))."
            )
        return None
