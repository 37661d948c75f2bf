"""The ``kfac`` structure's Kronecker factors follow one convention — KFC's "expand" (Grosse &
Martens 2016; docs/math.md, "Kronecker factors from layer hooks") — checked in float64 against
an independent, maintained implementation of it: curvlinops' ``KFACLinearOperator`` with the
exact (type-2) Fisher and ``kfac_approx="expand"``.

Weights must agree block for block. Biases are not compared with it: ``kfac`` measures every
bias block exactly (tests/test_measure.py checks those against the dense Fisher), where
curvlinops Kronecker-factors them too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_data, tiny_model
from curvlinops import KFACLinearOperator

from lightning_flatness.core import spectral
from lightning_flatness.core.measure import measure
from lightning_flatness.core.options import KFACOptions

LAM = 1e-3


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "resmlp"])
@pytest.mark.parametrize("batch_size", [8, 64])
def test_kronecker_blocks_equal_curvlinops_expand(architecture, batch_size):
    model = tiny_model(architecture).eval()
    inputs, targets = random_data(64)
    data = [
        (inputs[i : i + batch_size], targets[i : i + batch_size]) for i in range(0, 64, batch_size)
    ]
    params = list(model.parameters())
    independent = KFACLinearOperator(
        model,
        torch.nn.CrossEntropyLoss(reduction="mean"),
        params,
        data,
        fisher_type="type-2",
        kfac_approx="expand",
        check_deterministic=False,
    )
    size = sum(p.numel() for p in params)
    dense = independent @ torch.eye(size, dtype=torch.float64)
    report = measure(model, data, lam=LAM, num_train_samples=1000, structure=KFACOptions())
    start, compared = 0, 0
    for name, p in model.named_parameters():
        block = slice(start, start + p.numel())
        start += p.numel()
        if report.coverage[name] != "kronecker":
            continue
        expected = spectral.spectral_summary(spectral.psd_eigenvalues(dense[block, block]), LAM)
        got = report.blocks[name]
        assert got.soft_rank == pytest.approx(expected.soft_rank, rel=1e-9), name
        assert got.logdet == pytest.approx(expected.logdet, rel=1e-9), name
        assert got.trace == pytest.approx(expected.trace, rel=1e-9), name
        compared += 1
    assert compared == sum(1 for name, _ in model.named_parameters() if name.endswith("weight"))


@pytest.mark.parametrize("larger", ["g", "a"])
def test_the_larger_factor_is_decomposed_in_float32_only_where_the_smaller_bounds_it(
    larger, monkeypatch
):
    """The smaller factor's float64 eigenvalues and the larger one's trace bound ‖G ⊗ A‖; the
    larger factor goes to float32 when that bound allows it, and its eigenvalues then agree
    with float64's to float32 accuracy."""
    from lightning_flatness.core.curvature import kfac as kfac_module

    generator = torch.Generator().manual_seed(0)
    small = torch.randn(3, 40, generator=generator, dtype=torch.float64)
    big = torch.randn(30, 40, generator=generator, dtype=torch.float64)
    factors = (big @ big.T, small @ small.T) if larger == "g" else (small @ small.T, big @ big.T)
    asked = []
    original = kfac_module.psd_eigenvalues

    def recorded(matrix, dtype=torch.float64):
        asked.append((matrix.shape[0], dtype))
        return original(matrix, dtype)

    monkeypatch.setattr(kfac_module, "psd_eigenvalues", recorded)
    for lam, expected in ((1e-2, torch.float32), (1e-9, torch.float64)):
        asked.clear()
        fisher = kfac_module.KFACFisher(precision=torch.float32)
        fisher.kronecker["w"] = factors
        g_values, a_values = fisher.block_eigenvalues(num_samples=4, lam=lam)["w"]
        assert dict(asked) == {3: torch.float64, 30: expected}
        exact_g = torch.linalg.eigvalsh(factors[0] / 4).clamp_min(0)
        exact_a = torch.linalg.eigvalsh(factors[1] / 4).clamp_min(0)
        scale = float(exact_g.max() + exact_a.max())
        assert torch.allclose(g_values, exact_g, atol=1e-5 * scale)
        assert torch.allclose(a_values, exact_a, atol=1e-5 * scale)
