"""Pictures and tables of flatness reports: TensorBoard spectrum histogram, gap figure, summary."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["gap_figure", "log10_spectrum", "summary_table"]


def log10_spectrum(eigenvalues: Tensor, floor: float = 1e-30) -> Tensor:
    """``log10`` of the positive eigenvalues (zeros carry no information on a log axis)."""
    values = eigenvalues.detach().to(torch.float64).reshape(-1)
    return torch.log10(values[values > floor])


def gap_figure(history: Sequence[Mapping[str, float]]):
    """Matplotlib figure: predicted (held-out and training trace ratio) vs observed gap."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    epochs = [record["epoch"] for record in history]
    figure, axis = plt.subplots(figsize=(6, 4), dpi=100)
    series = (
        ("observed_gap", "observed gap (val − train loss)", "k-o"),
        ("predicted_gap", "predicted gap, Eq. 13", "C0-s"),
        ("predicted_gap_train", "predicted gap, training trace ratio", "C1--^"),
    )
    for key, label, style in series:
        values = [record.get(key, math.nan) for record in history]
        if any(math.isfinite(v) for v in values):
            axis.plot(epochs, values, style, label=label, markersize=4)
    axis.set_xlabel("epoch")
    axis.set_ylabel("generalization gap (nats)")
    axis.set_title("Predicted vs observed generalization gap")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


SUMMARY_ROWS = (
    ("predicted_gap", "predicted gap (Eq. 13)"),
    ("observed_gap", "observed gap"),
    ("predicted_gap_train", "predicted gap, train ratio"),
    ("soft_rank", "soft rank rank_λ(F)"),
    ("trace_ratio_val", "trace ratio Tr(C)/Tr(F), val"),
    ("trace_ratio_train", "trace ratio Tr(C)/Tr(F), train"),
    ("lam", "λ"),
    ("num_samples", "samples in F"),
)


def summary_table(record: Mapping[str, float], structure: str) -> str:
    """A short fixed-width table of the last measurement."""
    width = max(len(label) for _, label in SUMMARY_ROWS)
    lines = [f"Flatness summary (epoch {int(record.get('epoch', -1))}, structure={structure})"]
    for key, label in SUMMARY_ROWS:
        value = record.get(key, math.nan)
        lines.append(f"  {label:<{width}}  {value:.6g}")
    return "\n".join(lines)
