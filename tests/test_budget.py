"""The monitor's overhead budget: which scheduled measurement runs (exact, the scaled Kronecker
fill-in, or none), that the fill-in is scaled by the last exact ratio, that callbacks reading the
values every epoch still get one, and that none of it changes training."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import EarlyStopping
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness import (
    FlatnessClassifier,
    FlatnessMonitor,
    KernelOptions,
    KFACOptions,
    MNIST7DataModule,
    measure,
)
from lightning_flatness.core.curvature.probe_kernel import FIRST_HALF
from lightning_flatness.core.sample_growth import extrapolated_soft_rank
from lightning_flatness.lightning import monitor_measurement
from lightning_flatness.lightning.budget import (
    ALLOWANCE_SECONDS,
    CALIBRATION_PROBES,
    CHEAP,
    EXACT,
    FILL_IN_MIN_SAMPLES,
    FILL_IN_SAMPLES,
    FILL_IN_SPREAD,
    SKIP,
    UNTIMED_SHARE,
    YIELD_SHARE,
    OverheadBudget,
)
from lightning_flatness.lightning.calibration import RECALIBRATE_DRIFT, Calibration, fill_in_record
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.monitor_checks import cost_line, predicted_exact_seconds
from lightning_flatness.lightning.monitor_measurement import tensor_numbers


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _budget(share=0.3, untimed=0.0, allowance=0.0) -> tuple[OverheadBudget, FakeClock]:
    """A budget on a fake clock; ``untimed=0`` (no part left for unseen work) and
    ``allowance=0`` (no seconds granted whatever the fit's length) keep the arithmetic of the
    decision tests plain."""
    clock = FakeClock()
    budget = OverheadBudget(share, clock=clock, untimed=untimed, allowance=allowance)
    budget.start()
    return budget, clock


def test_the_budget_prefers_exact_then_the_fill_in_then_nothing():
    budget, clock = _budget(0.3)  # the monitor may add 30% to the training time
    clock.now = 10.0  # 10 s of training after 1 of 10 epochs: 100 s projected, 30 s allowed
    budget.exact_seconds, budget.cheap_seconds = 10.0, 1.0
    # 10 + 10 (reserve) ≤ 30, with the fill-in it runs for its ratio and one at each of the 8
    # later epochs before the last: 10 + 1 + 10 + 8 ≤ 30
    assert budget.decide(1, 10, last=False, cheap=True) == EXACT
    budget.charge(10.0)
    clock.now = 30.0  # 20 s of training after 2 epochs: still 100 s projected
    # 10 + 10 + 10 ≤ 30, but 10 + 11 + 10 + 7 > 30: an exact one now would leave later epochs
    # without a value; with no fill-in to keep room for, it runs
    assert budget.decide(2, 10, last=False, cheap=True) == CHEAP
    assert budget.decide(2, 10, last=False, cheap=False) == EXACT
    budget.charge(10.0)
    clock.now = 50.0  # 30 s of training after 3 epochs
    # 20 + 10 + 10 > 30; the fill-in would leave no room for the fit-end one: 20 + 1 + 10 > 30
    assert budget.decide(3, 10, last=False, cheap=True) == SKIP
    budget.exact_seconds = 15.0  # now the fit-end one cannot fit anyway (20 + 15 > 30)
    assert budget.decide(3, 10, last=False, cheap=True) == CHEAP  # 20 + 1 ≤ 30
    assert budget.decide(3, 10, last=False, cheap=False) == SKIP
    budget.exact_seconds = 10.0
    budget.charge(15.0)
    clock.now = 65.0  # 35 spent, 30 s of training after 3 epochs: nothing fits
    assert budget.decide(3, 10, last=False, cheap=True) == SKIP
    assert budget.decide(3, 10, last=False, cheap=True, required=True) == CHEAP
    assert budget.decide(3, 10, last=False, cheap=False, required=True) == EXACT
    assert budget.overhead() == pytest.approx(35 / 30)
    # the last epoch: within the fit's own training time, no reserve to keep; the fill-in
    # runs even over the budget (35 + 1 > 9): the summary's number is never missing
    assert budget.decide(3, 10, last=True, cheap=True) == CHEAP
    assert budget.decide(3, 10, last=True, cheap=False) == SKIP
    clock.now = 165.0  # 130 s of training: 39 allowed, 35 + 10 > 39
    assert budget.decide(10, 10, last=True, cheap=True) == CHEAP
    assert budget.decide(10, 10, last=True, cheap=False) == SKIP
    clock.now = 235.0  # 200 s of training: 35 + 10 ≤ 60
    assert budget.decide(10, 10, last=True, cheap=True) == EXACT


def test_the_decisions_leave_the_untimed_share_of_the_budget_unspent():
    budget, clock = _budget(0.3, untimed=UNTIMED_SHARE)
    clock.now = 100.0  # the last epoch after 100 s of training: 30 s allowed, 24 s to spend
    budget.exact_seconds, budget.cheap_seconds = 20.0, 1.0
    budget.charge(4.0)
    clock.now = 104.0
    assert 0 < UNTIMED_SHARE < 1
    assert budget.decide(10, 10, last=True, cheap=True) == EXACT  # 4 + 20 ≤ 24
    budget.exact_seconds = 20.5
    assert budget.decide(10, 10, last=True, cheap=True) == CHEAP  # 4 + 20.5 > 24
    assert OverheadBudget(0.3).untimed == UNTIMED_SHARE  # the monitor's default


def test_an_unmeasured_fill_in_is_taken_to_cost_one_epoch():
    budget, clock = _budget(0.3)
    budget.exact_seconds = 1e9
    clock.now = 10.0  # 10 s of training, 2 of 10 epochs: 50 s projected, 15 s allowed
    assert budget.decide(2, 10, last=False, cheap=True) == CHEAP  # 5 s per epoch ≤ 15
    assert budget.decide(1, 2, last=False, cheap=True) == SKIP  # 10 s per epoch, 6 allowed


def test_no_budget_measures_exactly_and_bad_shares_are_refused():
    budget, _ = _budget(None)
    budget.exact_seconds = 1e9
    assert budget.decide(1, 10, last=False, cheap=True) == EXACT
    for share in (0.0, -0.2, math.inf, "30%"):
        with pytest.raises(ValueError, match="overhead_budget"):
            OverheadBudget(share)


def test_the_first_exact_cost_is_predicted_from_the_trial_and_kept_until_measured():
    # the lower run's cost per sample, scaled; never below the larger run's own time
    assert predicted_exact_seconds({8: 0.16, 32: 1.3}, 400) == pytest.approx(8.0)
    assert predicted_exact_seconds({8: 0.16, 32: 1.3}, 40) == pytest.approx(1.3)
    assert predicted_exact_seconds({8: 0.16, 32: 0.32}, 400) == pytest.approx(4.0)
    assert predicted_exact_seconds({1: 0.5}, 100) == pytest.approx(50.0)
    assert cost_line({8: 0.2, 32: 0.5}) == pytest.approx((0.1, 0.0125))
    budget, _ = _budget()
    budget.predict_exact(21.5)
    budget.predict_exact(9.0)  # only before one is known
    assert budget.exact_seconds == pytest.approx(21.5)


def _gap_record(soft_rank: float, **fields: float) -> dict[str, float]:
    """A record of n = 100 samples, trace ratios 0.4 (training) and 0.8 (held-out)."""
    record = {"soft_rank": soft_rank, "num_train_samples": 100.0, "trace_ratio_train": 0.4}
    record.update(trace_ratio_val=0.8, train_nll=0.3, tic=3.0, **fields)
    record.update(
        predicted_gap_train=0.4 * soft_rank / 100,
        predicted_gap_val=0.8 * soft_rank / 100,
        predicted_gap=0.8 * soft_rank / (100 + soft_rank),
    )
    return record


def test_a_fill_in_scales_the_soft_rank_and_the_gaps_by_the_last_exact_ratio():
    record = _gap_record(100.0)
    scaled = fill_in_record(record, 0.5)
    assert scaled["soft_rank"] == 50.0 and scaled["predicted_gap_train"] == pytest.approx(0.2)
    assert scaled["predicted_gap_val"] == pytest.approx(0.4) and scaled["tic"] == 3.0
    # the headline follows the scaled soft rank: 0.8 · 50 / (100 + 50), not half of 0.4
    assert scaled["predicted_gap"] == pytest.approx(0.8 * 50 / 150)
    assert scaled["predicted_test_nll"] == pytest.approx(0.3 + 0.8 * 50 / 150)
    assert scaled["fill_in"] == 1.0 and scaled["calibration"] == 0.5
    raw = fill_in_record(record, math.nan)  # before any exact measurement: unscaled
    assert raw["soft_rank"] == 100.0 and math.isnan(raw["calibration"])


def test_a_short_fit_may_always_spend_the_allowance():
    """A 3-epoch fit of 0.39 s of training: 30% of it is 0.12 s, but a fit with the monitor may
    always last ALLOWANCE_SECONDS, so it may spend 20 − 0.39 s. An exact measurement of 2.2 s
    runs at every epoch; one of 13 s (two do not fit) leaves the first epochs to the fill-in
    and runs at the last."""
    assert OverheadBudget(0.3).allowance == ALLOWANCE_SECONDS == 20.0
    budget, clock = _budget(0.3, allowance=20.0)
    budget.exact_seconds, budget.cheap_seconds = 2.2, 0.1
    for epoch in (1, 2, 3):
        clock.now += 0.13  # an epoch of training
        assert budget.decide(epoch, 3, last=epoch == 3, cheap=True) == EXACT
        budget.charge(2.2)
        clock.now += 2.2
    budget, clock = _budget(0.3, allowance=20.0)
    budget.exact_seconds, budget.cheap_seconds = 13.0, 0.5
    clock.now = 0.13
    assert budget.decide(1, 3, last=False, cheap=True) == CHEAP  # 13 + 13 > 19.61 ≥ 0.5 + 13
    budget.charge(0.5)
    clock.now = 0.76
    assert budget.decide(2, 3, last=False, cheap=True) == CHEAP
    budget.charge(6.0)  # a fill-in that took longer: 6.5 + 13 ≤ 19.61 still
    clock.now = 6.89
    assert budget.decide(3, 3, last=True, cheap=True) == EXACT
    budget.exact_seconds = 14.0  # 6.5 + 14 > 19.61, but it alone costs under what A leaves
    assert budget.decide(3, 3, last=True, cheap=True) == EXACT
    budget.exact_seconds = 19.7  # over what A leaves beside the training: the fill-in's
    assert budget.decide(3, 3, last=True, cheap=True) == CHEAP
    budget.exact_seconds = 14.0
    budget.charge(14.0)  # 20.5 spent before the last epoch: no second allowance
    assert budget.decide(3, 3, last=True, cheap=True) == CHEAP
    assert budget.decide(3, 3, last=True, cheap=False) == SKIP


def test_the_allowance_counts_the_fits_own_training_time():
    """The allowance is what a fit with the monitor may last, training included: a fit of 5 s
    of training may spend 15 s, one of 21 s its share only (0.3 · 21 = 6.3 s), not 20 more."""
    budget, _ = _budget(0.3, allowance=20.0)
    assert budget.allowed(5.0) == pytest.approx(15.0)
    assert budget.allowed(21.0) == pytest.approx(6.3)
    assert budget.allowed(100.0) == pytest.approx(30.0)
    # the crossover: A − T = 0.3 · T at T = 20 / 1.3
    assert budget.allowed(20.0 / 1.3) == pytest.approx(20.0 - 20.0 / 1.3)


def test_fill_ins_are_paced_over_the_fit_and_the_last_one_always_runs():
    """60 s of training projected over 30 epochs, 18 s allowed, 10 spent, fill-ins of 1 s:
    what is left pays for 8, so with 28 epochs to go one runs once 4 epochs have passed since
    the last value (28 / 8 = 3.5), and at every epoch once the money left pays for every
    remaining one; the last epoch's runs even when none fits."""
    budget, clock = _budget(0.3, allowance=0.0)
    budget.exact_seconds, budget.cheap_seconds = 1e9, 1.0
    budget.charge(10.0)
    clock.now = 14.0  # 4 s of training after 2 of 30 epochs: 60 s projected, 18 s allowed
    assert budget.allowed(60.0) == pytest.approx(18.0)
    assert budget.decide(2, 30, last=False, cheap=True, since_last=None) == CHEAP  # the first
    assert budget.decide(2, 30, last=False, cheap=True, since_last=3) == SKIP
    assert budget.decide(2, 30, last=False, cheap=True, since_last=4) == CHEAP
    budget.cheap_seconds = 0.2  # now 39 affordable: one at every epoch
    assert budget.decide(2, 30, last=False, cheap=True, since_last=1) == CHEAP
    # a fit of unknown length is not paced
    assert budget._paced(1.0, 1.0, (2, None), since_last=1)
    budget.cheap_seconds = 1.0
    budget.charge(7.5)  # 17.5 spent: 17.5 + 1 > 18
    clock.now = 21.5
    assert budget.decide(2, 30, last=False, cheap=True, since_last=20) == SKIP
    assert budget.decide(30, 30, last=True, cheap=True, since_last=20) == CHEAP


def test_the_per_epoch_reads_still_to_come_are_kept_from_the_fill_ins():
    """The settled test's read at every epoch's end is spent whatever is decided, so pacing
    keeps it for the remaining epochs beside the last calibration's reserve: 18 s allowed, 10
    spent, the calibration again 3 + 1 s, fill-ins of 1 s, 28 epochs to go. Without reads, 4
    fill-ins are affordable (one every 7 epochs); with 0.1 s reads (2.8 s to come), 1."""
    budget, clock = _budget(0.3, allowance=0.0)
    budget.exact_seconds, budget.cheap_seconds, budget.subset_seconds = 1e9, 1.0, 3.0
    budget.charge(10.0)
    clock.now = 14.0  # 4 s of training after 2 of 30 epochs: 60 s projected, 18 s allowed
    assert budget.decide(2, 30, last=False, cheap=True, since_last=7) == CHEAP
    assert budget.fits_beside_fill_in(3.0, 2, 30, last=False)
    budget.per_epoch_seconds = 0.1
    assert budget.decide(2, 30, last=False, cheap=True, since_last=7) == SKIP
    assert budget.decide(2, 30, last=False, cheap=True, since_last=28) == CHEAP
    assert not budget.fits_beside_fill_in(3.0, 2, 30, last=False)  # 10 + 4 + 4 + 2.8 > 18
    # the last epoch has no reads to come: its calibration may use what they were kept for
    clock.now = 10.0 + 60.0
    assert budget.fits_beside_fill_in(3.0, 30, 30, last=True)


def test_a_calibration_taken_again_mid_fit_leaves_a_fill_in_for_every_epoch_to_come():
    """18 s allowed, 6 spent, fill-ins of 0.2 s, 28 epochs to go: this epoch's fill-in and 28
    more counted at FILL_IN_SPREAD = 1.5 times its cost, 0.2 + 8.4 s, leave 3.4 s. With the
    last calibration's reserve of 2 + 0.2 s, a calibration again of 1 s fits and one of 1.5 s
    does not (it would fit beside this epoch's fill-in alone: fill-ins come first); in a fit of
    unknown length it never runs."""
    assert FILL_IN_SPREAD == 1.5
    budget, clock = _budget(0.3, allowance=0.0)
    budget.exact_seconds, budget.cheap_seconds, budget.subset_seconds = 1e9, 0.2, 2.0
    budget.charge(6.0)
    clock.now = 10.0  # 4 s of training after 2 of 30 epochs: 60 s projected, 18 s allowed
    assert budget.affords_recalibration(1.0, 2, 30)
    assert not budget.affords_recalibration(1.5, 2, 30)
    assert budget.fits_beside_fill_in(1.5, 2, 30, last=False)
    assert not budget.affords_recalibration(0.1, 2, None)
    assert OverheadBudget(None).affords_recalibration(1e9, 2, 30)  # no budget: always


def test_the_fill_in_measures_fewer_samples_where_its_cap_costs_more_than_its_part():
    """After one epoch of 0.8 s of a 30-epoch fit, 7.2 s allowed: a fill-in at every epoch may
    cost half of 7.2 / 30 = 0.12 s. On a line of 0.02 s + 0.45 ms a sample, 1,024 samples cost
    0.48 s: the fill-in takes the floor of 128 (not the 222 the line would afford: it predicts
    a count in between too loosely); a cheap fill-in keeps its cap (the line at 1,024 samples
    just within 0.12 s), and never more than the samples there are."""
    budget, clock = _budget(0.3, allowance=0.0)
    clock.now = 0.8
    budget.fill_in_line = (0.02, 0.00045)
    assert budget.choose_fill_in_samples(1, 30, available=5000) == FILL_IN_MIN_SAMPLES
    assert budget.fill_in_samples == FILL_IN_MIN_SAMPLES
    assert budget.cheap_seconds == pytest.approx(0.02 + 0.00045 * FILL_IN_MIN_SAMPLES)
    budget.fill_in_line = (0.02, 0.0999 / FILL_IN_SAMPLES)
    assert budget.choose_fill_in_samples(1, 30, available=5000) == FILL_IN_SAMPLES
    budget.fill_in_line = (0.02, 0.1001 / FILL_IN_SAMPLES)
    assert budget.choose_fill_in_samples(1, 30, available=5000) == FILL_IN_MIN_SAMPLES
    budget.fill_in_line = (0.02, 0.001)
    assert budget.choose_fill_in_samples(1, 30, available=5000) == FILL_IN_MIN_SAMPLES
    assert budget.cheap_seconds == pytest.approx(0.02 + 0.001 * FILL_IN_MIN_SAMPLES)
    assert budget.choose_fill_in_samples(1, 30, available=100) == 100
    assert budget.choose_fill_in_samples(1, 30, available=0) == FILL_IN_MIN_SAMPLES  # unknown n
    budget.fill_in_line = (0.01, 1e-5)
    assert budget.choose_fill_in_samples(1, 30, available=5000) == FILL_IN_SAMPLES
    # a fit of unknown length, or one without a budget, keeps the cap
    budget.fill_in_line = (0.02, 0.001)
    assert budget.choose_fill_in_samples(1, None, available=5000) == FILL_IN_SAMPLES
    unbudgeted = OverheadBudget(None)
    unbudgeted.fill_in_line = (0.02, 0.001)
    assert unbudgeted.choose_fill_in_samples(1, 30, available=5000) == FILL_IN_SAMPLES


def test_the_quickstart_fit_at_the_defaults_logs_every_epoch_and_ends_exact(tmp_path, caplog):
    """The README quickstart's kind of fit: 3 epochs of 400 samples, ``FlatnessMonitor()``. Its
    training takes well under a second, yet every epoch gets the curves, the last one exact, and
    one line at fit end says what was measured how."""
    seed_everything(0)
    data = MNIST7DataModule(train_size=400, val_size=200, batch_size=32)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False, spectrum=False))
    trainer = quiet_trainer(tmp_path, [monitor], max_epochs=3)
    with caplog.at_level("INFO"):
        trainer.fit(FlatnessClassifier(weight_decay=1e-3), data)
    assert [r["epoch"] for r in monitor.history] == [0.0, 1.0, 2.0]
    assert monitor.history[-1]["fill_in"] == 0.0
    for name in ("soft_rank", "predicted_gap", "trace_ratio_val"):
        assert all(math.isfinite(r[name]) for r in monitor.history), name
        assert math.isfinite(float(trainer.callback_metrics[f"flatness/{name}"]))
    said = [r.getMessage() for r in caplog.records if "FlatnessMonitor measured" in r.getMessage()]
    assert len(said) == 1 and "exact (probe_kernel) at epochs" in said[0], said


