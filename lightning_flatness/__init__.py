"""lightning-flatness: predict a classifier's generalization gap from the soft rank of its Fisher.

The pure-torch core (:func:`measure`, the spectral functions and curvature structures) imports
no Lightning; the Lightning layer (:class:`FlatnessMonitor`, the bundled module, data and CLI) is
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_flatness._backpack import UnsupportedModelError
from lightning_flatness.curvature import STRUCTURES, StructureTooLargeError
from lightning_flatness.measure import (
    MATRIX_FREE_STRUCTURES,
    FlatnessReport,
    MeasurementError,
    measure,
)
from lightning_flatness.regularizer import SoftRankPenalty, soft_rank_penalty
from lightning_flatness.spectral import (
    logdet_complexity,
    max_eig,
    soft_rank,
    soft_rank2,
    spectral_summary,
    trace,
)

__version__ = "0.1.0"

_LAZY = {
    "FlatnessMonitor": "lightning_flatness.callback",
    "FlatnessClassifier": "lightning_flatness.lightning_module",
    "MNIST7DataModule": "lightning_flatness.data",
}

__all__ = [
    # measuring
    "measure",
    "FlatnessReport",
    "STRUCTURES",
    "MATRIX_FREE_STRUCTURES",
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
    "FlatnessClassifier",
    "MNIST7DataModule",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_flatness' has no attribute {name!r}")
