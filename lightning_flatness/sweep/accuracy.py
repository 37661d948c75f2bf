"""How close each structure is to the exact soft rank, and how close Eq. 13 is to the measured gap.

Per structure, over the finished runs of a sweep:

- ``soft rank ÷ exact``: its soft rank divided by the exact full-training-set soft rank of the
  same run (``exact``: the dense or Gram Fisher of every training sample), median and the
  10th–90th percentile range;
- ``predicted ÷ measured gap``: the headline predicted gap (``predicted_gap``: the held-out
  trace ratio times ``rank_λ(F)/(n + rank_λ(F))``) divided by the measured gap (test −
  training loss), median and the share of runs within a factor 2 (``0.5 ≤ ratio ≤ 2``); a run
  whose measured gap is ≤ 0 counts as outside;
- Kendall τ of the headline with the measured gap, and the median measurement time.

:func:`trust_rows` splits the same calibration by the trust diagnostic
(:mod:`lightning_flatness.core.trust`), which is how its threshold was chosen.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_flatness.core.trust import TRUST_THRESHOLD
from lightning_flatness.sweep.config import EXACT
from lightning_flatness.sweep.kendall import kendall_tau_b

__all__ = [
    "accuracy_rows",
    "accuracy_table",
    "gap_ratio",
    "percentile",
    "trust_rows",
    "trust_table",
]

#: the factor within which a predicted gap counts as calibrated
WITHIN = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 ≤ q ≤ 1) by linear interpolation; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def _measure(record: Mapping[str, Any], structure: str, field: str) -> float:
    value = record.get("measures", {}).get(structure, {}).get(field)
    return math.nan if value is None else float(value)


def gap_ratio(record: Mapping[str, Any], structure: str) -> float:
    """The headline predicted gap ÷ measured gap; NaN without a positive measured gap."""
    gap = record.get("gap")
    if gap is None or not float(gap) > 0:
        return math.nan
    return _measure(record, structure, "predicted_gap") / float(gap)


def _within(ratios: Sequence[float]) -> float:
    """Share of runs whose ratio is within :data:`WITHIN` (NaN counts as outside)."""
    if not ratios:
        return math.nan
    inside = sum(1 for r in ratios if math.isfinite(r) and 1 / WITHIN <= r <= WITHIN)
    return inside / len(ratios)


def accuracy_rows(
    records: Sequence[Mapping[str, Any]], structures: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per structure (module docstring); ``runs`` is the count of runs measured."""
    rows = []
    for structure in structures:
        measured = [r for r in records if structure in r.get("measures", {})]
        to_exact = [
            _measure(r, structure, "soft_rank") / _measure(r, EXACT, "soft_rank")
            for r in measured
            if EXACT in r.get("measures", {})
        ]
        to_exact = [v for v in to_exact if math.isfinite(v)]
        ratios = [gap_ratio(r, structure) for r in measured]
        finite = [v for v in ratios if math.isfinite(v)]
        tau, _ = kendall_tau_b(
            [_measure(r, structure, "predicted_gap") for r in measured],
            [math.nan if r.get("gap") is None else float(r["gap"]) for r in measured],
        )
        seconds = [_measure(r, structure, "seconds") for r in measured]
        seconds = [s for s in seconds if math.isfinite(s)]
        rows.append(
            {
                "structure": structure,
                "runs": len(measured),
                "soft_rank_to_exact_median": percentile(to_exact, 0.5),
                "soft_rank_to_exact_p10": percentile(to_exact, 0.1),
                "soft_rank_to_exact_p90": percentile(to_exact, 0.9),
                "gap_ratio_median": percentile(finite, 0.5),
                "gap_within_2x": _within(ratios),
                "tau_predicted_gap": tau,
                "seconds_median": statistics.median(seconds) if seconds else math.nan,
            }
        )
    return rows


def _number(value: float, spec: str) -> str:
    return "—" if value is None or not math.isfinite(value) else format(value, spec)


def accuracy_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows of :func:`accuracy_rows` as a markdown table."""
    lines = [
        "| structure | runs | soft rank ÷ exact, median [p10, p90] | predicted ÷ measured gap, "
        "median | runs within 2× | τ (headline) | s / measurement |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        spread = (
            f"{_number(row['soft_rank_to_exact_median'], '.2f')} "
            f"[{_number(row['soft_rank_to_exact_p10'], '.2f')}, "
            f"{_number(row['soft_rank_to_exact_p90'], '.2f')}]"
        )
        lines.append(
            f"| {row['structure']} | {row['runs']} | {spread} | "
            f"{_number(row['gap_ratio_median'], '.2f')} | "
            f"{_number(100 * row['gap_within_2x'], '.0f')}% | "
            f"{_number(row['tau_predicted_gap'], '+.2f')} | "
            f"{_number(row['seconds_median'], '.2f')} |"
        )
    return "\n".join(lines)


def trust_rows(
    records: Sequence[Mapping[str, Any]],
    structure: str,
    thresholds: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7),
) -> list[dict[str, Any]]:
    """Calibration of ``structure``'s headline predicted gap among the runs whose trust score
    (the training error/uncertainty ratio) is at or above each threshold, and among those below
    it."""
    scored = [
        (_measure(r, structure, "error_uncertainty_train"), gap_ratio(r, structure))
        for r in records
        if structure in r.get("measures", {})
    ]
    scored = [(score, ratio) for score, ratio in scored if math.isfinite(score)]
    rows = []
    for threshold in sorted({*thresholds, TRUST_THRESHOLD}):
        above = [ratio for score, ratio in scored if score >= threshold]
        below = [ratio for score, ratio in scored if score < threshold]
        rows.append(
            {
                "threshold": threshold,
                "runs_trusted": len(above),
                "trusted_within_2x": _within(above),
                "trusted_median": percentile([r for r in above if math.isfinite(r)], 0.5),
                "runs_untrusted": len(below),
                "untrusted_within_2x": _within(below),
                "untrusted_median": percentile([r for r in below if math.isfinite(r)], 0.5),
            }
        )
    return rows


def trust_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows of :func:`trust_rows` as a markdown table (the package's threshold marked)."""
    lines = [
        "| threshold on α_train | trusted runs | within 2× | median ratio | untrusted runs | "
        "within 2× | median ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        mark = " (default)" if row["threshold"] == TRUST_THRESHOLD else ""
        lines.append(
            f"| {row['threshold']:g}{mark} | {row['runs_trusted']} | "
            f"{_number(100 * row['trusted_within_2x'], '.0f')}% | "
            f"{_number(row['trusted_median'], '.2f')} | {row['runs_untrusted']} | "
            f"{_number(100 * row['untrusted_within_2x'], '.0f')}% | "
            f"{_number(row['untrusted_median'], '.2f')} |"
        )
    return "\n".join(lines)