def test_the_fill_in_keeps_room_for_the_last_exact_measurement_while_it_can_fit():
    budget, clock = _budget(0.3, allowance=20.0)
    budget.exact_seconds, budget.cheap_seconds = 14.0, 3.0
    budget.charge(3.0)
    clock.now = 3.5  # 0.5 s of training after 2 of 10 epochs: 2.5 projected, 17.5 allowed
    # 3 + 3 + 14 > 17.5: a fill-in now would leave no room for the fit's exact number
    assert budget.decide(2, 10, last=False, cheap=True) == SKIP
    assert budget.fits_beside_fill_in(0.0, 2, 10, last=False) is False
    budget.exact_seconds = 30.0  # the exact number cannot fit anyway: the curve goes on
    assert budget.decide(2, 10, last=False, cheap=True) == CHEAP
    assert budget.fits_beside_fill_in(11.5, 2, 10, last=False)  # 3 + 3 + 11.5 ≤ 17.5
    assert not budget.fits_beside_fill_in(12.0, 2, 10, last=False)


def test_where_the_allowance_decides_the_exact_reserve_gives_way_to_cheap_fill_ins():
    """0.5 s of training after 2 of 10 epochs (2.5 s projected): the allowance leaves 17.5 s;
    3 s spent, the fit-end exact measurement predicted at 14 s. A fill-in at this and every
    later epoch, 9 × 0.3 = 2.7 s, does not fit beside that reserve (3 + 14 + 2.7 > 17.5) but
    costs at most YIELD_SHARE of the 17.5 s: the reserve gives way and the fill-ins run at
    every epoch, and the last epoch still takes the exact measurement (14 ≤ 17.5, and the
    5.4 s spent by then too). At 0.6 s (5.4 s to come, over a quarter) the reserve stands and
    the fill-in waits (3 + 0.6 + 14 > 17.5); so it does where the share decides the fit."""
    assert YIELD_SHARE == 0.25
    budget, clock = _budget(0.3, allowance=20.0)
    budget.exact_seconds, budget.cheap_seconds = 14.0, 0.3
    budget.charge(3.0)
    clock.now = 3.5
    assert budget.decide(2, 10, last=False, cheap=True, since_last=1) == CHEAP
    budget.cheap_seconds = 0.6
    assert budget.decide(2, 10, last=False, cheap=True, since_last=1) == SKIP
    budget.cheap_seconds = 0.3
    budget.charge(2.4)  # eight more fill-ins; the fit's 2.5 s of training at its last epoch
    clock.now = 2.5 + budget.spent
    assert budget.decide(10, 10, last=True, cheap=True) == EXACT
    shared, clock = _budget(0.3, allowance=0.0)  # the share decides: 0.3 · 60 = 18 s
    shared.exact_seconds, shared.cheap_seconds = 14.0, 0.3
    shared.charge(3.0)
    clock.now = 7.0  # 4 s of training after 2 of 30 epochs: 60 s projected
    assert shared.decide(2, 30, last=False, cheap=True, since_last=1) == SKIP  # paced


