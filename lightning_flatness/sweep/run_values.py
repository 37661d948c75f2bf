"""Values read off a sweep's finished runs: the latest record of each run, the structures
measured, one measure of one structure in one run, and the run's measured gap."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_flatness.sweep.config import SWEEP_STRUCTURES

__all__ = ["latest_records", "measure_value", "measured_gap", "structures_of"]


def latest_records(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The last record of each run key, in order of first appearance, ``status="ok"`` only."""
    latest: dict[str, Mapping[str, Any]] = {}
    for record in records:
        if "key" in record:
            latest.pop(record["key"], None)  # keep first-appearance order of the survivors
            latest[record["key"]] = record
    return [dict(r) for r in latest.values() if r.get("status") == "ok"]


def structures_of(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The structures measured in any of ``records``, in the sweep's order."""
    present = {s for r in records for s in r.get("measures", {})}
    return [s for s in SWEEP_STRUCTURES if s in present]


def measure_value(record: Mapping[str, Any], structure: str, measure: str, scaled: bool) -> float:
    """``measure`` of ``structure`` in ``record`` (÷ n where ``scaled``); NaN where missing,
    and for a headline recorded before it read the held-out ratio."""
    values = record.get("measures", {}).get(structure, {})
    value = values.get(measure)
    if measure == "predicted_gap" and "predicted_gap_train" not in values:
        return math.nan  # recorded before the headline changed: Eq. 13, training ratio
    if value is None:
        return math.nan
    return float(value) / float(record["n"]) if scaled else float(value)


def measured_gap(record: Mapping[str, Any]) -> float:
    """The run's measured gap (test − training loss); NaN where it has none."""
    return math.nan if record.get("gap") is None else float(record["gap"])
