"""The stored-row estimate's values from its finished Lanczos runs, whichever space they ran in
(docs/math.md, "The probe kernel", stored rows and a bracket).

Each run gives its trace functions as the midpoint of its Gauss and Gauss–Radau rules, which
bracket the soft rank's share; the run sets' jackknife
(:class:`~lightning_flatness.core.curvature.run_sets.RunSets`) combines the midpoints, and the
standard error adds the probe groups' spread, the Hutchinson probes' and the half-width of the
jackknifed bracket in quadrature. The trace is exact (the rows' squared norms), the largest
eigenvalue is the top Ritz value of the whole kernel's runs, and those runs' Gauss rules give a
sample of the spectral density.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.curvature.lanczos_quadrature import (
    LanczosDecomposition,
    density_sample,
    gauss_quadrature,
    radau_quadrature,
    slq_values,
)
from lightning_flatness.core.curvature.run_sets import RunSets
from lightning_flatness.core.spectral import SpectralSummary
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS

__all__ = ["FIELDS", "RunSummary", "bracketed", "run_summary"]

#: entries of the histogram sample of the spectrum
HISTOGRAM_ENTRIES = 100_000
#: the trace functions in :class:`SpectralSummary` order (``max_eig`` apart)
FIELDS = tuple(TRACE_FUNCTIONS)


@dataclass
class RunSummary:
    """The jackknifed trace functions, their standard errors, the plain (uncorrected) ones and
    a sample of the spectrum's density."""

    corrected: SpectralSummary
    stderr: SpectralSummary
    plain: SpectralSummary
    eigenvalues: Tensor

    def estimate(self, decrement: tuple[float, float]) -> CurvatureEstimate:
        """The curvature estimate, with the Newton decrement and its standard error."""
        return CurvatureEstimate(
            summary=self.corrected,
            eigenvalues=self.eigenvalues[self.eigenvalues > 0],
            blocks={"stderr": self.stderr, "uncorrected": self.plain},
            tic_trace=math.nan,
            newton_decrement=decrement[0],
            newton_decrement_stderr=decrement[1],
        )


def run_summary(
    decomposition: LanczosDecomposition, sets: RunSets, probes: int, lam: float, traces: Tensor
) -> RunSummary:
    """The summary of finished runs ordered by run set, then probe (``sets.count · probes``
    runs, the whole kernel's first); ``traces`` is each probe group's exact ``Σ‖v‖²/m``."""
    values, width = _run_values(decomposition, sets.count, probes, lam)
    values[:, :, FIELDS.index("trace")] = sets.traces(traces)[:, None]
    largest, all_nodes, all_weights = 0.0, [], []
    for index in range(probes):  # the whole kernel's runs: its spectrum and top eigenvalue
        nodes, weights = gauss_quadrature(decomposition, index)
        largest = max(largest, float(nodes.max()) if nodes.numel() else 0.0)
        all_nodes.append(nodes)
        all_weights.append(weights * float(decomposition.norms[index]) ** 2 / probes)
    means = values.mean(1)
    plain = SpectralSummary(*means[0].tolist(), max_eig=largest)
    leave_outs = [
        SpectralSummary(*means[r].tolist(), max_eig=largest) for r in range(1, sets.count)
    ]
    corrected, spread = sets.jackknife(plain, leave_outs)
    _, half = _jackknifed_bracket(values, width, sets)
    stderr = _with_probe_noise(values, spread, sets, half)
    eigenvalues = density_sample(torch.cat(all_nodes), torch.cat(all_weights), HISTOGRAM_ENTRIES)
    return RunSummary(corrected, stderr, plain, eigenvalues)


def bracketed(
    sets: RunSets,
    probes: int,
    lam: float,
    tolerance: float,
    *,
    steps: int | None = None,
    loose: float = 1.0,
) -> Callable[[LanczosDecomposition], bool]:
    """The runs' stopping rule: the jackknifed soft rank's bracket is within ``tolerance`` of
    it (relative half-width), or, from ``steps`` steps on, within ``loose`` of it."""

    def stop(decomposition: LanczosDecomposition) -> bool:
        values, width = _run_values(decomposition, sets.count, probes, lam)
        value, half = _jackknifed_bracket(values, width, sets)
        taken = int(decomposition.lengths.max()) if decomposition.lengths.numel() else 0
        reached = tolerance if steps is None or taken < steps else max(tolerance, loose)
        return half <= reached * abs(value)

    return stop


def _run_values(
    decomposition: LanczosDecomposition, runs: int, probes: int, lam: float
) -> tuple[Tensor, Tensor]:
    """Each run's trace functions, ``(runs, probes, fields)``: the midpoint of its Gauss and
    Gauss–Radau rules; and each run's soft-rank bracket width (Gauss − Radau), ``(runs,
    probes)``."""
    values = torch.zeros(runs, probes, len(FIELDS), dtype=torch.float64)
    width = torch.zeros(runs, probes, dtype=torch.float64)
    soft_rank = FIELDS.index("soft_rank")
    for index in range(runs * probes):
        scale = float(decomposition.norms[index]) ** 2
        gauss = slq_values(*gauss_quadrature(decomposition, index), scale, lam, False)
        radau = slq_values(*radau_quadrature(decomposition, index), scale, lam, False)
        both = torch.tensor([[gauss[f], radau[f]] for f in FIELDS], dtype=torch.float64)
        values[index // probes, index % probes] = both.mean(1)
        width[index // probes, index % probes] = max(
            0.0, float(both[soft_rank, 0] - both[soft_rank, 1])
        )
    return values, width


def _jackknifed_bracket(values: Tensor, width: Tensor, sets: RunSets) -> tuple[float, float]:
    """The jackknifed soft rank of the runs' midpoints and the half-width of its bracket: the
    jackknife (:meth:`RunSets.combine`) of values each known to within ±width/2."""
    soft_rank = FIELDS.index("soft_rank")
    means, widths = values[:, :, soft_rank].mean(1), width.mean(1) / 2
    return float(sets.combine(means)), sets.half_width(widths)


def _with_probe_noise(
    values: Tensor, spread: SpectralSummary, sets: RunSets, quadrature: float = 0.0
) -> SpectralSummary:
    """The jackknife's spread over groups and the Hutchinson probes' standard error of the
    corrected value (per probe: the jackknife of its runs), added in quadrature; the soft
    rank's also with the half-width of its quadrature bracket."""
    probes = values.shape[1]
    per_probe = sets.combine(values)
    noise = per_probe.std(0) / math.sqrt(probes) if probes > 1 else torch.zeros(len(FIELDS))
    group_spread = torch.tensor([getattr(spread, f) for f in FIELDS], dtype=torch.float64)
    combined = group_spread.nan_to_num(0.0).square() + noise.square()
    combined[FIELDS.index("soft_rank")] += quadrature**2
    return SpectralSummary(*combined.sqrt().tolist(), max_eig=math.nan)