def test_where_the_exact_number_cannot_fit_the_fill_in_keeps_room_for_its_calibration():
    """Once the fill-in has been calibrated on its own samples (4 s) and the whole set's exact
    measurement cannot fit, the fill-ins leave room for that calibration at the last epoch
    (with its fill-in: 4 + 1 s), while it can still fit."""
    budget, clock = _budget(0.3, allowance=20.0)
    budget.exact_seconds, budget.cheap_seconds = 30.0, 1.0
    budget.charge(10.0)
    clock.now = 10.5  # 0.5 s of training after 2 of 10 epochs: 17.5 allowed
    assert budget.decide(2, 10, last=False, cheap=True) == CHEAP  # no calibration to keep
    budget.subset_seconds = 4.0
    assert budget.decide(2, 10, last=False, cheap=True) == CHEAP  # 10 + 1 + 5 ≤ 17.5
    budget.charge(2.0)
    clock.now = 12.5
    assert budget.decide(2, 10, last=False, cheap=True) == SKIP  # 12 + 1 + 5 > 17.5
    assert budget.fits_beside_fill_in(4.0, 10, 10, last=True)  # the last epoch: 12 + 5 ≤ 19.5
    budget.charge(1.0)  # 13 spent: the calibration cannot fit any more, the curve goes on
    clock.now = 13.5
    assert budget.decide(2, 10, last=False, cheap=True) == CHEAP  # 13 + 1 ≤ 17.5


