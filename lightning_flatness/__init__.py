"""lightning-flatness: predict a classifier's generalization gap from the soft rank of its Fisher.

The pure-torch core (:mod:`lightning_flatness.core`: :func:`measure`, the spectral functions and
curvature structures) and the regularizer (:mod:`lightning_flatness.regularizer`) import neither
Lightning nor BackPACK; the Lightning layer (:mod:`lightning_flatness.lightning`: the callbacks,
the bundled module, data and CLI) is loaded on first use of one of its names.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_flatness.core import (
    MATRIX_FREE_STRUCTURES,
    STRUCTURES,
    FlatnessReport,
    MeasurementError,
    StructureTooLargeError,
    UnsupportedModelError,
    logdet_complexity,
    max_eig,
    measure,
    soft_rank,
    soft_rank2,
    spectral_summary,
    trace,
)
from lightning_flatness.core.options import (
    DenseOptions,
    DiagOptions,
    GramOptions,
    KernelOptions,
    KFACOptions,
    MatrixFreeOptions,
)
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty, soft_rank_penalty

__version__ = "0.1.0"

_LAZY = {
    "FlatnessMonitor": "lightning_flatness.lightning.monitor",
    "SoftRankRegularizer": "lightning_flatness.lightning.regularizer",
    "FlatnessClassifier": "lightning_flatness.lightning.module",
    "MNIST7DataModule": "lightning_flatness.lightning.data",
    "LogOptions": "lightning_flatness.lightning.log_options",
}

__all__ = [
    # measuring
    "measure",
    "FlatnessReport",
    "STRUCTURES",
    "MATRIX_FREE_STRUCTURES",
    # settings objects: a structure's options, how batches are read, the penalty's options
    "KernelOptions",
    "KFACOptions",
    "DiagOptions",
    "DenseOptions",
    "GramOptions",
    "MatrixFreeOptions",
    "BatchReading",
    "PenaltyOptions",
    "LogOptions",
    # errors
    "MeasurementError",
    "StructureTooLargeError",
    "UnsupportedModelError",
    # the regularizer (Theorem 6.5)
    "SoftRankPenalty",
    "soft_rank_penalty",
    # spectral functions
    "soft_rank",
    "soft_rank2",
    "logdet_complexity",
    "trace",
    "max_eig",
    "spectral_summary",
    # Lightning layer
    "FlatnessMonitor",
    "SoftRankRegularizer",
    "FlatnessClassifier",
    "MNIST7DataModule",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_flatness' has no attribute {name!r}")
