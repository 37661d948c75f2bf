"""The sweep report: Kendall τ of every measure with the measured gap, tables and scatter plots.

Written into the sweep's folder by :func:`write_report`:

- ``report.md``: first the headline's τ (``predicted_gap``, the value users compare) with a
  bootstrap 90% interval, beside soft rank ÷ n, Eq. 13 with the training trace ratio and the
  paper's 0.84; then τ per measure (rows) and structure (columns) as in Table 4 of "Flatness
  After All?", each measure as is and divided by ``n`` (the gap scales as ``rank_λ(F)/n``,
  Eq. 13, so across training-set sizes the ratio is the comparable quantity); the paper's
  numbers next to ours; each structure's soft rank against the exact one and its headline
  predicted gap against the measured gap (:mod:`lightning_flatness.sweep.accuracy`), split by
  the trust diagnostic; run costs; failed runs;
- ``kendall.json``: the same numbers, machine-readable;
- ``scatter_<structure>.png``: predicted vs measured gap per structure, one panel per estimator
  (the headline, regularized TIC, Thomas et al., Eq. 13 with the training trace ratio), like
  the paper's Figure 1; ``scatter_overview.png``: Thomas et al. and the headline with the
  diagonal, KFAC and exact Fisher side by side, like its Figure 3.

Only the latest record of each run key counts, and only runs with ``status="ok"``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_flatness.sweep.accuracy import accuracy_rows, accuracy_table, trust_rows, trust_table
from lightning_flatness.sweep.config import EXACT, MONITOR_DEFAULT
from lightning_flatness.sweep.headline import headline_rows, headline_table
from lightning_flatness.sweep.kendall import format_tau, kendall_tau_b
from lightning_flatness.sweep.records import INVOCATIONS_FILE, RESULTS_FILE, json_safe, read_records
from lightning_flatness.sweep.run_values import (
    latest_records,
    measure_value,
    measured_gap,
    structures_of,
)

__all__ = [
    "MEASURES",
    "PAPER_TABLE4",
    "kendall_rows",
    "null_standard_deviation",
    "write_report",
]

#: ``(field of FlatnessReport, label, also divided by n)``. The gap estimators already carry 1/n.
MEASURES: tuple[tuple[str, str, bool], ...] = (
    ("predicted_gap", "predicted gap (headline)", False),
    ("soft_rank", "rank_λ(F)", True),
    ("logdet", "½ log det(F/λ + I)", True),
    ("soft_rank2", "rank⁽²⁾_λ(F)", True),
    ("trace_fisher", "Tr(F)", True),
    ("max_eig", "‖F‖₂", True),
    ("predicted_gap_train", "Eq. 13, training Tr(C)/Tr(F)", False),
    ("predicted_gap_val", "Eq. 13, held-out Tr(C)/Tr(F)", False),
    ("thomas_gap", "Thomas et al. (1/n)·Tr(C)/Tr(F)", False),
    ("tic", "TIC (1/n)·Tr(C(F+λI)⁻¹)", False),
)

#: Table 4 of the paper: ``(measure, structure, τ)``; "exact" is the full Fisher.
PAPER_TABLE4: tuple[tuple[str, str, float], ...] = (
    ("soft_rank", EXACT, 0.84),
    ("logdet", EXACT, 0.82),
    ("soft_rank", "kfac", 0.78),
    ("logdet", "kfac", 0.76),
    ("logdet", "diag", 0.72),
    ("soft_rank", "diag", 0.68),
    ("trace_fisher", EXACT, 0.28),
    ("max_eig", EXACT, 0.08),
)

_LABELS = dict((key, label) for key, label, _ in MEASURES)
_NAN = float("nan")


def kendall_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Kendall τ-b of every measure (as is and ÷ n) per structure with the measured gap.

    Args:
        records: Finished runs (``status="ok"``).

    Returns:
        One row per measure variant: ``{"measure", "scaled", "label", "tau": {structure: τ},
        "count": {structure: runs used}}``; a structure whose measure is NaN in every run gets
        τ = NaN.
    """
    structures = structures_of(records)
    gaps = [measured_gap(r) for r in records]
    rows = []
    for measure, label, divisible in MEASURES:
        for scaled in (False, True) if divisible else (False,):
            row: dict[str, Any] = {
                "measure": measure,
                "scaled": scaled,
                "label": f"{label} / n" if scaled else label,
                "tau": {},
                "count": {},
            }
            for structure in structures:
                values = [measure_value(r, structure, measure, scaled) for r in records]
                tau, count = kendall_tau_b(values, gaps)
                row["tau"][structure], row["count"][structure] = tau, count
            rows.append(row)
    return rows


