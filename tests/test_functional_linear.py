"""A module that applies ``F.linear`` to its own weight in its ``forward`` is measured as the
linear layer it is (Kronecker factors under kfac, exact rows and blocks elsewhere); one that
uses its parameters otherwise keeps the per-sample gradients of its own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_kronecker_blocks_exact
from torch import Tensor, nn

from lightning_flatness import measure
from lightning_flatness.core import reference, spectral

LAM = 1e-3


class FunctionalLinear(nn.Module):
    """``F.linear`` on its own weight and bias (as LoRA-style or weight-normed layers do)."""

    def __init__(self, fan_in: int, fan_out: int, mode: str = "plain") -> None:
        super().__init__()
        self.mode = mode
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in) / fan_in**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(fan_out))
        if mode == "scaled":  # a parameter that is no linear map's
            self.scale = nn.Parameter(torch.ones(fan_out))

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, bias=self.bias)
        if self.mode == "twice":  # the same weight applied twice: not one linear map's rows
            out = F.linear(torch.tanh(out), self.weight[:, : out.shape[-1]].T.contiguous().T)
        if self.mode == "scaled":
            out = out * self.scale
        return out


class Net(nn.Module):
    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.first = FunctionalLinear(5, 5 if mode == "twice" else 7, mode)
        self.second = FunctionalLinear(5 if mode == "twice" else 7, 3)

    def forward(self, x: Tensor) -> Tensor:  # positions along dimension 1
        return self.second(torch.tanh(self.first(x)).mean(1))


def _data(n: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(n, 4, 5, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (n,), generator=generator)


def test_its_kronecker_block_is_exact_for_one_sample_at_one_position():
    torch.manual_seed(0)
    model = Net().double().eval()
    inputs, targets = torch.randn(1, 1, 5, dtype=torch.float64), torch.tensor([1])
    report = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=10, structure="kfac")
    assert report.coverage == {
        "first.weight": "kronecker",
        "first.bias": "exact block",
        "second.weight": "kronecker",
        "second.bias": "exact block",
    }
    names = ["first.weight", "second.weight"]
    assert_kronecker_blocks_exact(model, inputs, targets, names, LAM)


@pytest.mark.parametrize(
    ("mode", "kind"), [("plain", "kronecker"), ("twice", "diagonal"), ("scaled", "diagonal")]
)
def test_every_structure_is_exact_where_it_claims_and_batch_size_free(mode, kind):
    torch.manual_seed(0)
    model = Net(mode).double().eval()
    inputs, targets = _data(10)
    fisher = reference.dense_fisher(model, inputs)
    exact = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    first = None
    for size in (1, 4, 10):
        data = [(inputs[i : i + size], targets[i : i + size]) for i in range(0, 10, size)]
        default = measure(model, data, lam=LAM, num_train_samples=100)  # 3 classes: exact rows
        assert default.soft_rank == pytest.approx(exact, rel=1e-8)
        kfac = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac")
        assert kfac.coverage["first.weight"] == kind
        assert kfac.coverage["second.weight"] == "kronecker"
        assert kfac.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-8)
        diag = measure(model, data, lam=LAM, num_train_samples=100, structure="diag")
        assert diag.soft_rank == pytest.approx(spectral.soft_rank(fisher.diagonal(), LAM), rel=1e-8)
        first = kfac.soft_rank if first is None else first
        assert kfac.soft_rank == pytest.approx(first, rel=1e-9)
