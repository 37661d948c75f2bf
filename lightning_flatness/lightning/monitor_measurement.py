"""How ``FlatnessMonitor`` measures: the fixed samples it reads (a seeded subset of a sized
dataset, or the batches the loops drew from a stream), the arguments it hands
:func:`~lightning_flatness.core.measure`, the DDP reduction, and a failed measurement turned
into a warning and NaN, and the samples the training NLL of every epoch's end is read on
(:mod:`lightning_flatness.lightning.monitor_nll`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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
)
from lightning_flatness.lightning.stream_buffer import leading_size
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
    "MonitorMeasurement",
    "monitor_options",
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


class MonitorMeasurement:
    """The measurement of :class:`~lightning_flatness.lightning.monitor.FlatnessMonitor` (a part of
    it: these methods read the monitor's settings and state)."""

    def _batches(
        self, trainer: Trainer, loaders: object, split: str, limit: int | None = None
    ) -> Iterable:
        """A fixed subset of a sized dataset (at most ``limit`` samples, if given), or this
        epoch's batches of a stream. A subset with a ``limit`` (the fill-in's, its
        calibration's) is read once per fit and kept while the dataset object, its length, the
        batch size and the sharding stay the same, if it is small (:data:`KEPT_SUBSET_NUMBERS`);
        a dataset that draws random augmentations is then measured on one draw of them, the
        same at every fill-in."""
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
        batch_size = self.batch_size or (
            self._fill_in_batch_size() if limit is not None else MEASUREMENT_BATCH_SIZE
        )
        shard = (trainer.global_rank, trainer.world_size)
        settings = (len(loader.dataset), max_samples, batch_size, *shard)
        kept = self._kept_subsets.get((split, limit))
        if limit is not None and kept is not None:
            dataset, kept_settings, batches = kept
            if dataset is loader.dataset and kept_settings == settings:
                return batches
        batches = fixed_subset_batches(
            loader, max_samples, batch_size, self.seed, rank=shard[0], world_size=shard[1]
        )
        if limit is None:
            return batches
        batches = list(batches)
        if tensor_numbers(batches) <= KEPT_SUBSET_NUMBERS:
            self._kept_subsets[(split, limit)] = (loader.dataset, settings, batches)
        return batches

    def _fill_in_batch_size(self) -> int:
        """All :data:`FILL_IN_SAMPLES` in one batch, or as many as hold
        :data:`FILL_IN_BATCH_NUMBERS` numbers (at least :data:`MEASUREMENT_BATCH_SIZE`)."""
        per_sample = self._sample_numbers or 0.0
        fitting = int(FILL_IN_BATCH_NUMBERS // per_sample) if per_sample > 0 else FILL_IN_SAMPLES
        return max(MEASUREMENT_BATCH_SIZE, min(FILL_IN_SAMPLES, fitting))

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
        train_batches = self._batches(trainer, trainer.train_dataloader, "training", limit)
        val_batches = None
        if self.use_val and not half and trainer.val_dataloaders is not None:
            val_batches = self._batches(trainer, trainer.val_dataloaders, "validation", limit)
        arguments = self.calibration_arguments() if calibration else None
        if half:
            held = sum(leading_size(batch) for batch in train_batches)
            arguments = {
                **(arguments or self.measure_arguments(structure or self._active_structure)),
                "max_samples": max(held // 2, 1),
            }
        return self._call_measure(
            pl_module,
            train_batches,
            val_batches,
            all_reduce=self._all_reduce(trainer),
            shard=self._shard(trainer),
            structure=structure,
            arguments=arguments,
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
        :meth:`measure_arguments` says for ``structure`` (the active one by default)."""
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
                reading=self.reading,
                **arguments,
            )

    def measure_arguments(self, structure: str) -> dict[str, Any]:
        """:func:`measure`'s arguments that say what to measure ``structure`` with: the options
        object passed as ``structure=`` for its structure, else :func:`monitor_options` of the
        name with the factor "auto" chose (:func:`sketched`)."""
        chosen = self.structure_options
        if chosen is not None and chosen.structure == structure:
            return {"structure": chosen}
        return {"structure": monitor_options(structure, sketched(structure, self))}

    def calibration_arguments(self) -> dict[str, Any]:
        """:func:`measure`'s arguments for the fill-in's calibration on its own samples: the
        active structure's, and for the probe kernel at its default rows (by name, or options
        without ``probes`` or ``groups``)
        :data:`~lightning_flatness.lightning.budget.CALIBRATION_PROBES` probe rows per sample
        (module docstring of :mod:`~lightning_flatness.lightning.budget`); the probe kernel
        for its trace functions alone (``summary_only``: the ratio needs the soft rank, not the
        spectrum or the Newton decrement)."""
        arguments = self.measure_arguments(self._active_structure)
        options = arguments["structure"]
        if not isinstance(options, KernelOptions):
            return arguments
        if not options.default_rows:  # the user's rows, for the sums alone
            return {"structure": replace(options, summary_only=True)}
        probes = {"probes": CALIBRATION_PROBES, "groups": CALIBRATION_PROBES, "summary_only": True}
        return {"structure": replace(options, **probes)}

    def _measured_samples(self) -> int:
        """The training samples a measurement of the whole set reads: n, at most
        ``max_samples`` (0 while n is unknown)."""
        return int(min(self.resolved_num_train_samples or 0, self.max_samples or math.inf))

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

    def _nll_batches(self, trainer: Trainer) -> Iterable:
        """The samples the settled test reads: the fixed subset of at most
        :data:`FILL_IN_SAMPLES` of a sized dataset that the fill-in is calibrated on (kept for
        the fit), or of a stream the first :data:`FILL_IN_SAMPLES` samples the loop
        drew in the first epoch, kept for the fit (none before it)."""
        loader = first_dataloader(trainer.train_dataloader)
        if loader is None:
            return []
        if is_sized(loader):
            return self._batches(trainer, trainer.train_dataloader, "training", FILL_IN_SAMPLES)
        if self._nll_stream is None and self._streams["training"].batches:
            self._nll_stream = first_samples(self._streams["training"].batches, FILL_IN_SAMPLES)
        return self._nll_stream or []

    def _keep_validation_batch(self, trainer: Trainer, batch: Any, dataloader_idx: int) -> None:
        """A validation batch the loop drew from a stream, kept for this epoch's held-out
        numbers (the measured dataloader's only, never during the sanity check)."""
        if trainer.sanity_checking or dataloader_idx != self.val_dataloader_idx:
            return
        loader = select_dataloader(trainer.val_dataloaders, self.val_dataloader_idx)
        if loader is not None and not is_sized(loader):
            self._streams["validation"].add(batch)


def sketched(structure: str, monitor: Any) -> int | None:
    """The probe kernel's ``sketch_factor`` where ``structure="auto"`` found its rows fit
    memory only sketched shorter than the default (the monitor's ``_sketch_factor``), else
    None."""
    factor = getattr(monitor, "_sketch_factor", None)
    return factor if structure == "probe_kernel" else None
