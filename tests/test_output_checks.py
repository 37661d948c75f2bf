"""Outputs that are not logits stop the fit at its start, naming the argument that fixes it."""

from __future__ import annotations

import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_flatness import BatchReading, FlatnessMonitor
from lightning_flatness.core.likelihoods import TargetError
from lightning_flatness.core.measure import check_batch
from lightning_flatness.lightning.log_options import LogOptions


class Classifier(LightningModule):
    def __init__(self, output: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.output = output

    def forward(self, x):
        logits = self.net(x)
        if self.output == "probabilities":
            return logits.softmax(-1)
        if self.output == "log_probabilities":
            return logits.log_softmax(-1)
        return logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.nll_loss(self(x).clamp_min(1e-12).log(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, weight_decay=1e-2)


def _loader():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_probabilities_are_refused_and_log_probabilities_pass():
    batch = next(iter(_loader()))
    with pytest.raises(TargetError, match="logits_fn="):
        check_batch(Classifier("probabilities"), batch)
    assert check_batch(Classifier("log_probabilities"), batch) == (8, 3)
    assert check_batch(Classifier("logits"), batch) == (8, 3)
    reading = BatchReading(logits_fn=lambda model, x: model(x).log())
    fixed = check_batch(Classifier("probabilities"), batch, reading)
    assert fixed == (8, 3)


def test_a_fit_on_probabilities_stops_at_its_start(tmp_path):
    trainer = quiet_trainer(tmp_path, [FlatnessMonitor(log_options=LogOptions(summary=False))])
    model = Classifier("probabilities")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"probabilities.*logits_fn="):
        trainer.fit(model, _loader())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