@pytest.mark.parametrize("calibrated", [False, True])
def test_once_calibrated_the_last_calibration_is_kept_within_the_untimed_part(calibrated):
    """90 s of training after 9 of 10 epochs (100 s projected): 0.8 · 0.3 · 100 = 24 s allowed,
    30 s with the untimed part; 20 s spent, fill-ins of 1 s. Before any calibration in this fit,
    a calibration again of 8.5 + 1 s (with its fill-in) is dropped from the reserve
    (29.5 > 24) and the fill-in runs. Once calibrated (the ratio drifts: the last calibration
    decides the last value), the reserve is kept while it fits within the untimed part
    (29.5 ≤ 30), and a fill-in runs only where it fits beside it there: at 8.5 s it waits
    (30.5 > 30) and the last epoch's calibration runs there; beside one of 4 + 1 s it runs
    (21 ≤ 24 without the reserve, 26 ≤ 30 with it)."""
    budget, clock = _budget(0.3, untimed=0.2)
    budget.exact_seconds, budget.cheap_seconds, budget.subset_seconds = 300.0, 1.0, 8.5
    budget.calibrated = calibrated
    budget.charge(20.0)
    clock.now = 110.0
    assert budget.decide(9, 10, last=False, cheap=True) == (SKIP if calibrated else CHEAP)
    clock.now = 120.0  # the last epoch: 100 s of training
    assert budget.fits_beside_fill_in(8.5, 10, 10, last=True) is calibrated  # 29.5 ≤ 30, > 24
    clock.now = 110.0
    budget.subset_seconds = 4.0
    assert budget.decide(9, 10, last=False, cheap=True) == CHEAP
    budget.subset_seconds = 10.0  # 20 + 11 > 30: past even the untimed part, the curve goes on
    assert budget.decide(9, 10, last=False, cheap=True) == CHEAP  # 20 + 1 ≤ 24
    budget.start()
    assert budget.calibrated is False  # a new fit has not been calibrated


def test_a_calibration_again_mid_fit_leaves_the_last_one_to_the_untimed_part():
    """60 s of training projected after 2 of 30 epochs: 0.8 · 0.3 · 60 = 14.4 s allowed, 18 s
    with the untimed part; 4 s spent, fill-ins of 0.2 s, 28 epochs to go (0.2 + 8.4 s counted
    at FILL_IN_SPREAD), the last calibration's reserve 2 + 0.2 s. In a fit calibrated before,
    that reserve lies within the untimed part: a calibration again of 1.5 s fits
    (4 + 8.6 + 1.5 ≤ 14.4; + 2.2 ≤ 18), one of 2 s does not (14.6 > 14.4); where the reserve
    counted in the 14.4 s (a second calibration again in the fit, or a fit not calibrated),
    neither would (4 + 8.6 + 2.2 + 1.5 > 14.4)."""
    budget, clock = _budget(0.3, untimed=0.2, allowance=0.0)
    budget.exact_seconds, budget.cheap_seconds, budget.subset_seconds = 1e9, 0.2, 2.0
    budget.calibrated = True
    budget.charge(4.0)
    clock.now = 8.0  # 4 s of training after 2 of 30 epochs: 60 s projected
    assert budget.allowed(60.0) == pytest.approx(14.4)
    assert budget.affords_recalibration(1.5, 2, 30)
    assert not budget.affords_recalibration(2.0, 2, 30)
    budget.recalibrated = True  # once taken again in this fit, the reserve is in the 14.4 s
    assert not budget.affords_recalibration(1.5, 2, 30)
    budget.recalibrated, budget.calibrated = False, False
    assert not budget.affords_recalibration(1.5, 2, 30)
    budget.start()
    assert budget.recalibrated is False


