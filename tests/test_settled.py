"""The monitor's settled test: ``trusted`` is 0 while the training NLL still falls by more than
SETTLED_DROP per epoch (a short fit is not at a minimum and Eq. 13 over-estimates its gap), the
NLL is read without changing anything, and training is the same with and without the monitor."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import batches, quiet_trainer, random_data
from lightning.pytorch import Callback, seed_everything

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule, measure
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.core.training_nll import mean_nll
from lightning_flatness.core.trust import (
    DECREMENT_LIMIT,
    SETTLED_DROP,
    nll_drop,
    settled_verdict,
)
from lightning_flatness.lightning.budget import OverheadBudget
from lightning_flatness.lightning.figures import summary_table
from lightning_flatness.lightning.monitor_nll import TrainingNll


class FrozenFrom(Callback):
    """Sets every learning rate to 0 from epoch ``epoch`` on: the weights stop moving, so the
    training NLL settles exactly."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch >= self.epoch:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = 0.0


def _mlp_fit(tmp_path, callbacks, max_epochs: int = 2) -> FlatnessClassifier:
    """The paper's MLP on 400 MNIST 7×7 images, Adam at lr 1e-2 (the NLL falls fast)."""
    seed_everything(0)
    data = MNIST7DataModule(train_size=400, val_size=200, batch_size=32)
    model = FlatnessClassifier(lr=1e-2, weight_decay=1e-3)
    trainer = quiet_trainer(tmp_path, callbacks, max_epochs=max_epochs, deterministic=True)
    trainer.fit(model, data)
    return model


@pytest.fixture(scope="module")
def short_fit(tmp_path_factory):
    """A 2-epoch fit with the monitor at its defaults (no budget) and the same fit without."""
    monitor = FlatnessMonitor(overhead_budget=None)
    watched = _mlp_fit(tmp_path_factory.mktemp("watched"), [monitor])
    plain = _mlp_fit(tmp_path_factory.mktemp("plain"), [])
    return monitor, watched, plain


def test_a_short_fit_is_not_trusted_and_the_summary_says_why(short_fit):
    monitor, _, _ = short_fit
    last = monitor.history[-1]
    assert last["trust_score"] >= 0.3  # α_train alone would trust it
    assert last["nll_drop"] > SETTLED_DROP
    assert last["trusted"] == 0.0
    assert set(monitor.nll.by_epoch) == {-1, 0, 1}  # before the first epoch, then each one
    expected = nll_drop(monitor.nll.by_epoch[0], monitor.nll.by_epoch[1])
    assert last["nll_drop"] == pytest.approx(expected)
    summary = summary_table(last, "probe_kernel")
    assert f"the training loss still fell by {last['nll_drop']:.1%}" in summary
    assert "not at a minimum yet" in summary


def test_the_monitor_leaves_training_bit_identical(short_fit):
    _, watched, plain = short_fit
    for name, value in plain.state_dict().items():
        assert torch.equal(value, watched.state_dict()[name]), name


def test_a_stopped_fit_is_settled_but_not_at_a_minimum(tmp_path):
    """Two epochs of training, then one at learning rate 0: the NLL did not fall over the last
    epoch, so the settled test passes and ``trusted`` is the report's own verdict; that verdict
    is 0, since the Newton decrement sees what the drop cannot: weights stopped two epochs into
    training are far from a minimum. The summary says so."""
    monitor = FlatnessMonitor(overhead_budget=None, every_n_epochs=3)
    _mlp_fit(tmp_path, [monitor, FrozenFrom(2)], max_epochs=3)
    (record,) = monitor.history
    assert record["nll_drop"] == 0.0
    assert record["trust_score"] >= 0.3
    assert record["soft_rank"] <= record["rank_bound"]
    assert record["newton_decrement"] > DECREMENT_LIMIT
    assert record["trusted"] == 0.0
    assert monitor.nll.by_epoch[1] == monitor.nll.by_epoch[2]
    assert "the Newton decrement is" in summary_table(record, "probe_kernel")


def test_the_nll_is_the_train_nll_of_measure_and_changes_nothing():
    """A model with BatchNorm and Dropout in training mode: the NLL is ``measure()``'s
    ``train_nll``; modes, BatchNorm statistics and the global RNG are as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(49, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(16, 10),
    ).double()
    model.train()
    model[4].eval()  # a mixed mode, to be restored module by module
    inputs, targets = random_data(40)
    data = batches(inputs, targets, 16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    value = mean_nll(model, data)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model] == [True, True, True, True, False, True]
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[key]), key
    assert all(p.grad is None for p in model.parameters())
    report = measure(model, data, lam=1e-3, num_train_samples=40)
    assert value == pytest.approx(report.train_nll, rel=1e-12)
    assert math.isnan(mean_nll(model, []))


@pytest.mark.parametrize(
    ("previous", "now", "drop"),
    [(1.1, 1.0, 0.1), (1.0, 1.0, 0.0), (1.0, 1.25, -0.2), (math.nan, 1.0, math.nan)],
)
def test_nll_drop_is_relative_to_the_new_value(previous, now, drop):
    assert nll_drop(previous, now) == pytest.approx(drop, nan_ok=True)


def test_settled_verdict_untrusts_a_falling_or_unknown_loss_and_keeps_nan():
    assert settled_verdict(1.0, SETTLED_DROP) == 1.0
    assert settled_verdict(1.0, -0.3) == 1.0  # a rising loss is not a descent
    assert settled_verdict(1.0, SETTLED_DROP * 1.01) == 0.0
    assert settled_verdict(1.0, math.nan) == 0.0
    assert settled_verdict(0.0, 0.0) == 0.0
    assert math.isnan(settled_verdict(math.nan, 0.5))


def test_the_settled_part_reads_once_per_epoch_and_fails_to_nan():
    """``TrainingNll`` on its own: each epoch read once (on the batches it is handed, the time
    charged), a failed reading NaN with one warning, and ``settle`` untrusting a falling NLL."""
    model = torch.nn.Linear(3, 2)
    inputs, targets = torch.randn(8, 3), torch.tensor([0, 1] * 4)
    budget = OverheadBudget(0.3)
    nll = TrainingNll(BatchReading(), budget)
    reads = []

    def read():
        reads.append(1)
        return [(inputs, targets)]

    nll.record(model, 0, read)
    nll.record(model, 0, read)
    assert len(reads) == 1 and budget.spent > 0
    assert nll.by_epoch[0] == pytest.approx(mean_nll(model, [(inputs, targets)]))

    def broken():
        raise RuntimeError("no batch")

    with pytest.warns(UserWarning, match="could not be read"):
        nll.record(model, 1, broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nll.record(model, 2, broken)  # said once
    assert math.isnan(nll.by_epoch[1]) and math.isnan(nll.by_epoch[2])
    nll.by_epoch.update({3: 2.0, 4: 1.0})  # halved over epoch 4: still descending
    record = {"trusted": 1.0}
    nll.settle(record, 4)
    assert record["nll_drop"] == pytest.approx(1.0) and record["trusted"] == 0.0
    nll.reset()
    assert nll.by_epoch == {}
