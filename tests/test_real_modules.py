"""FlatnessMonitor at its defaults on LightningModules written the way users write them.

Dict batches, tuple inputs, outputs that are tuples, dicts or objects with ``.logits``, a
module without ``forward``, BCE (multi-label and single-logit binary), MSE regression, label
smoothing and two validation loaders. Each fit's numbers
must equal those of the same model measured with plain ``(x, y)`` batches, or the fit must stop
at its start with one message naming the fix.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_records_equal
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_flatness import (
    BatchReading,
    FlatnessMonitor,
    KernelOptions,
    PenaltyOptions,
    SoftRankRegularizer,
    measure,
)
from lightning_flatness.lightning.log_options import LogOptions

N_TRAIN, N_VAL, BATCH = 48, 24, 16
LAM = 1e-3


def _data(kind: str, size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 1, 7, 7, generator=generator)
    if kind == "multilabel":
        y = (torch.rand(size, 4, generator=generator) < 0.4).float()
    elif kind == "binary":
        y = (x.mean((1, 2, 3)) > 0).float()
    elif kind == "regression":
        y = torch.randn(size, 3, generator=generator)
    else:
        y = torch.randint(0, 5, (size,), generator=generator)
    return x, y


def _outputs(kind: str) -> int:
    return {"multilabel": 4, "binary": 1, "regression": 3}.get(kind, 5)


@dataclass
class Output:
    """What a Hugging Face model returns: an object with ``.logits`` (and more)."""

    logits: torch.Tensor
    hidden: torch.Tensor


class UserClassifier(LightningModule):
    """A classifier as a user writes it; ``batches``/``output``/``loss`` pick the conventions."""

    def __init__(self, kind="classes", batches="tuple", output="tensor", smoothing=0.0):
        super().__init__()
        self.kind, self.batches, self.output, self.smoothing = kind, batches, output, smoothing
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(49, 12), nn.ReLU())
        self.head = nn.Linear(12, _outputs(kind))

    def forward(self, x):
        return self._pack(self.head(self.body(x)), x)

    def _pack(self, logits, x):
        features = x.flatten(1)
        if self.output == "tuple":
            return logits, features
        if self.output == "dict":
            return {"features": features, "logits": logits}
        if self.output == "object":
            return Output(logits=logits, hidden=features)
        return logits

    def _split(self, batch):
        if self.batches == "dict":
            return {"x": batch["x"]}, batch["y"]
        if self.batches == "hf":
            return {"x": batch["x"], "scale": batch["scale"]}, batch["labels"]
        if self.batches == "tuple2":
            return {"x": batch[0][0], "scale": batch[0][1]}, batch[1]
        return {"x": batch[0]}, batch[1]

    def _loss(self, batch):
        inputs, y = self._split(batch)
        output = self(**inputs)
        logits = (
            output
            if isinstance(output, torch.Tensor)
            else (
                output.logits
                if isinstance(output, Output)
                else output["logits"]
                if isinstance(output, dict)
                else output[0]
            )
        )
        if self.kind in ("multilabel", "binary"):
            return F.binary_cross_entropy_with_logits(logits, y.reshape(logits.shape))
        if self.kind == "regression":
            return F.mse_loss(logits, y)
        return F.cross_entropy(logits, y, label_smoothing=self.smoothing)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=LAM)


class TwoInputClassifier(UserClassifier):
    """``forward(x, scale)``: two inputs, as a Hugging Face model takes ids and a mask."""

    def forward(self, x, scale):
        return self._pack(self.head(self.body(x)) * scale.unsqueeze(-1), x)


def _dataset(kind: str, batches: str, size: int, seed: int) -> list:
    x, y = _data(kind, size, seed)
    if batches == "dict":
        return [{"x": x[i], "y": y[i]} for i in range(size)]
    if batches == "hf":
        return [{"x": x[i], "scale": torch.tensor(1.0), "labels": y[i]} for i in range(size)]
    if batches == "tuple2":
        return [((x[i], torch.tensor(1.0)), y[i]) for i in range(size)]
    return [(x[i], y[i]) for i in range(size)]


def fit(module, monitor=None, kind="classes", val_sets=1, max_epochs=2):
    seed_everything(0)
    train = DataLoader(_dataset(kind, module.batches, N_TRAIN, 1), batch_size=BATCH, shuffle=True)
    vals = [
        DataLoader(_dataset(kind, module.batches, N_VAL, 2 + i), batch_size=BATCH)
        for i in range(val_sets)
    ]
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=[] if monitor is None else [monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module, train, vals if val_sets > 1 else vals[0])
    return trainer


def _records(monitor):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in monitor.history]


def _plain_measurement(module, kind, loss: str = "cross_entropy"):
    """The same weights measured with plain (x, y) batches and a tensor-returning model."""
    plain = UserClassifier(kind=kind)
    plain.load_state_dict(module.state_dict())
    x, y = _data(kind, N_TRAIN, 1)
    vx, vy = _data(kind, N_VAL, 2)
    return measure(
        plain,
        [(x, y)],
        val_batches=[(vx, vy)],
        lam=LAM,
        num_train_samples=N_TRAIN,
        structure=KernelOptions(trace_estimator="probe"),  # the monitor's defaults
        reading=BatchReading(loss=loss),
    )


def _monitor(**kwargs) -> FlatnessMonitor:
    """Measured exactly at each epoch (compared with measure()), whatever the timing."""
    kwargs.setdefault("overhead_budget", None)
    return FlatnessMonitor(**kwargs, log_options=LogOptions(summary=False, spectrum=False))


def _assert_matches(record, report):
    for key in ("soft_rank", "trace_fisher", "trace_cov", "train_nll", "val_nll"):
        assert record[key] == pytest.approx(getattr(report, key), rel=1e-5), key
    assert math.isfinite(record["predicted_gap"])


def test_dict_batches_give_the_numbers_of_plain_batches():
    module = UserClassifier(batches="dict")
    monitor = _monitor()
    fit(module, monitor)
    reference = _monitor()
    fit(UserClassifier(batches="tuple"), reference)
    assert_records_equal(_records(monitor)[-1], _records(reference)[-1])
    _assert_matches(monitor.history[-1], _plain_measurement(module, "classes"))


def test_hugging_face_style_batches_called_with_keywords_equal_tuple_inputs():
    """``{"x", "scale", "labels"}`` → ``module(x=..., scale=...)``; ``((x, scale), y)`` →
    ``module(x, scale)``: the same model, the same numbers."""
    monitor, reference = _monitor(), _monitor()
    fit(TwoInputClassifier(batches="hf", output="object"), monitor)
    fit(TwoInputClassifier(batches="tuple2"), reference)
    assert_records_equal(_records(monitor)[-1], _records(reference)[-1])
    assert math.isfinite(monitor.history[-1]["soft_rank"])


@pytest.mark.parametrize("output", ["tuple", "dict", "object"])
def test_outputs_that_are_not_a_bare_tensor(output):
    monitor, reference = _monitor(), _monitor()
    fit(UserClassifier(output=output), monitor)
    fit(UserClassifier(), reference)
    assert_records_equal(_records(monitor)[-1], _records(reference)[-1])


class NoForward(LightningModule):
    """The network lives in ``self.model``; ``training_step`` calls it; no ``forward``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(49, 5))
        self.batches = "tuple"

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, weight_decay=LAM)


