"""The kernels the stored-row estimate's Hutchinson probes run on, and the jackknife that
combines their values (docs/math.md, "The probe kernel", stored and sketched rows).

A run set is one restriction of the kernel ``K = V Vᵀ / m``: the whole one; with G ≥ 2 probe
groups, each leave-one-probe-group-out kernel (that group's rows dropped, the rest times
G/(G − 1)); on rows sketched in S ≥ 2 groups
(:class:`~lightning_flatness.core.curvature.row_sketch.RowSketch`), each leave-one-sketch-group-
out kernel (that group's columns dropped, the rest times S/(S − 1)). The probes' bias and the
sketch's are independent, each falls like one over its group count, and the two delete-one
jackknifes' corrections add:

    θ_J = θ + (G − 1)(θ − mean θ₋g) + (S − 1)(θ − mean θ₋s),

with the families' spreads added in quadrature as the standard error. The sketch's jackknife
removes most of its bias, not all (docs/RESULTS.md, "Sketched rows").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_flatness.core.curvature.row_sketch import RowSketch
from lightning_flatness.core.jackknife import UNCORRECTED_FIELDS, jackknife
from lightning_flatness.core.spectral import SpectralSummary

__all__ = ["RunSets"]


@dataclass(frozen=True)
class RunSets:
    """The whole kernel, then each probe group's leave-out (with ``groups`` ≥ 2), then each
    sketch group's (with ``sketch_groups`` ≥ 2; 0: the rows are not sketched)."""

    groups: int
    sketch_groups: int = 0

    @property
    def probe_families(self) -> int:
        """The probe leave-outs' run sets."""
        return self.groups if self.groups >= 2 else 0

    @property
    def sketch_families(self) -> int:
        """The sketch leave-outs' run sets."""
        return self.sketch_groups if self.sketch_groups >= 2 else 0

    @property
    def count(self) -> int:
        """The run sets."""
        return 1 + self.probe_families + self.sketch_families

    def _families(self) -> list[tuple[slice, int]]:
        """Each family of leave-outs: its run sets and its number of groups."""
        probes = slice(1, 1 + self.probe_families)
        sketches = slice(probes.stop, probes.stop + self.sketch_families)
        return [
            (sets, size)
            for sets, size in ((probes, self.groups), (sketches, self.sketch_groups))
            if sets.stop > sets.start
        ]

    def kept_groups(self, device: torch.device | None = None) -> Tensor:
        """Which probe groups each run set keeps, ``(count, G)`` of 0/1 (float64)."""
        kept = torch.ones(self.count, self.groups, dtype=torch.float64, device=device)
        for group in range(self.probe_families):
            kept[1 + group, group] = 0.0
        return kept

    def scales(self, device: torch.device | None = None) -> Tensor:
        """Each run set's scale, ``(count,)``: G/(G − 1) or S/(S − 1) for a leave-out."""
        scales = torch.ones(self.count, dtype=torch.float64, device=device)
        for sets, size in self._families():
            scales[sets] = size / (size - 1)
        return scales

    def column_keep(self, sketch: RowSketch) -> Tensor:
        """Which sketched columns each run set keeps, ``(count, k)`` of 0/1 (float64)."""
        group_of = sketch.group_of_columns()
        keep = torch.ones(self.count, group_of.numel(), dtype=torch.float64, device=group_of.device)
        start = 1 + self.probe_families
        for group in range(self.sketch_families):
            keep[start + group] = (group_of != group).to(torch.float64)
        return keep

    def traces(self, group_traces: Tensor) -> Tensor:
        """Each run set's exact trace from each probe group's ``Σ‖v‖²/m``, ``(count,)``: a
        sketch's run set keeps the whole trace (the trace is of the rows, not the sketch)."""
        total = float(group_traces.sum())
        traces = torch.full((self.count,), total, dtype=torch.float64)
        for group in range(self.probe_families):
            kept = total - float(group_traces[group])
            traces[1 + group] = kept * self.groups / (self.groups - 1)
        return traces

    def combine(self, values: Tensor) -> Tensor:
        """The corrected value (module docstring) of per-run-set ``values`` (run sets first)."""
        combined = values[0].clone()
        for sets, size in self._families():
            combined += (size - 1) * (values[0] - values[sets].mean(0))
        return combined

    def half_width(self, widths: Tensor) -> float:
        """The half-width of the corrected value's bracket from each run set's ``widths``
        (half-widths, ``(count,)``): every term's weight in absolute value."""
        families = self._families()
        half = (1 + sum(size - 1 for _, size in families)) * float(widths[0])
        for sets, size in families:
            half += (size - 1) * float(widths[sets].mean())
        return half

    def jackknife(
        self, plain: SpectralSummary, leave_outs: list[SpectralSummary]
    ) -> tuple[SpectralSummary, SpectralSummary]:
        """The corrected summary and its standard errors (module docstring); ``leave_outs``
        are the run sets after the whole one, in order. The trace and the largest eigenvalue
        are left as they are."""
        families = self._families()
        if not families:
            return jackknife(plain, [])
        fields = list(SpectralSummary.__dataclass_fields__)
        rows = [plain, *leave_outs]
        values = torch.tensor([[getattr(s, f) for f in fields] for s in rows], dtype=torch.float64)
        corrected = self.combine(values)
        for field in UNCORRECTED_FIELDS:
            corrected[fields.index(field)] = getattr(plain, field)
        variance = torch.zeros(len(fields), dtype=torch.float64)
        for sets, _ in families:
            spread = jackknife(plain, leave_outs[sets.start - 1 : sets.stop - 1])[1]
            variance += _spread(spread, fields) ** 2
        return SpectralSummary(*corrected.tolist()), SpectralSummary(*variance.sqrt().tolist())


def _spread(spread: SpectralSummary, fields: list[str]) -> Tensor:
    """A summary's standard errors as a tensor, NaN as 0."""
    return torch.tensor([getattr(spread, f) for f in fields], dtype=torch.float64).nan_to_num(0.0)