def test_the_calibration_on_the_subset_measures_two_probe_rows_per_sample():
    """The probe kernel at its default rows (by name, or options without probes or groups) is
    calibrated with CALIBRATION_PROBES rows per sample (in as many jackknife groups); the rows
    of an options object that names them are measured as given; either for its trace
    functions alone (``summary_only``)."""
    monitor = FlatnessMonitor()
    monitor.state.active_structure = "probe_kernel"
    arguments = monitor.measurer.calibration_arguments()
    assert CALIBRATION_PROBES == 2
    options = arguments["structure"]
    assert isinstance(options, KernelOptions) and options.trace_estimator == "probe"
    assert options.probes == options.groups == 2
    assert options.summary_only is True  # the soft rank is all it needs
    chosen = KernelOptions(probes=6, groups=3)
    monitor = FlatnessMonitor(structure=chosen)
    monitor.state.active_structure = "probe_kernel"
    summed = KernelOptions(probes=6, groups=3, summary_only=True)
    assert monitor.measurer.calibration_arguments() == {"structure": summed}
    monitor = FlatnessMonitor(structure=KernelOptions(side="samples"))
    monitor.state.active_structure = "probe_kernel"
    calibrated = monitor.measurer.calibration_arguments()["structure"]
    assert (calibrated.probes, calibrated.side, calibrated.summary_only) == (2, "samples", True)
    monitor = FlatnessMonitor(structure="cg")
    monitor.state.active_structure = "cg"
    assert monitor.measurer.calibration_arguments() == monitor.measurer.arguments("cg")


def test_a_fill_in_is_never_above_its_rank_bound():
    record = _gap_record(900.0, rank_bound=576.0)
    raw = fill_in_record(record, math.nan)  # unscaled: capped at its own samples' bound
    assert raw["soft_rank"] == 576.0 and raw["predicted_gap_train"] == pytest.approx(0.4 * 5.76)
    assert raw["predicted_gap"] == pytest.approx(0.8 * 576 / 676) and raw["tic"] == 3.0
    scaled = fill_in_record(record, 2.0, rank_bound=5000.0)  # stands for the whole set's
    assert scaled["soft_rank"] == 1800.0 and scaled["rank_bound"] == 5000.0
    capped = fill_in_record(record, 2.0, rank_bound=1000.0)
    assert capped["soft_rank"] == 1000.0 and capped["predicted_gap_val"] == pytest.approx(8.0)


def test_a_first_fill_in_dearer_than_its_part_moves_the_fill_in_to_its_fewest_samples():
    """The part is 0.12 s (as above: 7.2 s allowed over 30 epochs, halved). A first fill-in on
    1,024 samples that took 0.13 s is too dear, one of 0.11 s is not; the check is made once per
    fit, never on the fewest samples already, in a fit of unknown length or without a budget.
    Moved to 128 samples, its cost until measured is scaled along the trial's line (or by the
    samples without one)."""
    for seconds, dear in ((0.13, True), (0.11, False)):
        budget, clock = _budget(0.3, allowance=0.0)
        clock.now = 0.8
        budget.fill_in_samples = FILL_IN_SAMPLES
        assert budget.fill_in_too_dear(seconds, 1, 30) is dear
        assert not budget.fill_in_too_dear(10.0, 1, 30)  # once per fit
        clock.now = 0.0
        budget.start()
        clock.now = 0.8
        budget.fill_in_samples = FILL_IN_SAMPLES
        assert budget.fill_in_too_dear(seconds, 1, 30) is dear  # a new fit checks again
    budget, clock = _budget(0.3, allowance=0.0)
    clock.now = 0.8
    budget.fill_in_samples = FILL_IN_MIN_SAMPLES
    assert not budget.fill_in_too_dear(10.0, 1, 30)
    budget.fill_in_samples = FILL_IN_SAMPLES
    assert not budget.fill_in_too_dear(10.0, 1, None)
    assert not OverheadBudget(None).fill_in_too_dear(10.0, 1, 30)

    budget.fill_in_line = (0.02, 0.00045)
    budget.use_fewest_fill_in_samples(0.5)
    assert budget.fill_in_samples == FILL_IN_MIN_SAMPLES
    line = [0.02 + 0.00045 * samples for samples in (FILL_IN_MIN_SAMPLES, FILL_IN_SAMPLES)]
    assert budget.cheap_seconds == pytest.approx(0.5 * line[0] / line[1])
    budget.fill_in_samples, budget.fill_in_line = FILL_IN_SAMPLES, None
    budget.use_fewest_fill_in_samples(0.5)
    assert budget.cheap_seconds == pytest.approx(0.5 * FILL_IN_MIN_SAMPLES / FILL_IN_SAMPLES)


class WeightsAtEpochEnd(Callback):
    """A copy of the model after each training epoch (after the monitor measured it)."""

    def __init__(self) -> None:
        self.models: list[torch.nn.Module] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.models.append(copy.deepcopy(pl_module).eval())


def _fit(tmp_path, callbacks, max_epochs=3):
    seed_everything(0)
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=16)
    model = FlatnessClassifier(weight_decay=1e-3)
    trainer = quiet_trainer(tmp_path, callbacks, max_epochs=max_epochs, deterministic=True)
    trainer.fit(model, data)
    return trainer, model, data


def _kfac_soft_rank(model, data) -> float:
    x, y = data.train_set.tensors
    return measure(model, [(x, y)], lam=1e-3, num_train_samples=64, structure="kfac").soft_rank


def _cap_fill_in(monkeypatch, samples: int) -> None:
    """The fill-in's sample cap FILL_IN_SAMPLES set to ``samples`` wherever it is read."""
    for module in ("budget", "monitor_measurement", "monitor_checks", "monitor_schedule"):
        monkeypatch.setattr(f"lightning_flatness.lightning.{module}.FILL_IN_SAMPLES", samples)


def _record_measurements(monitor: FlatnessMonitor) -> tuple[list, list]:
    """Every report the monitor's measurements return, and each one's structure with the
    training inputs it measured, in order (filled as the fit runs)."""
    reports, measured = [], []
    original = monitor.measurer.call

    def recording(pl_module, train_batches, *args, **kwargs):
        batches = list(train_batches)
        report = original(pl_module, batches, *args, **kwargs)
        reports.append(report)
        measured.append((report.structure, torch.cat([x for x, _ in batches])))
        return report

    monitor.measurer.call = recording
    return reports, measured


def _fill_in_without_probes(monkeypatch) -> None:
    """``kfac`` by name measured with the exact output rows (Tr(F) still from probes): a
    fill-in whose factors a plain ``measure()`` reproduces."""
    defaults = monitor_measurement.monitor_options

    def options(structure, sketch_factor=None):
        chosen = defaults(structure, sketch_factor)
        return replace(chosen, kfac_mode="exact") if isinstance(chosen, KFACOptions) else chosen

    monkeypatch.setattr(monitor_measurement, "monitor_options", options)


