"""``FlatnessMonitor``: measure flatness and predict the generalization gap while training.

At the end of every ``every_n_epochs``-th training epoch the callback calls
:func:`lightning_flatness.core.measure` on a fixed, deterministic subset of the training set (and of
the validation set), logs every :class:`~lightning_flatness.FlatnessReport` field through
``pl_module.log`` under ``log_options.prefix`` — so every logger, ``EarlyStopping`` and
``ModelCheckpoint`` see them: ``ModelCheckpoint(monitor="flatness/predicted_test_nll",
mode="min")`` keeps the epoch with the lowest predicted test loss (never the smallest
``predicted_gap``: an under-fit epoch has a small gap) — and, with a ``TensorBoardLogger``,
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

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_flatness.core.checks import check_count
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.defaults import AUTO
from lightning_flatness.core.measure import checked_structure
from lightning_flatness.core.options import (
    OPTION_CLASSES,
    StructureOptions,
)
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.spectral import check_lam
from lightning_flatness.lightning.budget import OverheadBudget
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.monitor_checks import FitStart
from lightning_flatness.lightning.monitor_logging import MonitorLog
from lightning_flatness.lightning.monitor_measurement import Measurer
from lightning_flatness.lightning.monitor_nll import TrainingNll
from lightning_flatness.lightning.monitor_regularizer import (
    add_regularizer,
    own_regularizer,
    required_regularizer,
)
from lightning_flatness.lightning.monitor_schedule import Schedule
from lightning_flatness.lightning.monitor_state import FitState, MonitorSettings
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.lightning.trainer_facts import (
    resolve_lam,
    sharding_refusal,
)
from lightning_flatness.regularizer import SoftRankPenalty

__all__ = ["FlatnessMonitor"]

DEFAULT_MAX_VAL_SAMPLES = 1024


def _check_structure(structure: str | StructureOptions) -> StructureOptions | None:
    """The options object passed as ``structure`` (None for a name: the monitor measures a name
    with its own defaults), refusing what ``measure()`` refuses, with its message
    (:func:`~lightning_flatness.core.measure.checked_structure`)."""
    checked_structure(structure)
    return structure if isinstance(structure, OPTION_CLASSES) else None


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
        structure_options = _check_structure(structure)
        #: the monitor's arguments as its parts read them
        self.settings = MonitorSettings(
            structure=structure if structure_options is None else structure_options.structure,
            structure_options=structure_options,
            lam=None if lam is None else float(lam),
            num_train_samples=num_train_samples,
            every_n_epochs=every_n_epochs,
            max_samples=max_samples,
            max_val_samples=max_val_samples,
            use_val=val_dataloader is not None,
            val_dataloader_idx=val_dataloader or 0,
            batch_size=batch_size,
            reading=reading,
            log_options=log_options,
            measure_on_fit_end=measure_on_fit_end,
            strict=bool(strict),
            seed=seed,
        )
        #: what the fit has found out, shared by the parts below
        self.state = FitState(active_structure=self.settings.structure)
        #: the callback that owns the penalty when ``regularize`` is set (added at fit start)
        self.regularizer = own_regularizer(
            regularize, lam, num_train_samples, reading, seed, log_options.prefix
        )
        #: the overhead budget: what the monitor may spend, and what it has
        self.budget = OverheadBudget(overhead_budget)
        #: the parts: the samples and arguments of every measurement, the fit-start checks,
        #: the writer of the records, the settled test and the schedule that uses them all
        self.measurer = Measurer(self.settings, self.state, self.budget)
        self.fit_start = FitStart(
            self.settings, self.state, self.measurer, self.budget, self.regularizer
        )
        self.writer = MonitorLog(log_options)
        self.nll = TrainingNll(reading, self.budget)
        self.schedule = Schedule(
            self.settings, self.state, self.measurer, self.budget, self.writer, self.nll
        )

    @property
    def structure(self) -> str:
        """The structure asked for (``"auto"``, a name, or the options object's structure)."""
        return self.settings.structure

    @property
    def regularize(self) -> bool:
        """Whether the monitor also trains against the soft rank (it owns a regularizer)."""
        return self.regularizer is not None

    @property
    def history(self) -> list[dict[str, float]]:
        """One record per measured epoch (what was logged, under the names without prefix)."""
        return self.state.history

    @property
    def disabled_reason(self) -> str | None:
        """Why the monitor switched itself off at fit start (``strict=False``), or None."""
        return self.state.disabled_reason

    @property
    def resolved_lam(self) -> float | ParameterDecay | None:
        """λ as measured: the argument, or read from the optimizer at fit start."""
        return self.state.resolved_lam

    @property
    def resolved_num_train_samples(self) -> int | None:
        """n as measured: the argument, or the training set's size read at fit start."""
        return self.state.resolved_num_train_samples

    @property
    def state_key(self) -> str:
        prefix = self.settings.log_options.prefix
        return self._generate_state_key(structure=self.structure, log_prefix=prefix)

    def state_dict(self) -> dict[str, Any]:
        """Plain values only, so checkpoints load with ``torch.load(weights_only=True)``."""
        return {
            "history": [dict(record) for record in self.history],
            "active_structure": self.state.active_structure,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.history = [dict(record) for record in state_dict.get("history", [])]
        self.state.active_structure = state_dict.get("active_structure", self.structure)
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
        self.schedule.start_fit()
        refusal = sharding_refusal(trainer.strategy, pl_module)
        if refusal is not None:
            self.fit_start.refuse(pl_module, ValueError(refusal))
            return
        self.state.resolved_lam = resolve_lam(trainer.optimizers, self.settings.lam, pl_module)
        if isinstance(self.state.resolved_lam, ParameterDecay):
            rank_zero_info(
                "FlatnessMonitor: the optimizer's groups decay differently "
                f"({self.state.resolved_lam.describe()}); the soft rank is Tr(F(F+D)⁻¹) with "
                "D = diag(λ_j), and a group without decay counts each Fisher direction it "
                "carries (lam= sets one λ instead)."
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.state.disabled_reason is not None:  # refused at fit start (strict=False)
            return
        self.budget.start()
        self.fit_start.resolve(trainer)
        self.fit_start.start(trainer, pl_module)
        # the training NLL before this fit's first epoch (after the last one, when resumed)
        self.schedule.read_nll(trainer, pl_module, trainer.current_epoch - 1)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.fit_start.read_stream_batch(trainer, pl_module, batch)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.measurer.start_epoch("training")

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.measurer.start_epoch("validation")

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.measurer.keep_validation_batch(trainer, batch, dataloader_idx)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Measured here when validation closes the epoch, so that ModelCheckpoint and
        # EarlyStopping (which act on validation end) already see this epoch's values.
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.is_last_batch and self.schedule.due(trainer):
            self.schedule.read_nll(trainer, pl_module, trainer.current_epoch)
            self.schedule.measure_epoch(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # every epoch, for its drop
        self.schedule.read_nll(trainer, pl_module, trainer.current_epoch)
        if self.schedule.due(trainer):
            self.schedule.measure_epoch(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.schedule.finish_fit(trainer, pl_module)
