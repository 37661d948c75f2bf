"""Every structure's report carries the Fisher's rank bound ``min(P, m·r)`` (docs/math.md,
"Rank bound"), r = C − 1 for softmax and C for bce, P the trainable parameters measured.

Tiny float64 MLPs (P = 730, C = 10) on sample counts on both sides of P / r, with per-group
decay (which rescales F but keeps its rank) and with a frozen layer (which lowers P); the exact
soft rank of the dense reference is never above the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import random_data, tiny_model

from lightning_flatness import BatchReading, measure
from lightning_flatness.core import reference, spectral
from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.options import ALL_STRUCTURES, structure_options

LAM = 1e-3
N_TRAIN = 1000
#: per-group decay of the tiny MLP: weights decayed, biases not
GROUP_DECAY = {"1.weight": LAM, "1.bias": 0.0, "3.weight": 10 * LAM, "3.bias": 0.0}
#: the rank of one sample's output Fisher for C = 10 outputs
SAMPLE_RANK = {"cross_entropy": 9, "bce": 10}


@dataclass(frozen=True)
class Case:
    """One measurement: the likelihood, the sample count m, per-group decay, a frozen layer."""

    loss: str
    samples: int
    group_decay: bool = False
    freeze_first_layer: bool = False


CASES = {
    "softmax, m·r < P": Case("cross_entropy", 40),  # 360 < 730
    "softmax, P < m·r": Case("cross_entropy", 100),  # 730 < 900
    "bce, m·r < P": Case("bce", 40),  # 400 < 730
    "bce, P < m·r": Case("bce", 80),  # 730 < 800
    "softmax, per-group decay": Case("cross_entropy", 100, group_decay=True),
    "bce, frozen first layer": Case("bce", 20, freeze_first_layer=True),  # P = 130 < 200
}


def _model(case: Case) -> torch.nn.Module:
    """The tiny MLP, its first linear layer frozen when the case asks."""
    model = tiny_model("mlp").eval()
    if case.freeze_first_layer:
        model[1].requires_grad_(False)
    return model


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``case.samples`` random inputs with class labels (softmax) or multi-hot targets (bce)."""
    inputs, labels = random_data(case.samples)
    if case.loss == "bce":
        generator = torch.Generator().manual_seed(3)
        return inputs, (torch.rand(case.samples, 10, generator=generator) < 0.3).double()
    return inputs, labels


def _expected_bound(model: torch.nn.Module, case: Case) -> float:
    """``min(P, m·r)`` written out, P counting the trainable parameters only."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return float(min(trainable, case.samples * SAMPLE_RANK[case.loss]))


def _reference_soft_rank(model: torch.nn.Module, inputs: torch.Tensor, case: Case) -> float:
    """The exact soft rank from the dense P × P reference: ``Tr(F(F+λI)⁻¹)``, or under per-group
    decay ``Tr(F̃(F̃+I)⁻¹)`` with ``F̃ = D^{-1/2} F D^{-1/2}``."""
    fisher = reference.dense_fisher(model, inputs, case.loss)
    if not case.group_decay:
        return spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    named = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    names, sizes = zip(*named, strict=True)
    scale = ParameterDecay(GROUP_DECAY).column_scale(list(names), list(sizes))
    scaled = fisher * scale[:, None] * scale[None, :]
    return spectral.soft_rank(spectral.psd_eigenvalues(scaled), 1.0)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_dense_reference_soft_rank_is_within_the_bound(case, one_thread):
    model = _model(case)
    inputs, _ = _batch(case)
    bound = _expected_bound(model, case)
    assert 0 < _reference_soft_rank(model, inputs, case) <= bound


@pytest.mark.filterwarnings("ignore:.*the largest rank the Fisher")  # diagonals over-count
@pytest.mark.parametrize("structure", ALL_STRUCTURES)
@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_every_structure_reports_the_rank_bound(structure, case, one_thread):
    model = _model(case)
    inputs, targets = _batch(case)
    half = case.samples // 2  # two batches: m is the count over all of them
    report = measure(
        model,
        [(inputs[:half], targets[:half]), (inputs[half:], targets[half:])],
        lam=GROUP_DECAY if case.group_decay else LAM,
        num_train_samples=N_TRAIN,
        structure=structure_options(
            structure,
            {"probes": 4, "lanczos_steps": 20, "cg_steps": 30}
            if structure in ("lanczos", "hutchinson", "cg")
            else None,
        ),
        reading=BatchReading(loss=case.loss),
    )
    assert report.num_samples == case.samples
    assert report.rank_bound == _expected_bound(model, case)
    if structure in ("dense", "gram"):  # the exact spectrum is within it
        assert report.soft_rank <= report.rank_bound
