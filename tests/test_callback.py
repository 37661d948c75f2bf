"""FlatnessMonitor in real (tiny) fits: logging, λ and n resolution, failures, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_records_equal
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule, measure
from lightning_flatness.core.options import DenseOptions, KFACOptions
from lightning_flatness.core.reading import BatchReading
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.trainer_facts import LambdaResolutionError, resolve_lam


def fit(tmp_path, callbacks=(), architecture="mlp", max_epochs=2, optimizer="adam", **trainer_kw):
    seed_everything(0)
    data = MNIST7DataModule(train_size=256, val_size=128, batch_size=32)
    model = FlatnessClassifier(architecture=architecture, optimizer=optimizer, weight_decay=1e-3)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        enable_model_summary=False,
        deterministic=True,
        **{"enable_progress_bar": False, **trainer_kw},
    )
    trainer.fit(model, data)
    return trainer, model, data


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"structure": "full"}, "'full'"),
        ({"every_n_epochs": 0}, "every_n_epochs"),
        ({"max_samples": -5}, "max_samples"),
        ({"lam": 0.0}, "lam"),
        ({"structure": KFACOptions}, "KFACOptions"),
        ({"val_dataloader": -1}, "val_dataloader"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"reading": {"loss": "bce"}}, "BatchReading"),
        ({"log_options": "flatness/"}, "LogOptions"),
        ({"regularize": "yes"}, "SoftRankRegularizer"),
    ],
)
def test_arguments_are_validated_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlatnessMonitor(**kwargs)


def test_settings_objects_are_validated_when_built():
    with pytest.raises(ValueError, match="'cheap'"):
        KFACOptions(trace_estimator="cheap")
    with pytest.raises(ValueError, match="loss"):
        BatchReading(loss="hinge")
    with pytest.raises(ValueError, match="figure_every_n_measurements"):
        LogOptions(figure_every_n_measurements=0)


def _optimizer(name, **kwargs):
    param = torch.nn.Parameter(torch.zeros(2))
    return getattr(torch.optim, name)([param], lr=0.1, **kwargs)


def test_lambda_is_read_from_coupled_weight_decay():
    assert resolve_lam([_optimizer("SGD", weight_decay=1e-3)], None) == 1e-3
    assert resolve_lam([_optimizer("Adam", weight_decay=2e-4)], None) == 2e-4
    assert resolve_lam([_optimizer("AdamW", weight_decay=1e-2)], 5e-4) == 5e-4  # explicit wins


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        (lambda: _optimizer("AdamW", weight_decay=1e-2), "AdamW uses decoupled"),
        (lambda: _optimizer("Adam", weight_decay=0.0), "weight_decay is 0.0"),
        (lambda: _optimizer("Adam", weight_decay=1e-3, decoupled_weight_decay=True), "decoupled"),
    ],
)
def test_lambda_refusals_say_to_pass_lam(optimizer, match):
    with pytest.raises(LambdaResolutionError, match=f"{match}.*lam="):
        resolve_lam([optimizer()], None)


def test_lambda_refused_for_differing_parameter_groups():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD(
        [{"params": [a], "weight_decay": 1e-3}, {"params": [b], "weight_decay": 0.0}], lr=0.1
    )
    with pytest.raises(LambdaResolutionError, match=r"different weight decays \[0.0, 0.001\]"):
        resolve_lam([optimizer], None)


def test_adamw_fit_fails_before_training_with_the_fix(tmp_path):
    with pytest.raises(LambdaResolutionError, match="lam="):
        fit(tmp_path, [FlatnessMonitor()], optimizer="adamw", max_epochs=1)


def test_metrics_are_logged_and_monitorable(tmp_path):
    monitor = FlatnessMonitor(structure="kfac")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="flatness/predicted_test_nll")
    stopping = EarlyStopping(monitor="flatness/predicted_test_nll", patience=5)
    trainer, _, _ = fit(tmp_path, [monitor, checkpoint, stopping])
    metrics = trainer.callback_metrics
    for name in ("soft_rank", "predicted_gap", "predicted_test_nll", "observed_gap", "tic"):
        assert f"flatness/{name}" in metrics
    assert len(monitor.history) == 2
    last = monitor.history[-1]
    assert last["num_train_samples"] == 256 and last["num_samples"] == 256
    assert last["lam"] == pytest.approx(1e-3)
    assert checkpoint.best_model_path  # ModelCheckpoint found the metric
    assert float(metrics["flatness/soft_rank"]) == pytest.approx(last["soft_rank"], rel=1e-6)


def test_logged_values_equal_a_direct_measurement(tmp_path):
    """The callback measures the end-of-epoch weights on the fixed subset it documents."""
    monitor = FlatnessMonitor(
        structure="diag", max_samples=100, max_val_samples=50, seed=3, overhead_budget=None
    )
    trainer, model, _ = fit(tmp_path, [monitor], max_epochs=1)
    generator = torch.Generator().manual_seed(3)
    train_set = trainer.train_dataloader.dataset
    indices = torch.randperm(len(train_set), generator=generator)[:100].sort().values
    inputs = torch.stack([train_set[i][0] for i in indices])
    targets = torch.stack([torch.as_tensor(train_set[i][1]) for i in indices])
    report = measure(model, [(inputs, targets)], lam=1e-3, num_train_samples=256, structure="diag")
    assert monitor.history[-1]["soft_rank"] == pytest.approx(report.soft_rank, rel=1e-5)
    assert monitor.history[-1]["train_nll"] == pytest.approx(report.train_nll, rel=1e-5)


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_monitor_does_not_change_training(tmp_path, architecture):
    _, plain, _ = fit(tmp_path / "plain", [], architecture=architecture, max_epochs=2)
    monitor = FlatnessMonitor(
        structure=KFACOptions(kfac_mode="sampled", trace_estimator="sampled"),
        overhead_budget=None,
    )
    _, monitored, _ = fit(tmp_path / "monitored", [monitor], architecture=architecture)
    assert len(monitor.history) == 2
    for (name, a), b in zip(
        plain.state_dict().items(), monitored.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_structure_that_cannot_measure_the_model_fails_once_at_fit_start(tmp_path):
    """The structure is tried on one real training batch at fit start: strict, the fit stops
    there naming the fix; strict=False, one warning and the monitor is off (no NaN epochs)."""
    kwargs = {"structure": DenseOptions(trace_estimator="exact", max_parameters=10)}
    with pytest.raises(ValueError, match=r"structure='dense' failed.*DenseOptions.max_parameters"):
        fit(tmp_path, [FlatnessMonitor(**kwargs)])
    monitor = FlatnessMonitor(strict=False, **kwargs)
    with pytest.warns(UserWarning, match=r"DenseOptions.max_parameters.*switched off"):
        trainer, _, _ = fit(tmp_path, [monitor])
    assert trainer.current_epoch == 2
    assert monitor.history == [] and "DenseOptions.max_parameters" in monitor.disabled_reason


def test_every_n_epochs_and_fit_end(tmp_path):
    monitor = FlatnessMonitor(every_n_epochs=2, measure_on_fit_end=True, overhead_budget=None)
    fit(tmp_path, [monitor], max_epochs=3)
    assert [record["epoch"] for record in monitor.history] == [1.0, 2.0]


def test_checkpoint_loads_weights_only_and_resume_continues(tmp_path):
    monitor = FlatnessMonitor(max_samples=64, overhead_budget=None)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [monitor, checkpoint], max_epochs=2)
    path = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(path, weights_only=True)
    (saved,) = [v for k, v in state["callbacks"].items() if "FlatnessMonitor" in k]
    assert len(saved["history"]) == 2

    resumed = FlatnessMonitor(max_samples=64, overhead_budget=None)
    seed_everything(0)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        callbacks=[resumed],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        FlatnessClassifier(weight_decay=1e-3),
        MNIST7DataModule(train_size=256, val_size=128, batch_size=32),
        ckpt_path=path,
    )
    assert [record["epoch"] for record in resumed.history] == [0.0, 1.0, 2.0]
    for restored, original in zip(resumed.history[:2], saved["history"], strict=True):
        assert_records_equal(restored, original)


def test_tensorboard_gets_spectrum_and_figure_and_other_loggers_skip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    csv = CSVLogger(tmp_path, name="csv")
    fit(tmp_path, [FlatnessMonitor(overhead_budget=None)], logger=[tensorboard, csv])
    events = EventAccumulator(tensorboard.log_dir, size_guidance={"histograms": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    assert "flatness/soft_rank" in tags["scalars"]
    assert "flatness/spectrum_log10" in tags["histograms"]
    assert "flatness/gap" in tags["images"]
    assert len(events.Histograms("flatness/spectrum_log10")) == 2
    csv_text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "flatness/predicted_gap" in csv_text


class ScaledClassifier(FlatnessClassifier):
    """A model BackPACK cannot extend: LayerNorm and a parameter used functionally."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(49, 16),
            torch.nn.LayerNorm(16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 10),
        )
        self.temperature = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.model(x) * self.temperature