def test_exact_then_fill_in_then_exact_and_training_is_unchanged(tmp_path, monkeypatch):
    _, plain, _ = _fit(tmp_path / "plain", [])
    _fill_in_without_probes(monkeypatch)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [EXACT, CHEAP, EXACT]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    weights = WeightsAtEpochEnd()
    trainer, watched, data = _fit(tmp_path / "watched", [monitor, weights])
    assert [r["fill_in"] for r in monitor.history] == [0.0, 1.0, 0.0]
    ratio = monitor.history[0]["soft_rank"] / _kfac_soft_rank(weights.models[0], data)
    fill_in = monitor.history[1]
    # to float32 round-off: the monitor's measurements read the model in passes of the size its
    # earlier ones found, a copy measured afresh starts with a first pass of FIRST_CHUNK
    assert fill_in["calibration"] == pytest.approx(ratio, rel=1e-6)
    kfac_now = _kfac_soft_rank(weights.models[1], data)
    assert fill_in["soft_rank"] == pytest.approx(ratio * kfac_now, rel=1e-6)
    assert float(trainer.callback_metrics["flatness/overhead"]) > 0.0
    for name, value in plain.state_dict().items():
        assert torch.equal(value, watched.state_dict()[name]), name


def test_the_fill_in_measures_a_fixed_subset_of_at_most_its_sample_cap(tmp_path, monkeypatch):
    """The fill-in's cost stops growing with n: it measures FILL_IN_SAMPLES training samples
    (16 here, of 64), the same ones at every epoch, and its calibration is taken on them."""
    _cap_fill_in(monkeypatch, 16)
    _fill_in_without_probes(monkeypatch)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [EXACT, CHEAP, CHEAP]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    measured = []
    original = monitor.measurer.call

    def recording(pl_module, train_batches, *args, **kwargs):
        batches = list(train_batches)
        measured.append(torch.cat([x for x, _ in batches]))
        return original(pl_module, batches, *args, **kwargs)

    monitor.measurer.call = recording
    _fit(tmp_path, [monitor])
    assert [r["num_samples"] for r in monitor.history] == [64.0, 16.0, 16.0]
    # the trial's runs, then epoch 1: exact and the calibrating fill-in, then two fill-ins
    subsets = [x for x in measured if len(x) == 16]
    assert len(subsets) == 3 and all(torch.equal(x, subsets[0]) for x in subsets)
    assert any(len(x) == 64 for x in measured)


def test_a_fill_in_on_fewer_samples_is_calibrated_on_the_calibrations_subset(tmp_path, monkeypatch):
    """The budget chose 8 fill-in samples (of a cap of 16): every fill-in measures the same 8,
    the calibration's exact structure the 16 of its subset, and the ratio is the whole set's
    extrapolated exact value ÷ the fill-in on its 8."""
    _cap_fill_in(monkeypatch, 16)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [CHEAP, CHEAP, CHEAP]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    monitor.budget.choose_fill_in_samples = lambda *args: 8
    reports, measured = _record_measurements(monitor)
    _fit(tmp_path, [monitor])
    assert monitor.budget.fill_in_samples == 8
    assert monitor.budget.calibrated  # the last epoch's calibration is now reserved
    fill_ins = [x for structure, x in measured if structure == "kfac" and len(x) == 8]
    assert len(fill_ins) == 3  # one at each epoch (the first in the calibration)
    assert all(torch.equal(x, fill_ins[0]) for x in fill_ins)
    assert not any(structure == "kfac" and len(x) != 8 for structure, x in measured[-6:])
    at = next(
        i for i, r in enumerate(reports) if (r.structure, r.num_samples) == ("probe_kernel", 16)
    )
    exact, kfac = reports[at], next(r for r in reports[at:] if r.structure == "kfac")
    assert kfac.num_samples == 8
    half = exact.blocks[FIRST_HALF]
    whole = extrapolated_soft_rank(half.soft_rank, exact.soft_rank, 16, 64)
    assert monitor.history[0]["calibration"] == pytest.approx(whole / kfac.soft_rank, rel=1e-12)


def test_a_first_fill_in_that_cost_too_much_is_measured_again_on_fewer_samples(
    tmp_path, monkeypatch
):
    """The fill-in's part is made 0 s, so its first measurement (on the cap of 16) costs too
    much: it is measured again at once on the fewest samples (8), the calibration's ratio is
    the extrapolated exact value ÷ the fill-in on those 8, and every later fill-in measures the
    same 8."""
    _cap_fill_in(monkeypatch, 16)
    monkeypatch.setattr("lightning_flatness.lightning.budget.FILL_IN_MIN_SAMPLES", 8)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [CHEAP, CHEAP, CHEAP]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    monitor.budget.fits_beside_fill_in = lambda *args: True  # the calibrations always fit
    monitor.budget.choose_fill_in_samples = lambda *args: 16
    monitor.budget._fill_in_part = lambda *args: 0.0
    reports, measured = _record_measurements(monitor)
    _fit(tmp_path, [monitor])
    assert monitor.budget.fill_in_samples == 8
    kfac = [len(x) for structure, x in measured if structure == "kfac"]
    assert kfac[-4:] == [16, 8, 8, 8] and kfac.count(16) == 1  # epoch 0 twice, then 1 and 2
    eights = [x for structure, x in measured if structure == "kfac" and len(x) == 8]
    assert all(torch.equal(x, eights[0]) for x in eights)
    at = next(
        i for i, r in enumerate(reports) if (r.structure, r.num_samples) == ("probe_kernel", 16)
    )
    exact = reports[at]
    fewer = next(r for r in reports[at:] if (r.structure, r.num_samples) == ("kfac", 8))
    whole = extrapolated_soft_rank(exact.blocks[FIRST_HALF].soft_rank, exact.soft_rank, 16, 64)
    assert monitor.history[0]["calibration"] == pytest.approx(whole / fewer.soft_rank, rel=1e-12)
    assert monitor.history[0]["num_samples"] == 8.0


def test_before_any_exact_measurement_the_fill_in_is_calibrated_on_its_own_samples(
    tmp_path, monkeypatch
):
    """The whole set's exact measurement does not fit before the last epoch, the one on the
    fill-in's 16 samples does: the fill-ins are scaled by exact ÷ kfac on those samples, the
    exact value extrapolated to the whole set's 64 samples from it and its first 8 samples'
    (said so), taken once, not the unscaled kfac."""
    _cap_fill_in(monkeypatch, 16)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [CHEAP, CHEAP, EXACT]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    reports = []
    original = monitor.measurer.call

    def recording(*args, **kwargs):
        report = original(*args, **kwargs)
        reports.append(report)
        return report

    monitor.measurer.call = recording
    _, model, _ = _fit(tmp_path, [monitor])
    assert [r["fill_in"] for r in monitor.history] == [1.0, 1.0, 0.0]
    # epoch 0: the exact structure on the subset (its first half read off its kernel) and the
    # fill-in on the subset; epoch 1: the fill-in alone
    on_subset = [r for r in reports if r.num_samples == 16]
    assert [r.structure for r in on_subset] == ["probe_kernel", "kfac", "kfac"]
    exact, kfac = on_subset[:2]
    half = exact.blocks[FIRST_HALF]
    assert half.soft_rank < exact.soft_rank
    whole = extrapolated_soft_rank(half.soft_rank, exact.soft_rank, 16, 64)
    assert whole > exact.soft_rank
    ratio = whole / kfac.soft_rank
    first, second = monitor.history[:2]
    assert first["calibration"] == second["calibration"] == pytest.approx(ratio, rel=1e-12)
    bound = min(sum(p.numel() for p in model.parameters()), 4 * exact.rank_bound)
    assert first["rank_bound"] == bound
    assert first["soft_rank"] == pytest.approx(min(whole, bound), rel=1e-12)
    described = monitor.schedule.calibration.describe()
    assert "at epoch 0, exact on 16 samples, extrapolated to 64" in described


