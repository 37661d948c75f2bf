"""The sweep's accuracy and trust tables, on hand-made records whose answers are known."""

from __future__ import annotations

import math

import pytest

from lightning_flatness.core.trust import TRUST_THRESHOLD
from lightning_flatness.sweep.accuracy import (
    accuracy_rows,
    accuracy_table,
    gap_ratio,
    percentile,
    trust_rows,
    trust_table,
)


def _record(gap, exact_rank, kfac_rank, kfac_predicted, alpha):
    def measures(rank, predicted):
        return {
            "soft_rank": rank,
            "predicted_gap": predicted,
            "error_uncertainty_train": alpha,
            "seconds": 0.5,
        }

    return {
        "gap": gap,
        "measures": {
            "exact": measures(exact_rank, gap),
            "kfac": measures(kfac_rank, kfac_predicted),
        },
    }


RECORDS = [
    _record(0.10, 100.0, 150.0, 0.15, 0.9),  # ratio 1.5: within 2×
    _record(0.20, 200.0, 500.0, 0.90, 0.05),  # ratio 4.5
    _record(0.05, 50.0, 100.0, 0.03, 0.6),  # ratio 0.6: within
    _record(-0.01, 80.0, 160.0, 0.20, 0.01),  # negative gap: outside, ratio undefined
]


def test_percentile_interpolates_linearly():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.1) == pytest.approx(1.0)
    assert math.isnan(percentile([], 0.5))


def test_gap_ratio_needs_a_positive_measured_gap():
    assert gap_ratio(RECORDS[0], "kfac") == pytest.approx(1.5)
    assert math.isnan(gap_ratio(RECORDS[3], "kfac"))


def test_accuracy_rows_compare_with_the_exact_soft_rank_and_the_measured_gap():
    exact, kfac = accuracy_rows(RECORDS, ["exact", "kfac"])
    assert exact["soft_rank_to_exact_median"] == 1.0 and exact["gap_within_2x"] == 0.75
    assert kfac["soft_rank_to_exact_median"] == pytest.approx(2.0)  # 1.5, 2.5, 2, 2
    assert kfac["soft_rank_to_exact_p90"] == pytest.approx(2.35)
    assert kfac["gap_within_2x"] == 0.5  # 2 of 4; the negative gap counts as outside
    assert kfac["gap_ratio_median"] == pytest.approx(1.5)  # of 0.6, 1.5, 4.5
    assert kfac["runs"] == 4 and kfac["seconds_median"] == 0.5
    table = accuracy_table([exact, kfac])
    assert "| kfac | 4 | 2.00 [1.65, 2.35] | 1.50 | 50% |" in table


def test_trust_rows_split_the_calibration_at_each_threshold():
    rows = {row["threshold"]: row for row in trust_rows(RECORDS, "kfac", thresholds=(0.5,))}
    assert set(rows) == {0.5, TRUST_THRESHOLD}
    split = rows[0.5]
    assert (split["runs_trusted"], split["runs_untrusted"]) == (2, 2)
    assert split["trusted_within_2x"] == 1.0 and split["untrusted_within_2x"] == 0.0
    assert "(default)" in trust_table(list(rows.values()))
