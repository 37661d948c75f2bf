"""Streaming training data: the monitor never iterates the user's stream, and measures what the
training loop drew."""

from __future__ import annotations

import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_flatness import FlatnessMonitor
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.stream_buffer import StreamBuffer


class EpochShuffledStream(IterableDataset):
    """Yields its samples in a new order each time it is iterated (its own epoch counter)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets
        self.iterators_opened = 0

    def __iter__(self):
        self.iterators_opened += 1
        order = torch.randperm(
            len(self.inputs), generator=torch.Generator().manual_seed(self.iterators_opened)
        )
        for index in order.tolist():
            yield self.inputs[index], self.targets[index]


class SizedStream(EpochShuffledStream):
    def __len__(self) -> int:
        return len(self.inputs)


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, weight_decay=1e-2)


def _data(size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 6, generator=generator), torch.randint(
        0, 3, (size,), generator=generator
    )


def _fit(tmp_path, stream_type, callbacks=()):
    seed_everything(0)
    train = stream_type(*_data(96, 1))
    val = stream_type(*_data(40, 2))
    model = Classifier()
    trainer = quiet_trainer(tmp_path, callbacks, max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(train, batch_size=16), DataLoader(val, batch_size=16))
    return model, train, val


@pytest.mark.parametrize("stream_type", [EpochShuffledStream, SizedStream])
def test_a_stream_is_left_alone_and_its_drawn_batches_are_measured(tmp_path, stream_type):
    plain, plain_train, plain_val = _fit(tmp_path / "plain", stream_type)
    kwargs = {} if stream_type is SizedStream else {"num_train_samples": 96}
    monitor = FlatnessMonitor(overhead_budget=None, **kwargs, log_options=LogOptions(summary=False))
    watched, train, val = _fit(tmp_path / "watched", stream_type, [monitor])
    for name, value in plain.state_dict().items():
        assert torch.equal(value, watched.state_dict()[name]), name
    assert train.iterators_opened == plain_train.iterators_opened == 3
    assert val.iterators_opened == plain_val.iterators_opened
    assert monitor.resolved_num_train_samples == 96
    assert len(monitor.history) == 3
    for record in monitor.history:
        assert record["num_samples"] == 96 and record["num_val_samples"] == 40
        assert record["soft_rank"] > 0


def test_a_stream_without_a_length_names_num_train_samples(tmp_path):
    with pytest.raises(ValueError, match="num_train_samples"):
        _fit(
            tmp_path, EpochShuffledStream, [FlatnessMonitor(log_options=LogOptions(summary=False))]
        )


def test_the_stream_budget_keeps_whole_batches_up_to_max_samples(tmp_path):
    seed_everything(0)
    monitor = FlatnessMonitor(
        max_samples=40, overhead_budget=None, log_options=LogOptions(summary=False)
    )
    _fit(tmp_path, SizedStream, [monitor])
    assert [record["num_samples"] for record in monitor.history] == [48.0] * 3
    buffer = StreamBuffer(None)
    for _ in range(3):
        buffer.add((torch.zeros(5000, 2), torch.zeros(5000)))
    assert buffer.num_samples == 10_000 and len(buffer.batches) == 2
