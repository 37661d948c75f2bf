"""A classifier ``LightningModule`` around the architectures of
:mod:`lightning_flatness.core.models`.

Weight decay. With ``optimizer`` in ``{"adam", "sgd", "rmsprop"}`` the decay is PyTorch's
*coupled* ``weight_decay``: ``λ θ`` is added to the gradient, i.e. the training objective is
``mean cross-entropy + (λ/2) ‖θ‖²``. ``weight_decay_c = c`` sets ``λ = c / n`` with ``n`` the
number of training samples, as in "Flatness After All?": multiplied by ``n`` the objective is the
summed loss plus ``(c/2) ‖θ‖²``, a Gaussian prior of precision ``c`` whose strength does not
change with the training-set size. ``"adamw"`` applies *decoupled* decay instead, which is not an
L2 term of the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_flatness.core.models import build_model

__all__ = ["OPTIMIZERS", "FlatnessClassifier"]

#: Supported values of ``FlatnessClassifier(optimizer=...)``.
OPTIMIZERS = ("adam", "sgd", "adamw", "rmsprop")


class FlatnessClassifier(LightningModule):
    """Classifier trained with cross-entropy; logs loss and accuracy per epoch.

    Logged keys (epoch averages): ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``,
    ``test/loss``, ``test/acc``.

    Args:
        architecture: One of :data:`lightning_flatness.core.models.ARCHITECTURES`.
        input_shape: Shape ``(channels, height, width)`` of one input image.
        num_classes: Number of classes.
        hidden: Width of the hidden layers of the MLPs.
        optimizer: One of :data:`OPTIMIZERS`.
        lr: Learning rate.
        weight_decay: Fixed weight decay ``λ`` (coupled L2 except for ``"adamw"``).
        weight_decay_c: If given, ``λ = weight_decay_c / n`` with ``n`` the training-set size
            reported by the datamodule's ``num_train_samples``; then ``weight_decay`` must be 0.
        momentum: Momentum of ``"sgd"`` and ``"rmsprop"`` (ignored by the Adam variants).
    """

    def __init__(
        self,
        architecture: str = "mlp",
        input_shape: tuple[int, int, int] = (1, 7, 7),
        num_classes: int = 10,
        hidden: int = 70,
        optimizer: str = "adam",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        weight_decay_c: float | None = None,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        optimizer = optimizer.lower()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got optimizer={optimizer!r}.")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got lr={lr}.")
        if weight_decay < 0 or (weight_decay_c is not None and weight_decay_c < 0):
            raise ValueError(
                f"weight decay must be non-negative, got weight_decay={weight_decay}, "
                f"weight_decay_c={weight_decay_c}."
            )
        if weight_decay_c is not None and weight_decay != 0:
            raise ValueError(
                f"Give either weight_decay or weight_decay_c (λ = c / n), not both; got "
                f"weight_decay={weight_decay}, weight_decay_c={weight_decay_c}."
            )
        if momentum < 0:
            raise ValueError(f"momentum must be non-negative, got momentum={momentum}.")
        input_shape = tuple(int(s) for s in input_shape)
        if len(input_shape) != 3:
            raise ValueError(
                f"input_shape must be (channels, height, width), got input_shape={input_shape}."
            )
        self.save_hyperparameters()
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.optimizer_name = optimizer
        self.model = build_model(architecture, input_shape, num_classes, hidden)
        self.loss_fn = nn.CrossEntropyLoss()
        self.example_input_array = torch.zeros(1, *input_shape)
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        #: The weight decay λ actually passed to the optimizer (set by configure_optimizers).
        self.effective_weight_decay: float | None = None

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        return self.model(x)

    def _step(self, batch: Any, stage: str, accuracy: MulticlassAccuracy) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        accuracy(logits, y)
        # on_step=False keeps the logged keys exactly "<stage>/loss" and "<stage>/acc"; under
        # DDP the loss is averaged over processes (the accuracy metric syncs itself).
        self.log(
            f"{stage}/loss",
            loss,
            on_step=False,
            on_epoch=True,
            prog_bar=stage == "val",
            sync_dist=True,
        )
        self.log(f"{stage}/acc", accuracy, on_step=False, on_epoch=True, prog_bar=stage == "val")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Cross-entropy on one training batch; logs ``train/loss`` and ``train/acc``."""
        return self._step(batch, "train", self.train_acc)

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Logs ``val/loss`` and ``val/acc``."""
        return self._step(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Logs ``test/loss`` and ``test/acc``."""
        return self._step(batch, "test", self.test_acc)

    def setup(self, stage: str) -> None:
        """Check that the datamodule's input shape and class count match the model's."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        for name in ("input_shape", "num_classes"):
            expected = getattr(datamodule, name, None)
            if expected is None:
                continue
            expected = tuple(expected) if name == "input_shape" else expected
            if expected != getattr(self, name):
                raise ValueError(
                    f"The datamodule has {name}={expected} but the model was built with "
                    f"{name}={getattr(self, name)}; set model {name} to match."
                )

    def resolve_weight_decay(self) -> float:
        """The weight decay ``λ``: ``weight_decay``, or ``weight_decay_c / n``.

        Returns:
            ``λ`` as a float.

        Raises:
            RuntimeError: If ``weight_decay_c`` is set but no datamodule attached to the trainer
                exposes ``num_train_samples``.
        """
        c = self.hparams.weight_decay_c
        if c is None:
            return float(self.hparams.weight_decay)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        n = getattr(datamodule, "num_train_samples", None)
        if n is None:
            raise RuntimeError(
                f"weight_decay_c={c} sets λ = c / n, which needs the training-set size n from "
                f"trainer.datamodule.num_train_samples, but "
                + (
                    "the module is not attached to a Trainer."
                    if self._trainer is None
                    else "no datamodule exposing num_train_samples was given to the Trainer."
                )
                + " Pass such a datamodule, or use weight_decay instead."
            )
        if int(n) < 1:
            raise RuntimeError(f"num_train_samples must be positive, got {n}.")
        return float(c) / int(n)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The optimizer named by ``optimizer`` with the resolved weight decay."""
        weight_decay = self.resolve_weight_decay()
        self.effective_weight_decay = weight_decay
        hp = self.hparams
        params = self.parameters()
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=hp.lr, weight_decay=weight_decay)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=hp.lr, weight_decay=weight_decay)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(
                params, lr=hp.lr, momentum=hp.momentum, weight_decay=weight_decay
            )
        return torch.optim.RMSprop(
            params, lr=hp.lr, momentum=hp.momentum, weight_decay=weight_decay
        )
