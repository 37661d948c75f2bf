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

import time
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_flatness.core.checks import check_choice, check_count
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.defaults import AUTO
from lightning_flatness.core.options import (
    ALL_STRUCTURES,
    OPTION_CLASSES,
    StructureOptions,
)
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.lightning.budget import Calibration, OverheadBudget
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.monitor_checks import FitStartChecks
from lightning_flatness.lightning.monitor_logging import MonitorLog
from lightning_flatness.lightning.monitor_measurement import MonitorMeasurement
from lightning_flatness.lightning.monitor_nll import TrainingNll
from lightning_flatness.lightning.monitor_regularizer import (
    add_regularizer,
    own_regularizer,
    required_regularizer,
)
from lightning_flatness.lightning.monitor_schedule import MeasurementSchedule
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.lightning.stream_buffer import StreamBuffer
from lightning_flatness.lightning.trainer_facts import (
    resolve_lam,
    sharding_refusal,
)
from lightning_flatness.regularizer import SoftRankPenalty

__all__ = ["FlatnessMonitor"]

DEFAULT_MAX_VAL_SAMPLES = 1024


def _check_structure(structure: str | StructureOptions) -> StructureOptions | None:
    """The options object passed as ``structure`` (None for a name), refusing anything else."""
    if isinstance(structure, OPTION_CLASSES):
        return structure
    if structure != AUTO:
        check_choice("structure", structure, ALL_STRUCTURES)
    return None


class FlatnessMonitor(
    FitStartChecks,
    MeasurementSchedule,
    MonitorMeasurement,
    Callback,
):
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
        batch_size: batch size of the measurement passes (does not change any number);
            ``None``: 256 for the exact-quality measurement, and the fill-in's 1,024 samples
            in one batch (fewer, down to 256, when that batch would hold over 2²⁵ numbers),
            which the layer hooks split into passes by their own size rule.
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
        batch_size: int | None = None,
        reading: BatchReading | None = None,
        log_options: LogOptions | None = None,
        regularize: bool | SoftRankRegularizer = False,
        measure_on_fit_end: bool = True,
        strict: bool = True,
        seed: int = 0,
    ) -> None:
        if lam is not None:
            check_lam(lam)
        check_count("every_n_epochs", every_n_epochs)
        check_count("max_samples", max_samples, allow_none=True)
        check_count("max_val_samples", max_val_samples, allow_none=True)
        check_count("num_train_samples", num_train_samples, allow_none=True)
        check_count("batch_size", batch_size, allow_none=True)
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
        self.regularizer = own_regularizer(
            regularize, lam, num_train_samples, reading, seed, log_options.prefix
        )
        self.lam = None if lam is None else float(lam)
        self.every_n_epochs = every_n_epochs
        self.overhead_budget = overhead_budget
        self.budget = OverheadBudget(overhead_budget)
        #: exact ÷ fill-in soft rank at the last exact measurement (or on the fill-in's samples)
        self._calibration = Calibration()
        self._fill_in_failed = False
        self._subset_failed = False
        #: scheduled epochs the budget left without a value
        self._skipped: list[int] = []
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
        #: the writer of the records, the spectrum and the gap figure
        self.writer = MonitorLog(log_options)
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
        #: the probe kernel's sketch factor that fits the rows in memory, where "auto" chose
        #: one above the option's (None: the option's)
        self._sketch_factor: int | None = None
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
        #: the numbers one training sample's batch entry holds (read at fit start)
        self._sample_numbers: float | None = None
        #: the fill-in's and its calibration's subsets by split and size, read once per fit:
        #: (dataset, settings, batches)
        self._kept_subsets: dict[tuple[str, int], tuple[Any, tuple, list]] = {}
        #: the training NLL on the calibration's subset after each epoch (the settled test)
        self.nll = TrainingNll(reading, self.budget)
        #: a stream's samples that NLL is read on (the first epoch's first ones)
        self._nll_stream: list | None = None

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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """With ``regularize=True``, add the regularizer callback for the user (once)."""
        if self.regularizer is not None and stage == "fit":
            add_regularizer(trainer, self.regularizer)

    def make_penalty(self) -> SoftRankPenalty:
        """The regularizer's :class:`SoftRankPenalty` (see
        :meth:`SoftRankRegularizer.make_penalty`)."""
        return required_regularizer(self.regularizer).make_penalty()

    def penalty(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """The penalty ``h(F_b)/B`` of one batch (without β), for manual optimization::

            loss = loss + beta * monitor.penalty(self, x)
            self.manual_backward(loss)

        With automatic optimization the regularizer adds ``β · penalty`` itself when
        ``regularize=True``; do not add it twice.
        """
        return required_regularizer(self.regularizer).penalty(model, inputs)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._kept_subsets = {}
        self.nll.reset()
        self._nll_stream = None
        self._skipped = []
        self._calibration = Calibration()  # a ratio of this fit's weights only
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
        # the training NLL before this fit's first epoch (after the last one, when resumed)
        self._read_nll(trainer, pl_module, trainer.current_epoch - 1)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._read_stream_batch(trainer, pl_module, batch)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._streams["training"].reset()

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._streams["validation"].reset()

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._keep_validation_batch(trainer, batch, dataloader_idx)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Measured here when validation closes the epoch, so that ModelCheckpoint and
        # EarlyStopping (which act on validation end) already see this epoch's values.
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.is_last_batch and self._due(trainer):
            self._read_nll(trainer, pl_module, trainer.current_epoch)
            self._scheduled(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_nll(trainer, pl_module, trainer.current_epoch)  # every epoch, for its drop
        if self._due(trainer):
            self._scheduled(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish_fit(trainer, pl_module)

    def _read_nll(self, trainer: Trainer, pl_module: LightningModule, epoch: int) -> None:
        """The training NLL after ``epoch`` (-1: before the first) for the settled test, on the
        fill-in's samples (:meth:`_nll_batches`), unless the monitor is switched off."""
        if self.disabled_reason is None:
            batches = partial(self._nll_batches, trainer)  # read in the part's forked RNG
            self.nll.record(pl_module, epoch, batches, self._all_reduce(trainer))
