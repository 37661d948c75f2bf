"""How ``FlatnessMonitor`` measures: the fixed samples it reads (a seeded subset of a sized
dataset, or the batches the loops drew from a stream), the arguments it hands
:func:`~lightning_flatness.core.measure`, the DDP reduction, and a failed measurement turned
into a warning and NaN, and the samples the training NLL of every epoch's end is read on
(:mod:`lightning_flatness.lightning.monitor_nll`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils._pytree import tree_leaves

from lightning_flatness.core.curvature import describe_coverage
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.failures import (
    TrainingSplitError,
    UnsupportedModelError,
)
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import (
    HOOK_STRUCTURES,
    MATRIX_FREE_STRUCTURES,
    KernelOptions,
    KFACOptions,
    StructureOptions,
    structure_options,
)
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.lightning.budget import (
    CALIBRATION_PROBES,
    FILL_IN,
    FILL_IN_SAMPLES,
    OverheadBudget,
)
from lightning_flatness.lightning.monitor_state import FitState, MonitorSettings
from lightning_flatness.lightning.stream_buffer import StreamBuffer, leading_size
from lightning_flatness.lightning.trainer_facts import (
    first_dataloader,
    fixed_subset_batches,
    is_sized,
    select_dataloader,
)

__all__ = [
    "FALLBACK",
    "FILL_IN_BATCH_NUMBERS",
    "KEPT_SUBSET_NUMBERS",
    "MEASUREMENT_BATCH_SIZE",
    "Measurer",
    "all_reduce_of",
    "monitor_options",
    "shard_of",
    "tensor_numbers",
]


def monitor_options(structure: str, sketch_factor: int | None = None) -> StructureOptions:
    """The options object a structure named by a string is measured with: its defaults, but
    Tr(F) from probe rows (no extra backward pass: ``"probe"`` for the layer-hook structures,
    the matrix-free structures' ``"sampled"`` estimate, which is the same probes; ``dense`` and
    ``gram`` compute the exact rows anyway) and ``kfac``'s output factors from one probe per
    input (docs/RESULTS.md); the probe kernel's rows kept ``sketch_factor`` times shorter where
    ``structure="auto"`` found they fit memory only so."""
    options = structure_options(structure)
    if structure in HOOK_STRUCTURES:
        options = replace(options, trace_estimator="probe")
    elif structure in MATRIX_FREE_STRUCTURES:
        options = replace(options, trace_estimator="sampled")
    if isinstance(options, KFACOptions):
        options = replace(options, kfac_mode="probe")
    if isinstance(options, KernelOptions) and sketch_factor is not None:
        options = replace(options, sketch_factor=sketch_factor)
    return options


#: the structure measured when BackPACK cannot extend the model for ``dense`` or ``gram``
FALLBACK = "lanczos"
#: the measurement's batch size when the user gives none (the fill-in reads its whole subset
#: in one batch instead: the layer hooks split it into passes of the size they run fastest at)
MEASUREMENT_BATCH_SIZE = 256
#: the most numbers a fill-in batch holds when it has more than MEASUREMENT_BATCH_SIZE samples
#: (1,024 images of 224 × 224 × 3 would be 600 MB of float32 inputs)
FILL_IN_BATCH_NUMBERS = 2**25
#: the fill-in's fixed subset is read once per fit and kept (collated, where the dataset put
#: it) when its batches hold at most this many numbers: reading 2,048 samples again through the
#: dataset and the collate function cost a quarter of a fill-in of the paper's MLP
KEPT_SUBSET_NUMBERS = 2**24


def first_samples(batches: list, samples: int) -> list:
    """Whole batches from the start of ``batches`` until they hold ``samples`` samples."""
    kept, held = [], 0
    for batch in batches:
        if held >= samples:
            break
        kept.append(batch)
        held += leading_size(batch)
    return kept


def tensor_numbers(batch: Any) -> int:
    """How many numbers the tensors of a batch (nested tuples, lists, dicts) hold."""
    return sum(leaf.numel() for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor))


def all_reduce_of(trainer: Trainer) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A sum across the trainer's processes, in place (None with one process)."""
    if trainer.world_size <= 1:
        return None
    strategy = trainer.strategy

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        reduced = strategy.reduce(tensor.clone(), reduce_op="sum")
        tensor.copy_(reduced.to(tensor.device, tensor.dtype))
        return tensor

    return all_reduce


