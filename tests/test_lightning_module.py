"""Tests of the FlatnessClassifier LightningModule."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness.lightning.data import MNIST7DataModule
from lightning_flatness.lightning.module import OPTIMIZERS, FlatnessClassifier

# Harmless Lightning notices about the deliberately tiny runs below.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:.*but have no `validation_step`"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)"),
]


def _trainer(tmp_path, **kwargs):
    defaults = {
        "max_epochs": 1,
        "limit_train_batches": 3,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
        "default_root_dir": tmp_path,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "deterministic": True,
    }
    return L.Trainer(**{**defaults, **kwargs})


@pytest.mark.parametrize("architecture", ["mlp", "bigmlp", "cnn", "resmlp"])
def test_forward_returns_logits(architecture):
    model = FlatnessClassifier(architecture=architecture, hidden=16)
    logits = model(torch.randn(5, 1, 7, 7))
    assert logits.shape == (5, 10)
    assert model.hparams.architecture == architecture
    assert isinstance(model.model, torch.nn.Module)


def test_hyperparameters_are_saved():
    model = FlatnessClassifier(architecture="bigmlp", input_shape=[3, 8, 8], num_classes=4)
    assert model.hparams.input_shape == (3, 8, 8)
    assert model.hparams.num_classes == 4
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "lbfgs"}, "optimizer must be one of"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"weight_decay": -1.0}, "weight_decay=-1.0"),
        ({"weight_decay": 0.1, "weight_decay_c": 1.0}, "not both"),
        ({"momentum": -0.5}, "momentum=-0.5"),
        ({"input_shape": (7, 7)}, "input_shape"),
        ({"architecture": "transformer"}, "architecture must be one of"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlatnessClassifier(**kwargs)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adam", torch.optim.Adam),
        ("sgd", torch.optim.SGD),
        ("adamw", torch.optim.AdamW),
        ("rmsprop", torch.optim.RMSprop),
    ],
)
def test_optimizer_choices(name, cls):
    assert name in OPTIMIZERS
    model = FlatnessClassifier(optimizer=name.upper(), lr=0.02, weight_decay=0.003, momentum=0.5)
    optimizer = model.configure_optimizers()
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.02
    assert group["weight_decay"] == 0.003
    assert model.effective_weight_decay == 0.003
    if name in ("sgd", "rmsprop"):
        assert group["momentum"] == 0.5
    # Only AdamW decouples the decay from the gradient.
    assert bool(group.get("decoupled_weight_decay", name == "adamw")) is (name == "adamw")
    assert {id(p) for p in group["params"]} == {id(p) for p in model.parameters()}


def test_sgd_weight_decay_is_coupled_l2_on_the_gradient():
    torch.manual_seed(0)
    lam, lr = 0.1, 0.5
    model = FlatnessClassifier(optimizer="sgd", lr=lr, weight_decay=lam, hidden=8)
    optimizer = model.configure_optimizers()
    x, y = torch.randn(16, 1, 7, 7), torch.randint(0, 10, (16,))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    for p, p0, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), p0 - lr * (g + lam * p0))


def test_weight_decay_c_needs_a_datamodule():
    model = FlatnessClassifier(weight_decay_c=2.0)
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        model.configure_optimizers()


def test_weight_decay_c_without_num_train_samples_fails_clearly(tmp_path):
    data = TensorDataset(torch.randn(20, 1, 7, 7), torch.randint(0, 10, (20,)))
    model = FlatnessClassifier(weight_decay_c=2.0)
    with pytest.raises(RuntimeError, match="num_train_samples"):
        _trainer(tmp_path).fit(model, train_dataloaders=DataLoader(data, batch_size=5))


def test_fixed_weight_decay_works_without_datamodule(tmp_path):
    data = TensorDataset(torch.randn(20, 1, 7, 7), torch.randint(0, 10, (20,)))
    model = FlatnessClassifier(weight_decay=0.01)
    trainer = _trainer(tmp_path)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=5))
    assert trainer.optimizers[0].param_groups[0]["weight_decay"] == 0.01


def test_tiny_fit_resolves_lambda_from_n_and_logs_metrics(tmp_path):
    torch.manual_seed(0)
    datamodule = MNIST7DataModule(train_size=200, val_size=100, batch_size=32)
    model = FlatnessClassifier(weight_decay_c=2.0, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path)
    trainer.fit(model, datamodule=datamodule)

    assert model.effective_weight_decay == pytest.approx(2.0 / 200)
    assert trainer.optimizers[0].param_groups[0]["weight_decay"] == pytest.approx(0.01)
    assert isinstance(trainer.optimizers[0], torch.optim.Adam)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert key in metrics and torch.isfinite(metrics[key])
    assert 0.0 <= float(metrics["val/acc"]) <= 1.0
    assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), before, strict=True))

    results = trainer.test(model, datamodule=datamodule, verbose=False)
    assert set(results[0]) == {"test/loss", "test/acc"}
    # The test set is the held-out set: same loss as validating on it in full.
    (validated,) = trainer.validate(model, datamodule=datamodule, verbose=False)
    assert results[0]["test/loss"] == pytest.approx(validated["val/loss"], rel=1e-5)


def test_logged_loss_is_the_epoch_mean(tmp_path):
    datamodule = MNIST7DataModule(train_size=100, val_size=100, eval_batch_size=30)
    model = FlatnessClassifier()
    trainer = _trainer(tmp_path, limit_val_batches=None)
    (logged,) = trainer.validate(model, datamodule=datamodule, verbose=False)
    x, y = datamodule.val_set.tensors
    with torch.no_grad():
        logits = model(x)
    expected_loss = torch.nn.functional.cross_entropy(logits, y)
    expected_acc = (logits.argmax(1) == y).float().mean()
    assert logged["val/loss"] == pytest.approx(float(expected_loss), rel=1e-5)
    assert logged["val/acc"] == pytest.approx(float(expected_acc), abs=1e-6)


def test_input_shape_mismatch_with_datamodule_is_reported(tmp_path):
    datamodule = MNIST7DataModule(train_size=50, val_size=50, image_size=14)
    model = FlatnessClassifier(input_shape=(1, 7, 7))
    with pytest.raises(ValueError, match=r"input_shape=\(1, 14, 14\)"):
        _trainer(tmp_path).fit(model, datamodule=datamodule)


def test_seeded_fits_are_reproducible(tmp_path):
    def fit():
        L.seed_everything(7, verbose=False)
        model = FlatnessClassifier(architecture="cnn", weight_decay_c=1.0)
        datamodule = MNIST7DataModule(train_size=96, val_size=32, batch_size=16)
        _trainer(tmp_path, limit_val_batches=0).fit(model, datamodule=datamodule)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(fit(), fit())
