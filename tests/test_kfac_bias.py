"""``kfac``'s exact bias blocks: a bias of a layer applied once per sample shares its weight's
``G`` factor (one matrix, one eigendecomposition), a bias seen with one position in some
batches and several in others keeps its own block, and a float32 model's factors are
eigendecomposed in float32 only where that is accurate — each against the dense Fisher."""

from __future__ import annotations

import pytest
import torch
from conftest import batches, random_data, tiny_model
from torch import nn

from lightning_flatness.core import reference, spectral
from lightning_flatness.core.measure import measure

LAM = 1e-3


class PositionMean(nn.Module):
    """A per-position linear map, averaged over positions, then a class layer: its first
    bias has T = 1 on inputs (N, 1, d) and T > 1 on inputs (N, T, d)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x)).mean(1))


def _dense_bias_block(model: nn.Module, data: list, name: str) -> torch.Tensor:
    """``(1/m) Σ_i V_iᵀV_i`` restricted to ``name``, over batches of different shapes."""
    blocks = dict(reference.parameter_blocks(model))
    total, count = 0.0, 0
    for inputs, _ in data:
        fisher = reference.dense_fisher(model, inputs)
        total = total + fisher[blocks[name], blocks[name]] * inputs.shape[0]
        count += inputs.shape[0]
    return total / count


@pytest.mark.parametrize("order", ["one position first", "several positions first"])
def test_a_bias_seen_with_one_and_with_several_positions_keeps_its_exact_block(order):
    model = PositionMean().to(torch.float64).eval()
    generator = torch.Generator().manual_seed(3)
    single = (torch.randn(5, 1, 4, generator=generator, dtype=torch.float64), torch.arange(5) % 3)
    several = (torch.randn(7, 3, 4, generator=generator, dtype=torch.float64), torch.arange(7) % 3)
    data = [single, several] if order == "one position first" else [several, single]
    report = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac")
    for name in ("inner.bias", "head.bias"):
        block = _dense_bias_block(model, data, name)
        expected = spectral.spectral_summary(spectral.psd_eigenvalues(block), LAM)
        assert report.blocks[name].soft_rank == pytest.approx(expected.soft_rank, rel=1e-9)
        assert report.blocks[name].trace == pytest.approx(expected.trace, rel=1e-9)


@pytest.mark.parametrize("batch_size", [3, 20])
def test_a_one_position_bias_block_is_its_weights_g_factor_and_exact(batch_size):
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(20)
    report = measure(
        model,
        batches(inputs, targets, batch_size),
        lam=LAM,
        num_train_samples=100,
        structure="kfac",
    )
    fisher = reference.dense_fisher(model, inputs)
    for name, block in reference.parameter_blocks(model):
        if name.endswith("bias"):
            expected = spectral.spectral_summary(
                spectral.psd_eigenvalues(fisher[block, block]), LAM
            )
            assert report.blocks[name].soft_rank == pytest.approx(expected.soft_rank, rel=1e-9)
            assert report.blocks[name].logdet == pytest.approx(expected.logdet, rel=1e-9)


def test_a_float32_model_measures_as_its_float64_copy():
    """float32 factorisations (where the bound ‖G ⊗ A‖/λ allows them) and float32 passes move
    the soft rank by round-off only."""
    model = tiny_model("mlp").eval()
    inputs, targets = random_data(40)
    data = batches(inputs, targets, 10)
    exact = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac")
    single = measure(
        model.to(torch.float32),
        [(x.float(), y) for x, y in data],
        lam=LAM,
        num_train_samples=100,
        structure="kfac",
    )
    assert single.soft_rank == pytest.approx(exact.soft_rank, rel=1e-5)
    for name, block in exact.blocks.items():
        assert single.blocks[name].soft_rank == pytest.approx(block.soft_rank, rel=1e-4), name