def test_unsupported_model_switches_to_matrix_free_with_one_message(tmp_path, caplog):
    monitor = FlatnessMonitor(
        structure=DenseOptions(),
        max_samples=64,
    )
    seed_everything(0)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    with caplog.at_level("INFO"):
        trainer.fit(
            ScaledClassifier(weight_decay=1e-3),
            MNIST7DataModule(train_size=64, val_size=32, batch_size=32),
        )
    switches = [r for r in caplog.records if "Switching to the matrix-free" in r.getMessage()]
    assert len(switches) == 1
    assert "ScaledClassifier" in switches[0].getMessage()  # names what forced the switch
    assert monitor.state.active_structure == "lanczos"
    assert all(math.isfinite(record["soft_rank"]) for record in monitor.history)


def test_progress_shows_the_gaps_on_the_bar_or_in_a_line_per_measurement(tmp_path, caplog):
    """The main job is not silent: the predicted and observed gap are on the progress bar,
    and without a bar each measurement prints one line."""
    monitor = FlatnessMonitor(
        max_samples=64,
        max_val_samples=64,
        overhead_budget=None,
        log_options=LogOptions(summary=False),
    )
    trainer, _, _ = fit(tmp_path / "bar", [monitor], max_epochs=1, enable_progress_bar=True)
    shown = trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)
    assert {"flatness/predicted_gap", "flatness/observed_gap"} <= set(shown)
    assert "flatness/soft_rank" not in shown
    quiet = FlatnessMonitor(
        max_samples=64,
        max_val_samples=64,
        overhead_budget=None,
        log_options=LogOptions(summary=False),
    )
    with caplog.at_level("INFO"):
        fit(tmp_path / "line", [quiet], max_epochs=2)
    lines = [r.getMessage() for r in caplog.records if "predicted gap" in r.getMessage()]
    assert len(lines) == 2 and "observed gap" in lines[0] and "(probe_kernel)" in lines[0]


