"""The fill-in's calibration: the ratio exact ÷ fill-in soft rank that scales the cheap
structure between exact-quality measurements (:class:`Calibration`, where it was taken and when
it is to be taken again), and the record a fill-in logs with it (:func:`fill_in_record`: scaled,
and never above its rank bound). The budget decides when a calibration runs
(:mod:`~lightning_flatness.lightning.budget`); this module has no Lightning import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_flatness.core.predicted_gap import headline_gap, predicted_test_nll
from lightning_flatness.lightning.budget import FILL_IN

__all__ = ["Calibration", "RECALIBRATE_DRIFT", "SCALED_FIELDS", "fill_in_record"]

#: the fill-in's own soft rank moved by more than this factor since its calibration (either
#: way): the ratio is taken again where that leaves a fill-in for every epoch still to come
#: (:meth:`OverheadBudget.affords_recalibration`). On the ladder's ResNet at c = 2.5 the ratio
#: exact ÷ fill-in falls by a third over the first epochs of a fit while the fill-in falls by
#: 25–35%; at c = 25 the fill-in grows by 60% with its ratio unchanged: a drift is a reason to
#: look again, not a measure of the ratio's (docs/RESULTS.md, "The fill-in's ratio taken again
#: where it drifts")
RECALIBRATE_DRIFT = 1.5
#: the record fields proportional to the soft rank (scaled in a fill-in record; the headline
#: ``predicted_gap`` and ``predicted_test_nll`` are computed again from the scaled soft rank)
SCALED_FIELDS = ("soft_rank", "soft_rank_stderr", "predicted_gap_train", "predicted_gap_val")


def fill_in_record(
    record: dict[str, float], calibration: float, rank_bound: float | None = None
) -> dict[str, float]:
    """A fill-in measurement's record: the soft rank and the Eq. 13 gaps (linear in it) times
    ``calibration``, the ratio exact ÷ fill-in of the last exact measurement; before the first
    one (``calibration`` NaN) the fill-in's own values, unscaled. The soft rank is then capped
    at its rank bound, the gaps with it: ``rank_bound`` (that of the measurement whose soft
    rank the calibrated value stands for), else the record's own (the largest rank the Fisher
    of the fill-in's samples can have). The headline ``predicted_gap`` and
    ``predicted_test_nll`` follow from the scaled soft rank
    (:func:`~lightning_flatness.core.predicted_gap.headline_gap`). Marked ``fill_in = 1``; its
    ``trusted`` is the fill-in structure's own (0: it is not of exact quality)."""
    scaled = dict(record)
    factor = calibration if math.isfinite(calibration) else 1.0
    bound = scaled.get("rank_bound", math.inf) if rank_bound is None else rank_bound
    soft_rank = scaled.get("soft_rank", math.nan) * factor
    if math.isfinite(soft_rank) and soft_rank > bound > 0:
        factor *= bound / soft_rank
    for name in SCALED_FIELDS:
        if name in scaled:
            scaled[name] = scaled[name] * factor
    if "predicted_gap" in scaled:
        scaled["predicted_gap"] = headline_gap(
            scaled.get("trace_ratio_val", math.nan),
            scaled.get("trace_ratio_train", math.nan),
            scaled.get("soft_rank", math.nan),
            scaled.get("num_train_samples", math.nan),
        )
        scaled["predicted_test_nll"] = predicted_test_nll(
            scaled.get("train_nll", math.nan), scaled["predicted_gap"]
        )
    scaled.update(fill_in=1.0, calibration=calibration)
    if math.isfinite(bound):
        scaled["rank_bound"] = bound
    return scaled


@dataclass
class Calibration:
    """The ratio exact ÷ fill-in soft rank that scales the fill-in, and where it was taken: at
    an exact measurement of the whole measured set (``samples`` None), or, before any, the
    exact structure on the fill-in's own ``samples``, extrapolated to the ``target_samples`` of
    the whole set from its first half's value
    (:func:`~lightning_flatness.core.sample_growth.extrapolated_soft_rank`: the soft rank grows
    with the samples measured)."""

    ratio: float = math.nan
    epoch: float = math.nan
    samples: int | None = None
    #: the rank bound of the measurement the ratio stands for (caps the scaled values)
    rank_bound: float | None = None
    #: the samples the subset's soft rank was extrapolated to (None: not extrapolated)
    target_samples: int | None = None
    #: the fill-in's own (unscaled) soft rank when the ratio was taken
    fill_in: float = math.nan

    def drifted(self, fill_in: float) -> bool:
        """Whether the fill-in's own soft rank has moved by more than a factor
        :data:`RECALIBRATE_DRIFT` (either way) since the ratio was taken: its ratio to the
        exact value is then no longer to be relied on."""
        if not (math.isfinite(fill_in) and math.isfinite(self.fill_in)):
            return False
        if fill_in <= 0 or self.fill_in <= 0:
            return False
        return max(fill_in / self.fill_in, self.fill_in / fill_in) > RECALIBRATE_DRIFT

    def describe(self) -> str:
        """How a fill-in value is made, for the per-epoch line and the summary."""
        if not math.isfinite(self.ratio):
            return f"{FILL_IN}, unscaled: an upper estimate"
        where = f"at epoch {int(self.epoch)}"
        if self.samples is not None:
            where = f"at epoch {int(self.epoch)}, exact on {self.samples:,} samples"
            if self.target_samples is not None and self.target_samples > self.samples:
                where += f", extrapolated to {self.target_samples:,}"
        return f"{FILL_IN} × {self.ratio:.3g}, the exact ÷ {FILL_IN} ratio {where}"
