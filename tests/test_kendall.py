"""Kendall's τ-b against hand-computed examples (and scipy, where installed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_flatness.sweep.kendall import kendall_tau_b
from lightning_flatness.sweep.report import kendall_rows


def test_no_ties_hand_computed():
    # Pairs (i<j) of x = 1..5, y = 3 1 2 5 4: discordant are (1,2), (1,3), (4,5); the other
    # 7 are concordant. τ = (7 − 3) / 10.
    assert kendall_tau_b([1, 2, 3, 4, 5], [3, 1, 2, 5, 4]) == (pytest.approx(0.4), 5)


def test_ties_hand_computed():
    # x = 1 1 2 3, y = 1 2 2 3: pair (1,2) tied in x, pair (2,3) tied in y, the other 4 pairs
    # concordant. τ_b = (4 − 0) / √((6 − 1)(6 − 1)) = 0.8 (τ_a would be 4/6).
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 2, 3])[0] == pytest.approx(0.8)


def test_ties_and_discordance_hand_computed():
    # x = 1 2 2 3, y = 2 1 3 3: (1,2) discordant; (1,3), (1,4), (2,4) concordant; (2,3) tied
    # in x; (3,4) tied in y. τ_b = (3 − 1) / √(5 · 5) = 0.4.
    assert kendall_tau_b([1, 2, 2, 3], [2, 1, 3, 3])[0] == pytest.approx(0.4)


def test_monotone_transforms_and_reversal():
    x = [0.1, 0.5, 2.0, 7.0, 30.0]
    assert kendall_tau_b(x, np.log(x))[0] == pytest.approx(1.0)
    assert kendall_tau_b(x, [-v for v in x])[0] == pytest.approx(-1.0)


def test_non_finite_pairs_are_left_out():
    tau, count = kendall_tau_b([1, 2, math.nan, 4, 5, 6], [3, 1, 0, 2, math.inf, 5])
    # Left: x = 1 2 4 6, y = 3 1 2 5 → D: (1,2), (1,3); C: the other 4. τ = 2/6.
    assert count == 4
    assert tau == pytest.approx(2 / 6)


def test_undefined_cases():
    assert math.isnan(kendall_tau_b([1.0], [2.0])[0])
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3])[0])  # constant x
    with pytest.raises(ValueError, match="same length"):
        kendall_tau_b([1, 2], [1, 2, 3])


def test_matches_scipy_with_ties():
    """torchmetrics' τ-b against scipy's, to single precision (its result is float32)."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, size=60).astype(float)
    y = x + rng.integers(-3, 4, size=60)
    assert kendall_tau_b(x, y)[0] == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-6)


def test_a_sweeps_records_give_scipys_tau_for_every_measure():
    """The report's table (kendall_rows) from records shaped as a sweep writes them: each
    structure's τ of each measure against the gap is scipy's, over the runs where both are
    finite (a failed measurement is None in the record)."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    records = []
    for index in range(40):
        gap = float(rng.gamma(2.0, 0.05))
        n = int(rng.choice([500, 1000, 2000]))
        kfac = {"soft_rank": gap * n * float(rng.lognormal(0, 0.3)), "logdet": float(rng.normal())}
        diag = {"soft_rank": None if index in (3, 17) else round(gap * 100 + rng.normal(0, 3))}
        records.append({"n": n, "gap": gap, "measures": {"kfac": kfac, "diag": diag}})
    rows = {(row["measure"], row["scaled"]): row for row in kendall_rows(records)}
    gaps = np.array([r["gap"] for r in records])
    for structure, measure in [("kfac", "soft_rank"), ("kfac", "logdet"), ("diag", "soft_rank")]:
        for scaled in (False, True) if measure == "soft_rank" else (False,):
            values = [r["measures"][structure][measure] for r in records]
            values = np.array([np.nan if v is None else v for v in values], dtype=float)
            if scaled:
                values = values / np.array([r["n"] for r in records])
            keep = np.isfinite(values)
            expected = stats.kendalltau(values[keep], gaps[keep]).statistic
            row = rows[(measure, scaled)]
            assert row["count"][structure] == int(keep.sum())
            assert row["tau"][structure] == pytest.approx(expected, abs=1e-6), (structure, measure)
