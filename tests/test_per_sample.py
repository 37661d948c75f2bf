"""Per-sample functions: vmap where it can follow the model, a loop (said once) where not."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from lightning_flatness.core.per_sample import map_samples


class Branchy(nn.Module):
    """Its control flow depends on the input's values, as a padding-mask check does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        out = self.linear(x)
        return out * 2 if bool((x > 0).any()) else out


def _per_sample_gradients(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, sample):
        return functional_call(model, p, (sample.unsqueeze(0),)).square().sum()

    return map_samples(grad(loss), (None, 0), model)(params, x)


def test_the_loop_gives_what_autograd_gives_per_sample_and_says_so_once():
    torch.manual_seed(0)
    model = Branchy().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    x[1] = -x[1].abs()  # one sample takes the other branch
    with pytest.warns(UserWarning, match="one sample at a time"):
        got = _per_sample_gradients(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _per_sample_gradients(model, x)  # remembered: no second attempt, no warning
    for i in range(5):
        model.zero_grad()
        model(x[i : i + 1]).square().sum().backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(got[name][i], param.grad)
            torch.testing.assert_close(again[name][i], param.grad)


def test_vmap_is_used_where_it_follows_the_model_and_other_errors_propagate():
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = _per_sample_gradients(model, x)
    assert grads["weight"].shape == (4, 2, 3)

    def broken(sample):
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        map_samples(broken, (0,))(x)
