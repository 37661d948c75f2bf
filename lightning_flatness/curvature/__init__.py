"""Curvature structures of the Fisher, one module each; :func:`make_estimator` picks one."""

from __future__ import annotations

from lightning_flatness.curvature.base import (
    CurvatureEstimate,
    CurvatureEstimator,
    StructureTooLargeError,
)
from lightning_flatness.curvature.dense import DenseFisher
from lightning_flatness.curvature.diag import DiagonalFisher
from lightning_flatness.curvature.gram import GramFisher
from lightning_flatness.curvature.hutchinson import HutchinsonFisher
from lightning_flatness.curvature.kfac import KFACFisher, describe_coverage
from lightning_flatness.curvature.lanczos import LanczosFisher, SLQEstimate

__all__ = [
    "BACKPACK_STRUCTURES",
    "STRUCTURES",
    "CurvatureEstimate",
    "CurvatureEstimator",
    "DenseFisher",
    "DiagonalFisher",
    "GramFisher",
    "HutchinsonFisher",
    "KFACFisher",
    "LanczosFisher",
    "SLQEstimate",
    "StructureTooLargeError",
    "describe_coverage",
    "make_estimator",
]

#: every structure that is not matrix-free; ``kfac``, ``diag``, ``diag_mc`` from layer hooks,
#: ``dense`` and ``gram`` from BackPACK
STRUCTURES = ("dense", "gram", "kfac", "diag", "diag_mc")
#: the structures :func:`make_estimator` builds on BackPACK's extensions
BACKPACK_STRUCTURES = ("dense", "gram")


def make_estimator(
    structure: str,
    *,
    ggn_scale: float = 1.0,
    dense_max_parameters: int | None = None,
    gram_max_kernel_size: int | None = None,
) -> CurvatureEstimator:
    """The BackPACK estimator for ``structure`` (one of :data:`BACKPACK_STRUCTURES`)."""
    if structure == "dense":
        kwargs = {} if dense_max_parameters is None else {"max_parameters": dense_max_parameters}
        return DenseFisher(ggn_scale, **kwargs)
    if structure == "gram":
        kwargs = {} if gram_max_kernel_size is None else {"max_kernel_size": gram_max_kernel_size}
        return GramFisher(ggn_scale, **kwargs)
    raise ValueError(f"structure must be one of {BACKPACK_STRUCTURES}, got {structure!r}.")
