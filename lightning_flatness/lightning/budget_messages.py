"""What the monitor says about its overhead budget: the line after its first exact measurement
(what one costs, what the budget does about it), the fit-end line (what was measured how, and
what it spent against what it may), and the one said when the last value is the fill-in.
Plain strings from :class:`~lightning_flatness.lightning.budget.OverheadBudget`'s state; no
Lightning import.
"""

from __future__ import annotations

from lightning_flatness.lightning.budget import FILL_IN, OverheadBudget
from lightning_flatness.lightning.calibration import Calibration

__all__ = ["cost_message", "measured_line", "not_exact_message"]


def measured_line(
    history: list[dict[str, float]], skipped: list[int], structure: str, budget: OverheadBudget
) -> str:
    """The fit-end line that says what was measured how: the epochs measured exactly, those
    filled in, those skipped, and what the monitor spent against what it may."""

    def epochs(values: list[float] | list[int]) -> str:
        return ", ".join(str(int(value)) for value in values)

    exact = [r["epoch"] for r in history if not r.get("fill_in")]
    filled = [r["epoch"] for r in history if r.get("fill_in")]
    parts = [f"exact ({structure}) at epochs {epochs(exact)}"] if exact else []
    if filled:
        parts.append(f"the {FILL_IN} fill-in at {epochs(filled)}")
    if skipped:
        parts.append(f"nothing at {epochs(skipped)} (over the budget)")
    line = "FlatnessMonitor measured " + "; ".join(parts)
    if budget.share is None:
        return line + f"; {budget.spent:.1f} s in all (overhead_budget=None)."
    training = budget.training_seconds()
    return line + (
        f"; {budget.spent:.1f} s of the {budget.allowed(training):.1f} s it may spend "
        f"(overhead_budget={budget.share:g} of {training:.1f} s of training, "
        f"or {budget.allowance:g} s when that is more)."
    )


def cost_message(
    budget: OverheadBudget, seconds: float, epochs_done: int, every_n_epochs: int, structure: str
) -> str:
    """What one exact measurement costs this fit, and what the budget does about it (said once,
    after the first)."""
    training = budget.training_seconds()
    epoch = training / epochs_done if epochs_done else float("nan")
    epochs = f", {seconds / epoch:.0f} training epochs" if epoch > 0 else ""
    head = f"FlatnessMonitor: one {structure} measurement takes {seconds:.1f} s{epochs}. "
    if budget.share is None:
        added = seconds / (every_n_epochs * epoch) if epoch > 0 else float("nan")
        return (
            head + f"Measuring every {every_n_epochs} epoch(s) (overhead_budget=None) adds about "
            f"{added:.0%} to the training time; overhead_budget=0.3 keeps it under 30%."
        )
    return (
        head + f"It runs while the monitor adds at most overhead_budget={budget.share:g} of the "
        f"training time, or {budget.allowance:g} s in a fit where that is more (the last "
        f"epoch's whenever the whole fit allows it); {FILL_IN!r} scaled by the last exact ratio "
        "fills in between (flatness/fill_in = 1). overhead_budget=None measures exactly at "
        "every scheduled epoch."
    )


def not_exact_message(budget: OverheadBudget, structure: str, calibration: Calibration) -> str:
    """Said once when the fit's last value is the fill-in, not the exact measurement."""
    training = budget.training_seconds()
    return (
        f"FlatnessMonitor: the {structure} measurement (about {budget.exact_seconds or 0:.1f} s) "
        f"did not fit what this fit may spend (overhead_budget={budget.share:g} of its "
        f"{training:.1f} s of training, or {budget.allowance:g} s), so the last values are "
        f"{calibration.describe()}, not trusted. For the exact number pass "
        "overhead_budget=None (or a larger share), or measure the trained model with "
        "lightning_flatness.measure()."
    )
