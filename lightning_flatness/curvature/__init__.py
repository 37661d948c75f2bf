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
from lightning_flatness.curvature.kfac import KFACFisher
from lightning_flatness.curvature.lanczos import LanczosFisher, SLQEstimate

__all__ = [
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
    "make_estimator",
]

STRUCTURES = ("dense", "gram", "kfac", "diag", "diag_mc")


def make_estimator(
    structure: str,
    *,
    ggn_scale: float = 1.0,
    kfac_mode: str = "exact",
    mc_samples: int = 1,
    dense_max_parameters: int | None = None,
    gram_max_kernel_size: int | None = None,
) -> CurvatureEstimator:
    """The estimator for ``structure`` (one of :data:`STRUCTURES`)."""
    if structure == "dense":
        kwargs = {} if dense_max_parameters is None else {"max_parameters": dense_max_parameters}
        return DenseFisher(ggn_scale, **kwargs)
    if structure == "gram":
        kwargs = {} if gram_max_kernel_size is None else {"max_kernel_size": gram_max_kernel_size}
        return GramFisher(ggn_scale, **kwargs)
    if structure == "kfac":
        return KFACFisher(ggn_scale, mode=kfac_mode, mc_samples=mc_samples)
    if structure in ("diag", "diag_mc"):
        return DiagonalFisher(ggn_scale, sampled=structure == "diag_mc", mc_samples=mc_samples)
    raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}.")
