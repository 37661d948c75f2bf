"""The pure-torch core: from a model and its batches to a :class:`FlatnessReport`.

It holds the spectral functions, the likelihoods, the batch reader, the measurement pipeline
with its backends (layer hooks, ``torch.func``), the curvature structures and the dense
autograd reference. Importing it loads neither Lightning nor BackPACK; BackPACK
(:mod:`lightning_flatness.core.backpack`) is imported only when ``dense`` or ``gram`` is
measured.
"""

from __future__ import annotations

from lightning_flatness.core.failures import (
    MeasurementError,
    StructureTooLargeError,
    UnsupportedModelError,
)
from lightning_flatness.core.measure import check_batch, measure
from lightning_flatness.core.options import MATRIX_FREE_STRUCTURES, STRUCTURES
from lightning_flatness.core.report import FlatnessReport
from lightning_flatness.core.spectral import (
    logdet_complexity,
    max_eig,
    soft_rank,
    soft_rank2,
    spectral_summary,
    trace,
)

__all__ = [
    "MATRIX_FREE_STRUCTURES",
    "STRUCTURES",
    "FlatnessReport",
    "MeasurementError",
    "StructureTooLargeError",
    "UnsupportedModelError",
    "check_batch",
    "logdet_complexity",
    "max_eig",
    "measure",
    "soft_rank",
    "soft_rank2",
    "spectral_summary",
    "trace",
]
