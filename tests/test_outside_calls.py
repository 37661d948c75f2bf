"""A layer's weight also applied by ``F.linear`` outside the layer's forward: one more set of
positions of the same linear map (``lightning_flatness.core.outside_calls``), measured by the
layer hooks instead of the whole-model fallback — in float64 against the dense reference, at
several batch sizes, with and without the layer's bias in the outside call, and refused to the
exact fallback when the weight is used some other way."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import zoo
from conftest import batches
from torch import nn
from torch.nn import functional as F

from lightning_flatness import KernelOptions, measure
from lightning_flatness.core import outside_calls, reference, spectral

LAM = 1e-3
FEATURES, HIDDEN, CLASSES = 6, 5, 4


class OutsideUse(nn.Module):
    """A head whose weight also maps the features outside it: without the head's bias
    (``"weight"``), with it (``"layer"``, a second full application), or transposed
    (``"transposed"``, not the same linear map: the whole-model fallback)."""

    def __init__(self, use: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.use = use
        self.encode = nn.Linear(FEATURES, HIDDEN)
        self.square = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encode(x))
        out, second = self.head(h), torch.tanh(self.square(h))
        if self.use == "weight":
            return out + 0.5 * F.linear(second, self.head.weight)
        if self.use == "layer":
            return out + F.linear(second, self.head.weight, self.head.bias)
        return out + second[:, :CLASSES] @ self.head.weight[:, :CLASSES].T


def _data(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, FEATURES, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, CLASSES, (count,), generator=generator)


@pytest.mark.parametrize("use", ["weight", "layer"])
@pytest.mark.parametrize("batch_size", [1, 5, 12])
def test_an_outside_application_is_measured_exactly_by_the_hooks(use, batch_size):
    model = OutsideUse(use).to(torch.float64).eval()
    inputs, targets = _data(12)
    data = batches(inputs, targets, batch_size)
    fisher = reference.dense_fisher(model, inputs)
    blocks = dict(reference.parameter_blocks(model))
    kfac = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac")
    assert kfac.coverage["head.weight"] == "kronecker"
    assert "diagonal (whole model)" not in kfac.coverage.values(), kfac.coverage
    for name in ("encode.bias", "square.bias", "head.bias"):  # exact blocks
        expected = spectral.soft_rank(
            spectral.psd_eigenvalues(fisher[blocks[name]][:, blocks[name]]), LAM
        )
        assert kfac.blocks[name].soft_rank == pytest.approx(expected, rel=1e-9), name
    assert kfac.trace_fisher == pytest.approx(float(fisher.trace()), rel=1e-9)
    diag = measure(model, data, lam=LAM, num_train_samples=100, structure="diag")
    diagonal = fisher.diagonal()
    assert diag.soft_rank == pytest.approx(float((diagonal / (diagonal + LAM)).sum()), rel=1e-9)
    whole = measure(  # as many probe rows as classes: the exact rows, the whole Fisher
        model,
        data,
        lam=LAM,
        num_train_samples=100,
        structure=KernelOptions(probes=CLASSES, groups=1),
    )
    expected = spectral.soft_rank(spectral.psd_eigenvalues(fisher), LAM)
    assert whole.soft_rank == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("use", ["weight", "layer"])
def test_the_kronecker_factors_count_the_outside_call_as_positions(use):
    """One sample: G ⊗ A of the head over its two applications is KFC's factorisation with
    T = 2 positions, A = Σ_t a_t a_tᵀ and G = (1/2) Σ_t s_t s_tᵀ (exact rows)."""
    model = OutsideUse(use).to(torch.float64).eval()
    inputs, targets = _data(1)
    report = measure(model, [(inputs, targets)], lam=LAM, num_train_samples=100, structure="kfac")
    h = torch.tanh(model.encode(inputs))
    second = torch.tanh(model.square(h))
    a = torch.stack([h[0], second[0]])  # (T, d)
    p = torch.softmax(model(inputs), -1)[0].detach()
    scale = 0.5 if use == "weight" else 1.0
    # the head's two outputs enter the logits times 1 and times ``scale``: over the exact
    # rows u_k (Σ_k u_k u_kᵀ = Λ), G = (1/T) Σ_t c_t² Λ
    g = (1.0 + scale**2) / 2 * (torch.diag(p) - torch.outer(p, p))
    factor = a.T @ a
    expected = spectral.kron_summary(
        [spectral.psd_eigenvalues(g), spectral.psd_eigenvalues(factor)], LAM
    )
    assert report.blocks["head.weight"].soft_rank == pytest.approx(expected.soft_rank, rel=1e-9)


def test_a_weight_used_some_other_way_keeps_the_exact_fallback():
    model = OutsideUse("transposed").to(torch.float64).eval()
    inputs, targets = _data(10)
    report = measure(
        model, batches(inputs, targets, 5), lam=LAM, num_train_samples=100, structure="diag"
    )
    assert report.coverage["head.weight"] == "diagonal (whole model)"
    diagonal = reference.dense_fisher(model, inputs).diagonal()
    assert report.soft_rank == pytest.approx(float((diagonal / (diagonal + LAM)).sum()), rel=1e-9)


def test_the_recorder_is_kept_only_where_the_first_batch_found_outside_calls(monkeypatch):
    """Later batches and later measurements (the remembered plan) record outside calls only
    for a model that has them: no per-op interception for every other model."""
    created = []
    original = outside_calls.OutsideLinearCalls.__init__

    def counting(self, *args, **kwargs):
        created.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(outside_calls.OutsideLinearCalls, "__init__", counting)
    inputs, targets = _data(8)
    data = batches(inputs, targets, 4)  # two batches per measurement
    for model, per_measurement in (
        (OutsideUse("weight").to(torch.float64), [2, 2]),
        (nn.Sequential(nn.Linear(FEATURES, CLASSES)).to(torch.float64), [1, 0]),
    ):
        counts, values = [], []
        for _ in range(2):
            created.clear()
            report = measure(model, data, lam=LAM, num_train_samples=100, structure="kfac")
            counts.append(len(created))
            values.append(report.soft_rank)
        assert counts == per_measurement
        assert values[0] == values[1]


@pytest.mark.parametrize("use", ["weight", "layer"])
@pytest.mark.parametrize("backend", ["layerwise", "rules"])
@pytest.mark.parametrize("labels", ["sampled", "exact"])
def test_the_regularizers_hooked_kernels_follow_an_outside_application(use, backend, labels):
    """The batch kernel V_b V_bᵀ and its gradient from the hooked backends equal
    ``torch.func``'s per-sample gradients on a head also applied outside its layer."""
    from lightning_flatness.regularizer import fisher_gram

    model = OutsideUse(use).to(torch.float64).eval()
    inputs, _ = _data(6)
    params = list(model.parameters())

    def kernel_and_gradient(name: str):
        generator = torch.Generator().manual_seed(3)
        kernel = fisher_gram(model, inputs, labels=labels, generator=generator, backend=name)
        return kernel.detach(), torch.autograd.grad(kernel.square().sum(), params)

    expected, expected_grads = kernel_and_gradient("func")
    kernel, grads = kernel_and_gradient(backend)
    torch.testing.assert_close(kernel, expected, rtol=1e-9, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_copies_of_a_compiled_model_are_regularized(one_thread):
    """Inside compiled code the layers' hooks do not run, so no call may be taken for an outside
    one: copies of a compiled model that has already run keep the penalty's fallback and train
    (the second copy's recorded calls would otherwise come from the compiled graph, and the
    penalty's double backward through it raises)."""
    from lightning_flatness.regularizer import SoftRankPenalty

    trained = torch.compile(zoo.TiedMLP(features=FEATURES, hidden=8, classes=CLASSES))
    inputs = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(2))
    targets = torch.arange(64) % CLASSES
    F.cross_entropy(trained(inputs), targets).backward()  # compiled forward and backward
    for _ in range(2):  # as a benchmark does: a fresh copy each time
        model = copy.deepcopy(trained).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        penalty = SoftRankPenalty(lam=1e-2, num_train_samples=100)
        for rows in torch.arange(64).split(16):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs[rows]), targets[rows])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "uses torch.func for this model"
                loss = loss + penalty(model, inputs[rows])
            loss.backward()
            optimizer.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
