"""The sweep report's first section: does the headline ``predicted_gap`` order the runs as their
measured gaps? Kendall τ with a bootstrap 90% interval, beside the two predictors from training
data alone (soft rank ÷ n and Eq. 13 with the training trace ratio) and the paper's τ."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_flatness.sweep.config import EXACT, MONITOR_DEFAULT
from lightning_flatness.sweep.kendall import bootstrap_interval, format_tau, kendall_tau_b
from lightning_flatness.sweep.run_values import measure_value, measured_gap, structures_of

__all__ = ["HEADLINE", "headline_rows", "headline_table"]

#: the headline's section: ``(field, scaled by 1/n, label)``, the headline first, then the two
#: predictors from training data alone it is set against
HEADLINE: tuple[tuple[str, bool, str], ...] = (
    ("predicted_gap", False, "predicted gap (headline: held-out ratio × rank/(n + rank))"),
    ("soft_rank", True, "soft rank ÷ n (training data only)"),
    ("predicted_gap_train", False, "Eq. 13, training trace ratio (training data only)"),
)


def _headline_structure(structures: Sequence[str]) -> str | None:
    """The column the headline is read from: the monitor's default, else the exact Fisher,
    else the first structure measured."""
    preferred = [s for s in (MONITOR_DEFAULT, EXACT) if s in structures]
    return next(iter(preferred or structures), None)


def headline_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """τ of the headline and of the two training-data-only predictors with the measured gap,
    each with a bootstrap 90% interval
    (:func:`~lightning_flatness.sweep.kendall.bootstrap_interval`), read off the monitor's
    default structure (else the exact one, else the first measured).

    Returns:
        One row per entry of :data:`HEADLINE`: ``{"measure", "label", "structure", "tau",
        "low", "high", "count"}``; empty without a structure to read.
    """
    structure = _headline_structure(structures_of(records))
    if structure is None:
        return []
    gaps = [measured_gap(r) for r in records]
    rows = []
    for measure, scaled, label in HEADLINE:
        values = [measure_value(r, structure, measure, scaled) for r in records]
        tau, count = kendall_tau_b(values, gaps)
        low, high = bootstrap_interval(values, gaps)
        rows.append(
            dict(measure=measure, label=label, structure=structure, tau=tau, low=low, high=high,
                 count=count)
        )  # fmt: skip
    return rows


def headline_table(rows: Sequence[Mapping[str, Any]], paper: float) -> str:
    """The rows of :func:`headline_rows` as a markdown table, ending with the paper's τ of the
    exact soft rank (``paper``)."""
    lines = ["| predictor | structure | τ | 90% interval | runs |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['label']} | {row['structure']} | {format_tau(row['tau'])} | "
            f"{format_tau(row['low'])} to {format_tau(row['high'])} | {row['count']} |"
        )
    lines.append(f"| the paper's Table 4: rank_λ(F), exact | exact | {paper:+.2f} | | |")
    return "\n".join(lines)