def test_module_without_forward_fails_at_fit_start_naming_logits_fn():
    with pytest.raises(ValueError, match=r"NoForward defines no forward\(\).*logits_fn="):
        fit(NoForward(), _monitor())
    monitor = _monitor(reading=BatchReading(logits_fn=lambda module, x: module.model(x)))
    fit(NoForward(), monitor)
    assert math.isfinite(monitor.history[-1]["soft_rank"])


@pytest.mark.parametrize("kind", ["multilabel", "binary"])
def test_bce_multilabel_and_binary(kind):
    module = UserClassifier(kind=kind)
    monitor = _monitor(reading=BatchReading(loss="bce"))
    fit(module, monitor, kind=kind)
    record = monitor.history[-1]
    _assert_matches(record, _plain_measurement(module, kind, loss="bce"))
    assert 0.0 <= record["train_accuracy"] <= 1.0


def test_multi_hot_targets_with_the_default_loss_fail_at_fit_start_suggesting_bce():
    with pytest.raises(ValueError, match="loss='bce'"):
        fit(UserClassifier(kind="multilabel"), _monitor(), kind="multilabel")


def test_mse_regression_logs_nan_accuracy():
    module = UserClassifier(kind="regression")
    monitor = _monitor(reading=BatchReading(loss="mse"))
    fit(module, monitor, kind="regression")
    record = monitor.history[-1]
    _assert_matches(record, _plain_measurement(module, "regression", loss="mse"))
    assert math.isnan(record["train_accuracy"]) and math.isnan(record["val_accuracy"])
    assert math.isnan(record["error_uncertainty_train"])


