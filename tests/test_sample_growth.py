"""The soft rank's extrapolation from a subset and its first half to the whole set."""

from __future__ import annotations

import math

import pytest

from lightning_flatness.core.sample_growth import extrapolated_soft_rank


@pytest.mark.parametrize("target", [1024, 3000, 4096, 50_000])
def test_a_soft_rank_growing_by_the_same_amount_per_doubling_is_extrapolated_exactly(target):
    def soft_rank(samples: float) -> float:
        return 100.0 + 37.0 * math.log2(samples)

    value = extrapolated_soft_rank(soft_rank(256), soft_rank(512), 512, target)
    assert value == pytest.approx(soft_rank(target), rel=1e-12)


@pytest.mark.parametrize("ratio", [0.5, 0.9, 1.3])
def test_increments_shrinking_or_growing_by_a_ratio_per_doubling_are_summed(ratio):
    """Increments Δ·ρ, Δ·ρ², … over whole doublings; between them the sum is continuous."""
    increment, half, whole = 40.0, 500.0, 540.0
    for doublings in (1, 2, 3):
        expected = whole + sum(increment * ratio**k for k in range(1, doublings + 1))
        value = extrapolated_soft_rank(half, whole, 1000, 1000 * 2**doublings, ratio)
        assert value == pytest.approx(expected, rel=1e-12)
    between = extrapolated_soft_rank(half, whole, 1000, 3000, ratio)
    assert whole + increment * ratio < between < whole + increment * (ratio + ratio**2)


def test_no_growth_from_a_decrease_nor_below_the_subset_and_nan_stays_nan():
    assert extrapolated_soft_rank(120.0, 110.0, 1024, 5000) == 110.0
    assert extrapolated_soft_rank(80.0, 110.0, 1024, 1024) == 110.0
    assert extrapolated_soft_rank(80.0, 110.0, 1024, 500) == 110.0
    assert math.isnan(extrapolated_soft_rank(math.nan, 110.0, 1024, 5000))
    assert math.isnan(extrapolated_soft_rank(80.0, math.inf, 1024, 5000))
    with pytest.raises(ValueError, match="ratio=0"):
        extrapolated_soft_rank(80.0, 110.0, 1024, 5000, ratio=0)
