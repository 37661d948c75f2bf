"""Pictures and tables of flatness reports: TensorBoard spectrum histogram, gap figure, summary."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_flatness.core.trust import (
    DECREMENT_LIMIT,
    EXACT_QUALITY,
    RATIO_DISAGREEMENT_LIMIT,
    SETTLED_DROP,
    TRUST_THRESHOLD,
    TRUSTED_WITHIN_2X,
    above_rank_bound,
)

__all__ = [
    "STRUCTURE_KINDS",
    "describe_structure",
    "gap_figure",
    "headline_source",
    "log10_spectrum",
    "summary_table",
]


def log10_spectrum(eigenvalues: Tensor, floor: float = 1e-30) -> Tensor:
    """``log10`` of the positive eigenvalues (zeros carry no information on a log axis)."""
    values = eigenvalues.detach().to(torch.float64).reshape(-1)
    return torch.log10(values[values > floor])


#: what each structure's soft rank is, relative to the exact one (summary table, figure title)
STRUCTURE_KINDS = {
    "dense": "exact",
    "gram": "exact",
    "probe_kernel": "whole Fisher from probes, jackknifed ± stderr",
    "cg": "exact F, Hutchinson with conjugate gradients ± stderr; soft rank only",
    "lanczos": "exact F, stochastic ± stderr; under-counts at small budgets",
    "kfac": "Kronecker approximation, usually above exact",
    "diag": "upper estimate: diagonal, Prop. 6.1",
    "diag_mc": "sampled-label diagonal",
    "hutchinson": "upper estimate: estimated diagonal ± stderr",
}


def describe_structure(structure: str) -> str:
    """``"kfac (Kronecker approximation, …)"``: the structure and what its soft rank is."""
    kind = STRUCTURE_KINDS.get(structure)
    return f"{structure} ({kind})" if kind else structure


def _untrusted_epochs(history: Sequence[Mapping[str, float]]) -> list[float]:
    return [record["epoch"] for record in history if record.get("trusted") == 0.0]


def gap_figure(history: Sequence[Mapping[str, float]], structure: str = ""):
    """Matplotlib figure: the predicted gaps (the headline and Eq. 13 with the training trace
    ratio) against the observed gap.

    Epochs whose estimate is not to be trusted (``trusted == 0``: the training
    error/uncertainty ratio below :data:`~lightning_flatness.core.trust.TRUST_THRESHOLD`, or the
    training loss still falling faster than :data:`~lightning_flatness.core.trust.SETTLED_DROP`
    per epoch) are shaded; random structures show their standard error as error bars.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    epochs = [record["epoch"] for record in history]
    figure, axis = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for index, epoch in enumerate(_untrusted_epochs(history)):
        label = "not to be trusted (α_train low, or loss still falling)" if index == 0 else None
        axis.axvspan(epoch - 0.5, epoch + 0.5, color="0.85", zorder=0, label=label)
    series = (
        ("observed_gap", "observed gap (val − train loss)", "k-o"),
        ("predicted_gap", "predicted gap (headline)", "C0-s"),
        ("predicted_gap_train", "Eq. 13, training trace ratio", "C1--^"),
    )
    for key, label, style in series:
        values = [record.get(key, math.nan) for record in history]
        if not any(math.isfinite(v) for v in values):
            continue
        errors = _predicted_gap_errors(history, key)
        if errors is not None:
            axis.errorbar(epochs, values, yerr=errors, fmt=style, label=label, markersize=4)
        else:
            axis.plot(epochs, values, style, label=label, markersize=4)
    axis.set_xlabel("epoch")
    axis.set_ylabel("generalization gap (nats)")
    title = "Predicted vs observed generalization gap"
    if structure:
        title += f"\n{describe_structure(structure)}"
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _predicted_gap_errors(history: Sequence[Mapping[str, float]], key: str) -> list[float] | None:
    """Standard errors of a predicted gap from the soft rank's (random structures only): Eq. 13
    is linear in the soft rank; the headline's ``rank/(n + rank)`` has the relative derivative
    ``n/(n + rank)`` times the soft rank's."""
    if key == "observed_gap" or not any("soft_rank_stderr" in r for r in history):
        return None
    errors = []
    for record in history:
        rank, stderr = record.get("soft_rank", math.nan), record.get("soft_rank_stderr", math.nan)
        value = record.get(key, math.nan)
        relative = stderr / rank if rank and math.isfinite(stderr) else 0.0
        n = record.get("num_train_samples", math.nan)
        if key == "predicted_gap" and math.isfinite(n) and n + rank > 0:
            relative *= n / (n + rank)
        errors.append(abs(value) * relative)
    return errors