def shard_of(trainer: Trainer) -> tuple[int, int] | None:
    """``(rank, world_size)`` when the ranks split one fixed subset of a sized dataset between
    them (:func:`fixed_subset_batches`): then they draw the probes by global position and
    together log what one process would."""
    loader = first_dataloader(trainer.train_dataloader)
    if trainer.world_size <= 1 or loader is None or not is_sized(loader):
        return None
    return trainer.global_rank, trainer.world_size


class Measurer:
    """What :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` measures on and with:
    a plain object that owns the samples it reads (the streams' batches of this epoch, the
    fill-in's subsets kept for the fit) and hands :func:`measure` the monitor's arguments.

    Args:
        settings: the monitor's arguments.
        state: the fit's shared state; this part reads λ, n, the structure and the sample
            size, switches ``active_structure`` to :data:`FALLBACK` where BackPACK cannot
            follow the model, and keeps the last exact report.
        budget: the overhead budget (the fill-in's sample count it chose).
    """

    def __init__(self, settings: MonitorSettings, state: FitState, budget: OverheadBudget) -> None:
        self.settings = settings
        self.state = state
        self.budget = budget
        #: batches the loops drew this epoch, measured when the dataset is a stream
        self.streams = {
            "training": StreamBuffer(settings.max_samples),
            "validation": StreamBuffer(settings.max_val_samples),
        }
        #: the fill-in's and its calibration's subsets by split and size, read once per fit:
        #: (dataset, settings, batches)
        self._kept_subsets: dict[tuple[str, int | None], tuple[Any, tuple, list]] = {}
        #: a stream's samples the training NLL is read on (the first epoch's first ones)
        self._nll_stream: list | None = None
        self._coverage_said = False

    def forget_samples(self) -> None:
        """Hold no sample beyond a fit: the kept subsets and the stream's NLL samples go."""
        self._kept_subsets = {}
        self._nll_stream = None

    def batches(
        self, trainer: Trainer, loaders: object, split: str, limit: int | None = None
    ) -> Iterable:
        """A fixed subset of a sized dataset (at most ``limit`` samples, if given), or this
        epoch's batches of a stream. A subset with a ``limit`` (the fill-in's, its
        calibration's) is read once per fit and kept while the dataset object, its length, the
        batch size and the sharding stay the same, if it is small (:data:`KEPT_SUBSET_NUMBERS`);
        a dataset that draws random augmentations is then measured on one draw of them, the
        same at every fill-in."""
        settings = self.settings
        if split == "validation":
            loader = select_dataloader(loaders, settings.val_dataloader_idx)
            max_samples = settings.max_val_samples
        else:
            loader = first_dataloader(loaders)
            max_samples = settings.max_samples
        if limit is not None:
            max_samples = min(max_samples or limit, limit)
        if loader is None:
            return []
        if not is_sized(loader):
            return list(self.streams[split].batches)
        batch_size = settings.batch_size or (
            self.fill_in_batch_size() if limit is not None else MEASUREMENT_BATCH_SIZE
        )
        shard = (trainer.global_rank, trainer.world_size)
        kept_settings = (len(loader.dataset), max_samples, batch_size, *shard)
        kept = self._kept_subsets.get((split, limit))
        if limit is not None and kept is not None:
            dataset, earlier_settings, batches = kept
            if dataset is loader.dataset and earlier_settings == kept_settings:
                return batches
        batches = fixed_subset_batches(
            loader, max_samples, batch_size, settings.seed, rank=shard[0], world_size=shard[1]
        )
        if limit is None:
            return batches
        batches = list(batches)
        if tensor_numbers(batches) <= KEPT_SUBSET_NUMBERS:
            self._kept_subsets[(split, limit)] = (loader.dataset, kept_settings, batches)
        return batches

    def fill_in_batch_size(self) -> int:
        """All :data:`FILL_IN_SAMPLES` in one batch, or as many as hold
        :data:`FILL_IN_BATCH_NUMBERS` numbers (at least :data:`MEASUREMENT_BATCH_SIZE`)."""
        per_sample = self.state.sample_numbers or 0.0
        fitting = int(FILL_IN_BATCH_NUMBERS // per_sample) if per_sample > 0 else FILL_IN_SAMPLES
        return max(MEASUREMENT_BATCH_SIZE, min(FILL_IN_SAMPLES, fitting))

    def run(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        structure: str | None = None,
        limit: int | None = None,
        half: bool = False,
        calibration: bool = False,
    ) -> FlatnessReport:
        """``structure`` (the active one by default) on the fixed subsets; the fill-in on its
        subset (the budget's ``fill_in_samples``, :data:`FILL_IN_SAMPLES` until chosen), any
        structure given a ``limit`` on the subset of at most that many samples;
        ``half``: the soft rank of the first half of each process's samples of that subset
        only (no held-out set), which with every process's half is the first half of the
        subset (its samples are dealt to the processes in turn); ``calibration``: with
        :meth:`calibration_arguments`."""
        if structure == FILL_IN:
            limit = self.budget.fill_in_samples or FILL_IN_SAMPLES
        train_batches = self.batches(trainer, trainer.train_dataloader, "training", limit)
        val_batches = None
        if self.settings.use_val and not half and trainer.val_dataloaders is not None:
            val_batches = self.batches(trainer, trainer.val_dataloaders, "validation", limit)
        arguments = self.calibration_arguments() if calibration else None
        if half:
            held = sum(leading_size(batch) for batch in train_batches)
            arguments = {
                **(arguments or self.arguments(structure or self.state.active_structure)),
                "max_samples": max(held // 2, 1),
            }
        return self.call(
            pl_module,
            train_batches,
            val_batches,
            all_reduce=all_reduce_of(trainer),
            shard=shard_of(trainer),
            structure=structure,
            arguments=arguments,
        )

    def call(
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
        :meth:`arguments` says for ``structure`` (the active one by default)."""
        if arguments is None:
            arguments = self.arguments(structure or self.state.active_structure)
        with torch.inference_mode(False), torch.enable_grad():
            return measure(
                pl_module,
                train_batches,
                lam=self.state.lam_argument(),
                num_train_samples=self.state.resolved_num_train_samples,
                val_batches=val_batches,
                seed=self.settings.seed,
                all_reduce=all_reduce,
                shard=shard,
                reading=self.settings.reading,
                **arguments,
            )

    def arguments(self, structure: str) -> dict[str, Any]:
        """:func:`measure`'s arguments that say what to measure ``structure`` with: the options
        object passed as ``structure=`` for its structure, else :func:`monitor_options` of the
        name with the sketch factor "auto" chose (which only the probe kernel takes)."""
        chosen = self.settings.structure_options
        if chosen is not None and chosen.structure == structure:
            return {"structure": chosen}
        return {"structure": monitor_options(structure, self.state.sketch_factor)}

    def calibration_arguments(self) -> dict[str, Any]:
        """:func:`measure`'s arguments for the fill-in's calibration on its own samples: the
        active structure's, and for the probe kernel at its default rows (by name, or options
        without ``probes`` or ``groups``)
        :data:`~lightning_flatness.lightning.budget.CALIBRATION_PROBES` probe rows per sample
        (module docstring of :mod:`~lightning_flatness.lightning.budget`); the probe kernel
        for its trace functions alone (``summary_only``: the ratio needs the soft rank, not the
        spectrum or the Newton decrement)."""
        arguments = self.arguments(self.state.active_structure)
        options = arguments["structure"]
        if not isinstance(options, KernelOptions):
            return arguments
        if not options.default_rows:  # the user's rows, for the sums alone
            return {"structure": replace(options, summary_only=True)}
        probes = {"probes": CALIBRATION_PROBES, "groups": CALIBRATION_PROBES, "summary_only": True}
        return {"structure": replace(options, **probes)}

    def measured_samples(self) -> int:
        """The training samples a measurement of the whole set reads: n, at most
        ``max_samples`` (0 while n is unknown)."""
        return self.state.measured_samples(self.settings.max_samples)

    def record(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """One measurement of the whole measured set as a plain dict (its report kept as the
        state's ``last_report``); NaN (and a warning) if it fails."""
        state = self.state
        try:
            report = self.with_fallback(lambda: self.run(trainer, pl_module))
        except Exception as error:  # a metric must never stop training
            rank_zero_warn(
                f"FlatnessMonitor: the measurement at epoch {trainer.current_epoch} failed and "
                f"is recorded as NaN ({type(error).__name__}: {error})"
            )
            lam = state.resolved_lam
            report = FlatnessReport.failed(
                state.active_structure,
                lam.representative if isinstance(lam, ParameterDecay) else lam,
                state.resolved_num_train_samples or 0,
                val=error.val_sums if isinstance(error, TrainingSplitError) else None,
            )
        state.last_report = report
        if report.coverage and not self._coverage_said:
            rank_zero_info(f"FlatnessMonitor: {describe_coverage(report.coverage)}")
            self._coverage_said = True
        record = {k: v for k, v in report.as_dict().items() if k != "structure"}
        if trainer.world_size > 1:  # the only per-rank number: log the mean so ranks agree
            seconds = torch.tensor(record["seconds"], dtype=torch.float64)
            record["seconds"] = float(trainer.strategy.reduce(seconds, reduce_op="mean"))
        return record

    def with_fallback(self, run: Callable[[], FlatnessReport]) -> FlatnessReport:
        """``run()``; when BackPACK cannot convert the model (``dense``/``gram``), switch to
        :data:`FALLBACK` for the rest of the fit, say so, and run again."""
        try:
            return run()
        except UnsupportedModelError as error:
            if self.state.active_structure in MATRIX_FREE_STRUCTURES:
                raise
            rank_zero_info(
                f"FlatnessMonitor: {error} Switching to the matrix-free structure "
                f"{FALLBACK!r} for this model."
            )
            self.state.active_structure = FALLBACK
            return run()

    def nll_batches(self, trainer: Trainer) -> Iterable:
        """The samples the settled test reads: the fixed subset of at most
        :data:`FILL_IN_SAMPLES` of a sized dataset that the fill-in is calibrated on (kept for
        the fit), or of a stream the first :data:`FILL_IN_SAMPLES` samples the loop
        drew in the first epoch, kept for the fit (none before it)."""
        loader = first_dataloader(trainer.train_dataloader)
        if loader is None:
            return []
        if is_sized(loader):
            return self.batches(trainer, trainer.train_dataloader, "training", FILL_IN_SAMPLES)
        if self._nll_stream is None and self.streams["training"].batches:
            self._nll_stream = first_samples(self.streams["training"].batches, FILL_IN_SAMPLES)
        return self._nll_stream or []

    def keep_training_batch(self, batch: Any) -> None:
        """A training batch the loop drew from a stream, kept for this epoch's measurement."""
        self.streams["training"].add(batch)

    def keep_validation_batch(self, trainer: Trainer, batch: Any, dataloader_idx: int) -> None:
        """A validation batch the loop drew from a stream, kept for this epoch's held-out
        numbers (the measured dataloader's only, never during the sanity check)."""
        index = self.settings.val_dataloader_idx
        if trainer.sanity_checking or dataloader_idx != index:
            return
        loader = select_dataloader(trainer.val_dataloaders, index)
        if loader is not None and not is_sized(loader):
            self.streams["validation"].add(batch)

    def start_epoch(self, split: str) -> None:
        """A new epoch of ``split``: the stream's batches of the last one go."""
        self.streams[split].reset()

    def stream_samples(self) -> int:
        """The most samples of a training stream an epoch's measurement reads."""
        return self.streams["training"].max_samples
