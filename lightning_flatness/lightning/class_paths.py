"""Class paths of the bundled model and datamodule: the defaults of the command line and of
sweep configurations, importable without loading either (or LightningCLI)."""

from __future__ import annotations

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL"]

#: Class path of the default model.
DEFAULT_MODEL = "lightning_flatness.lightning.module.FlatnessClassifier"
#: Class path of the default datamodule.
DEFAULT_DATA = "lightning_flatness.lightning.data.MNIST7DataModule"
