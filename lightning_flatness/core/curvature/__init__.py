"""Curvature structures of the Fisher computed without BackPACK, one module each (BackPACK's
``dense`` and ``gram`` live in :mod:`lightning_flatness.core.backpack`)."""

from __future__ import annotations

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.diag import DiagonalFisher
from lightning_flatness.core.curvature.hutchinson import HutchinsonFisher
from lightning_flatness.core.curvature.kfac import KFACFisher, describe_coverage
from lightning_flatness.core.curvature.lanczos import LanczosFisher, SLQEstimate
from lightning_flatness.core.curvature.probe_kernel import ProbeKernelFisher
from lightning_flatness.core.options import STRUCTURES

__all__ = [
    "STRUCTURES",
    "CurvatureEstimate",
    "DiagonalFisher",
    "HutchinsonFisher",
    "KFACFisher",
    "LanczosFisher",
    "ProbeKernelFisher",
    "SLQEstimate",
    "describe_coverage",
]
