"""Fit with FlatnessMonitor under Lightning's DDP on two CPU processes (gloo).

Usage: python ddp_fit.py OUTPUT_DIR STRUCTURE [MODE]

MODE is one of sampled, defaults, wide, spread, regularize, compositional, fail (none: exact
rows).
``defaults`` is ``FlatnessMonitor(structure=STRUCTURE)`` (``auto``: the monitor's default) with
every other default but ``overhead_budget`` (None, so that the one epoch is measured whatever
it costs): Tr(F) from probe rows, the whole training set and the held-out set.

``wide`` is ``defaults`` on an MLP of :data:`WIDE` hidden units, above the probe kernel's P × P
guard: each process keeps its probe rows, and the processes gather them (few enough for a formed
kernel).

``spread`` is the probe kernel above its P × P guard (:data:`SPREAD`): each process keeps its
probe rows, sketched, and the quadrature's vectors are split across the processes, every other
option the monitor's default but ``overhead_budget``.

``fail`` makes every measurement on rank 1 (only) see NaN logits, so that it fails there.
Each rank writes its last flatness record to OUTPUT_DIR/rank{r}.json and its final weights to
OUTPUT_DIR/weights{r}.pt; with ``compositional`` also the regularizer's checkpoint state
(its running Fisher) to OUTPUT_DIR/regularizer{r}.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_flatness import (
    BatchReading,
    FlatnessClassifier,
    FlatnessMonitor,
    MNIST7DataModule,
    PenaltyOptions,
    SoftRankRegularizer,
)
from lightning_flatness.core.options import MATRIX_FREE_STRUCTURES, structure_options

#: the hidden width of ``wide``'s MLP: 12,010 parameters, above the P × P guard at the defaults
WIDE = 200
#: the probe kernel's options of ``spread``: the MLP's 4,210 parameters above the P × P guard
#: and above where the sketch starts, its 1,024 probe rows above a formed kernel: sketched rows
#: measured by the runs split across the processes
SPREAD = {"max_parameters": 1000, "sketch_from_parameters": 2000, "max_kernel_size": 512}


def rows_options(structure: str, rows: str, small: dict | None = None):
    """The options object of ``structure`` with Tr(F), and kfac's output rows, from ``rows``
    (``"exact"`` or ``"sampled"``), and a matrix-free structure's ``small`` fields."""
    values = {"trace_estimator": rows}
    if structure == "kfac":
        values["kfac_mode"] = rows
    if structure in MATRIX_FREE_STRUCTURES:
        values.update(small or {})
    return structure_options(structure, values)


def nan_on_rank_one(module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The model's logits, NaN on rank 1 during a measurement (eval mode, gradients on)."""
    logits = module(inputs)
    measuring = not module.training and torch.is_grad_enabled()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return logits * float("nan") if measuring and rank == 1 else logits


def main() -> None:
    output, structure = Path(sys.argv[1]), sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    wide = mode == "wide"
    seed_everything(0)
    # deterministic, to compare with one process exactly
    rows = "sampled" if mode == "sampled" else "exact"  # drawn labels: keyed by position too
    small = {"probes": 2, "lanczos_steps": 4} if mode == "fail" else None
    if mode in ("defaults", "wide"):  # the monitor's defaults but the budget (the one epoch)
        monitor_kwargs = {"structure": structure, "overhead_budget": None}
    else:
        monitor_kwargs = {
            "structure": rows_options(structure, rows, small),
            "max_samples": 200,
            "max_val_samples": 100,
            "overhead_budget": None,  # measured at the one epoch, whatever the timing
        }
    if mode == "spread":
        spread = structure_options("probe_kernel", SPREAD)
        monitor_kwargs = {"structure": spread, "overhead_budget": None}
    if mode == "regularize":
        monitor_kwargs.update(regularize=SoftRankRegularizer(strength=1.0))
    if mode == "compositional":
        penalty = PenaltyOptions(estimator="compositional")
        monitor_kwargs.update(regularize=SoftRankRegularizer(strength=1.0, penalty=penalty))
    if mode == "fail":
        monitor_kwargs.update(reading=BatchReading(logits_fn=nan_on_rank_one))
    monitor = FlatnessMonitor(**monitor_kwargs)
    trainer = Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_epochs=1,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=output,
    )
    model = FlatnessClassifier(architecture="mlp", weight_decay=1e-3, hidden=WIDE if wide else 70)
    trainer.fit(model, MNIST7DataModule(train_size=256, val_size=128, batch_size=32))
    rank = trainer.global_rank
    (output / f"rank{rank}.json").write_text(json.dumps(monitor.history[-1]))
    logged = {key: float(value) for key, value in trainer.callback_metrics.items()}
    (output / f"logged{rank}.json").write_text(json.dumps(logged))
    torch.save(model.state_dict(), output / f"weights{rank}.pt")
    if monitor.regularizer is not None:
        torch.save(monitor.regularizer.state_dict(), output / f"regularizer{rank}.pt")


if __name__ == "__main__":
    main()
