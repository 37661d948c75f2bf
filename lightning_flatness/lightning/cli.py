"""Command line: ``lightning-flatness {fit,validate,test,predict,sweep,measure} --config CONFIG``.

Built on :class:`lightning.pytorch.cli.LightningCLI`. The model and the data default to
:class:`~lightning_flatness.lightning.module.FlatnessClassifier` and
:class:`~lightning_flatness.lightning.data.MNIST7DataModule`, so their arguments can be given
directly (``--model.architecture=cnn``, ``--data.train_size=1000``), but *any*
``LightningModule`` and ``LightningDataModule`` can be chosen by class path::

    model:
      class_path: my_package.MyModule
      init_args: {hidden: 32}
    data:
      class_path: my_package.MyData

``data: null`` drops the datamodule (for a model that defines its own data loaders). The seed
defaults to 0 rather than a random one, for reproducible runs.

``lightning-flatness sweep ...`` is handed to ``lightning_flatness.sweep.main`` when that module
exists; ``lightning-flatness measure --config CONFIG --ckpt_path CKPT`` prints the report of a
trained checkpoint (:mod:`~lightning_flatness.lightning.measure_command`). The callbacks are
known by their short names (``class_path: FlatnessMonitor``,
``--trainer.callbacks.help FlatnessMonitor``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_flatness.lightning.class_paths import DEFAULT_DATA, DEFAULT_MODEL
from lightning_flatness.lightning.measure_command import run_measure

# imported so that LightningCLI resolves the callbacks by their short names (it looks among the
# imported subclasses of Callback)
from lightning_flatness.lightning.monitor import FlatnessMonitor  # noqa: F401
from lightning_flatness.lightning.regularizer import SoftRankRegularizer  # noqa: F401

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "FlatnessCLI", "main"]

_SWEEP_MODULE = "lightning_flatness.sweep"
_DESCRIPTION = (
    "Train, validate or test a classifier with PyTorch Lightning (subcommands fit, validate, "
    "test, predict), run a sweep (sweep) or measure a trained checkpoint (measure); "
    "'lightning-flatness SUBCOMMAND --help' describes each."
)
#: the top-level help: every subcommand, this package's two first
_OVERVIEW = """usage: lightning-flatness SUBCOMMAND [options]

Train a classifier with FlatnessMonitor, measure a trained one, or run a sweep.

subcommands:
  fit        train (and validate) a model; the config's callbacks, e.g. FlatnessMonitor,
             log the soft rank and the predicted gap
  validate   one evaluation epoch over the validation set
  test       one evaluation epoch over the test set
  predict    run inference on the prediction data
  measure    the flatness report of a trained checkpoint, without training:
             lightning-flatness measure --config CONFIG.yaml --ckpt_path PATH.ckpt
  sweep      train and measure a grid of runs (tables, rank correlations):
             lightning-flatness sweep --config configs/sweep_quick.yaml --output DIR

'lightning-flatness SUBCOMMAND --help' shows a subcommand's options; callbacks go by their
short names, e.g. 'lightning-flatness fit --trainer.callbacks.help FlatnessMonitor'.
"""


class FlatnessCLI(LightningCLI):
    """``LightningCLI`` accepting any model and datamodule, with this package's as defaults.

    Args:
        args: Command line arguments (``None``: ``sys.argv[1:]``), a dict or a namespace.
        **kwargs: Further keyword arguments of :class:`~lightning.pytorch.cli.LightningCLI`.
    """

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_kwargs", {"description": _DESCRIPTION})
        # With model_class=None and datamodule_class=None, LightningCLI accepts any
        # LightningModule / LightningDataModule by class path (subclass mode); the defaults are
        # set in add_arguments_to_parser.
        super().__init__(None, None, args=args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Make this package's classifier and datamodule the defaults."""
        parser.set_defaults(
            {"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}}
        )

    def after_fit(self) -> None:
        """Say where the TensorBoard logs went and how to look at them."""
        if not self.trainer.is_global_zero:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                print(
                    f"\nTensorBoard logs: {logger.log_dir}\n"
                    f"Look at the curves with:  tensorboard --logdir {logger.save_dir}\n"
                    "and open http://localhost:6006 (scalars under flatness/, the Fisher spectrum "
                    "under Histograms, predicted vs observed gap under Images)."
                )


def _run_sweep(args: list[str]) -> Any:
    if importlib.util.find_spec(_SWEEP_MODULE) is None:
        raise SystemExit(
            "lightning-flatness: the 'sweep' subcommand is not available in this installation."
        )
    return importlib.import_module(_SWEEP_MODULE).main(args)


def main(args: ArgsType = None) -> int | None:
    """Entry point of the ``lightning-flatness`` console script.

    Args:
        args: Command line arguments without the program name (``None``: ``sys.argv[1:]``), or a
            dict/namespace as accepted by ``LightningCLI``.

    Returns:
        The exit status of ``sweep`` if it returns one, else ``None`` (success).
    """
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list | tuple):
        if not argv or argv[0] in ("-h", "--help"):
            print(_OVERVIEW)
            return 0 if argv else 2
        if argv[0] == "sweep":
            return _run_sweep(list(argv[1:]))
        if argv[0] == "measure":
            return run_measure(list(argv[1:]), FlatnessCLI)
    FlatnessCLI(args=args)
    return None


if __name__ == "__main__":
    sys.exit(main())
