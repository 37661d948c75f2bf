"""``kfac_mode="probe"``: Rademacher probes through the output Fisher's square root as the
Fisher rows of the layer-hook structures — unbiased like drawn labels, and far less noisy on a
confident model, where a drawn label is nearly always the predicted one."""

from __future__ import annotations

import pytest
import torch
from conftest import batches, random_data, tiny_model

from lightning_flatness import (
    DenseOptions,
    DiagOptions,
    GramOptions,
    KFACOptions,
    MatrixFreeOptions,
    measure,
)

LAM = 1e-4
N = 1000


def confident(architecture: str, scale: float) -> tuple[torch.nn.Module, list]:
    """A tiny model with its logits scaled up, measured on its own predictions as labels."""
    model = tiny_model(architecture)
    with torch.no_grad():
        layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        layers[-1].weight.mul_(scale)
        layers[-1].bias.mul_(scale)
    inputs, _ = random_data(128)
    with torch.no_grad():
        labels = model(inputs).argmax(-1)
    return model, batches(inputs, labels, 32)


def kfac(model: torch.nn.Module, data: list, rows: str = "exact", seed: int = 0, **options):
    """``kfac`` with ``rows`` as its Fisher rows, for the factors and for Tr(F)."""
    return measure(
        model,
        data,
        lam=LAM,
        num_train_samples=N,
        structure=KFACOptions(kfac_mode=rows, trace_estimator=rows, **options),
        seed=seed,
    )


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_probe_rows_are_unbiased_for_the_trace_and_the_factors(architecture):
    """Tr(F) and every block's trace (linear in the factors) average to the exact rows' values
    over seeds, within four standard errors."""
    model, data = confident(architecture, 1.0)
    exact = kfac(model, data)
    runs = [kfac(model, data, "probe", seed) for seed in range(24)]
    traces = torch.tensor([r.trace_fisher for r in runs], dtype=torch.float64)
    error = float(traces.std() / len(runs) ** 0.5)
    assert abs(float(traces.mean()) - exact.trace_fisher) <= 4 * error
    for name, block in exact.blocks.items():
        values = torch.tensor([r.blocks[name].trace for r in runs], dtype=torch.float64)
        spread = float(values.std() / len(runs) ** 0.5) + 1e-12 * block.trace
        assert abs(float(values.mean()) - block.trace) <= 4 * spread, name


def test_probe_rows_are_far_less_noisy_than_drawn_labels_on_a_confident_model():
    model, data = confident("cnn", 40.0)
    exact = kfac(model, data).soft_rank

    def ratios(mode: str) -> torch.Tensor:
        values = [kfac(model, data, mode, seed).soft_rank for seed in range(6)]
        return torch.tensor(values, dtype=torch.float64) / exact

    probe, sampled = ratios("probe"), ratios("sampled")
    assert abs(float(probe.mean()) - 1.0) < 0.02
    assert abs(float(probe.mean()) - 1.0) < 0.5 * abs(float(sampled.mean()) - 1.0)
    assert float(probe.std()) < 0.5 * float(sampled.std())


def test_the_monitors_probe_trace_for_every_structure():
    """Hook structures draw probe rows for Tr(F); the monitor's options give the matrix-free
    ones their (Hutchinson) "sampled" trace, which is those probes, and dense/gram, which
    compute the exact rows anyway, the exact one."""
    from lightning_flatness.lightning.monitor_measurement import monitor_options

    model, data = confident("mlp", 1.0)

    def run(options):
        return measure(model, data, lam=LAM, num_train_samples=N, structure=options, seed=3)

    diag, probed = run(DiagOptions()), run(monitor_options("diag"))
    assert monitor_options("diag") == DiagOptions(trace_estimator="probe")
    assert probed.soft_rank == diag.soft_rank  # the diagonal itself is exact either way
    assert probed.trace_fisher != diag.trace_fisher
    assert probed.trace_fisher == pytest.approx(diag.trace_fisher, rel=0.5)
    assert monitor_options("kfac") == KFACOptions(kfac_mode="probe", trace_estimator="probe")
    assert monitor_options("dense") == DenseOptions(trace_estimator="exact")
    assert monitor_options("gram") == GramOptions(trace_estimator="exact")
    for structure in ("lanczos", "hutchinson", "cg"):
        assert monitor_options(structure) == MatrixFreeOptions(
            structure=structure, trace_estimator="sampled"
        )
    with pytest.raises(ValueError, match="trace_estimator must be one of"):
        KFACOptions(trace_estimator="rademacher")


def test_probe_error_shrinks_with_its_budget():
    """More probes per input (``mc_samples``) bring the probe soft rank closer to the exact
    rows' one, which the dense reference pins elsewhere (tests/test_measure.py)."""
    model, data = confident("cnn", 40.0)
    exact = kfac(model, data).soft_rank

    def error(probes: int) -> float:
        values = [
            kfac(model, data, "probe", seed, mc_samples=probes).soft_rank for seed in range(4)
        ]
        return max(abs(v / exact - 1.0) for v in values)

    one, sixteen = error(1), error(16)
    assert sixteen < 0.5 * one and sixteen < 5e-3