def test_label_smoothing_logs_the_plain_nll_under_its_own_name():
    module = UserClassifier(smoothing=0.3)
    monitor = _monitor()
    trainer = fit(module, monitor)
    record = monitor.history[-1]
    assert "train_loss" not in record and "val_loss" not in record
    plain = _plain_measurement(module, "classes")
    _assert_matches(record, plain)
    x, y = _data("classes", N_TRAIN, 1)
    with torch.no_grad():
        smoothed = float(F.cross_entropy(module(x), y, label_smoothing=0.3))
        unsmoothed = float(F.cross_entropy(module(x), y))
    assert record["train_nll"] == pytest.approx(unsmoothed, rel=1e-5)
    assert abs(record["train_nll"] - smoothed) > 0.05
    assert "flatness/train_nll" in trainer.callback_metrics


def test_second_validation_loader_is_used_when_asked(caplog):
    module = UserClassifier()
    monitor = _monitor(val_dataloader=1)
    with caplog.at_level("INFO"):
        fit(module, monitor, val_sets=2)
    assert sum("2 validation dataloaders" in r.getMessage() for r in caplog.records) == 1
    x, y = _data("classes", N_TRAIN, 1)
    vx, vy = _data("classes", N_VAL, 3)  # the second loader's samples
    report = measure(module, [(x, y)], val_batches=[(vx, vy)], lam=LAM, num_train_samples=N_TRAIN)
    assert monitor.history[-1]["val_nll"] == pytest.approx(report.val_nll, rel=1e-6)


def test_val_dataloader_beyond_the_loaders_fails_at_fit_start():
    with pytest.raises(ValueError, match="val_dataloader=3"):
        fit(UserClassifier(), _monitor(val_dataloader=3), val_sets=2)


def test_unreadable_batch_fails_once_at_fit_start_or_switches_off_with_strict_false(
    monkeypatch,
):
    class Batchless(UserClassifier):
        def _split(self, batch):
            return {"x": batch["image"]}, batch["answer"]

    def dataset(kind, batches, size, seed):
        x, y = _data(kind, size, seed)
        return [{"image": x[i], "answer": y[i]} for i in range(size)]

    monkeypatch.setattr(sys.modules[__name__], "_dataset", dataset)
    with pytest.raises(ValueError, match="unpack_batch="):
        fit(Batchless(batches="custom"), _monitor())
    monitor = _monitor(strict=False)
    with pytest.warns(UserWarning, match="switched off"):
        fit(Batchless(batches="custom"), monitor)
    assert monitor.history == [] and monitor.disabled_reason
    unpacked = _monitor(reading=BatchReading(unpack_batch=lambda b: (b["image"], b["answer"])))
    fit(Batchless(batches="custom"), unpacked)
    assert math.isfinite(unpacked.history[-1]["soft_rank"])


@pytest.mark.parametrize(
    ("cls", "kind", "batches", "output", "loss"),
    [
        (TwoInputClassifier, "classes", "hf", "object", "cross_entropy"),
        (UserClassifier, "multilabel", "dict", "tuple", "bce"),
    ],
)
def test_metrics_only_monitor_leaves_training_bit_identical(cls, kind, batches, output, loss):
    watched = cls(kind=kind, batches=batches, output=output)
    fit(watched, _monitor(reading=BatchReading(loss=loss)), kind=kind)
    alone = cls(kind=kind, batches=batches, output=output)
    fit(alone, None, kind=kind)
    for (name, a), (_, b) in zip(
        watched.state_dict().items(), alone.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("kind", "loss", "estimator"),
    [
        ("classes", "cross_entropy", "batched"),
        ("multilabel", "bce", "batched"),
        ("classes", "cross_entropy", "compositional"),
        ("multilabel", "bce", "compositional"),
    ],
)
def test_regularizer_on_dict_batches_trains_as_on_tuple_batches(kind, loss, estimator):
    """The penalty unpacks the batch like the measurement: dict batches give the same fit."""
    weights = []
    for batches in ("dict", "tuple"):
        module = UserClassifier(kind=kind, batches=batches, output="tuple")
        regularizer = SoftRankRegularizer(
            strength=5.0 if estimator == "batched" else 0.5,
            penalty=PenaltyOptions(estimator=estimator),
        )
        monitor = _monitor(
            reading=BatchReading(loss=loss), regularize=regularizer, every_n_epochs=2
        )
        fit(module, monitor, kind=kind)
        weights.append(module.state_dict())
    plain = UserClassifier(kind=kind)
    fit(plain, None, kind=kind)
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name
    assert not torch.equal(weights[0]["head.weight"], plain.state_dict()["head.weight"])