def _paper_soft_rank() -> float:
    """The paper's τ for the exact soft rank (Table 4), the number the headline is set beside."""
    return next(tau for m, structure, tau in PAPER_TABLE4 if (m, structure) == ("soft_rank", EXACT))


def _reference_structure(structures: Sequence[str]) -> str | None:
    """The column standing for the paper's full Fisher: exact, dense, gram or lanczos."""
    return next((s for s in (EXACT, "dense", "gram", "lanczos") if s in structures), None)


def _column_label(structure: str, records: Sequence[Mapping[str, Any]]) -> str:
    if structure != EXACT:
        return structure
    used = sorted({r.get("exact_structure") for r in records if EXACT in r.get("measures", {})})
    return f"exact ({'/'.join(u for u in used if u)})"


def _tau_table(rows: Sequence[Mapping[str, Any]], structures: Sequence[str], records) -> str:
    total = len(records)
    header = ["measure", *(_column_label(s, records) for s in structures)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = []
        for structure in structures:
            tau, count = row["tau"][structure], row["count"][structure]
            cell = format_tau(tau)
            if not math.isnan(tau) and count < total:
                cell += f" ({count})"
            cells.append(cell)
        lines.append("| " + " | ".join([row["label"], *cells]) + " |")
    return "\n".join(lines)


def _paper_table(rows: Sequence[Mapping[str, Any]], structures: Sequence[str]) -> str:
    reference = _reference_structure(structures)
    lookup = {(r["measure"], r["scaled"]): r["tau"] for r in rows}
    lines = [
        "| measure (paper's Table 4) | structure | paper τ | τ here | τ here, ÷ n |",
        "|---|---|---|---|---|",
    ]
    for measure, structure, paper in PAPER_TABLE4:
        column = reference if structure == EXACT else structure
        as_is = lookup[(measure, False)].get(column, _NAN) if column else _NAN
        scaled = lookup[(measure, True)].get(column, _NAN) if column else _NAN
        lines.append(
            f"| {_LABELS[measure]} | {column or structure} | {paper:.2f} | {format_tau(as_is)} | "
            f"{format_tau(scaled)} |"
        )
    return "\n".join(lines)


def _distinct(records: Sequence[Mapping[str, Any]], field: str) -> str:
    values = sorted({r[field] for r in records if r.get(field) is not None})
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _cost_table(records: Sequence[Mapping[str, Any]], structures: Sequence[str]) -> str:
    def stats(values: list[float]) -> str:
        values = [v for v in values if v is not None and math.isfinite(v)]
        if not values:
            return "— | —"
        return f"{statistics.median(values):.1f} | {max(values):.1f}"

    lines = ["| part | median s | max s |", "|---|---|---|"]
    lines.append(f"| whole run | {stats([r.get('seconds') for r in records])} |")
    lines.append(f"| training | {stats([r.get('train_seconds') for r in records])} |")
    for structure in structures:
        seconds = [
            r["measures"][structure].get("seconds")
            for r in records
            if structure in r.get("measures", {})
        ]
        lines.append(f"| measure, {structure} | {stats(seconds)} |")
    return "\n".join(lines)


def null_standard_deviation(count: int) -> float:
    """Standard deviation of Kendall's τ between two independent variables over ``count`` runs.

    ``√(2(2N+5) / (9N(N−1)))`` (Kendall, 1938); NaN for fewer than two runs.
    """
    if count < 2:
        return _NAN
    return math.sqrt(2 * (2 * count + 5) / (9 * count * (count - 1)))


def _noise_note(count: int) -> str:
    sd = null_standard_deviation(count)
    if math.isnan(sd):
        return "Too few runs for a correlation."
    return (
        f"With {count} runs, τ between two unrelated variables has a standard deviation of "
        f"{sd:.2f} (Kendall, 1938): a rough scale of the sampling noise in each cell."
    )


def _category_key(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The first grid parameter with string values (e.g. the architecture), for markers."""
    for path in records[0].get("params", {}) if records else ():
        if all(isinstance(r.get("params", {}).get(path), str) for r in records):
            return path
    return None


_PANELS = (
    ("predicted_gap", "predicted gap (headline)"),
    ("tic", "regularized TIC (training)"),
    ("thomas_gap", "Thomas et al., Eq. 11 (training)"),
    ("predicted_gap_train", "Eq. 13, training trace ratio"),
)
_MARKERS = "osD^vP*X<>"


def _scatter(
    records: Sequence[Mapping[str, Any]],
    panels: Sequence[tuple[str, str, str]],
    path: Path,
    title: str,
) -> bool:
    """Log-log scatter of predicted (``(structure, measure, title)`` per panel) vs measured gap."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D

    panels = [
        p
        for p in panels
        if any(math.isfinite(measure_value(r, p[0], p[1], False)) for r in records)
    ]
    if not panels:
        return False
    sizes = sorted({r["n"] for r in records})
    colors = {n: plt.get_cmap("viridis")(i / max(1, len(sizes) - 1)) for i, n in enumerate(sizes)}
    category = _category_key(records)
    kinds = sorted({r["params"][category] for r in records}) if category else [None]
    markers = {kind: _MARKERS[i % len(_MARKERS)] for i, kind in enumerate(kinds)}
    figure, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels), 4.2), dpi=110, squeeze=False
    )
    for axis, (structure, measure, panel_title) in zip(axes[0], panels, strict=True):
        shown = hidden = 0
        lows, highs = [], []
        for record in records:
            x, y = measured_gap(record), measure_value(record, structure, measure, False)
            if not (math.isfinite(x) and math.isfinite(y) and x > 0 and y > 0):
                hidden += 1
                continue
            kind = record["params"][category] if category else None
            axis.scatter(x, y, color=colors[record["n"]], marker=markers[kind], s=28, alpha=0.85)
            lows.append(min(x, y))
            highs.append(max(x, y))
            shown += 1
        if lows:
            low, high = min(lows) / 1.5, max(highs) * 1.5
            axis.plot([low, high], [low, high], "k--", linewidth=0.8)
            axis.set_xlim(low, high)
            axis.set_ylim(low, high)
        axis.set_xscale("log")
        axis.set_yscale("log")
        tau, _ = kendall_tau_b(
            [measure_value(r, structure, measure, False) for r in records],
            [measured_gap(r) for r in records],
        )
        axis.set_title(f"{panel_title}\nτ = {format_tau(tau)}", fontsize=9)
        axis.set_xlabel("measured gap (test − training loss)")
        axis.set_ylabel("predicted gap")
        axis.grid(alpha=0.3, which="both")
        if hidden:
            axis.text(
                0.02,
                0.97,
                f"{hidden} run(s) ≤ 0 not shown",
                transform=axis.transAxes,
                fontsize=7,
                va="top",
            )
    handles = [
        Line2D([], [], color=colors[n], marker="o", linestyle="", label=f"n = {n}") for n in sizes
    ]
    if category:
        handles += [
            Line2D([], [], color="grey", marker=markers[k], linestyle="", label=str(k))
            for k in kinds
        ]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="lower right")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def _scatter_plots(records: Sequence[Mapping[str, Any]], out: Path) -> list[str]:
    structures = structures_of(records)
    written = []
    for structure in structures:
        name = f"scatter_{structure}.png"
        panels = [(structure, measure, title) for measure, title in _PANELS]
        label = _column_label(structure, records)
        if _scatter(records, panels, out / name, f"Predicted vs measured gap, F: {label}"):
            written.append(name)
    overview = []
    if structures:
        overview.append((structures[0], "thomas_gap", "Thomas et al., Eq. 11"))
    reference = _reference_structure(structures)
    for structure in ("diag", "kfac", reference):
        if structure in structures:
            title = f"predicted gap, {_column_label(structure, records)}"
            overview.append((structure, "predicted_gap", title))
    if _scatter(records, overview, out / "scatter_overview.png", "Cheap gap estimates"):
        written.append("scatter_overview.png")
    return written