class SkipsNonFiniteBatches(FlatnessClassifier):
    """A training step that skips a batch whose loss is not finite (a common guard)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss if torch.isfinite(loss) else None


def test_a_non_finite_training_batch_leaves_the_held_out_numbers(tmp_path):
    """The measurement's training split fails on a NaN input (a warning and NaN curvature for
    the epoch); the held-out numbers of that epoch are still measured, equal to a measurement
    of the same weights on the held-out data."""
    from conftest import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    seed_everything(0)
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=16)
    data.setup("fit")
    inputs, targets = (t.clone() for t in data.train_set.tensors)
    inputs[20] = math.nan
    train = DataLoader(TensorDataset(inputs, targets), batch_size=16)
    val = DataLoader(data.val_set, batch_size=16)
    model = SkipsNonFiniteBatches(weight_decay=1e-3)
    monitor = FlatnessMonitor(structure="kfac", overhead_budget=None)
    with pytest.warns(UserWarning, match="epoch 0 failed .*not finite"):
        quiet_trainer(tmp_path, [monitor]).fit(model, train, val)
    record = monitor.history[-1]
    assert math.isnan(record["soft_rank"]) and math.isnan(record["train_nll"])
    clean = [(inputs[:16], targets[:16])]
    expected = measure(model, clean, val_batches=val, lam=1e-3, num_train_samples=64)
    for name in ("val_nll", "val_accuracy"):
        assert record[name] == pytest.approx(getattr(expected, name), rel=1e-5), name
    assert record["trace_fisher_val"] > 0 and record["trace_cov_val"] > 0  # probe estimates
    assert record["num_val_samples"] == 32
