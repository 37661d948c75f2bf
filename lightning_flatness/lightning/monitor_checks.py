"""What ``FlatnessMonitor`` does once, when training starts: λ and n, ``structure="auto"``
resolved, one real batch read as every measurement will read it, and the structure tried on it
(the trial, whose time predicts a measurement's). A configuration the monitor cannot measure
stops the fit here with one message naming the fix, or (``strict=False``) switches the monitor
off; BackPACK's structures switch to ``lanczos`` where BackPACK cannot follow the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_flatness.core.curvature.stored_rows import keeps_rows, quadrature_seconds
from lightning_flatness.core.defaults import choose_across_processes, kernel_rows, row_width
from lightning_flatness.core.failures import (
    MeasurementError,
    UnsupportedModelError,
)
from lightning_flatness.core.measure import check_batch
from lightning_flatness.core.options import MATRIX_FREE_STRUCTURES, KernelOptions
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.lightning.budget import (
    FILL_IN,
    FILL_IN_SAMPLES,
    TRIAL_SAMPLES,
    trial_settings,
)
from lightning_flatness.lightning.monitor_measurement import (
    FALLBACK,
    monitor_options,
    tensor_numbers,
)
from lightning_flatness.lightning.monitor_schedule import quiet_fill_in
from lightning_flatness.lightning.trainer_facts import (
    all_dataloaders,
    first_dataloader,
    is_sized,
    resolve_missing,
)

__all__ = ["FitStartChecks"]


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
    """The first exact measurement's predicted cost on ``samples``: the smaller timed run's
    cost per sample, scaled (its fixed part makes this an upper estimate of the pass), and never
    below the larger run's own time. Not the line through both: the larger run may have taken a
    costlier path that then does not grow with the samples (the probe kernel's P × P sums and
    eigendecomposition, once the rows outnumber the parameters: the paper's MLP measured
    0.16 s on 8 samples, 1.3 s on 32, and 1.5 s on 400, which the line put at 19 s)."""
    sizes = sorted(times)
    small, large = sizes[0], sizes[-1]
    return max(times[large], times[small] * samples / small)


class FitStartChecks:
    """The fit-start checks of :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` (a
    part of it: these methods read the monitor's settings and state)."""

    def _resolve(self, trainer: Trainer) -> None:
        """λ from the optimizers and n from the training dataloader, if not yet read."""
        resolve_missing(self, trainer)

    def _choose_structure(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve ``structure="auto"`` once, for this model and the samples measured, and say
        which structure was chosen and why
        (:func:`~lightning_flatness.core.defaults.choose_structure`)."""
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        samples = self.resolved_num_train_samples
        cap = self.max_samples
        loader = first_dataloader(trainer.train_dataloader)
        if loader is not None and not is_sized(loader):
            cap = self._streams["training"].max_samples
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
            all_reduce=self._all_reduce(trainer),
            world=trainer.world_size,
            sharing=trainer.num_devices if on_cpu else 1,
        )
        self._active_structure = choice.structure
        self._sketch_factor = choice.sketch_factor
        rank_zero_info(f"FlatnessMonitor: structure='auto' measures {choice.reason}.")

    def _check_configuration(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Read one real training (and validation) batch as every measurement will; for a
        stream, the first batch the training loop draws (:meth:`on_train_batch_start`).

        Raises (``strict=True``) or warns once and switches the monitor off (``strict=False``)
        when the batch, the model's output or the targets cannot be measured.
        """
        val_loaders = all_dataloaders(trainer.val_dataloaders) if self.use_val else []
        if len(val_loaders) > 1:
            rank_zero_info(
                f"FlatnessMonitor: {len(val_loaders)} validation dataloaders; the held-out "
                f"numbers use dataloader {self.val_dataloader_idx} (val_dataloader)."
            )
        train_loader = first_dataloader(trainer.train_dataloader)
        if train_loader is not None and not is_sized(train_loader):
            self._check_on_first_batch = True
            rank_zero_info(
                "FlatnessMonitor: the training data is a stream (an IterableDataset); the "
                f"monitor measures the first {self._streams['training'].max_samples:,} samples "
                "the training loop draws in each measured epoch and never iterates the stream "
                "itself (max_samples sets the number)."
            )
        splits = [] if self._check_on_first_batch else [("training", trainer.train_dataloader)]
        if val_loaders:
            splits.append(("validation", val_loaders))
        try:
            for split, loaders in splits:
                batch = next(iter(self._batches(trainer, loaders, split)), None)
                if batch is not None:
                    samples, _ = self._check_batch(pl_module, batch)
                    if split == "training":
                        self._trial_samples = samples
                        self._sample_numbers = tensor_numbers(batch) / max(samples, 1)
                if split == "training":
                    self._first_batch = batch
        except Exception as error:
            self._refuse(pl_module, error)

    def _check_batch(self, pl_module: LightningModule, batch: Any) -> tuple[int, int]:
        return check_batch(pl_module, batch, self.reading)

    def _refuse(self, pl_module: LightningModule, error: Exception) -> None:
        """Raise (``strict=True``), or warn once and switch the monitor off."""
        message = (
            f"FlatnessMonitor cannot measure {type(pl_module).__name__} "
            f"({type(error).__name__}): {error}"
        )
        if self.strict:
            raise ValueError(message) from error
        self.disabled_reason = str(error)
        if self.regularizer is not None:
            self.regularizer.disabled = True
        rank_zero_warn(f"{message} The monitor is switched off for this fit (strict=False).")

    def _read_stream_batch(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """A training batch the loop drew from a stream: checked (with the trial) if it is the
        fit's first, then kept for this epoch's measurement."""
        loader = first_dataloader(trainer.train_dataloader)
        if loader is None or is_sized(loader) or self.disabled_reason is not None:
            return
        if self._check_on_first_batch:
            self._check_on_first_batch = False
            try:
                self._trial_samples, _ = self._check_batch(pl_module, batch)
            except Exception as error:
                self._refuse(pl_module, error)
                return
            self._timed_trial(trainer, pl_module, batch)
            if self.disabled_reason is not None:
                return
        self._streams["training"].add(batch)

    def _timed_trial(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """The fit-start trial, charged to the budget. The trial's structure is timed once more
        on a quarter of its samples, to predict the first exact measurement's cost
        (:func:`predicted_exact_seconds`: the budget's decisions, and the line announcing a long
        one); with a budget the fill-in is timed on both sample counts too, and so is its
        calibration on its samples where the whole set is larger than they are."""
        started = time.perf_counter()
        self._trial(trainer, pl_module, batch)
        seconds = time.perf_counter() - started
        self.budget.charge(seconds)
        if self.disabled_reason is not None:
            return
        started = time.perf_counter()
        samples = self._measured_samples()
        world = max(trainer.world_size, 1)  # each process measures (and is timed on) its share
        arguments, work = trial_settings(self.measure_arguments(self._active_structure))
        trial_samples = max(min(self._trial_samples, TRIAL_SAMPLES), 1)
        times = self._timed_runs(pl_module, batch, arguments, trial_samples, seconds)
        if times is not None:
            quadrature = self._quadrature_seconds(pl_module, samples, trainer.world_size)
            share = math.ceil(samples / world)
            self.budget.predict_exact(work * predicted_exact_seconds(times, share) + quadrature)
        if self.budget.share is not None and self._has_fill_in():
            fill_in_samples = min(samples, FILL_IN_SAMPLES)
            val_samples = min(self.max_val_samples or FILL_IN_SAMPLES, FILL_IN_SAMPLES)
            val_samples = val_samples if self.use_val else 0
            arguments = self.measure_arguments(FILL_IN)
            line = self._cost_line(pl_module, batch, arguments, trial_samples)
            if line is not None:  # per sample of the fill-in's subset: with its held-out ones
                fixed, per_sample = line
                per_subset_sample = per_sample * (1 + val_samples / fill_in_samples) / world
                self.budget.fill_in_line = (fixed, per_subset_sample)
                self.budget.cheap_seconds = fixed + per_subset_sample * fill_in_samples
            if samples > FILL_IN_SAMPLES:  # the fill-in will be calibrated on its samples
                arguments = self.calibration_arguments()
                share = math.ceil((FILL_IN_SAMPLES + val_samples) / world)
                subset = self._line_seconds(pl_module, batch, arguments, trial_samples, share)
                if subset is not None:
                    self.budget.subset_seconds = subset
        self.budget.charge(time.perf_counter() - started)

    def _quadrature_seconds(self, pl_module: LightningModule, samples: int, world: int) -> float:
        """The stored-row quadrature's predicted seconds when the probe kernel will take that
        path on ``samples`` (P above its P × P guard, the rows above a formed kernel's or
        spread over ``world`` > 1 processes, each running on its share), which the trial on a
        few samples does not run; else 0."""
        if self._active_structure != "probe_kernel":
            return 0.0
        chosen = self.structure_options
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
        width = row_width(parameters, options, self._sketch_factor)
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
                    self._call_measure(pl_module, [batch], None, arguments=run)
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
        disabled = self.disabled_reason is not None
        error = None if disabled or batch is None else self._trial_error(pl_module, batch)
        reduce = self._all_reduce(trainer)
        if reduce is not None:  # every process takes part, so all decide alike
            failed = int(reduce(torch.tensor([float(error is not None or disabled)])).item())
            if failed and error is None and not disabled:
                error = RuntimeError(
                    f"the structure failed at fit start on {failed} other process(es); see "
                    "their messages"
                )
        if error is not None:
            self._refuse(pl_module, error)

    def _trial_error(self, pl_module: LightningModule, batch: Any) -> Exception | None:
        """What stops the structure on ``batch``, or None (numerical failures included)."""

        def run() -> FlatnessReport:
            arguments, _ = trial_settings(self.measure_arguments(self._active_structure))
            return self._call_measure(pl_module, [batch], None, arguments=arguments)

        try:
            self._with_fallback(run)
        except (MeasurementError, FloatingPointError):  # NaN on this batch: not the structure
            return None
        except Exception as error:
            return RuntimeError(
                f"structure={self._active_structure!r} failed on a real training batch "
                f"({type(error).__name__}: {error}); pick another structure "
                "(FlatnessMonitor(structure=...))."
            )
        return None

    def _with_fallback(self, run: Callable[[], FlatnessReport]) -> FlatnessReport:
        """``run()``; when BackPACK cannot convert the model (``dense``/``gram``), switch to
        ``lanczos`` for the rest of the fit, say so, and run again."""
        try:
            return run()
        except UnsupportedModelError as error:
            if self._active_structure in MATRIX_FREE_STRUCTURES:
                raise
            rank_zero_info(
                f"FlatnessMonitor: {error} Switching to the matrix-free structure "
                f"{FALLBACK!r} for this model."
            )
            self._active_structure = FALLBACK
            return run()