def _invocations(out: Path) -> list[dict[str, Any]]:
    return read_records(out / INVOCATIONS_FILE)


def write_report(output_dir: str | Path) -> Path:
    """Compute Kendall τ for a sweep's folder and write ``report.md``, ``kendall.json``, PNGs.

    Args:
        output_dir: The sweep's folder (holding ``runs.jsonl``).

    Returns:
        The path of ``report.md``.

    Raises:
        FileNotFoundError: If the folder has no ``runs.jsonl``.
    """
    out = Path(output_dir)
    if not (out / RESULTS_FILE).exists():
        raise FileNotFoundError(f"No {RESULTS_FILE} in {out}; run the sweep first.")
    all_records = read_records(out / RESULTS_FILE)
    records = latest_records(all_records)
    ok_keys = {r["key"] for r in records}
    failed = {r["key"]: r for r in all_records if r.get("status") == "failed"}
    failed = [r for key, r in failed.items() if key not in ok_keys]
    structures = structures_of(records)
    rows = kendall_rows(records)
    headline = headline_rows(records)
    figures = _scatter_plots(records, out) if records else []
    invocations = _invocations(out)

    lines = ["# Sweep report", ""]
    lines.append(
        f"{len(records)} finished runs, {len(failed)} failed. Training-set sizes n: "
        f"{_distinct(records, 'n')}; c = λ·n: {_distinct(records, 'c')}."
    )
    lines += [
        "",
        "Measured gap: test loss − training loss (plain cross-entropy of the final model in eval "
        "mode, over the whole training set and the test half of the held-out set). Every measure "
        "comes from the whole training set; the headline and the Eq. 13 row with the held-out "
        "ratio also read the validation half of the held-out set, never the test half. Tr(F) "
        "and the Thomas et al. estimate come from per-sample statistics, not from the "
        "structure's approximation. A number in parentheses is the count of runs used where "
        "some runs had no value.",
        "",
        _noise_note(len(records)),
        "",
        "## The headline: does it order the runs as their gaps?",
        "",
        "Kendall τ between each predictor and the measured gap over the runs, with a bootstrap "
        "90% interval (the runs resampled 1,000 times).",
        "",
        headline_table(headline, _paper_soft_rank()) if headline else "(no finished runs)",
        "",
        "## Kendall τ with the measured gap",
        "",
        _tau_table(rows, structures, records) if structures else "(no finished runs)",
        "",
        "## Compared with the paper (Table 4)",
        "",
        _paper_table(rows, structures) if structures else "(no finished runs)",
        "",
    ]
    accuracy = accuracy_rows(records, structures)
    if records:
        lines += [
            "## Accuracy: soft rank against the exact one, Eq. 13 against the measured gap",
            "",
            "Soft rank ÷ the exact full-training-set soft rank of the same run, and the headline "
            "predicted gap ÷ the measured gap; a run with a measured gap ≤ 0 counts as outside "
            "2×.",
            "",
            accuracy_table(accuracy),
            "",
            "## Trust diagnostic",
            "",
            "Calibration of the headline among the runs whose training error/uncertainty ratio "
            "α_train is at or above a threshold (trusted) and below it (untrusted).",
            "",
        ]
        kfacs = (EXACT, MONITOR_DEFAULT, "kfac", "kfac_sampled", "kfac_probe")
        for structure in [s for s in kfacs if s in structures]:
            lines += [f"{structure}:", "", trust_table(trust_rows(records, structure)), ""]
    if figures:
        lines += ["## Predicted vs measured gap", ""]
        lines += [f"![{name}]({name})" for name in figures] + [""]
    if records:
        lines += ["## Cost", "", _cost_table(records, structures), ""]
    if invocations:
        lines += [
            "## Invocations",
            "",
            "| started | wall s | finished | failed | skipped | workers |",
        ]
        lines.append("|---|---|---|---|---|---|")
        for s in invocations:
            lines.append(
                f"| {s.get('started')} | {s.get('wall_seconds') or 0:.0f} | {s.get('finished')} | "
                f"{s.get('failed')} | {s.get('skipped')} | {s.get('workers')} |"
            )
        lines.append("")
    if failed:
        lines += ["## Failed runs", "", "| run | error |", "|---|---|"]
        for record in failed:
            error = str(record.get("error", "")).splitlines()[0][:200].replace("|", "\\|")
            lines.append(f"| {record.get('label') or record['key']} | {error} |")
        lines.append("")
    errors = {
        (s, e.splitlines()[0][:200])
        for r in records
        for s, e in (r.get("structure_errors") or {}).items()
    }
    if errors:
        lines += ["## Structures that failed in some runs", ""]
        lines += [f"- {s}: {e}" for s, e in sorted(errors)] + [""]

    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    payload = {
        "runs": len(records),
        "failed": len(failed),
        "structures": structures,
        "headline": headline,
        "rows": rows,
        "accuracy": accuracy,
        "paper_table4": [{"measure": m, "structure": s, "tau": t} for m, s, t in PAPER_TABLE4],
        "figures": figures,
    }
    (out / "kendall.json").write_text(
        json.dumps(json_safe(payload), indent=2, allow_nan=False), encoding="utf-8"
    )
    return report
