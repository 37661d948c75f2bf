"""Sharded models (FSDP, FSDP2, DeepSpeed ZeRO) are refused at fit start with one message."""

from __future__ import annotations

import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from torch import nn

from lightning_flatness import FlatnessClassifier, FlatnessMonitor, MNIST7DataModule
from lightning_flatness.lightning.log_options import LogOptions
from lightning_flatness.lightning.trainer_facts import sharding_refusal


class FullyShardedDataParallel(nn.Module):
    """Stands in for torch's FSDP wrapper (recognised by its class name)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_sharding_strategies_and_wrappers_are_recognised():
    plain = nn.Linear(2, 2)
    assert "FSDPStrategy" in sharding_refusal(object.__new__(FSDPStrategy), plain)
    assert sharding_refusal(object.__new__(DDPStrategy), plain) is None
    wrapped = nn.Sequential(FullyShardedDataParallel(plain))
    assert "FullyShardedDataParallel" in sharding_refusal(object.__new__(DDPStrategy), wrapped)


class StandInFSDP(SingleDeviceStrategy):
    """A strategy the monitor must treat as FSDP (FSDP itself cannot run on CPU)."""


StandInFSDP.__name__ = "FSDPStrategy"


@pytest.mark.parametrize("strict", [True, False])
def test_a_sharded_fit_is_refused_at_its_start(tmp_path, strict):
    monitor = FlatnessMonitor(strict=strict, log_options=LogOptions(summary=False))
    trainer = quiet_trainer(tmp_path, [monitor], strategy=StandInFSDP(device=torch.device("cpu")))
    data = MNIST7DataModule(train_size=64, val_size=32, batch_size=32)
    model = FlatnessClassifier(architecture="mlp", weight_decay=1e-3)
    if strict:
        with pytest.raises(ValueError, match=r"sharded.*strategy='ddp'"):
            trainer.fit(model, data)
        return
    with pytest.warns(UserWarning, match="switched off"):
        trainer.fit(model, data)
    assert monitor.history == [] and trainer.current_epoch == 1
