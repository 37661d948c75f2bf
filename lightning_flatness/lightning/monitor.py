"""``FlatnessMonitor``: measure flatness and predict the generalization gap while training.

At the end of every ``every_n_epochs``-th training epoch the callback calls
:func:`lightning_flatness.core.measure` on a fixed, deterministic subset of the training set (and of
the validation set), logs every :class:`~lightning_flatness.FlatnessReport` field through
``pl_module.log`` under ``log_prefix`` — so every logger, ``EarlyStopping`` and
``ModelCheckpoint`` see e.g. ``flatness/predicted_gap`` — and, with a ``TensorBoardLogger``,
draws the Fisher spectrum and a predicted-vs-observed gap figure.

The monitor watches and does not change training: it measures on the live model in eval mode
and restores every module's mode, draws its samples with its own generator through its own
dataloader, forks the RNG and writes no gradient. ``regularize=True`` is the one-flag way to
*also* change training: the monitor then adds a
:class:`~lightning_flatness.lightning.regularizer.SoftRankRegularizer` (the callback that owns
the penalty) to the trainer's callbacks for the user.

Two kinds of failure are kept apart. A configuration the monitor cannot handle (a batch it
cannot unpack, an output it cannot read, targets that do not fit ``loss``, a module without
``forward``) is found when training starts, on one real batch, and raises one error naming the
argument that fixes it (``strict=False``: one warning, and the monitor switches itself off). A
numerical failure during training (a NaN loss at some epoch) logs a warning and records NaN for
that epoch; training goes on.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_flatness.core.checks import check_choice, check_count
from lightning_flatness.core.curvature import describe_coverage
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.defaults import AUTO, choose_structure
from lightning_flatness.core.failures import (
    MeasurementError,
    TrainingSplitError,
    UnsupportedModelError,
)
from lightning_flatness.core.measure import check_batch, measure
from lightning_flatness.core.options import (
    ALL_STRUCTURES,
    MATRIX_FREE_STRUCTURES,
    OPTION_CLASSES,
    StructureOptions,
    structure_options,
)
from lightning_flatness.core.progress import reporting_progress
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.lightning.budget import (
    CHEAP,
    EXACT,
    FILL_IN,
    FILL_IN_SAMPLES,
    TRIAL_SAMPLES,
    OverheadBudget,
    cost_message,
    fill_in_record,
    not_exact_message,
    trial_settings,
)
from lightning_flatness.lightning.figures import gap_figure, log10_spectrum, summary_table
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.lightning.stream_buffer import StreamBuffer
from lightning_flatness.lightning.trainer_facts import (
    all_dataloaders,
    first_dataloader,
    fixed_subset_batches,
    is_sized,
    resolve_lam,
    resolve_missing,
    select_dataloader,
    sharding_refusal,
)
from lightning_flatness.regularizer import SoftRankPenalty

__all__ = ["FlatnessMonitor"]

DEFAULT_MAX_VAL_SAMPLES = 1024
#: an exact measurement expected to take longer is announced with one line
ANNOUNCE_SECONDS = 5.0
#: during an exact measurement, one line of progress at most this often (seconds)
PROGRESS_SECONDS = 10.0


#: what a structure named by a string is measured with: Tr(F) from probe rows (no extra
#: backward pass), and ``kfac``'s output factors from one probe per input (docs/RESULTS.md)
MONITOR_DEFAULTS = {"trace_estimator": "probe", "kfac_mode": "probe"}
#: the structure measured when BackPACK cannot extend the model for ``dense`` or ``gram``
FALLBACK = "lanczos"


def _check_structure(structure: str | StructureOptions) -> StructureOptions | None:
    """The options object passed as ``structure`` (None for a name), refusing anything else."""
    if isinstance(structure, OPTION_CLASSES):
        return structure
    if structure != AUTO:
        check_choice("structure", structure, ALL_STRUCTURES)
    return None


def _own_regularizer(
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


#: metrics also shown on the progress bar (or, without one, in a line per measurement)
_PROGRESS_BAR_KEYS = ("predicted_gap", "observed_gap")


@contextmanager
def _quiet_fill_in() -> Iterator[None]:
    """The fill-in on its sample cap often exceeds the rank bound of that subset; it is a
    tracker, scaled by the last exact ratio and never trusted, so that warning is not said."""
    with warnings.catch_warnings():
        pattern = re.escape(f"structure={FILL_IN!r} reports a soft rank")
        warnings.filterwarnings("ignore", message=pattern)
        yield


class FlatnessMonitor(Callback):
    """Log the soft rank of the Fisher and the predicted generalization gap during training.

    Example::

        trainer = Trainer(callbacks=[FlatnessMonitor()])
        trainer = Trainer(callbacks=[FlatnessMonitor(structure=KFACOptions(kfac_mode="exact"),
                                                     reading=BatchReading(loss="bce"))])

    Args:
        structure: what to measure: ``"auto"`` (default: ``"probe_kernel"``, the whole
            Fisher's soft rank within a few percent of exact, wherever it fits; else the
            matrix-free ``"cg"``, said once at fit start), a structure's name
            (``"probe_kernel"``, ``"kfac"``, ``"dense"``, ``"gram"``, ``"diag"``,
            ``"diag_mc"``, matrix-free ``"cg"``, ``"lanczos"``, ``"hutchinson"``) measured with
            the monitor's defaults (Tr(F) from probe rows, no extra backward pass; ``kfac``'s
            output factors from one Rademacher probe per input), or a structure's options
            object (:mod:`lightning_flatness.core.options`, e.g. ``KernelOptions(probes=8)``,
            ``MatrixFreeOptions(structure="lanczos", lanczos_steps=80)``), measured as it
            says. When BackPACK cannot extend the model for ``dense`` or ``gram``, the monitor
            switches to ``lanczos`` and says so.
        lam: λ, the coupled L2 weight decay. ``None`` reads it from the optimizer (SGD, Adam,
            RMSprop ``weight_decay``); different decays across parameter groups are measured as
            per-group decay (``Tr(F(F+D)⁻¹)``, docs/math.md); AdamW's decoupled decay and
            ``weight_decay=0`` on every group are refused with a message to pass ``lam``.
        every_n_epochs: measure at the end of every n-th training epoch (within
            ``overhead_budget``).
        overhead_budget: the most the monitor may add to the fit's training time, as a
            fraction (default 0.3: 30% more): a scheduled measurement of exact quality runs
            only when it keeps the monitor within it, the cheap Kronecker estimate scaled by
            the last exact ratio fills in when that one does not (``flatness/fill_in`` = 1),
            and the last epoch gets the exact one whenever the whole fit's budget allows
            (else the fill-in, said once at fit end;
            :mod:`lightning_flatness.lightning.budget`). ``None``: every scheduled
            measurement is exact, whatever it costs (said once, with the cost).
        max_samples: training samples the Fisher averages over (``None``, the default: the
            whole training set, the least biased soft rank; see docs/math.md, "Sample size").
        max_val_samples: held-out samples for the trace ratio and the observed gap.
        val_dataloader: which validation dataloader the held-out numbers (trace ratio,
            observed gap) use; ``None``: none.
        num_train_samples: n for the predicted gap; default ``len(train dataset)``.
        batch_size: batch size of the measurement passes (does not change any number).
        reading: how batches and outputs are read: the likelihood ``loss``,
            ``unpack_batch`` and ``logits_fn``
            (:class:`~lightning_flatness.core.reading.BatchReading`; default: cross-entropy on
            ``(x, y)`` batches and the module's own output).
        log_options: the logged names' prefix, the TensorBoard spectrum and figure, the fit-end
            summary (:class:`~lightning_flatness.lightning.log_options.LogOptions`).
        regularize: also train against the soft rank: ``True`` adds a
            :class:`~lightning_flatness.lightning.regularizer.SoftRankRegularizer` with its
            defaults, or pass one (``SoftRankRegularizer(strength=0.1)``); the monitor gives it
            its own λ, n, ``reading``, seed and log prefix wherever the regularizer leaves them
            unset, and adds it to the trainer's callbacks when fit starts. It adds
            ``strength ·`` the penalty to every training loss, exactly as writing
            ``loss + penalty`` in ``training_step``. Passing the regularizer callback yourself
            is the same.
        measure_on_fit_end: also measure after the last epoch if it was not measured.
        strict: a configuration the monitor cannot measure raises at fit start (True, as
            ``EarlyStopping(strict=True)`` does for a missing metric), or warns once and
            switches the monitor off (False).
        seed: seeds the sample subset and the Monte-Carlo structures.
    """

    def __init__(
        self,
        structure: str | StructureOptions = AUTO,
        lam: float | None = None,
        every_n_epochs: int = 1,
        overhead_budget: float | None = 0.3,
        max_samples: int | None = None,
        max_val_samples: int | None = DEFAULT_MAX_VAL_SAMPLES,
        val_dataloader: int | None = 0,
        num_train_samples: int | None = None,
        batch_size: int = 256,
        reading: BatchReading | None = None,
        log_options: LogOptions | None = None,
        regularize: bool | SoftRankRegularizer = False,
        measure_on_fit_end: bool = True,
        strict: bool = True,
        seed: int = 0,
    ) -> None:
        if lam is not None and (not math.isfinite(float(lam)) or float(lam) <= 0):
            raise ValueError(f"`lam` must be a finite positive number or None, got {lam!r}.")
        check_count("every_n_epochs", every_n_epochs)
        check_count("max_samples", max_samples, allow_none=True)
        check_count("max_val_samples", max_val_samples, allow_none=True)
        check_count("num_train_samples", num_train_samples, allow_none=True)
        check_count("batch_size", batch_size)
        check_count("val_dataloader", val_dataloader, 0, allow_none=True)
        reading = reading if reading is not None else BatchReading()
        log_options = log_options if log_options is not None else LogOptions()
        for name, value, kind in (
            ("reading", reading, BatchReading),
            ("log_options", log_options, LogOptions),
        ):
            if not isinstance(value, kind):
                raise ValueError(f"`{name}` must be a {kind.__name__} or None, got {value!r}.")
        #: the options object the user passed as ``structure``, if any
        self.structure_options = _check_structure(structure)
        self.structure = (
            structure if self.structure_options is None else self.structure_options.structure
        )
        #: the callback that owns the penalty when ``regularize`` is set (added at fit start)
        self.regularizer = _own_regularizer(
            regularize, lam, num_train_samples, reading, seed, log_options.prefix
        )
        self.lam = None if lam is None else float(lam)
        self.every_n_epochs = every_n_epochs
        self.overhead_budget = overhead_budget
        self.budget = OverheadBudget(overhead_budget)
        self._calibration = math.nan  # exact ÷ fill-in soft rank at the last exact measurement
        self._calibrated_at = math.nan  # and its epoch
        self._fill_in_failed = False
        self._cost_told = False
        self._trial_samples = 0
        self.max_samples = max_samples
        self.max_val_samples = max_val_samples
        self.use_val = val_dataloader is not None
        self.val_dataloader_idx = val_dataloader or 0
        self.measure_on_fit_end = measure_on_fit_end
        self.num_train_samples = num_train_samples
        self.batch_size = batch_size
        self.reading = reading
        self.log_options = log_options
        self.log_prefix = log_options.prefix
        self._figure_drawn_at = -1
        self.seed = seed
        self.regularize = self.regularizer is not None
        self.strict = bool(strict)
        #: why the monitor switched itself off at fit start (``strict=False``), or None
        self.disabled_reason: str | None = None
        self._checked = False
        self.history: list[dict[str, float]] = []
        self.resolved_lam: float | None = None
        self.resolved_num_train_samples: int | None = None
        self._active_structure = self.structure
        self._coverage_logged = False
        self._last_report: FlatnessReport | None = None
        #: batches the loops drew this epoch, measured when the dataset is a stream
        self._streams = {
            "training": StreamBuffer(max_samples),
            "validation": StreamBuffer(max_val_samples),
        }
        self._check_on_first_batch = False
        #: the training batch the fit-start check read, for the trial measurement
        self._first_batch: Any = None

    # ------------------------------------------------------------------ state
    @property
    def state_key(self) -> str:
        return self._generate_state_key(structure=self.structure, log_prefix=self.log_prefix)

    def state_dict(self) -> dict[str, Any]:
        """Plain values only, so checkpoints load with ``torch.load(weights_only=True)``."""
        return {
            "history": [dict(record) for record in self.history],
            "active_structure": self._active_structure,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(record) for record in state_dict.get("history", [])]
        self._active_structure = state_dict.get("active_structure", self.structure)
        if self.regularizer is not None and "penalty_calls" in state_dict:
            # a checkpoint from before the regularizer was a callback of its own
            self.regularizer.load_state_dict(state_dict)

    # ------------------------------------------------------------------ the regularizer
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

    # ------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        refusal = sharding_refusal(trainer.strategy, pl_module)
        if refusal is not None:
            self._refuse(pl_module, ValueError(refusal))
            return
        self.resolved_lam = resolve_lam(trainer.optimizers, self.lam, pl_module)
        if isinstance(self.resolved_lam, ParameterDecay):
            rank_zero_info(
                "FlatnessMonitor: the optimizer's groups decay differently "
                f"({self.resolved_lam.describe()}); the soft rank is Tr(F(F+D)⁻¹) with "
                "D = diag(λ_j), and a group without decay counts each Fisher direction it "
                "carries (lam= sets one λ instead)."
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.disabled_reason is not None:  # refused at fit start (strict=False)
            return
        self.budget.start()
        self._resolve(trainer)
        checking = time.perf_counter()
        if not self._checked:
            self._checked = True
            self._check_configuration(trainer, pl_module)
            if self.structure == AUTO and self.disabled_reason is None:
                self._choose_structure(trainer, pl_module)
            self.budget.charge(time.perf_counter() - checking)  # the checks; the trial below
            self._timed_trial(trainer, pl_module, self._first_batch)
            self._first_batch = None
            if self.regularizer is not None and self.disabled_reason is not None:
                self.regularizer.disabled = True

    def _resolve(self, trainer: Trainer) -> None:
        """λ from the optimizers and n from the training dataloader, if not yet read."""
        self.resolved_lam, self.resolved_num_train_samples = resolve_missing(
            trainer,
            self.lam,
            self.num_train_samples,
            (self.resolved_lam, self.resolved_num_train_samples),
            trainer.lightning_module,
        )

    def _choose_structure(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve ``structure="auto"`` once, for this model and the samples measured, and say
        which structure was chosen and why
        (:func:`~lightning_flatness.core.defaults.choose_structure`)."""
        options = structure_options("probe_kernel", **MONITOR_DEFAULTS)
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        samples = self.resolved_num_train_samples
        cap = self.max_samples
        loader = first_dataloader(trainer.train_dataloader)
        if loader is not None and not is_sized(loader):
            cap = self._streams["training"].max_samples
        if samples is not None and cap is not None:
            samples = min(samples, cap)
        if samples is not None and trainer.world_size > 1:
            samples = math.ceil(samples / trainer.world_size)
        choice = choose_structure(trainable, samples, options, summable=trainer.world_size > 1)
        self._active_structure = choice.structure
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
                if split == "training":
                    self._first_batch = batch
        except Exception as error:
            self._refuse(pl_module, error)

    def _check_batch(self, pl_module: LightningModule, batch: Any) -> tuple[int, int]:
        return check_batch(pl_module, batch, **self.reading.as_kwargs())

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

    # ------------------------------------------------------------------ streams
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._streams["training"].reset()

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._streams["validation"].reset()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
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

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking or dataloader_idx != self.val_dataloader_idx:
            return
        loader = select_dataloader(trainer.val_dataloaders, self.val_dataloader_idx)
        if loader is not None and not is_sized(loader):
            self._streams["validation"].add(batch)

    # ------------------------------------------------------------------ schedule
    def _due(self, trainer: Trainer) -> bool:
        if self.disabled_reason is not None:
            return False
        epoch = trainer.current_epoch
        already = any(record["epoch"] == epoch for record in self.history)
        return (epoch + 1) % self.every_n_epochs == 0 and not already

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Measured here when validation closes the epoch, so that ModelCheckpoint and
        # EarlyStopping (which act on validation end) already see this epoch's values.
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.is_last_batch and self._due(trainer):
            self._scheduled(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._due(trainer):
            self._scheduled(trainer, pl_module)

    def _has_fill_in(self) -> bool:
        return not self._fill_in_failed and self._active_structure not in (
            FILL_IN,
            "diag",
            "diag_mc",
        )

    def _scheduled(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A scheduled measurement: exact, the cheap fill-in or none, as the budget allows
        (the same decision on every process)."""
        epochs_done = trainer.current_epoch + 1
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        last = max_epochs is not None and epochs_done >= max_epochs
        decision = self._decide(trainer, epochs_done, max_epochs, last)
        started = time.perf_counter()
        record = self._budgeted_record(trainer, pl_module, decision, trainer.current_epoch)
        if record is not None:
            self._log_record(trainer, pl_module, record)
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
                    self.history[-1]["seconds"],
                    epochs_done,
                    self.every_n_epochs,
                    self._active_structure,
                )
            )

    def _decide(
        self, trainer: Trainer, epochs_done: int, max_epochs: int | None, last: bool
    ) -> str:
        """The budget's decision (:meth:`OverheadBudget.decide`), rank 0's on every process."""
        decision = self.budget.decide(
            epochs_done, max_epochs, last, self._has_fill_in(), self._read_every_epoch(trainer)
        )
        if trainer.world_size > 1:
            decision = trainer.strategy.broadcast(decision, src=0)
        return decision

    def _budgeted_record(
        self, trainer: Trainer, pl_module: LightningModule, decision: str, epoch: int
    ) -> dict[str, float] | None:
        """The record ``decision`` asks for: the exact measurement's, the fill-in's (scaled by
        the last exact ratio), or None (skipped, or the fill-in cannot measure this model)."""
        if decision == EXACT:
            self._announce(epoch)
            with reporting_progress(
                lambda line: rank_zero_info(f"FlatnessMonitor: {line}"), PROGRESS_SECONDS
            ):
                record = self._measure(trainer, pl_module)
            record.update(fill_in=0.0, calibration=1.0)
            return record
        if decision == CHEAP:
            cheap = self._cheap_record(trainer, pl_module)
            return None if cheap is None else fill_in_record(cheap, self._calibration)
        return None

    def _announce(self, epoch: int) -> None:
        """One line before an exact measurement expected to take more than
        :data:`ANNOUNCE_SECONDS`, so that a long pause is explained."""
        expected = self.budget.exact_seconds
        if expected is not None and expected > ANNOUNCE_SECONDS:
            rank_zero_info(
                f"FlatnessMonitor: measuring epoch {epoch} with {self._active_structure} "
                f"(about {expected:.0f} s; Ctrl-C stops the fit)"
            )

    def _read_every_epoch(self, trainer: Trainer) -> bool:
        """Whether EarlyStopping or ModelCheckpoint monitors one of this monitor's values (it
        then needs one at every scheduled epoch)."""
        return any(
            isinstance(callback, (EarlyStopping, ModelCheckpoint))
            and str(getattr(callback, "monitor", None) or "").startswith(self.log_prefix)
            for callback in trainer.callbacks
        )

    def _cheap_record(self, trainer: Trainer, pl_module: LightningModule) -> dict | None:
        """The fill-in structure's record, or None (it cannot measure this model: said once,
        and the fill-in is off for the fit)."""
        started = time.perf_counter()
        try:
            with _quiet_fill_in():
                report = self._run_measure(trainer, pl_module, FILL_IN)
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
            exact = self.history[-1]["soft_rank"]
            self._calibration = exact / cheap["soft_rank"] if cheap["soft_rank"] else math.nan
            self._calibrated_at = float(trainer.current_epoch)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        last_epoch = trainer.current_epoch - 1 if trainer.current_epoch else 0
        if (
            self.measure_on_fit_end
            and self.disabled_reason is None
            and trainer.global_step > 0
            and not any(record["epoch"] >= last_epoch for record in self.history)
        ):
            self._fit_end_measurement(trainer, pl_module, last_epoch)
        self._draw_gap_figure(trainer)
        last = self.history[-1] if self.history else None
        if last is None and self.budget.share is not None and self.disabled_reason is None:
            rank_zero_info(
                f"FlatnessMonitor: no measurement fitted overhead_budget={self.budget.share:g} "
                f"of this fit's {self.budget.training_seconds():.1f} s of training (one "
                f"{self._active_structure} measurement: about "
                f"{self.budget.exact_seconds or math.nan:.1f} s). Pass overhead_budget=None "
                "(or a larger share), or measure the trained model with "
                "lightning_flatness.measure()."
            )
        if last is not None and last.get("fill_in") and self.budget.share is not None:
            rank_zero_info(
                not_exact_message(self.budget, self._active_structure, self._calibrated_at)
            )
        if self.log_options.summary and last is not None and trainer.is_global_zero:
            structure = FILL_IN if last.get("fill_in") else self._active_structure
            rank_zero_info(summary_table(last, structure))

    def _fit_end_measurement(
        self, trainer: Trainer, pl_module: LightningModule, last_epoch: int
    ) -> None:
        """The last epoch was not measured (stopped early, or not scheduled): measure now,
        exact or fill-in as the budget allows, and log it directly to the loggers."""
        decision = self._decide(trainer, last_epoch + 1, None, True)
        started = time.perf_counter()
        record = self._budgeted_record(trainer, pl_module, decision, last_epoch)
        self.budget.charge(time.perf_counter() - started)
        if record is None:
            return
        record["epoch"] = float(last_epoch)
        self.history.append(record)
        metrics = {self.log_prefix + k: v for k, v in record.items() if k != "epoch"}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ measurement
    def _batches(
        self, trainer: Trainer, loaders: object, split: str, limit: int | None = None
    ) -> Iterable:
        """A fixed subset of a sized dataset (at most ``limit`` samples, if given), or this
        epoch's batches of a stream."""
        if split == "validation":
            loader = select_dataloader(loaders, self.val_dataloader_idx)
            max_samples = self.max_val_samples
        else:
            loader = first_dataloader(loaders)
            max_samples = self.max_samples
        if limit is not None:
            max_samples = min(max_samples or limit, limit)
        if loader is None:
            return []
        if not is_sized(loader):
            return list(self._streams[split].batches)
        return fixed_subset_batches(
            loader,
            max_samples,
            self.batch_size,
            self.seed,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
        )

    def _shard(self, trainer: Trainer) -> tuple[int, int] | None:
        """``(rank, world_size)`` when the ranks split one fixed subset of a sized dataset
        between them (:func:`fixed_subset_batches`): then they draw the probes by global
        position and together log what one process would."""
        loader = first_dataloader(trainer.train_dataloader)
        if trainer.world_size <= 1 or loader is None or not is_sized(loader):
            return None
        return trainer.global_rank, trainer.world_size

    def _all_reduce(self, trainer: Trainer):
        if trainer.world_size <= 1:
            return None
        strategy = trainer.strategy

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            reduced = strategy.reduce(tensor.clone(), reduce_op="sum")
            tensor.copy_(reduced.to(tensor.device, tensor.dtype))
            return tensor

        return all_reduce

    def _run_measure(
        self, trainer: Trainer, pl_module: LightningModule, structure: str | None = None
    ) -> FlatnessReport:
        val_loaders = trainer.val_dataloaders if self.use_val else None
        limit = FILL_IN_SAMPLES if structure == FILL_IN else None
        train_batches = self._batches(trainer, trainer.train_dataloader, "training", limit)
        val_batches = (
            None
            if val_loaders is None
            else self._batches(trainer, val_loaders, "validation", limit)
        )
        return self._call_measure(
            pl_module,
            train_batches,
            val_batches,
            all_reduce=self._all_reduce(trainer),
            shard=self._shard(trainer),
            structure=structure,
        )

    def _call_measure(
        self,
        pl_module: LightningModule,
        train_batches: Iterable,
        val_batches: Iterable | None,
        all_reduce: Any = None,
        shard: tuple[int, int] | None = None,
        structure: str | None = None,
        arguments: dict[str, Any] | None = None,
    ) -> FlatnessReport:
        """:func:`measure` with this monitor's arguments; ``arguments`` replaces what
        :meth:`_structure_arguments` says for ``structure`` (the active one by default)."""
        if arguments is None:
            arguments = self.measure_arguments(structure or self._active_structure)
        with torch.inference_mode(False), torch.enable_grad():
            return measure(
                pl_module,
                train_batches,
                lam=self._lam_argument(),
                num_train_samples=self.resolved_num_train_samples,
                val_batches=val_batches,
                seed=self.seed,
                all_reduce=all_reduce,
                shard=shard,
                **self.reading.as_kwargs(),
                **arguments,
            )

    def measure_arguments(self, structure: str) -> dict[str, Any]:
        """:func:`measure`'s arguments that say what to measure ``structure`` with: the options
        object passed as ``structure=`` for its structure, else the name with
        :data:`MONITOR_DEFAULTS` (the ``measure`` subcommand measures with these too)."""
        chosen = self.structure_options
        if chosen is not None and chosen.structure == structure:
            return {"structure": chosen}
        return {"structure": structure, **MONITOR_DEFAULTS}

    def _timed_trial(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """The fit-start trial, charged to the budget; its cost per sample predicts the first
        exact measurement's."""
        started = time.perf_counter()
        self._trial(trainer, pl_module, batch)
        seconds = time.perf_counter() - started
        self.budget.charge(seconds)
        samples = min(self.resolved_num_train_samples or 0, self.max_samples or math.inf)
        _, work = trial_settings(self.measure_arguments(self._active_structure))
        trial_samples = min(self._trial_samples, TRIAL_SAMPLES)
        self.budget.predict_exact(seconds * work, trial_samples, int(samples))
        if self.budget.share is not None and self._has_fill_in() and self.disabled_reason is None:
            started = time.perf_counter()
            fill_in_samples = min(int(samples), FILL_IN_SAMPLES)
            val_samples = min(self.max_val_samples or FILL_IN_SAMPLES, FILL_IN_SAMPLES)
            val_samples = val_samples if self.use_val else 0
            self._predict_fill_in(pl_module, batch, fill_in_samples + val_samples)
            self.budget.charge(time.perf_counter() - started)

    def _predict_fill_in(self, pl_module: LightningModule, batch: Any, samples: int) -> None:
        """The fill-in's cost on ``samples`` samples, from two timed runs on 8 and 32 samples
        of the trial batch (a fixed cost plus one per sample: a recurrent model's per-sample
        loop makes it many epochs, a small MLP's is mostly the fixed part)."""
        available = max(self._trial_samples, 1)
        sizes = sorted({min(TRIAL_SAMPLES // 4, available), min(TRIAL_SAMPLES, available)})
        times = []
        for size in sizes:
            arguments = {**self.measure_arguments(FILL_IN), "max_samples": size}
            started = time.perf_counter()
            try:
                with _quiet_fill_in():
                    self._call_measure(pl_module, [batch], None, arguments=arguments)
            except Exception:  # the fill-in cannot measure this model: found out when it runs
                return
            times.append(time.perf_counter() - started)
        if len(sizes) == 1:  # a batch of at most 8 samples: all of it per sample
            per_sample, fixed = times[0] / sizes[0], 0.0
        else:
            per_sample = max(times[1] - times[0], 0.0) / (sizes[1] - sizes[0])
            fixed = max(times[0] - sizes[0] * per_sample, 0.0)
        self.budget.cheap_seconds = fixed + per_sample * samples

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

    def _lam_argument(self) -> float | dict[str, float]:
        """λ for :func:`measure`: one value, or each parameter's (per-group decay)."""
        if isinstance(self.resolved_lam, ParameterDecay):
            return self.resolved_lam.decays
        return self.resolved_lam

    def _measure(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """One measurement as a plain dict; NaN (and a warning) if it fails."""
        self._resolve(trainer)
        try:
            report = self._with_fallback(lambda: self._run_measure(trainer, pl_module))
        except Exception as error:  # a metric must never stop training
            rank_zero_warn(
                f"FlatnessMonitor: the measurement at epoch {trainer.current_epoch} failed and "
                f"is recorded as NaN ({type(error).__name__}: {error})"
            )
            lam = self.resolved_lam
            report = FlatnessReport.failed(
                self._active_structure,
                lam.representative if isinstance(lam, ParameterDecay) else lam,
                self.resolved_num_train_samples or 0,
                val=error.val_sums if isinstance(error, TrainingSplitError) else None,
            )
        self._last_report = report
        if report.coverage and not self._coverage_logged:
            rank_zero_info(f"FlatnessMonitor: {describe_coverage(report.coverage)}")
            self._coverage_logged = True
        record = {k: v for k, v in report.as_dict().items() if k != "structure"}
        if trainer.world_size > 1:  # the only per-rank number: log the mean so ranks agree
            seconds = torch.tensor(record["seconds"], dtype=torch.float64)
            record["seconds"] = float(trainer.strategy.reduce(seconds, reduce_op="mean"))
        return record

    def _log_record(
        self, trainer: Trainer, pl_module: LightningModule, record: dict[str, float]
    ) -> None:
        record["epoch"] = float(trainer.current_epoch)
        self.history.append(record)
        metrics = {self.log_prefix + k: v for k, v in record.items() if k != "epoch"}
        # what the monitor has added to the training time so far, this measurement included
        # (not in history: it depends on the machine's speed, the history does not)
        seconds = record["seconds"] if math.isfinite(record["seconds"]) else 0.0
        metrics[self.log_prefix + "overhead"] = self.budget.overhead(pending=seconds)
        on_bar = {key: metrics.pop(self.log_prefix + key) for key in _PROGRESS_BAR_KEYS}
        # The values are already the same on every process (reduced before any eigenvalue);
        # syncing them (a mean of equal numbers) keeps Lightning's sync_dist advice quiet.
        sync = trainer.world_size > 1
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=sync)
        pl_module.log_dict(
            {self.log_prefix + key: value for key, value in on_bar.items()},
            on_step=False,
            on_epoch=True,
            batch_size=1,
            prog_bar=True,
            sync_dist=sync,
        )
        fill_in = bool(record.get("fill_in"))
        structure = f"{FILL_IN} scaled" if fill_in else self._active_structure
        if trainer.progress_bar_callback is None:  # no bar to show them: one line instead
            rank_zero_info(
                f"FlatnessMonitor, epoch {trainer.current_epoch}: predicted gap "
                f"{on_bar['predicted_gap']:.4g} ({structure}), observed gap "
                f"{on_bar['observed_gap']:.4g}, soft rank {record['soft_rank']:.4g}"
            )
        if not fill_in:  # the spectrum and figure are the exact measurement's
            self._draw(trainer)

    def _tensorboard_writers(self, trainer: Trainer) -> list:
        if not trainer.is_global_zero or not self.log_options.spectrum:
            return []
        return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]

    def _draw(self, trainer: Trainer) -> None:
        """Spectrum histogram, and now and then the gap figure (TensorBoard loggers only)."""
        eigenvalues = self._last_report.eigenvalues if self._last_report else None
        spectrum = log10_spectrum(eigenvalues) if eigenvalues is not None else None
        for writer in self._tensorboard_writers(trainer):
            if spectrum is not None and spectrum.numel():
                writer.add_histogram(
                    f"{self.log_prefix}spectrum_log10", spectrum.float(), trainer.global_step
                )
        if (len(self.history) - 1) % self.log_options.figure_every_n_measurements == 0:
            self._draw_gap_figure(trainer)

    def _draw_gap_figure(self, trainer: Trainer) -> None:
        writers = self._tensorboard_writers(trainer)
        if not writers or not self.history or self._figure_drawn_at == len(self.history):
            return
        for writer in writers:
            try:
                figure = gap_figure(self.history, self._active_structure)
            except Exception as error:  # drawing must never stop training either
                warnings.warn(
                    f"FlatnessMonitor could not draw the gap figure: {error}", stacklevel=2
                )
                return
            writer.add_figure(f"{self.log_prefix}gap", figure, trainer.global_step, close=True)
        self._figure_drawn_at = len(self.history)
