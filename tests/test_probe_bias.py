"""Where the probe kernel's soft rank nears its probe rows, measure() measures again with the
exact output rows: the dense Fisher's value, in float64, on a tiny model; elsewhere nothing
changes."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import batches, random_data, tiny_model

from lightning_flatness import measure
from lightning_flatness.core.curvature.base import CurvatureEstimate
from lightning_flatness.core.options import KernelOptions, KFACOptions
from lightning_flatness.core.probe_bias import PROBE_BIAS_SHARE, exact_rows_options
from lightning_flatness.core.spectral import SpectralSummary


def _estimate(soft_rank: float, probe_rows: tuple[int, int] | None) -> CurvatureEstimate:
    summary = SpectralSummary(soft_rank, math.nan, math.nan, math.nan, math.nan)
    return CurvatureEstimate(summary=summary, eigenvalues=None, probe_rows=probe_rows)


@pytest.mark.parametrize(
    ("options", "soft_rank", "probe_rows", "parameters", "again"),
    [
        (KernelOptions(), PROBE_BIAS_SHARE * 400, (4, 10), 1000, True),  # at the share
        (KernelOptions(), PROBE_BIAS_SHARE * 400 - 1, (4, 10), 1000, False),  # below it
        (KernelOptions(), 300.0, (10, 10), 1000, False),  # already the exact rows
        (KernelOptions(), 300.0, None, 1000, False),  # not a probe-kernel estimate
        (KFACOptions(), 300.0, (4, 10), 1000, False),  # another structure
        (KernelOptions(max_kernel_size=999), 300.0, (4, 10), 9000, False),  # past both guards
        (KernelOptions(max_kernel_size=1000), 300.0, (4, 10), 9000, True),  # C·m fits
    ],
)
def test_the_exact_rows_are_taken_where_the_bias_can_be_and_they_fit(
    options, soft_rank, probe_rows, parameters, again
):
    chosen = exact_rows_options(options, _estimate(soft_rank, probe_rows), 100, parameters, [])
    if again:
        assert chosen == dataclasses.replace(options, probes=10, groups=1)
    else:
        assert chosen is None


def test_batches_a_second_pass_cannot_read_are_measured_once():
    estimate = _estimate(300.0, (4, 10))
    assert exact_rows_options(KernelOptions(), estimate, 100, 1000, [[], None]) is not None
    assert exact_rows_options(KernelOptions(), estimate, 100, 1000, [iter([]), None]) is None


def test_near_its_probe_rows_the_default_is_the_dense_fisher_and_once_only_the_probes():
    """A tiny MLP (float64) at a small λ: its soft rank is more than the share of its 4·m probe
    rows, so measure() at its defaults gives the dense Fisher's soft rank to round-off; on an
    iterator of the same batches (one pass only) it keeps the jackknifed probe estimate."""
    model = tiny_model("mlp")
    inputs, targets = random_data(30)
    lam, n = 1e-4, 30
    dense = measure(
        model, batches(inputs, targets, 7), lam=lam, num_train_samples=n, structure="dense"
    )
    assert dense.soft_rank >= PROBE_BIAS_SHARE * 4 * 30
    default = measure(model, batches(inputs, targets, 7), lam=lam, num_train_samples=n)
    assert default.structure == "probe_kernel"
    assert default.soft_rank == pytest.approx(dense.soft_rank, rel=1e-8)
    once = measure(model, iter(batches(inputs, targets, 7)), lam=lam, num_train_samples=n)
    assert once.soft_rank != pytest.approx(dense.soft_rank, rel=1e-3)
    assert math.isfinite(once.as_dict()["soft_rank_stderr"])


def test_far_from_its_probe_rows_the_default_is_the_probe_estimate():
    """At a large λ the soft rank is far below the probe rows: one pass, the probes' estimate."""
    model = tiny_model("mlp")
    inputs, targets = random_data(30)
    data = batches(inputs, targets, 7)
    default = measure(model, data, lam=10.0, num_train_samples=30)
    assert default.soft_rank < PROBE_BIAS_SHARE * 4 * 30
    assert math.isfinite(default.as_dict()["soft_rank_stderr"])  # the jackknife's: probes
