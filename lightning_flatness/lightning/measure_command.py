"""``lightning-flatness measure``: the flatness report of a trained checkpoint, without training.

The configuration that trained the model (the one given to ``lightning-flatness fit``) says
what the model, the data and the monitor are; the checkpoint gives the weights. The model is
loaded by ``Trainer.validate`` (so the checkpoint goes through the module's own loading hooks,
and the validation metrics are printed), then measured once with
:func:`~lightning_flatness.core.measure.measure`, with the settings of the configuration's
``FlatnessMonitor`` (or its defaults) and λ read from the module's optimizer as the monitor
reads it. Prints the same summary the monitor prints at fit end.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

from lightning_flatness.core.curvature import describe_coverage
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.defaults import AUTO, auto_choice
from lightning_flatness.core.measure import measure
from lightning_flatness.lightning.figures import summary_table
from lightning_flatness.lightning.monitor import FlatnessMonitor
from lightning_flatness.lightning.monitor_measurement import (
    MEASUREMENT_BATCH_SIZE,
    monitor_options,
)
from lightning_flatness.lightning.regularizer import SoftRankRegularizer
from lightning_flatness.lightning.trainer_facts import (
    first_dataloader,
    fixed_subset_batches,
    resolve_lam,
    select_dataloader,
)

__all__ = ["run_measure"]

USAGE = (
    "lightning-flatness measure --config CONFIG.yaml --ckpt_path PATH.ckpt "
    "[--structure NAME] [--lam LAMBDA]"
)


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers of whatever ``configure_optimizers`` returned (an optimizer, a list, a
    dict with ``"optimizer"``, or ``([optimizers], [schedulers])``)."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)):
            return _optimizers(configured[0])
        return [opt for item in configured for opt in _optimizers(item)]
    return []


#: the parts of a fit's configuration that describe the model, the data and the trainer
_SECTIONS = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler")


def _fit_configuration(path: str) -> dict[str, Any]:
    """The configuration at ``path`` (the one given to ``fit``, or the copy the fit saved next
    to its logs, which also holds ``fit``'s own options such as ``ckpt_path``) without those
    options, and with neither a logger nor checkpointing: measuring writes nothing."""
    with open(path) as handle:
        loaded = yaml.safe_load(handle) or {}
    if not isinstance(loaded, Mapping):
        raise SystemExit(f"lightning-flatness measure: {path} is not a configuration mapping.")
    configuration = {key: loaded[key] for key in _SECTIONS if key in loaded}
    trainer = dict(configuration.get("trainer") or {})
    trainer.update(logger=False, enable_checkpointing=False)
    configuration["trainer"] = trainer
    return configuration


def _batches(
    trainer: Trainer, module: LightningModule, monitor: FlatnessMonitor
) -> tuple[list, list | None, int]:
    """The samples the monitor measures at fit end, in the same fixed order (so the same probe
    draws): the training and held-out batches, and n (the training set's size, or the
    monitor's ``num_train_samples``)."""
    datamodule = trainer.datamodule
    source = datamodule if datamodule is not None else module
    if datamodule is not None:
        datamodule.setup("fit")
    train = first_dataloader(source.train_dataloader())
    settings = monitor.settings
    size = settings.num_train_samples
    if size is None:
        try:
            size = len(train.dataset)
        except TypeError:
            raise SystemExit(
                "lightning-flatness measure: the training data has no length, so n is unknown; "
                "set num_train_samples in the config's FlatnessMonitor."
            ) from None
    seed, batch_size = settings.seed, settings.batch_size or MEASUREMENT_BATCH_SIZE
    train_batches = fixed_subset_batches(train, settings.max_samples, batch_size, seed)
    if not settings.use_val:
        return train_batches, None, size
    val = select_dataloader(source.val_dataloader(), settings.val_dataloader_idx)
    val_batches = fixed_subset_batches(val, settings.max_val_samples, batch_size, seed)
    return train_batches, val_batches, size


def _validate_reading_epoch(
    trainer: Trainer, module: LightningModule, datamodule: Any, ckpt_path: str
) -> int | None:
    """``trainer.validate`` from the checkpoint (its weights, hooks and the held-out loss), and
    the epoch the checkpoint was written at, read from the dict Lightning loads (once)."""
    seen: dict[str, Any] = {}
    hook = module.on_load_checkpoint

    def reading_epoch(checkpoint: dict[str, Any]) -> None:
        seen["epoch"] = checkpoint.get("epoch")
        hook(checkpoint)

    module.on_load_checkpoint = reading_epoch
    try:
        trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finally:
        del module.on_load_checkpoint  # the class's own hook again
    return seen.get("epoch")


def run_measure(args: list[str], cli_class: Callable[..., LightningCLI]) -> int:
    """Parse ``args`` (after ``measure``), build the fit's model, data and trainer with
    ``cli_class`` (the command line's ``LightningCLI``), load the checkpoint, measure, print the
    summary."""
    parser = argparse.ArgumentParser(
        prog="lightning-flatness measure",
        usage=USAGE,
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("-c", "--config", required=True, help="the configuration of the fit")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint the fit wrote")
    parser.add_argument("--structure", default=None, help="instead of the monitor's structure")
    parser.add_argument("--lam", type=float, default=None, help="instead of the optimizer's λ")
    options = parser.parse_args(args)
    cli = cli_class(args=_fit_configuration(options.config), run=False)
    trainer, module = cli.trainer, cli.model
    monitors = [c for c in trainer.callbacks if isinstance(c, FlatnessMonitor)]
    monitor = monitors[0] if monitors else FlatnessMonitor()
    # the checkpoint is only read: no callback of the fit runs
    trainer.callbacks = [
        c for c in trainer.callbacks if not isinstance(c, (FlatnessMonitor, SoftRankRegularizer))
    ]
    epoch = _validate_reading_epoch(trainer, module, cli.datamodule, options.ckpt_path)
    explicit = options.lam if options.lam is not None else monitor.settings.lam
    lam = resolve_lam(_optimizers(module.configure_optimizers()), explicit, module)
    train, val, size = _batches(trainer, module, monitor)
    module.eval()
    structure = options.structure or monitor.structure
    if structure == AUTO:  # resolved as measure() resolves it, measured as the monitor measures
        choice = auto_choice(module, size)
        arguments = {"structure": monitor_options(choice.structure, choice.sketch_factor)}
    else:
        arguments = monitor.measurer.arguments(structure)
    report = measure(
        module,
        train,
        lam=lam.decays if isinstance(lam, ParameterDecay) else lam,
        num_train_samples=size,
        val_batches=val,
        seed=monitor.settings.seed,
        reading=monitor.settings.reading,
        **arguments,
    )
    record = {**report.as_dict(), "epoch": -1.0 if epoch is None else float(epoch)}
    print(summary_table(record, report.structure))
    if report.coverage:
        print(f"  {describe_coverage(report.coverage)}")
    print(f"  measured in {report.seconds:.1f} s")
    return 0
