"""The compositional penalty's quadratic form, small blocks dense and large ones rotated, in
float64 against ``vec(U)ᵀ h'(F̂) vec(U)`` with ``h'(F̂)`` from the eigenvalues of the dense
running estimate, and its gradient against ``2 h'(F̂) vec(U)``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_flatness.core.decay import ParameterDecay
from lightning_flatness.core.trace_functions import TRACE_FUNCTIONS
from lightning_flatness.regularizer import compositional, small_blocks
from lightning_flatness.regularizer.running_fisher import RunningFisher

DTYPE = torch.float64
LAM = 1e-2
DEFAULT_SMALL_BLOCK = small_blocks.SMALL_BLOCK

#: a large weight (rotated), small ones, vectors, a scalar and a 4-D kernel
SHAPES = {
    "big.weight": (24, 13),
    "big.bias": (24,),
    "conv.weight": (3, 2, 3, 3),
    "conv.bias": (3,),
    "head.weight": (4, 24),
    "head.bias": (4,),
    "scale": (),
    "wide.weight": (30, 9),
}


def warmed(seed: int = 0, probes: int = 2) -> RunningFisher:
    """A running Fisher after a few updates from random (correlated) probe gradients."""
    generator = torch.Generator().manual_seed(seed)
    running = RunningFisher(SHAPES, decay=0.5)
    for _ in range(4):
        running.update(probe_gradients(generator, probes), batch_size=3)
    return running


def probe_gradients(generator: torch.Generator, probes: int) -> dict[str, Tensor]:
    gradients = {}
    for name, shape in SHAPES.items():
        base = torch.randn(probes, *shape, generator=generator, dtype=DTYPE)
        gradients[name] = base + 3 * base.mean(0, keepdim=True).roll(1, dims=-1)
    return gradients


def reference(running: RunningFisher, gradients: dict[str, Tensor], lams: dict[str, float]):
    """The form and its gradient from the dense ``F̂``, block by block at each block's λ."""
    dense = running.dense()
    total = torch.zeros((), dtype=DTYPE)
    directions = {}
    start = 0
    for name in SHAPES:
        size = gradients[name][0].numel()
        block = dense[start : start + size, start : start + size]
        start += size
        values, vectors = torch.linalg.eigh(block)
        weights = TRACE_FUNCTIONS["soft_rank"].derivative(values.clamp_min(0.0), lams[name])
        matrix = vectors @ torch.diag(weights) @ vectors.mT
        flat = gradients[name].reshape(len(gradients[name]), -1)
        total += (flat @ matrix * flat).sum()
        directions[name] = (2 * flat @ matrix).reshape(gradients[name].shape)
    return total, directions


@pytest.mark.parametrize("small_block", [0, DEFAULT_SMALL_BLOCK, 10_000])
@pytest.mark.parametrize("per_parameter_decay", [False, True])
def test_quadratic_form_and_gradient_match_the_dense_running_fisher(
    small_block, per_parameter_decay, monkeypatch
):
    """All blocks rotated (0), the default split, and every block dense (10,000): the same
    value and gradient as the dense reference, with one λ or a λ per parameter."""
    monkeypatch.setattr(small_blocks, "SMALL_BLOCK", small_block)
    running = warmed()
    gradients = {
        name: value.requires_grad_()
        for name, value in probe_gradients(torch.Generator().manual_seed(7), 2).items()
    }
    lams = {
        name: LAM * (1 + index if per_parameter_decay else 1) for index, name in enumerate(SHAPES)
    }
    decay = ParameterDecay(lams) if per_parameter_decay else None
    form = compositional._quadratic_form(running, gradients, LAM, "soft_rank", decay)
    got = torch.autograd.grad(form, list(gradients.values()))
    want, directions = reference(running, gradients, lams)
    assert float(form.detach()) == pytest.approx(float(want), rel=1e-10)
    for name, gradient in zip(SHAPES, got, strict=True):
        assert torch.allclose(gradient, directions[name], rtol=1e-9, atol=1e-12), name
    groups, others = small_blocks.small_block_groups(
        {name: torch.Size(shape) for name, shape in SHAPES.items()}
    )
    dense = {name for group in groups for name in group}
    assert dense | set(others) == set(SHAPES) and not dense & set(others)
    if small_block == DEFAULT_SMALL_BLOCK:  # the default: both paths taken
        assert "big.weight" in others and "big.bias" in dense and "scale" in dense


def test_groups_keep_their_order_and_size_limit(monkeypatch):
    monkeypatch.setattr(small_blocks, "GROUP_SIZE", 40)
    shapes = {f"p{index}": torch.Size((size,)) for index, size in enumerate([30, 5, 20, 300, 40])}
    groups, others = small_blocks.small_block_groups(shapes)
    assert groups == [["p0", "p1"], ["p2"], ["p4"]] and others == ["p3"]


def test_dense_derivative_of_a_block_is_its_rotated_form():
    """``Q diag(h'(μ)) Qᵀ`` applied to vec U equals rotating U, weighting and rotating back."""
    running = warmed(seed=3)
    spectra = dict(running.spectra())
    derivative = TRACE_FUNCTIONS["logdet"].derivative
    for name in ("big.weight", "conv.weight", "big.bias", "scale"):
        spectrum, shape = spectra[name], torch.Size(SHAPES[name])
        matrix = small_blocks.dense_derivative(spectrum, shape, derivative, LAM)
        u = torch.randn(shape, dtype=DTYPE)
        view = running.blocks[name].as_matrix(u)
        rotated = spectrum.rotate(view)
        expected = spectrum.rotate_back(derivative(spectrum.values, LAM) * rotated)
        assert torch.allclose(matrix @ u.reshape(-1), expected.reshape(-1), rtol=1e-10), name
