"""The Table-4 study of "Flatness After All?" as a command: ``lightning-flatness sweep``.

A sweep trains a grid of models (architecture, training-set size, weight decay λ = c/n, learning
rate, batch size, seed, or any init argument of your own LightningModule / LightningDataModule)
for a fixed step budget, measures every run's flatness on its whole training set with every
curvature structure, and reports the Kendall rank correlation of each measure with the measured
generalization gap, with scatter plots of predicted vs measured gap.

- :mod:`~lightning_flatness.sweep.config`: the YAML file and the grid;
- :mod:`~lightning_flatness.sweep.run`: one run, as executed in a worker;
- :mod:`~lightning_flatness.sweep.runner`: parallel, resumable execution;
- :mod:`~lightning_flatness.sweep.kendall`: Kendall's τ-b;
- :mod:`~lightning_flatness.sweep.report`: tables and figures.
"""

from __future__ import annotations

from lightning_flatness.sweep.command import main
from lightning_flatness.sweep.config import SweepConfig, load_config
from lightning_flatness.sweep.kendall import kendall_tau_b
from lightning_flatness.sweep.report import write_report
from lightning_flatness.sweep.run import execute_run
from lightning_flatness.sweep.runner import SweepSummary, read_records, run_sweep

__all__ = [
    "SweepConfig",
    "SweepSummary",
    "execute_run",
    "kendall_tau_b",
    "load_config",
    "main",
    "read_records",
    "run_sweep",
    "write_report",
]
