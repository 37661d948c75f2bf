"""The trust diagnostic: computed as documented, shown in the summary and the gap figure."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batches, random_data, tiny_model

from lightning_flatness import measure
from lightning_flatness.core.trust import (
    DECREMENT_LIMIT,
    RATIO_DISAGREEMENT_LIMIT,
    TRUST_THRESHOLD,
    TRUSTED_WITHIN_2X,
    trusted,
    verdict,
)
from lightning_flatness.lightning.figures import describe_structure, gap_figure, summary_table


def test_trust_score_is_the_training_error_uncertainty_ratio():
    model = tiny_model("mlp")
    inputs, targets = random_data(32)
    report = measure(model, batches(inputs, targets, 8), lam=1e-3, num_train_samples=100)
    assert report.trust_score == report.error_uncertainty_train
    assert math.isfinite(report.trust_score)
    settled = report.newton_decrement <= DECREMENT_LIMIT
    assert report.trusted == float(report.trust_score >= TRUST_THRESHOLD and settled)
    values = report.as_dict()
    assert values["trust_score"] == report.trust_score and values["trusted"] == report.trusted


@pytest.mark.parametrize(
    ("score", "expected"),
    [(TRUST_THRESHOLD, 1.0), (TRUST_THRESHOLD * 0.999, 0.0), (2.0, 1.0), (0.0, 0.0)],
)
def test_trusted_is_the_score_against_the_threshold(score, expected):
    assert trusted(score) == expected
    assert math.isnan(trusted(math.nan))  # a regression has no error/uncertainty ratio


def _record(epoch, score, **extra):
    return {
        "epoch": float(epoch),
        "observed_gap": 0.1,
        "predicted_gap": 0.2,
        "predicted_gap_train": 0.25,
        "predicted_gap_val": 0.15,
        "soft_rank": 100.0,
        "trust_score": score,
        "trusted": trusted(score),
        **extra,
    }


def test_summary_names_the_structure_and_says_when_not_to_trust():
    trusting = summary_table(_record(3, 0.8), "diag")
    assert "upper estimate" in trusting
    verdict = trusting[trusting.index("  predicted gap trusted") :]
    assert verdict.split()[:4] == ["predicted", "gap", "trusted", "yes:"]
    assert " ".join(TRUSTED_WITHIN_2X.split()) in " ".join(verdict.split())
    assert max(len(line) for line in trusting.splitlines()[1:]) <= 100  # wrapped, not one line
    doubting = summary_table(_record(4, 0.01, soft_rank_stderr=2.5), "lanczos")
    assert "± 2.5" in doubting and "no — α_train <" in doubting
    assert describe_structure("kfac").startswith("kfac (Kronecker")


def test_summary_says_when_the_two_trace_ratios_disagree():
    record = _record(49, 0.57, trace_ratio_val=0.97, trace_ratio_train=0.56, nll_drop=0.016)
    record["trusted"] = 0.0
    advice = " ".join(summary_table(record, "probe_kernel").split())
    assert "the held-out trace ratio is 1.73× the training one (above 1.5)" in advice


def test_summary_says_what_the_headline_read():
    """The headline line names its trace ratio: the held-out one, or the training one with the
    warning that it cannot rank over-fit runs."""
    held_out = summary_table(_record(3, 0.8, predicted_gap_held_out=1.0), "probe_kernel")
    line = next(row for row in held_out.splitlines() if row.strip().startswith("predicted gap "))
    assert "held-out ratio × rank/(n + rank)" in line
    alone = summary_table(_record(3, 0.8, predicted_gap_held_out=0.0), "probe_kernel")
    line = next(row for row in alone.splitlines() if row.strip().startswith("predicted gap "))
    assert "no held-out data, cannot rank over-fit runs" in line


def test_gap_figure_shades_untrusted_epochs_and_shows_error_bars():
    history = [_record(e, s, soft_rank_stderr=5.0) for e, s in enumerate((0.9, 0.5, 0.1, 0.05))]
    figure = gap_figure(history, "lanczos")
    (axis,) = figure.axes
    shaded = [p for p in axis.patches if p.get_facecolor()[:3] == pytest.approx((0.85,) * 3)]
    assert len(shaded) == 2  # epochs 2 and 3
    assert any("not to be trusted" in text.get_text() for text in axis.get_legend().get_texts())
    assert len(axis.containers) == 2  # error bars on both predicted gaps (headline, training)
    assert "lanczos" in axis.get_title()


@pytest.mark.parametrize(
    ("score", "structure", "soft_rank", "expected"),
    [
        (0.33, "probe_kernel", 300.0, 1.0),  # an MLP trained at c = 0.01: within 2× (1.1–1.3×)
        (0.55, "probe_kernel", 60.0, 1.0),  # trained at c = 100: within 2× (0.8×)
        (0.19, "probe_kernel", 460.0, 0.0),  # over-confident: Eq. 13 at 0.27× the gap
        (0.0, "probe_kernel", 600.0, 0.0),  # memorized: Eq. 13 near 0
        (0.9, "kfac", 300.0, 0.0),  # not an exact-quality soft rank
        (0.9, "probe_kernel", 2000.0, 0.0),  # above the rank bound
    ],
)
def test_verdict_cases_of_the_study(score, structure, soft_rank, expected):
    """Runs of benchmarks/study_trust.py's mlp7 grid (n = 1,000; rank bound 1,000 here)."""
    assert verdict(score, structure, soft_rank, rank_bound=1000.0) == expected


def test_threshold_is_the_studied_one():
    assert TRUST_THRESHOLD == 0.3


@pytest.mark.parametrize(
    ("disagreement", "expected"),
    [
        (1.05, 1.0),  # an MLP of the study trained at c = 100: the two ratios agree
        (1.31, 1.0),  # the most apart of the study's trusted runs
        (RATIO_DISAGREEMENT_LIMIT, 1.0),
        (1.71, 0.0),  # the main job: its headline at 1.95× the expected gap
        (4.16, 0.0),  # trained at c = 1, α_train 0.34: Eq. 13 at 0.56× the gap
        (5.89, 0.0),  # trained at c = 1, α_train 0.55: Eq. 13 at 0.21× the gap
        (math.nan, 1.0),  # no held-out data: not read
    ],
)
def test_a_held_out_trace_ratio_far_above_the_training_one_is_not_trusted(disagreement, expected):
    assert verdict(0.5, "probe_kernel", 100.0, 1000.0, 0.01, disagreement=disagreement) == expected


def test_a_report_untrusts_a_model_whose_held_out_ratio_is_far_above_its_training_one():
    """measure() passes the ratio of its two trace ratios to the verdict: the same model is
    trusted on held-out data that agrees with its training data and not on data it gets
    confidently wrong (the training data with shuffled labels)."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(64, 5), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(300):  # fit the labels (α_train stays above 0.3 at this decay)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        (loss + 0.5e-2 * sum(p.square().sum() for p in model.parameters())).backward()
        optimizer.step()
    wrong = targets[torch.randperm(64, generator=torch.Generator().manual_seed(1))]

    def report(val_targets):
        return measure(
            model,
            [(inputs, targets)],
            lam=1e-2,
            num_train_samples=64,
            val_batches=[(inputs, val_targets)],
            structure="dense",
        )

    agreeing, wrong_held_out = report(targets), report(wrong)
    assert agreeing.trace_ratio_val == pytest.approx(agreeing.trace_ratio_train)
    assert wrong_held_out.trace_ratio_val > RATIO_DISAGREEMENT_LIMIT * agreeing.trace_ratio_train
    assert agreeing.trusted == 1.0 and wrong_held_out.trusted == 0.0
