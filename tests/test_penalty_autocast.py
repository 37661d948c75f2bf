"""The penalty under bfloat16 autocast (``precision="bf16-mixed"``): every backend gives a
finite gradient close to the float32 one, and the one-product Gram backward takes a product
that autocast made bfloat16 from float32 rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty
from lightning_flatness.regularizer.products import gram_product


def test_gram_backward_under_autocast_returns_the_rows_dtype():
    rows = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        product = gram_product(rows)
    assert product.dtype == torch.bfloat16
    product.float().sum().backward()
    assert rows.grad.dtype == torch.float32
    expected = 2.0 * rows.detach().sum(0, keepdim=True).expand_as(rows)  # ∂ Σ RRᵀ / ∂R = 2·1 1ᵀR
    torch.testing.assert_close(rows.grad, expected, rtol=2e-2, atol=2e-2)


def _gradients(backend: str, autocast: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 5))
    inputs = torch.randn(24, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    penalty = SoftRankPenalty(
        lam=1e-2,
        num_train_samples=100,
        options=PenaltyOptions(backend=backend, labels="exact"),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        value = penalty(model, inputs)
    value.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("backend", ["func", "layerwise", "rules"])
def test_penalty_gradient_under_bf16_autocast_is_close_to_float32(backend):
    single = _gradients(backend, autocast=False)
    mixed = _gradients(backend, autocast=True)
    for low, high in zip(mixed, single, strict=True):
        assert torch.isfinite(low).all()
        scale = float(high.abs().max())
        assert float((low - high).abs().max()) <= 0.1 * scale + 1e-6
