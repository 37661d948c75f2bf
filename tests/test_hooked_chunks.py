"""The layer-hook backend splits a large batch into passes of about ``CHUNK_NUMBERS`` recorded
layer-output numbers (lightning_flatness/core/backends/hooks.py). The probes and sampled labels
are keyed by each sample's position, so the split must not change any number: checked in
float64 against the same measurement with every batch in one pass, for each hooked structure,
on the paper's CNN and the zoo's BatchNorm ResNet (train-mode BatchNorm is measured in eval
mode, so a pass's samples do not see each other)."""

from __future__ import annotations

import weakref

import pytest
import torch
import zoo
from conftest import random_data, tiny_model

from lightning_flatness.core import measure
from lightning_flatness.core.backends import hooks
from lightning_flatness.core.hooked_pass import HookedPass
from lightning_flatness.core.options import structure_options

pytestmark = pytest.mark.filterwarnings("ignore:structure='.*' reports a soft rank")

LAM = 1e-3
#: the pass's own forward, before any test wraps it
FORWARD = HookedPass.forward
FIELDS = (
    "soft_rank",
    "logdet",
    "trace_fisher",
    "trace_cov",
    "trace_fisher_val",
    "train_nll",
    "val_nll",
    "train_accuracy",
    "relative_flatness",
)


def _model(name: str) -> torch.nn.Module:
    if name == "resnet":
        torch.manual_seed(0)
        return zoo.ResNet(width=3, classes=10).to(torch.float64)
    return tiny_model(name)


def _measured(model, data, structure: str, monkeypatch, first: int, numbers: float):
    """The measurement with these pass-size settings and no pass size known yet, and the
    samples of each pass."""
    monkeypatch.setattr(hooks, "FIRST_CHUNK", first)
    monkeypatch.setattr(hooks, "CHUNK_NUMBERS", numbers)
    monkeypatch.setattr(hooks, "_KNOWN_CHUNKS", weakref.WeakKeyDictionary())  # none known yet
    return _counted(model, data, structure, monkeypatch)


def _counted(model, data, structure: str, monkeypatch):
    """The measurement as the settings stand, and the samples of each pass."""
    passes = []

    def counted(self, inputs):
        passes.append(inputs[0].shape[0])
        return FORWARD(self, inputs)

    monkeypatch.setattr(HookedPass, "forward", counted)
    options = {"trace_estimator": "probe"}
    if structure == "kfac":
        options["kfac_mode"] = "sampled"
    if structure == "probe_kernel":
        # the probes named: at the default ones this small model's soft rank nears its probe
        # rows, and the probe kernel would measure it again with the exact rows
        options.update(probes=4, groups=2)
    report = measure(
        model,
        data,
        lam=LAM,
        num_train_samples=100,
        structure=structure_options(structure, options),
        val_batches=data[:1],
        seed=3,
    )
    return report, passes


@pytest.mark.parametrize("name", ["cnn", "resnet"])
@pytest.mark.parametrize("structure", ["kfac", "diag", "probe_kernel"])
def test_a_batch_split_into_passes_measures_the_same(name, structure, monkeypatch):
    model = _model(name).eval()
    inputs, targets = random_data(37)
    data = [(inputs[:30], targets[:30]), (inputs[30:], targets[30:])]
    whole, whole_passes = _measured(model, data, structure, monkeypatch, 10**6, 1e18)
    split, split_passes = _measured(model, data, structure, monkeypatch, 3, 1.0)
    assert whole_passes == [30, 7, 30]  # two training batches, one held-out
    # the first pass learns the size: every later pass has FIRST_CHUNK samples here
    assert split_passes[:2] == [3, 3] and sum(split_passes) == 67 and max(split_passes) == 3
    for field in FIELDS:
        assert getattr(split, field) == pytest.approx(
            getattr(whole, field), rel=1e-10, nan_ok=True
        ), field


def test_the_pass_size_follows_the_recorded_numbers(monkeypatch):
    """A model recording r numbers per sample is measured in passes of CHUNK_NUMBERS // r
    samples after its first pass (and never fewer than FIRST_CHUNK)."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(50)
    recorded = sum(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    _, passes = _measured(model, [(inputs, targets)], "kfac", monkeypatch, 4, 9.5 * recorded)
    assert passes[:3] == [4, 9, 9] and sum(passes) == 100  # 50 training, 50 held-out
    _, passes = _measured(model, [(inputs, targets)], "kfac", monkeypatch, 4, 2.0)
    assert max(passes) == 4 and sum(passes) == 100


@pytest.mark.parametrize("structure", ["kfac", "probe_kernel"])
def test_a_model_measured_again_goes_straight_to_its_known_pass_size(structure, monkeypatch):
    """The pass size a measurement found is kept for the same model under its structure and
    sample shapes: measured again, a batch is read in passes of that size from the start (no
    first pass of FIRST_CHUNK samples), with the same numbers."""
    model = tiny_model("mlp").to(torch.float64).eval()
    inputs, targets = random_data(50)
    recorded = sum(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    data = [(inputs, targets)]
    first, passes = _measured(model, data, structure, monkeypatch, 4, 9.5 * recorded)
    assert passes[:3] == [4, 9, 9]
    again, passes = _counted(model, data, structure, monkeypatch)
    assert passes == [9] * 5 + [5] + [9] * 5 + [5]  # 50 training, 50 held-out
    for field in FIELDS:
        assert getattr(again, field) == pytest.approx(
            getattr(first, field), rel=1e-10, nan_ok=True
        ), field
    known = hooks._KNOWN_CHUNKS[model]
    assert set(known) == {(structure, tuple(inputs.shape[1:]))}


def test_a_recurrent_model_is_measured_in_passes_of_at_most_recurrent_chunk(monkeypatch):
    torch.manual_seed(0)
    model = zoo.build("lstm").to(torch.float64).eval()
    inputs, targets = zoo.zoo_data("lstm", 23)
    data = [(inputs, targets)]
    monkeypatch.setattr(hooks, "RECURRENT_CHUNK", 5)
    whole, _ = _measured(model, data, "kfac", monkeypatch, 10**6, 1e18)
    monkeypatch.setattr(hooks, "RECURRENT_CHUNK", 5)
    split, passes = _measured(model, data, "kfac", monkeypatch, 2, 1e18)
    assert passes[:2] == [2, 5] and max(passes) == 5 and sum(passes) == 46
    for field in FIELDS:
        assert getattr(split, field) == pytest.approx(getattr(whole, field), rel=1e-10, nan_ok=True)