SUMMARY_ROWS = (
    ("predicted_gap", "predicted gap"),
    ("observed_gap", "observed gap"),
    ("predicted_test_nll", "predicted test NLL"),
    ("predicted_gap_train", "Eq. 13, training ratio"),
    ("predicted_gap_val", "Eq. 13, held-out ratio"),
    ("soft_rank", "soft rank rank_λ(F)"),
    ("trace_ratio_val", "trace ratio Tr(C)/Tr(F), val"),
    ("trace_ratio_train", "trace ratio Tr(C)/Tr(F), train"),
    ("trust_score", "trust score α_train"),
    ("newton_decrement", "Newton decrement (nat)"),
    ("nll_drop", "training NLL drop, last epoch"),
    ("lam", "λ"),
    ("num_samples", "samples in F"),
)


def summary_table(record: Mapping[str, float], structure: str) -> str:
    """A short fixed-width table of the last measurement, with the structure, what its soft rank
    is, the standard error of a random structure and the trust verdict."""
    width = max(len(label) for _, label in SUMMARY_ROWS)
    lines = [
        f"Flatness summary (epoch {int(record.get('epoch', -1))}, "
        f"structure={describe_structure(structure)})"
    ]
    for key, label in SUMMARY_ROWS:
        if key == "nll_drop" and key not in record:  # a monitor's record only
            continue
        value = record.get(key, math.nan)
        line = f"  {label:<{width}}  {value:.6g}"
        if key == "predicted_gap":
            line += f" ({headline_source(record)})"
        stderr = record.get(f"{key}_stderr")
        if stderr is not None and math.isfinite(stderr):
            line += f" ± {stderr:.3g}"
        lines.append(line)
    verdict = record.get("trusted", math.nan)
    if math.isfinite(verdict):
        advice = _trust_advice(record, structure)
        label = f"  {'predicted gap trusted':<{width}}  "
        lines.append(
            textwrap.fill(
                advice, width=100, initial_indent=label, subsequent_indent=" " * len(label)
            )
        )
    return "\n".join(lines)


def headline_source(record: Mapping[str, float]) -> str:
    """What the headline ``predicted_gap`` of ``record`` read: the held-out trace ratio, or the
    training one where there was no held-out data."""
    if record.get("predicted_gap_held_out", 1.0) == 0.0:
        return "training ratio: no held-out data, cannot rank over-fit runs"
    return "held-out ratio × rank/(n + rank)"


def _trust_advice(record: Mapping[str, float], structure: str) -> str:
    """Why the predicted gap is or is not to be trusted
    (:func:`~lightning_flatness.core.trust.verdict`, and in a monitor's record
    :func:`~lightning_flatness.core.trust.settled_verdict`)."""
    if record.get("trusted"):
        return f"yes: {TRUSTED_WITHIN_2X}"
    if above_rank_bound(record.get("soft_rank", math.nan), record.get("rank_bound", math.inf)):
        return (
            f"no — the soft rank is above {record['rank_bound']:,.0f}, the largest rank the "
            "Fisher of the measured samples can have"
        )
    if record.get("trust_score", math.nan) < TRUST_THRESHOLD:
        return (
            f"no — α_train < {TRUST_THRESHOLD:g}: the model is over-confident on its training "
            "data (Prop. 5.4)"
        )
    if structure not in EXACT_QUALITY:
        return (
            f"no — {structure!r} is not an exact-quality soft rank (see docs/guide.md, "
            "Choosing a structure); structure='probe_kernel' is"
        )
    decrement = record.get("newton_decrement", math.nan)
    drop = record.get("nll_drop", math.nan)
    if decrement > DECREMENT_LIMIT and not drop > SETTLED_DROP:
        return (
            f"no — the Newton decrement is {decrement:.3g} nat (above {DECREMENT_LIMIT:g}): "
            "the model is not at a minimum yet, and Eq. 13 over-estimates a gap that has not "
            "opened"
        )
    apart = record.get("trace_ratio_val", math.nan) / record.get("trace_ratio_train", math.nan)
    if apart > RATIO_DISAGREEMENT_LIMIT and not drop > SETTLED_DROP:
        return (
            f"no — the held-out trace ratio is {apart:.2f}× the training one (above "
            f"{RATIO_DISAGREEMENT_LIMIT:g}): the model is more confident on its training data "
            "than its held-out answers bear out, and the predicted gap is an upper estimate"
        )
    return _settled_advice(drop)


def _settled_advice(drop: float) -> str:
    """Why a monitor record whose other tests pass is untrusted: its training NLL had not
    settled (:func:`~lightning_flatness.core.trust.settled_verdict`)."""
    if not math.isfinite(drop):
        return (
            "no — the training loss of the epoch before is unknown, so whether the model is at "
            "a minimum (where Eq. 13 holds) cannot be told"
        )
    return (
        f"no — the training loss still fell by {drop:.1%} over the last epoch (above "
        f"{SETTLED_DROP:.0%}): the model is not at a minimum yet, and Eq. 13 over-estimates a "
        "gap that has not opened"
    )