def test_the_last_fill_in_is_calibrated_again_and_a_report_without_a_half_measures_it(
    tmp_path, monkeypatch
):
    """The fill-in's ratio drifts over a fit, so the last epoch (no exact measurement of the
    whole set fitting) calibrates it again on the subset; where the exact structure's report
    has no first half of its own (the P × P side sums over samples: simulated here), the first
    half of the subset is measured on its own."""
    _cap_fill_in(monkeypatch, 16)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [CHEAP, CHEAP, CHEAP]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    monitor.budget.fits_beside_fill_in = lambda *args: True  # the calibration always fits
    reports = []
    original = monitor.measurer.call

    def recording(*args, **kwargs):
        report = original(*args, **kwargs)
        report.blocks.pop(FIRST_HALF, None)  # as from the P × P side: no half of its own
        reports.append(report)
        return report

    monitor.measurer.call = recording
    _fit(tmp_path, [monitor])
    assert [r["fill_in"] for r in monitor.history] == [1.0, 1.0, 1.0]
    on_subset = [(r.structure, r.num_samples) for r in reports if r.num_samples in (8, 16)]
    calibration = [("probe_kernel", 16), ("probe_kernel", 8), ("kfac", 16)]
    assert on_subset[-7:] == [*calibration, ("kfac", 16), *calibration], on_subset
    first, second, last = monitor.history
    assert first["calibration"] == second["calibration"] != last["calibration"]
    assert monitor.schedule.calibration.epoch == 2.0
    exact, half, _ = [r for r in reports if r.num_samples in (8, 16)][-3:]
    whole = extrapolated_soft_rank(half.soft_rank, exact.soft_rank, 16, 64)
    assert last["soft_rank"] == pytest.approx(min(whole, last["rank_bound"]), rel=1e-12)


def test_a_calibration_notices_only_a_drift_beyond_its_factor():
    """The ratio is taken again only where the fill-in's own value has moved by more than
    RECALIBRATE_DRIFT, either way; never without a value at calibration."""
    calibration = Calibration(0.5, 0.0, 16, fill_in=100.0)
    assert not calibration.drifted(100.0 * RECALIBRATE_DRIFT)
    assert calibration.drifted(100.0 * RECALIBRATE_DRIFT * 1.01)
    assert not calibration.drifted(100.0 / RECALIBRATE_DRIFT)
    assert calibration.drifted(100.0 / RECALIBRATE_DRIFT / 1.01)
    assert not calibration.drifted(math.nan)
    assert not Calibration(0.5, 0.0, 16).drifted(1e6)  # no fill-in value recorded


@pytest.mark.parametrize("moved", [1.1, 2.0])
def test_a_fill_in_that_drifted_is_calibrated_again_with_its_own_record(
    tmp_path, monkeypatch, moved
):
    """The fill-in's own soft rank at epoch 1 is made ``moved`` times its value at the
    calibration of epoch 0: by 2 (beyond RECALIBRATE_DRIFT) the exact structure is measured on
    the subset again at epoch 1 and the ratio is taken with that epoch's fill-in record, not a
    second fill-in; by 1.1 epoch 1 keeps epoch 0's ratio."""
    _cap_fill_in(monkeypatch, 16)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [CHEAP, CHEAP, EXACT]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    monitor.budget.fits_beside_fill_in = lambda *args: True  # a calibration always fits
    monitor.budget.affords_recalibration = lambda *args: True
    schedule = monitor.schedule
    cheap_record = schedule._cheap_record
    measured = []

    def drifting(trainer, pl_module):
        record = cheap_record(trainer, pl_module)
        if trainer.current_epoch == 1:
            record["soft_rank"] = schedule.calibration.fill_in * moved
        measured.append((trainer.current_epoch, "kfac", record["soft_rank"]))
        return record

    original = monitor.measurer.call

    def recording(pl_module, train_batches, *args, **kwargs):
        report = original(pl_module, train_batches, *args, **kwargs)
        if report.structure == "probe_kernel" and report.num_samples == 16:
            measured.append((pl_module.trainer.current_epoch, "exact", report.soft_rank))
        return report

    monkeypatch.setattr(schedule, "_cheap_record", drifting)
    monitor.measurer.call = recording
    _fit(tmp_path, [monitor])
    first, second, _ = monitor.history
    assert [r["fill_in"] for r in monitor.history] == [1.0, 1.0, 0.0]
    kinds = [(epoch, kind) for epoch, kind, _ in measured]
    if moved > RECALIBRATE_DRIFT:
        assert kinds == [(0, "exact"), (0, "kfac"), (1, "kfac"), (1, "exact")]
        assert second["calibration"] != first["calibration"]
        # the new ratio stands for the drifted fill-in: its scaled value is the subset's
        # extrapolated exact value, whatever the fill-in moved to
        scaled = min(second["calibration"] * measured[2][2], second["rank_bound"])
        assert second["soft_rank"] == pytest.approx(scaled, rel=1e-12)
    else:
        assert kinds == [(0, "exact"), (0, "kfac"), (1, "kfac")]
        assert second["calibration"] == first["calibration"]


class CountingDataset(TensorDataset):
    """A TensorDataset that counts the samples read from it."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def _fill_in_fit(tmp_path, monkeypatch, kept: bool) -> tuple[FlatnessMonitor, int]:
    """Three epochs with a fill-in at each (of 16 training and 16 held-out samples); the
    monitor's history and the samples read from both datasets."""
    _cap_fill_in(monkeypatch, 16)
    if not kept:
        monkeypatch.setattr(
            "lightning_flatness.lightning.monitor_measurement.KEPT_SUBSET_NUMBERS", -1
        )
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=16)
    data.setup("fit")
    train, val = CountingDataset(*data.train_set.tensors), CountingDataset(*data.val_set.tensors)
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    script = [CHEAP, CHEAP, CHEAP]
    monitor.budget.decide = lambda *args, **kwargs: script.pop(0)
    seed_everything(0)
    trainer = quiet_trainer(tmp_path, [monitor], max_epochs=3, deterministic=True)
    loaders = DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=32)
    trainer.fit(FlatnessClassifier(weight_decay=1e-3), *loaders)
    return monitor, train.reads + val.reads


def test_the_fill_in_reads_its_fixed_subset_once_per_fit(tmp_path, monkeypatch):
    """The fill-in's subset does not change between measurements: it is read from the
    dataset at the first fill-in only, and the values are those of reading it every time."""
    kept, kept_reads = _fill_in_fit(tmp_path / "kept", monkeypatch, kept=True)
    again, reads = _fill_in_fit(tmp_path / "again", monkeypatch, kept=False)
    assert [r["fill_in"] for r in kept.history] == [1.0, 1.0, 1.0]
    # five measurements read the subset: the calibrations on it at the first and the last
    # epoch and the three fill-ins. Kept, its held-out half is read once, by the first; its
    # training half once, by the settled test at train start, which also reads it (not kept)
    # at the ends of the three epochs
    assert reads - kept_reads == (5 - 1) * 16 + 5 * 16 + 3 * 16
    assert kept.measurer._kept_subsets == {}  # not held beyond the fit
    for record, reference in zip(kept.history, again.history, strict=True):
        for name in ("soft_rank", "trace_ratio_train", "trace_ratio_val", "val_nll"):
            assert record[name] == pytest.approx(reference[name], rel=1e-12), name


def test_an_early_stopping_on_a_flatness_value_gets_one_every_epoch(tmp_path, caplog):
    """No exact measurement fits (it is said to cost 1e9 s): the fill-in runs every epoch,
    unscaled, and the monitor says at fit end that the last values are not exact."""
    monitor = FlatnessMonitor(log_options=LogOptions(summary=False))
    monitor.budget.exact_seconds = 1e9
    stopping = EarlyStopping(monitor="flatness/predicted_test_nll", patience=10)
    with caplog.at_level("INFO"):
        _fit(tmp_path, [monitor, stopping])
    assert [r["fill_in"] for r in monitor.history] == [1.0, 1.0, 1.0]
    assert all(math.isnan(r["calibration"]) for r in monitor.history)  # no exact ratio
    said = [
        r.getMessage() for r in caplog.records if "did not fit what this fit may" in r.getMessage()
    ]
    assert len(said) == 1 and "overhead_budget=None" in said[0] and "unscaled" in said[0]


def test_what_does_not_fit_is_skipped_and_said(tmp_path, caplog):
    monitor = FlatnessMonitor(
        structure="kfac", log_options=LogOptions(summary=False)
    )  # no cheaper fill-in
    monitor.budget.exact_seconds = 1e9
    with caplog.at_level("INFO"):
        trainer, _, _ = _fit(tmp_path, [monitor])
    assert monitor.history == [] and trainer.current_epoch == 3
    assert monitor.state.skipped == [0, 1, 2]  # each epoch decided once, the fit end not again
    said = [r.getMessage() for r in caplog.records if "no measurement fitted" in r.getMessage()]
    assert len(said) == 1 and "overhead_budget=None" in said[0]


def test_a_fit_end_measurement_follows_the_budget_too(tmp_path):
    """every_n_epochs=2 over 3 epochs: the last epoch is measured at fit end, as a fill-in when
    the exact measurement does not fit."""
    monitor = FlatnessMonitor(every_n_epochs=2, log_options=LogOptions(summary=False))
    monitor.budget.exact_seconds = 1e9
    monitor.budget.clock = lambda: time.perf_counter() * 1e6  # a long fit: the fill-in fits
    monitor.budget.cheap_seconds = 1e-3
    _fit(tmp_path, [monitor])
    assert [(r["epoch"], r["fill_in"]) for r in monitor.history] == [(1.0, 1.0), (2.0, 1.0)]


@pytest.mark.parametrize(
    ("batch_size", "exact", "fill_in"),
    [(None, [256] * 11 + [184], [1024]), (100, [100] * 30, [100] * 10 + [24])],
)
def test_measurement_batches_by_default_and_as_asked(batch_size, exact, fill_in):
    """By default the exact measurement reads batches of 256 and the fill-in its whole subset
    of at most FILL_IN_SAMPLES in one batch (the hooks split it into passes); a batch size the
    user gives is used for both."""
    data = TensorDataset(torch.randn(3000, 3), torch.zeros(3000, dtype=torch.long))
    loader = DataLoader(data, batch_size=64)
    trainer = SimpleNamespace(global_rank=0, world_size=1)
    monitor = FlatnessMonitor(batch_size=batch_size)
    sizes = [len(y) for _, y in monitor.measurer.batches(trainer, loader, "training")]
    assert sizes == exact
    sizes = [
        len(y) for _, y in monitor.measurer.batches(trainer, loader, "training", FILL_IN_SAMPLES)
    ]
    assert sizes == fill_in


@pytest.mark.parametrize(
    ("numbers", "expected"), [(4, 1024), (2**15, 1024), (2**16, 512), (2**20, 256)]
)
def test_the_fill_in_batch_is_bounded_by_the_numbers_it_holds(numbers, expected):
    """The fill-in reads its subset whole unless that batch would hold more than
    FILL_IN_BATCH_NUMBERS numbers (the first training batch tells one sample's), never fewer
    than 256 samples per batch."""
    monitor = FlatnessMonitor()
    monitor.state.sample_numbers = numbers
    assert monitor.measurer.fill_in_batch_size() == expected
    batch = (torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.long), {"mask": torch.ones(8, 2)})
    assert tensor_numbers(batch) == 8 * (48 + 1 + 2)


@pytest.mark.parametrize("world", [1, 2])
def test_the_fit_start_prediction_is_of_each_process_share(world, monkeypatch):
    """Under data parallelism each process measures every world-th sample of the set and of
    the fill-in's subset: the first exact measurement and the fill-in are predicted for that
    share, not for the whole set (which put them at twice their cost on two processes)."""
    monitor = FlatnessMonitor()
    monitor.state.resolved_num_train_samples = 4000
    monitor.state.active_structure = "probe_kernel"
    monitor.fit_start.trial_samples = 32
    monkeypatch.setattr(monitor.fit_start, "_trial", lambda *args: None)
    monkeypatch.setattr(monitor.fit_start, "_timed_runs", lambda *args: {8: 0.8, 32: 2.0})
    monkeypatch.setattr(monitor.fit_start, "quadrature_seconds", lambda *args: 0.0)
    trainer = SimpleNamespace(world_size=world)
    monitor.fit_start.timed_trial(trainer, None, None)
    # 0.0625 s a sample from the 32-sample run (the lower); the fill-in's line: 0.4 s + 0.05 s
    # a sample over its 1,024 training and 1,024 held-out samples
    assert monitor.budget.exact_seconds == pytest.approx(0.0625 * 4000 / world)
    assert monitor.budget.cheap_seconds == pytest.approx(0.4 + 0.05 * 2048 / world)
    # per sample of the fill-in's subset, its held-out samples and the process's share in it
    assert monitor.budget.fill_in_line == pytest.approx((0.4, 0.1 / world))
